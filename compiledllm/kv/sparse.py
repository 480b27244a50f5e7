"""KV with a per-block selection: the full cache of every layer plus, for the layers past the dense ones, a pool of the
positions each (row, KV head) selected for its current block (MAGE, HERALD; docs/design.md §5).

Layer i >= dense_layers keeps one tensor [slots * (capacity + 1) + slots * P, KVH, D]: first the full cache (slot s,
position p at row s * (capacity + 1) + p, the last row of each slot the spare a -1 write lands on), then the
selection region (slot s's j-th selected key at row slots * (capacity + 1) + s * P + j; per KV head its own
position). The layer's view reads it as a pool through the store's own `index` [slots, capacity] and `length`
[slots]: per row either the full prefix (index = the row's full-cache rows, length = its cached prefix; the mode of a
block's first step, when the selection is made) or the selection (index = the row's selection rows, length = the
number selected). A forward writes its fresh K/V to the full cache only. Layers below dense_layers are a plain device
cache. So one captured step serves rows in either mode; `select` and `read_full` switch rows between them and are
pure tensor work (run in the policy's captured post-forward hook).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compiledllm.kv.cache import CacheLayer, Tier
from compiledllm.kv.store import DeviceKV


@dataclass(frozen=True)
class SparseLayer:
    """A selecting layer's view (kv/cache.LayerKV) of rows [first, first + B): the whole layer tensor as a pool, the
    rows' own index and length."""

    k: torch.Tensor  # [N, KVH, D]
    v: torch.Tensor
    index: torch.Tensor  # [B, capacity] pool rows of each row's visible keys
    length: torch.Tensor  # [B]
    first: int
    capacity: int

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """index [B, Q] positions (-1: not written) -> the rows' full cache."""
        slot = self.first + torch.arange(index.shape[0], device=index.device)[:, None]
        rows = slot * (self.capacity + 1) + torch.where(index < 0, self.capacity, index)
        self.k.index_put_((rows,), k)
        self.v.index_put_((rows,), v)


class SparseKV:
    """The store (kv/store.KVStore) over slots [first, first + n)."""

    def __init__(self, dense_k: list, dense_v: list, k: list, v: list, index: torch.Tensor, length: torch.Tensor,
                 count: torch.Tensor, slots: int, capacity: int, per_row: int, first: int = 0, n: int | None = None):
        self.dense_k, self.dense_v, self.k, self.v = dense_k, dense_v, k, v
        self.index, self.length, self.count = index, length, count  # [slots, capacity], [slots], [slots]
        self.slots, self.capacity, self.per_row = slots, capacity, per_row
        self.first, self.n = first, slots - first if n is None else n

    @property
    def dense_layers(self) -> int:
        return len(self.dense_k)

    def _rows(self) -> slice:
        return slice(self.first, self.first + self.n)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """A selecting layer's full cache [n, capacity + 1, KVH, D] for this store's slots."""
        S = self.capacity + 1
        return t[: self.slots * S].view(self.slots, S, *t.shape[1:])[self._rows()]

    def selection(self, t: torch.Tensor) -> torch.Tensor:
        """A selecting layer's selection region [n, P, KVH, D] for this store's slots."""
        return t[self.slots * (self.capacity + 1):].view(self.slots, self.per_row, *t.shape[1:])[self._rows()]

    def layer(self, i: int):
        if i < self.dense_layers:
            return CacheLayer(self.dense_k[i][self._rows()], self.dense_v[i][self._rows()])
        j = i - self.dense_layers
        r = self._rows()
        return SparseLayer(self.k[j], self.v[j], self.index[r], self.length[r], self.first, self.capacity)

    def rows(self, start: int, end: int, indexed: bool | None = None) -> "SparseKV":
        return SparseKV(self.dense_k, self.dense_v, self.k, self.v, self.index, self.length, self.count, self.slots,
                        self.capacity, self.per_row, self.first + start, end - start)

    def prefill_rows(self, start: int, end: int) -> "PrefillView":
        return PrefillView(self.rows(start, end))  # prefill chunks attend to the whole prefix

    # --- modes ---------------------------------------------------------------------------------------------------
    def _full_index(self) -> torch.Tensor:
        slot = self.first + torch.arange(self.n, device=self.index.device)[:, None]
        return slot * (self.capacity + 1) + torch.arange(self.capacity, device=self.index.device)

    def _selection_index(self) -> torch.Tensor:
        """The rows' selection rows (past P: their full-cache rows, never read: length <= P)."""
        j = torch.arange(self.capacity, device=self.index.device)
        slot = self.first + torch.arange(self.n, device=self.index.device)[:, None]
        return torch.where(j < self.per_row, self.slots * (self.capacity + 1) + slot * self.per_row + j,
                           self._full_index())

    def read_full(self, rows: torch.Tensor, prefix: torch.Tensor) -> None:
        """Rows where `rows` [n] is True read their full cache up to `prefix` [n] from now on."""
        r = self._rows()
        self.index[r] = torch.where(rows[:, None], self._full_index(), self.index[r])
        self.length[r] = torch.where(rows, prefix, self.length[r])

    def select(self, rows: torch.Tensor, importance: torch.Tensor, prefix: torch.Tensor, keep: torch.Tensor) -> None:
        """Rows where `rows` [n] is True read, from now on, in every selecting layer l and KV head h only the `keep`
        [n] (<= P) positions of their prefix [0, prefix) with the largest importance[l, :, h] ([L, n, KVH, >=
        prefix]; ties: the lower position), gathered from the full cache in position order."""
        L, n, KVH, _ = importance.shape
        pos = torch.arange(importance.shape[-1], device=importance.device)
        score = importance.masked_fill(pos >= prefix[None, :, None, None], float("-inf"))
        top = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., : self.per_row]
        ranked = torch.arange(self.per_row, device=top.device) < keep[None, :, None, None]
        chosen = torch.sort(torch.where(ranked, top, importance.shape[-1]), dim=-1).values.clamp(max=self.capacity)
        take = rows[:, None, None, None]
        for j in range(L):
            idx = chosen[j].transpose(1, 2)[..., None].expand(n, self.per_row, KVH, self.k[j].shape[-1])
            for t in (self.k[j], self.v[j]):
                picked, dest = self.full(t).gather(1, idx), self.selection(t)
                dest.copy_(torch.where(take, picked, dest))
        r = self._rows()
        self.index[r] = torch.where(rows[:, None], self._selection_index(), self.index[r])
        self.length[r] = torch.where(rows, keep, self.length[r])
        self.count[r] = torch.where(rows, keep, self.count[r])

    def move(self, src: int, dst: int, length: int) -> None:
        S, P = self.capacity + 1, self.per_row
        for t in (*self.dense_k, *self.dense_v):
            t[dst, :length] = t[src, :length]
        for t in (*self.k, *self.v):
            t[dst * S : dst * S + length] = t[src * S : src * S + length]
            base = self.slots * S
            t[base + dst * P : base + (dst + 1) * P] = t[base + src * P : base + (src + 1) * P]
        selected = bool((self.index[src, 0] >= self.slots * S).item()) if self.capacity else False
        one = SparseKV(self.dense_k, self.dense_v, self.k, self.v, self.index, self.length, self.count, self.slots,
                       self.capacity, self.per_row, dst, 1)
        one.index[dst] = (one._selection_index() if selected else one._full_index())[0]
        self.length[dst], self.count[dst] = self.length[src], self.count[src]


