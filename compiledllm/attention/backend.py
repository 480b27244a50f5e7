"""The attention backend: one entry point the model layers call, dispatching on the metadata type."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from compiledllm.attention.metadata import DenseAttention, WindowAttention
from compiledllm.attention.packed import packed_attention


def write_kv(kv_layer, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter the forwarded K/V [B, L, KVH, D] into the cache rows at their positions [B, L]."""
    k_cache, v_cache = kv_layer
    rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(positions)
    k_cache.index_put_((rows, positions), k)
    v_cache.index_put_((rows, positions), v)


def attend(q, k, v, positions, meta, kv_layer):
    """q [B, L, H, D], k/v [B, L, KVH, D] -> [B, L, H, D]."""
    if isinstance(meta, WindowAttention):
        k_cache, v_cache = kv_layer
        out = packed_attention(q, k_cache, v_cache, meta.prefix_len, k, v, meta.slot)
        write_kv(kv_layer, positions, k, v)
        return out
    if isinstance(meta, DenseAttention):
        if kv_layer is not None:
            write_kv(kv_layer, positions, k, v)
        mask = meta.mask if meta.mask.dim() == 2 else meta.mask[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2)
    raise TypeError(f"unknown attention metadata {type(meta).__name__}")
