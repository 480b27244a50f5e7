"""The attention backend: the one entry point the model layers call, reading the forward's AttentionSpec."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from compiledllm.attention import packed
from compiledllm.attention.launch import PackedArgs


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fwd, kv_layer, layer: int) -> torch.Tensor:
    """q [B, Q, H, D], the forward's fresh k/v [B, Q, KVH, D] -> [B, Q, H, D]. Reads the KV source as it was
    before this forward, then writes the fresh K/V at fwd.kv_write (-1 = skip)."""
    spec = fwd.attention
    stats = spec.wants_stats(layer)
    if spec.prefix_len is None and not stats:
        out = _among_themselves(q, k, v, spec.rule)
    else:
        if spec.prefix_len is None:  # statistics of a forward without a KV source: an empty one
            B, _, KVH, D = k.shape
            src_k = src_v = k.new_zeros(B, 0, KVH, D)
            prefix = torch.zeros(B, dtype=torch.long, device=q.device)
        else:
            src_k, src_v = kv_layer.k, kv_layer.v
            prefix = spec.prefix_len if kv_layer.length is None else kv_layer.length
        queries = None
        if stats:
            queries = spec.stats_queries if spec.stats_queries is not None else torch.ones(
                q.shape[:2], dtype=torch.bool, device=q.device)
        args = PackedArgs(q, src_k, src_v, prefix, k, v, spec.rule, spec.kv_index)
        out, _, mass = packed.run(args, backend=fwd.kernels.attention, mass_queries=queries)
        if mass is not None:
            spec.stats.add_(mass)
    if fwd.kv_write is not None and kv_layer is not None:
        kv_layer.write(fwd.kv_write, k, v)
    return out


def _among_themselves(q, k, v, rule) -> torch.Tensor:
    """No KV source (reference forwards, bidirectional models): SDPA under the rule's mask."""
    mask = rule.window_mask(q.shape[1], q.device)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], enable_gqa=True)
    return out.transpose(1, 2)
