"""Preallocated per-slot KV cache: [layers][slot][position][kv_head][head_dim] on the device."""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v  # [layers, slots, capacity, KVH, D]

    @classmethod
    def allocate(cls, num_layers, slots, capacity, kv_heads, head_dim, dtype, device) -> "KVCache":
        shape = (num_layers, slots, capacity, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def rows(self, start: int, end: int) -> "KVCache":
        """A view of slots [start, end) (writes go to this cache)."""
        return KVCache(self.k[:, start:end], self.v[:, start:end])