class PrefillView:
    """What prefill chunks see: every layer's full cache as a plain device cache."""

    def __init__(self, kv: SparseKV):
        self.kv = kv

    def layer(self, i: int) -> CacheLayer:
        kv = self.kv
        if i < kv.dense_layers:
            return kv.layer(i)
        j = i - kv.dense_layers
        return CacheLayer(kv.full(kv.k[j]), kv.full(kv.v[j]))


@dataclass(frozen=True)
class SparseLayout:
    """The full cache's sizes, plus a selection of up to ceil(budget x capacity) positions per row in every layer
    from `dense_layers` on."""

    full: DeviceKV
    dense_layers: int
    budget: float

    @property
    def per_row(self) -> int:
        return max(1, math.ceil(self.budget * self.full.capacity))

    def _bytes(self, rows: int) -> int:
        f = self.full
        return 2 * rows * f.kv_heads * f.head_dim * (torch.finfo(f.dtype).bits // 8)

    def tiers(self) -> list[Tier]:
        f, sel = self.full, self.full.num_layers - self.dense_layers
        dev = torch.device(f.device)
        return [Tier("device KV cache", dev, self._bytes(f.num_layers * f.slots * (f.capacity + 1))),
                Tier("selected KV", dev, self._bytes(sel * f.slots * self.per_row))]

    def allocate(self) -> SparseKV:
        f, P = self.full, self.per_row
        zeros = lambda *shape: torch.zeros(*shape, f.kv_heads, f.head_dim, dtype=f.dtype, device=f.device)  # noqa: E731
        dense = lambda: [zeros(f.slots, f.capacity + 1) for _ in range(self.dense_layers)]  # noqa: E731
        pools = lambda: [zeros(f.slots * (f.capacity + 1 + P)) for _ in range(f.num_layers - self.dense_layers)]  # noqa: E731
        index = torch.zeros(f.slots, f.capacity, dtype=torch.long, device=f.device)
        length = torch.zeros(f.slots, dtype=torch.long, device=f.device)
        kv = SparseKV(dense(), dense(), pools(), pools(), index, length, torch.zeros_like(length), f.slots,
                      f.capacity, P)
        kv.read_full(torch.ones_like(length, dtype=torch.bool), length)
        return kv
