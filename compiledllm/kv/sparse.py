"""KV with a per-block selection: every layer's full cache plus, per row, the positions each (layer, KV head) selected
for the row's current block (MAGE, HERALD; docs/design.md §5).

Every layer keeps one tensor [N, KVH, D] of regions:

* full cache: slot s, position p at row s * (capacity + 1) + p (the last row of each slot is the spare a -1 write
  lands on);
* `regions` selection regions of P rows per slot (region r, slot s, j-th selected key at F + (r * slots + s) * P + j,
  F = slots * (capacity + 1)); per KV head its own position; HERALD keeps two (the one being read and the one the
  next block's selection goes to);
* a draft region of `draft` rows per slot (HERALD's copy of the draft block's K/V, which the next block's retrieval
  reads while the main steps rewrite the block).

Every layer has the same regions (the dense ones leave theirs unused: one addressing for a few percent of memory).
Layers below dense_layers always read their full cache. A selecting layer's view reads its tensor as a pool through
the store's own `index` [slots, capacity] and `length` [slots]: per row the full prefix (a block's first step, when
the selection is made) or the row's selection. A forward writes its fresh K/V to the full cache only. Switching rows
between modes (`read_full`, `select`, `select_next` + `swap`) is pure tensor work over row masks, so it runs inside a
captured step or from a host hook alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compiledllm.kv.cache import CacheLayer, Tier
from compiledllm.kv.store import DeviceKV


@dataclass(frozen=True)
class PoolLayer:
    """A layer's view (kv/cache.LayerKV) over a pool tensor: rows read through `index` [B, capacity] (and `length`
    [B]; None: the forward's prefix_len); a write of position p goes to row base[b] + p % span (-1: base[b] + span):
    a full cache is span = capacity, a block buffer span = the block."""

    k: torch.Tensor
    v: torch.Tensor
    index: torch.Tensor
    length: torch.Tensor | None
    base: torch.Tensor
    span: int
    keys: torch.Tensor | None = None       # `keys: device`: the layer's full key cache, written too
    key_base: torch.Tensor | None = None   # [B] its row of position 0 per row (spare at + key_span)
    key_span: int = 0

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = self.base[:, None] + torch.where(index < 0, self.span, index % self.span)
        self.k.index_put_((rows,), k)
        self.v.index_put_((rows,), v)
        if self.keys is not None:
            self.keys.index_put_((self.key_base[:, None] + torch.where(index < 0, self.key_span, index),), k)


@dataclass(frozen=True)
class Regions:
    """The per-layer tensor's sizes (rows)."""

    slots: int
    capacity: int
    per_row: int      # P: selected keys a region holds per slot
    regions: int = 1  # selection regions
    draft: int = 0    # draft rows per slot

    @property
    def full_rows(self) -> int:
        return self.slots * (self.capacity + 1)

    @property
    def rows(self) -> int:
        return self.full_rows + self.slots * (self.regions * self.per_row + self.draft)


class SelectionStore:
    """What the stores with per-row selections share (SparseKV, kv/offload.OffloadKV): slots [first, first + n) of a
    store whose `size` has the capacity and P, layers past `dense_layers` selecting."""

    size: Regions
    k: list
    dense_layers: int
    first: int
    n: int

    @property
    def capacity(self) -> int:
        return self.size.capacity

    @property
    def per_row(self) -> int:
        return self.size.per_row

    @property
    def selecting_layers(self) -> range:
        return range(self.dense_layers, len(self.k))

    def _rows(self) -> slice:
        return slice(self.first, self.first + self.n)


