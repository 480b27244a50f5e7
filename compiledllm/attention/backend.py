"""The attention backend: one entry point the model layers call, dispatching on the metadata type."""
from __future__ import annotations

import torch.nn.functional as F

from compiledllm.attention.metadata import DenseAttention, WindowAttention
from compiledllm.attention.packed import packed_attention
from compiledllm.kv.cache import IndexedLayerKV, LayerKV


def attend(q, k, v, positions, meta, kv_layer: LayerKV | IndexedLayerKV | None):
    """q [B, L, H, D], k/v [B, L, KVH, D] -> [B, L, H, D]; the forward's K/V go to kv_layer.write."""
    if isinstance(meta, WindowAttention):
        out = packed_attention(q, kv_layer.k, kv_layer.v, meta.prefix_len, k, v, meta.slot)
        kv_layer.write(positions, k, v)
        return out
    if isinstance(meta, DenseAttention):
        if kv_layer is not None:
            kv_layer.write(positions, k, v)
        mask = meta.mask if meta.mask.dim() == 2 else meta.mask[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2)
    raise TypeError(f"unknown attention metadata {type(meta).__name__}")
