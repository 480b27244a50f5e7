"""The attention backend: the one entry point the model layers call, reading the forward's AttentionSpec."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from compiledllm.attention import packed
from compiledllm.attention.launch import PackedArgs
from compiledllm.attention.reference import reference


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd, kv_layer, layer: int, written: bool = False
           ) -> torch.Tensor:
    """q [B, Q, H, D], the forward's fresh k/v [B, Q, KVH, D] -> [B, Q, H, D]. Reads the KV source as it was
    before this forward, then writes the fresh K/V at fwd.kv_write (-1 = skip) unless the projection has (`written`:
    Forward.fused_cache, whose attention reads no position it writes)."""
    spec = fwd.attention
    if getattr(kv_layer, "on_host", False):  # a layer that attends on the CPU (kv/offload.HostLayer)
        return kv_layer.attend(q, k, v, spec.rule)
    captured = spec.capture_target(layer)
    if captured is not None:  # one query's q per row, kept for the caller
        at = spec.capture_at[:, None, None, None].expand(-1, 1, *q.shape[2:])
        captured.copy_(q.gather(1, at)[:, 0])
    acc = spec.stats_target(layer)  # where this layer adds its attention mass (None: it adds none)
    if spec.prefix_len is None and acc is None:
        out = _among_themselves(q, k, v, spec.rule)
    else:
        queries = None
        if acc is not None:
            queries = spec.stats_queries if spec.stats_queries is not None else torch.ones(
                q.shape[:2], dtype=torch.bool, device=q.device)
        src_k, src_v, length, index = _source(spec, kv_layer, k)
        args = PackedArgs(q, src_k, src_v, length, k, v, spec.rule, index)
        skew = spec.skew_target(layer)
        out, _, mass = packed.run(args, backend=fwd.kernels.attention, mass_queries=None if skew is not None
                                  else queries, mass_per_head=spec.stats_per_head,
                                  mass_logits=acc is not None and spec.stats_score == "logits")
        if skew is not None:
            mass = _approximate_mass(args, skew, queries)
        if mass is not None:
            acc.add_(mass)
    if fwd.kv_write is not None and kv_layer is not None and not written:
        kv_layer.write(fwd.kv_write, k, v)
    return out


def _approximate_mass(a: PackedArgs, skew: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[B, KVH, S + Q] the mass of the attention whose scores use the first r coordinates of q and k rotated by skew
    [KVH, D, r] (the same visible keys and scale)."""
    B, Q, H, D = a.q.shape
    KVH = skew.shape[0]
    rot = lambda x: torch.einsum("...kd,kdr->...kr", x.float(), skew.float())  # noqa: E731  [..., KVH, r]
    q = torch.einsum("bqkgd,kdr->bqkgr", a.q.float().view(B, Q, KVH, H // KVH, D), skew.float()).flatten(2, 3)
    keys = a.k_cache if a.kv_index is None else a.k_cache[a.kv_index]  # the rows' keys only, not the whole pool
    kc, kw = rot(keys), rot(a.k_win)
    approx = PackedArgs(q, kc, kc, a.prefix_len, kw, kw, a.rule, scale=a.softmax_scale)
    return reference(approx, mass_queries=queries, mass_per_head=True)[2]


def _source(spec, kv_layer, k: torch.Tensor):
    """(k_cache, v_cache, visible length [B], kv_index) of the layer's KV source: the layer's own length and index
    where it holds them (a sparse pool), else the forward's; an empty source for a forward without one."""
    if spec.prefix_len is None:  # statistics of a forward without a KV source
        B, _, KVH, D = k.shape
        empty = k.new_zeros(B, 0, KVH, D)
        return empty, empty, torch.zeros(B, dtype=torch.long, device=k.device), None
    length, index = kv_layer.length, kv_layer.index
    return (kv_layer.k, kv_layer.v, spec.prefix_len if length is None else length,
            spec.kv_index if index is None else index)


def _among_themselves(q, k, v, rule) -> torch.Tensor:
    """No KV source (reference forwards, bidirectional models): SDPA under the rule's mask."""
    mask = rule.window_mask(q.shape[1], q.device)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], enable_gqa=True)
    return out.transpose(1, 2)
