"""The torch reference of packed attention for every mask rule and KV source (float32 math, explicit masks).

Processes the batch in chunks so that its float32 scores and K/V copies stay near _REF_CHUNK_BYTES; no host
synchronisation on CUDA, so it also runs inside a CUDA graph (on the CPU it reads the source up to the longest
visible prefix only: `visible_keys`). A query that sees no key gets out = 0 and lse = -inf (the
kernels' convention). With `mass_queries` it also returns the attention mass per key [B, S + Q] (prefix keys,
then window keys), summed over heads and the queries marked True; with `mass_per_head` per KV head [B, KVH, S + Q]
(summed over the KV head's H / KVH query heads); with `mass_logits` the raw scaled scores of the keys each marked
query sees, summed the same way, instead of the probabilities.
"""
from __future__ import annotations

import torch

from compiledllm.attention.launch import PackedArgs
from compiledllm.attention.spec import ExplicitMask

_REF_CHUNK_BYTES = 256 << 20


def _rows(q, kc, vc, pre_seen, kw, vw, win_seen, scale, mass_q, per_head=False, logits=False):
    """One chunk of rows: pre_seen [B, 1 or Q, S], win_seen [B or 1, 1 or Q, Q] bool."""
    B, Lq, H, D = q.shape
    S, KVH = kc.shape[1], kc.shape[2]
    qf = q.float().view(B, Lq, KVH, H // KVH, D)
    s_pre = torch.einsum("bikgd,bjkd->bkgij", qf, kc.float())  # [B, KVH, G, Lq, S]
    s_win = torch.einsum("bikgd,bjkd->bkgij", qf, kw.float())  # [B, KVH, G, Lq, Lq]
    s_pre = s_pre.masked_fill(~pre_seen[:, None, None], float("-inf"))
    s_win = s_win.masked_fill(~win_seen[:, None, None], float("-inf"))
    scores = torch.cat([s_pre, s_win], dim=-1) * scale
    lse = torch.logsumexp(scores, dim=-1)  # [B, KVH, G, Lq]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a query that sees nothing: 0 everywhere
    out = torch.einsum("bkgij,bjkd->bikgd", probs[..., :S], vc.float())
    out = out + torch.einsum("bkgij,bjkd->bikgd", probs[..., S:], vw.float())
    mass = None
    if mass_q is not None:  # logits: the raw scaled scores of the keys each query sees, else the probabilities
        what = torch.where(scores > float("-inf"), scores, 0.0) if logits else probs
        # [B, KVH, S + Lq] per KV head (its G query heads), else [B, S + Lq]
        mass = (what * mass_q[:, None, None, :, None].float()).sum(dim=(2, 3) if per_head else (1, 2, 3))
    return out.reshape(B, Lq, H, D), lse.reshape(B, H, Lq), mass


def reference(a: PackedArgs, return_lse: bool = False, mass_queries: torch.Tensor | None = None,
              mass_per_head: bool = False, mass_logits: bool = False):
    """(out [B, Q, H, D] in q's dtype, lse [B, H, Q] float32 or None, mass float32 [B, S + Q] (mass_per_head:
    [B, KVH, S + Q]) or None); mass_logits: each key's raw scaled scores summed instead of its probabilities
    (Flash-dLLM's tracker score)."""
    q = a.q
    B, Lq, H, D = q.shape
    if mass_queries is not None:
        mass_queries = mass_queries.expand(B, Lq)
    kc, vc, index = a.k_cache, a.v_cache, a.kv_index
    source = kc.shape[1] if index is None else index.shape[1]
    S = visible_keys(a.prefix_len, source, q)
    if index is not None:  # a pool addressed through an index: gather each row's keys
        kc, vc = kc[index[:, :S].long()], vc[index[:, :S].long()]
    else:
        kc, vc = kc[:, :S], vc[:, :S]
    KVH = kc.shape[2]
    pre_seen = (torch.arange(S, device=q.device)[None, :] < a.prefix_len.to(q.device)[:, None])[:, None, :]
    if isinstance(a.rule, ExplicitMask):
        pre_seen = pre_seen & a.rule.mask[..., :S]
    win_seen = a.rule.window_mask(Lq, q.device)
    if win_seen.dim() == 2:
        win_seen = win_seen[None]
    per_row = 4 * (H * Lq * (S + Lq) * 2 + 2 * (S + Lq) * KVH * D)
    step = max(1, _REF_CHUNK_BYTES // max(per_row, 1))
    outs, lses, masses = [], [], []
    for b0 in range(0, B, step):
        r = slice(b0, b0 + step)
        w = win_seen if win_seen.shape[0] == 1 else win_seen[r]
        o, lse, m = _rows(q[r], kc[r], vc[r], pre_seen[r], a.k_win[r], a.v_win[r], w, a.softmax_scale,
                          None if mass_queries is None else mass_queries[r], mass_per_head, mass_logits)
        outs.append(o.to(q.dtype))
        lses.append(lse)
        masses.append(m)
    cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs)  # noqa: E731
    mass = cat(masses) if mass_queries is not None else None
    if mass is not None and S < source:  # the keys not read got no mass
        mass = torch.cat([mass[..., :S], mass.new_zeros(*mass.shape[:-1], source - S), mass[..., S:]], -1)
    return cat(outs), (cat(lses) if return_lse else None), mass


def visible_keys(prefix_len: torch.Tensor, source: int, q: torch.Tensor) -> int:
    """How many of the source's keys to read: on the CPU, eagerly, up to the longest visible prefix (a host read
    costs nothing there, and a server's cache is sized for its longest request: the keys past every row's prefix
    are masked, so skipping them changes nothing); elsewhere all (no host sync in a CUDA graph or a compiled
    graph)."""
    if q.device.type != "cpu" or torch.compiler.is_compiling() or torch.compiler.is_exporting() or source == 0:
        return source
    return min(source, int(prefix_len.max()))
