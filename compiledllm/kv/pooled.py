"""KV as one pool per layer, read through an index: what a policy uses when a forward must see a row's cached
positions with a hole or out of order, which the dense prefix [0, prefix_len) cannot say (Fast-dLLM's dual cache:
the prefix and the suffix around the block being decoded).

Layer i's pool is [slots * (capacity + 1), KVH, D]: slot s's position p at row s * (capacity + 1) + p, its last row
the spare a -1 write lands on (as in the device cache). A store's view of slots [first, ...) hands the attention
the pool from slot `first` on, so a forward addresses it with `AttentionSpec.kv_index = pool_index(positions,
capacity)`: row r's key j is its position positions[r, j], whatever slot the view starts at.

A layout with `hidden` > 0 also keeps each layer's input (the residual stream entering it) per position, in pools
[slots * (capacity + 1), hidden] addressed the same way: what a forward that resumes at a layer reads
(Forward.resume; Elastic-Cache recomputes the deeper layers from there, policies/elastic_cache.py).
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
    hidden: torch.Tensor | None = None  # [rows, hidden]: the layer's input per position (a layout with hidden > 0)

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """index [B, Q] positions (-1: not written) <- k, v [B, Q, KVH, D]."""
        rows = self._rows(index)
        self.k.index_put_((rows,), k)
        self.v.index_put_((rows,), v)

    def write_hidden(self, index: torch.Tensor, h: torch.Tensor) -> None:
        """index [B, Q] positions (-1: not written) <- the layer's input h [B, Q, hidden]."""
        self.hidden.index_put_((self._rows(index),), h)

    def read_hidden(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, Q, hidden]: the layer's kept input at positions [B, Q]."""
        return self.hidden[pool_index(positions, self.capacity)]

    def _rows(self, index: torch.Tensor) -> torch.Tensor:
        return pool_index(torch.where(index < 0, self.capacity, index), self.capacity)


class PooledKV:
    """The store (kv/store.KVStore) over the per-layer pools, for slots [first, first + slots)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], capacity: int, first: int = 0,
                 hidden: list[torch.Tensor] | None = None):
        self.k, self.v, self.capacity, self.first, self.hidden = k, v, capacity, first, hidden

    def layer(self, i: int) -> PoolView:
        start = self.first * (self.capacity + 1)
        return PoolView(self.k[i][start:], self.v[i][start:], self.capacity,
                        hidden=None if self.hidden is None else self.hidden[i][start:])

    def rows(self, start: int, end: int, indexed: bool | None = None) -> PooledKV:
        return PooledKV(self.k, self.v, self.capacity, self.first + start, self.hidden)

    def prefill_rows(self, start: int, end: int) -> PooledKV:
        return self.rows(start, end)

    def move(self, src: int, dst: int, length: int) -> None:
        s = self.capacity + 1
        for pool in (*self.k, *self.v, *(self.hidden or ())):
            pool[dst * s : dst * s + length] = pool[src * s : src * s + length]


@dataclass(frozen=True)
class PooledLayout(DeviceKV):
    """DeviceKV's sizes, kept as per-layer pools (PooledKV); hidden > 0: each layer's input kept too, at that
    width (the model's hidden size)."""

    hidden: int = 0

    def _shape(self) -> tuple[int, int, int]:
        return (self.slots * (self.capacity + 1), self.kv_heads, self.head_dim)

    def tiers(self) -> list[Tier]:
        rows = self.slots * (self.capacity + 1)
        n = self.num_layers * (2 * torch.Size(self._shape()).numel() + rows * self.hidden)
        what = "device KV and layer-input pools" if self.hidden else "device KV pools"
        return [Tier(what, torch.device(self.device), n * (torch.finfo(self.dtype).bits // 8))]

    def allocate(self) -> PooledKV:
        pools = lambda shape: [torch.zeros(shape, dtype=self.dtype, device=self.device)  # noqa: E731
                               for _ in range(self.num_layers)]
        hidden = pools((self.slots * (self.capacity + 1), self.hidden)) if self.hidden else None
        return PooledKV(pools(self._shape()), pools(self._shape()), self.capacity, hidden=hidden)
