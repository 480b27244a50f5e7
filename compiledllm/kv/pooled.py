"""KV as one pool per layer, read through an index: what a policy uses when a forward must see a row's cached
positions with a hole or out of order, which the dense prefix [0, prefix_len) cannot say (Fast-dLLM's dual cache:
the prefix and the suffix around the block being decoded).

Layer i's pool is [slots * (capacity + 1), KVH, D]: slot s's position p at row s * (capacity + 1) + p, its last row
the spare a -1 write lands on (as in the device cache). A store's view of slots [first, ...) hands the attention
the pool from slot `first` on, so a forward addresses it with `AttentionSpec.kv_index = pool_index(positions,
capacity)`: row r's key j is its position positions[r, j], whatever slot the view starts at.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.kv.cache import Tier
from compiledllm.kv.store import DeviceKV


def pool_index(positions: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, S] positions of each view row -> [B, S] rows of the view's pool."""
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
    return rows * (capacity + 1) + positions


@dataclass(frozen=True)
class PoolView:
    """One layer's view (kv/cache.LayerKV): the pool from the view's first slot on; no length or index of its own
    (the forward's prefix_len and kv_index say what is read)."""

    k: torch.Tensor  # [rows, KVH, D]
    v: torch.Tensor
    capacity: int
    length: torch.Tensor | None = None
    index: torch.Tensor | None = None

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """index [B, Q] positions (-1: not written) <- k, v [B, Q, KVH, D]."""
        rows = pool_index(torch.where(index < 0, self.capacity, index), self.capacity)
        self.k.index_put_((rows,), k)
        self.v.index_put_((rows,), v)


class PooledKV:
    """The store (kv/store.KVStore) over the per-layer pools, for slots [first, first + slots)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], capacity: int, first: int = 0):
        self.k, self.v, self.capacity, self.first = k, v, capacity, first

    def layer(self, i: int) -> PoolView:
        start = self.first * (self.capacity + 1)
        return PoolView(self.k[i][start:], self.v[i][start:], self.capacity)

    def rows(self, start: int, end: int, indexed: bool | None = None) -> PooledKV:
        return PooledKV(self.k, self.v, self.capacity, self.first + start)

    def prefill_rows(self, start: int, end: int) -> PooledKV:
        return self.rows(start, end)

    def move(self, src: int, dst: int, length: int) -> None:
        s = self.capacity + 1
        for pool in (*self.k, *self.v):
            pool[dst * s : dst * s + length] = pool[src * s : src * s + length]


@dataclass(frozen=True)
class PooledLayout(DeviceKV):
    """DeviceKV's sizes, kept as per-layer pools (PooledKV)."""

    def _shape(self) -> tuple[int, int, int]:
        return (self.slots * (self.capacity + 1), self.kv_heads, self.head_dim)

    def tiers(self) -> list[Tier]:
        n = 2 * self.num_layers * torch.Size(self._shape()).numel()
        return [Tier("device KV pools", torch.device(self.device), n * (torch.finfo(self.dtype).bits // 8))]

    def allocate(self) -> PooledKV:
        pools = lambda: [torch.zeros(self._shape(), dtype=self.dtype, device=self.device)  # noqa: E731
                         for _ in range(self.num_layers)]
        return PooledKV(pools(), pools(), self.capacity)