class SparseKV(SelectionStore):
    """The store (kv/store.KVStore) over slots [first, first + n)."""

    def __init__(self, k: list, v: list, dense_layers: int, size: Regions, index: torch.Tensor,
                 length: torch.Tensor, region: torch.Tensor, kept: torch.Tensor, first: int = 0,
                 n: int | None = None):
        self.k, self.v, self.dense_layers, self.size = k, v, dense_layers, size
        # per slot: the rows read, how many, the selection region read (or read next), keys kept in a region
        self.index, self.length, self.region, self.kept = index, length, region, kept
        self.first, self.n = first, size.slots - first if n is None else n
        self.device = index.device

    def _slots(self) -> torch.Tensor:
        return self.first + torch.arange(self.n, device=self.device)[:, None]

    # --- regions as tensors ------------------------------------------------------------------------------------------
    def full(self, t: torch.Tensor) -> torch.Tensor:
        """A layer's full cache [n, capacity + 1, KVH, D] for this store's slots."""
        s = self.size
        return t[: s.full_rows].view(s.slots, s.capacity + 1, *t.shape[1:])[self._rows()]

    def selection(self, t: torch.Tensor, r: int) -> torch.Tensor:
        """A layer's selection region r [n, P, KVH, D] for this store's slots."""
        s = self.size
        start = s.full_rows + r * s.slots * s.per_row
        return t[start : start + s.slots * s.per_row].view(s.slots, s.per_row, *t.shape[1:])[self._rows()]

    def drafts(self, t: torch.Tensor) -> torch.Tensor:
        """A layer's draft region [n, draft, KVH, D] for this store's slots."""
        s = self.size
        start = s.full_rows + s.regions * s.slots * s.per_row
        return t[start:].view(s.slots, s.draft, *t.shape[1:])[self._rows()]

    def keys(self, layer: int) -> torch.Tensor:
        """[n, capacity, KVH, D]: a layer's cached keys (what HERALD's scan scores)."""
        return self.full(self.k[layer])[:, :-1]

    def _full_index(self) -> torch.Tensor:
        return self._slots() * (self.capacity + 1) + torch.arange(self.capacity, device=self.device)

    def _selection_index(self, region: torch.Tensor) -> torch.Tensor:
        """[n, capacity] the rows of each row's selection region `region` [n] (past P: full-cache rows, never read)."""
        s, j = self.size, torch.arange(self.capacity, device=self.device)
        rows = s.full_rows + (region[:, None] * s.slots + self._slots()) * s.per_row + j
        return torch.where(j < s.per_row, rows, self._full_index())

    # --- views -------------------------------------------------------------------------------------------------------
    def layer(self, i: int):
        if i < self.dense_layers:
            return CacheLayer(self.full(self.k[i]), self.full(self.v[i]))
        r = self._rows()
        return PoolLayer(self.k[i], self.v[i], self.index[r], self.length[r], self._slots()[:, 0] * (self.capacity + 1),
                         self.capacity)

    def rows(self, start: int, end: int, indexed: bool | None = None) -> "SparseKV":
        return SparseKV(self.k, self.v, self.dense_layers, self.size, self.index, self.length, self.region,
                        self.kept, self.first + start, end - start)

    def prefill_rows(self, start: int, end: int) -> "FullView":
        return FullView(self.rows(start, end))  # prefill chunks attend to the whole prefix

    def retrieval_rows(self, start: int, end: int, block: torch.Tensor | None) -> "RetrievalView":
        """Slots [start, end) as a retrieval forward reads them: every layer's full cache, with the positions
        [block, block + draft) ([n]) read from the draft region instead (None: no draft, the full cache only)."""
        return RetrievalView(self.rows(start, end), block)

    # --- modes ---------------------------------------------------------------------------------------------------
    def reads_full(self) -> torch.Tensor:
        """[n] bool: the rows that read their full cache now."""
        return self.index[self._rows(), 0] < self.size.full_rows

    def read_full(self, rows: torch.Tensor, prefix: torch.Tensor) -> None:
        """Rows where `rows` [n] is True read their full cache up to `prefix` [n] from now on."""
        r = self._rows()
        self.index[r] = torch.where(rows[:, None], self._full_index(), self.index[r])
        self.length[r] = torch.where(rows, prefix, self.length[r])

    def _gather(self, rows: torch.Tensor, chosen: torch.Tensor, target: torch.Tensor) -> None:
        """Every selecting layer l: chosen[l] [n, KVH, P] positions (the capacity: an unused entry) -> the rows'
        selection region `target` [n]."""
        for j, layer in enumerate(self.selecting_layers):
            idx = chosen[j].transpose(1, 2)[..., None].expand(-1, -1, -1, self.k[layer].shape[-1])
            for t in (self.k[layer], self.v[layer]):
                picked = self.full(t).gather(1, idx)
                for r in range(self.size.regions):
                    take = (rows & (target == r))[:, None, None, None]
                    dest = self.selection(t, r)
                    dest.copy_(torch.where(take, picked, dest))

    def _top(self, importance: torch.Tensor, prefix: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return top_positions(importance, prefix, keep, self.per_row, self.capacity)

    def select(self, rows: torch.Tensor, importance: torch.Tensor, prefix: torch.Tensor, keep: torch.Tensor) -> None:
        """Rows where `rows` [n] is True read, from now on, in every selecting layer l and KV head h only the `keep`
        [n] (<= P) positions of their prefix [0, prefix) with the largest importance[l, :, h] ([L, n, KVH, >=
        prefix]; ties: the lower position), gathered from the full cache in position order (MAGE)."""
        chosen = self._top(importance, prefix, keep)
        r = self._rows()
        self._gather(rows, chosen, self.region[r])
        self.index[r] = torch.where(rows[:, None], self._selection_index(self.region[r]), self.index[r])
        self.length[r] = torch.where(rows, keep, self.length[r])

    def select_next(self, rows: torch.Tensor, importance: torch.Tensor, prefix: torch.Tensor, keep: torch.Tensor
                    ) -> None:
        """HERALD's retrieval for rows where `rows` is True: the same selection of `keep` positions of [0, prefix),
        gathered into the region the rows do not read now; `swap` appends the block after the prefix and switches.
        (The importance may come from a forward that also saw a draft of that block: it ranks the prefix only.)"""
        chosen = self._top(importance, prefix, keep)
        r = self._rows()
        self._gather(rows, chosen, 1 - self.region[r])
        self.kept[r] = torch.where(rows, keep, self.kept[r])

    def swap(self, rows: torch.Tensor, block: torch.Tensor, size: int) -> None:
        """Rows where `rows` is True: append the full cache's [block, block + size) ([n]) to their idle region's
        selection and read that region from now on (HERALD's pool swap at a block boundary)."""
        r = self._rows()
        idle, kept = 1 - self.region[r], self.kept[r]
        pos = (block[:, None] + torch.arange(size, device=self.device)).clamp(0, self.capacity)  # [n, size]
        slot_at = (kept[:, None] + torch.arange(size, device=self.device)).clamp(max=self.per_row - 1)
        for layer in self.selecting_layers:
            for t in (self.k[layer], self.v[layer]):
                src = self.full(t).gather(1, pos[..., None, None].expand(-1, -1, *t.shape[1:]))
                for reg in range(self.size.regions):
                    take = (rows & (idle == reg))[:, None, None, None]
                    dest = self.selection(t, reg)
                    old = dest.gather(1, slot_at[..., None, None].expand(-1, -1, *t.shape[1:]))
                    dest.scatter_(1, slot_at[..., None, None].expand(-1, -1, *t.shape[1:]),
                                  torch.where(take, src, old))
        self.region[r] = torch.where(rows, idle, self.region[r])
        self.index[r] = torch.where(rows[:, None], self._selection_index(self.region[r]), self.index[r])
        self.length[r] = torch.where(rows, kept + size, self.length[r])

    def stage_draft(self, rows: torch.Tensor, block: torch.Tensor) -> None:
        """Copy every layer's full-cache positions [block, block + draft) ([n]) of rows where `rows` is True into
        the draft region (the draft's K/V, which the main steps may rewrite before the retrieval reads it)."""
        pos = (block[:, None] + torch.arange(self.size.draft, device=self.device)).clamp(0, self.capacity)
        for t in (*self.k, *self.v):
            src = self.full(t).gather(1, pos[..., None, None].expand(-1, -1, *t.shape[1:]))
            dest = self.drafts(t)
            dest.copy_(torch.where(rows[:, None, None, None], src, dest))

    def move(self, src: int, dst: int, length: int) -> None:
        s = self.size
        one = lambda slot: self.rows(slot, slot + 1)  # noqa: E731
        a, b = one(src), one(dst)
        for t in (*self.k, *self.v):
            b.full(t)[:, :length] = a.full(t)[:, :length]
            for r in range(s.regions):
                b.selection(t, r).copy_(a.selection(t, r))
            if s.draft:
                b.drafts(t).copy_(a.drafts(t))
        for buf in (self.length, self.region, self.kept):
            buf[dst] = buf[src]
        selected = bool((self.index[src, 0] >= s.full_rows).item()) if self.capacity else False
        self.index[dst] = (b._selection_index(self.region[dst : dst + 1]) if selected else b._full_index())[0]


def top_positions(importance: torch.Tensor, prefix: torch.Tensor, keep: torch.Tensor, per_row: int, pad: int
                  ) -> torch.Tensor:
    """[..., n, KVH, per_row] positions in order, padded with `pad`: per (row, KV head) the keep[n] (<= per_row)
    positions < prefix[n] of largest importance [..., n, KVH, >= prefix] (ties: the lower position).

    No sort of the whole prefix: the keep-th largest value from a top-k, every position above it, the lowest
    positions equal to it up to keep, compacted in position order by a running count (on the CPU half the time of
    the two stable sorts it replaced at [18, 16, 4, 33K]; on an H100 MAGE's select step took 100 ms either way)."""
    S = importance.shape[-1]
    pos = torch.arange(S, device=importance.device)
    score = importance.masked_fill(pos >= prefix[:, None, None], float("-inf"))
    P = min(per_row, S)
    want = keep.clamp(max=P)[:, None, None]  # [n, 1, 1]: against [..., n, KVH, 1]
    top = torch.topk(score, P, dim=-1, sorted=True).values
    kth = top.gather(-1, (want - 1).clamp(min=0).expand(*top.shape[:-1], 1))  # the keep-th largest value
    above = score > kth
    tied = score == kth
    take = (above | (tied & (tied.cumsum(-1) <= want - above.sum(-1, keepdim=True)))) & (want > 0)
    slot = torch.where(take, take.cumsum(-1) - 1, per_row)  # its place in the selection (per_row: dropped)
    chosen = torch.full((*score.shape[:-1], per_row + 1), pad, dtype=torch.long, device=score.device)
    chosen.scatter_(-1, slot, pos.expand_as(slot))
    return chosen[..., :per_row]


class FullView:
    """What prefill chunks see: every layer's full cache as a plain device cache."""

    def __init__(self, kv: SparseKV):
        self.kv = kv

    def layer(self, i: int) -> CacheLayer:
        kv = self.kv
        return CacheLayer(kv.full(kv.k[i]), kv.full(kv.v[i]))


class RetrievalView:
    """A retrieval forward's store: every layer reads the rows' full cache, positions [block, block + draft) from
    the draft region; the forward writes nothing."""

    def __init__(self, kv: SparseKV, block: torch.Tensor | None):
        self.kv = kv
        index = kv._full_index()
        if block is not None:
            s, j = kv.size, torch.arange(kv.capacity, device=kv.device)
            draft = s.full_rows + s.regions * s.slots * s.per_row + kv._slots() * s.draft + (j - block[:, None])
            inside = (j >= block[:, None]) & (j < block[:, None] + s.draft)
            index = torch.where(inside, draft, index)
        self.index = index

    def layer(self, i: int) -> PoolLayer:  # (a retrieval forward writes nothing)
        kv = self.kv
        return PoolLayer(kv.k[i], kv.v[i], self.index, None, kv._slots()[:, 0] * (kv.capacity + 1), kv.capacity)


@dataclass(frozen=True)
class SparseLayout:
    """The full cache's sizes, plus `regions` selections of up to `per_row` positions per slot and a draft region of
    `draft` positions per slot, in every layer (the selecting ones read them)."""

    full: DeviceKV
    dense_layers: int
    per_row: int
    regions: int = 1
    draft: int = 0

    @staticmethod
    def budget_rows(budget: float, capacity: int, extra: int = 0) -> int:
        """P for a budget (a share of the prefix) at this capacity, plus `extra` (HERALD's appended block)."""
        return min(capacity, max(1, math.ceil(budget * capacity)) + extra)

    @property
    def size(self) -> Regions:
        f = self.full
        return Regions(f.slots, f.capacity, self.per_row, self.regions, self.draft)

    def tiers(self) -> list[Tier]:
        f, s = self.full, self.size
        per_row = 2 * f.kv_heads * f.head_dim * (torch.finfo(f.dtype).bits // 8) * f.num_layers
        dev = torch.device(f.device)
        return [Tier("device KV cache", dev, per_row * s.full_rows),
                Tier("selected KV", dev, per_row * (s.rows - s.full_rows))]

    def allocate(self) -> SparseKV:
        f, s = self.full, self.size
        tensor = lambda: torch.zeros(s.rows, f.kv_heads, f.head_dim, dtype=f.dtype, device=f.device)  # noqa: E731
        k = [tensor() for _ in range(f.num_layers)]
        v = [tensor() for _ in range(f.num_layers)]
        zeros = lambda: torch.zeros(f.slots, dtype=torch.long, device=f.device)  # noqa: E731
        index = torch.zeros(f.slots, f.capacity, dtype=torch.long, device=f.device)
        kv = SparseKV(k, v, self.dense_layers, s, index, zeros(), zeros(), zeros())
        kv.read_full(torch.ones(f.slots, dtype=torch.bool, device=f.device), kv.length)
        return kv
