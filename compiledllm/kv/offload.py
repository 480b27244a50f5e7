"""KV with the selecting layers' full cache in host memory (HERALD's system form, docs/design.md §5): the device holds,
per selecting layer, only what the steps read (two selection regions per slot) and what they write (one block buffer
per slot); the full K/V of every position lives in a host pool ([L, slots, KVH, capacity, D], pinned on CUDA), where
the once-per-block selection scans it on the CPU (ext/, kv/cpu_select.py) and gathers the chosen rows of the rows it
scanned for one host-to-device copy per layer.

A row's prompt still needs its whole prefix on the device while it prefills and for its first selection: the store
lends it one of `scratch` device full caches from admission (`admit`) until `release`. The first layers
(`dense_layers`) keep a device full cache per slot, as in kv/sparse.py.

Per selecting layer one device tensor [N, KVH, D] (the selecting layers stacked in one [L, N, KVH, D] per K and V,
so the host hooks move every layer in one op) holds, in rows:

* scratch caches: cache c, position p at c * (capacity + 1) + p (the last row: the spare a -1 write lands on);
* two selection regions of P rows per slot (region r, slot s, j-th key at F + (r * slots + s) * P + j, F the scratch
  rows), per KV head its own position, as in kv/sparse.py;
* block buffers: slot s, position p of its current block at F + 2 * slots * P + s * (B + 1) + p % B (a block is B
  consecutive positions, so p % B is unique in it; row B: the spare).

A step's view reads each row's `index` / `length` (its scratch cache, or its region) and writes the forward's fresh
K/V to the row's block buffer; a prefill view reads and writes the rows' scratch caches. The host copies between the
tiers (`offload_prefix`, `offload_block`, `fetch_prefix`) and the CPU retrieval (`scan`, `values_scan`, `place`) run
from the policy's host hooks; the engine thread's seconds in each are in `shared.seconds`.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from compiledllm.kv import cpu_select
from compiledllm.kv.cache import CacheLayer, Tier
from compiledllm.kv.host_attention import HostAttendView, host_attention
from compiledllm.kv.sparse import PoolLayer, SelectionStore, top_positions
from compiledllm.kv.store import DeviceKV


@dataclass(frozen=True)
class Scanned:
    """A CPU scan's result for the rows it selected for: store slots first + rows[i], their keep counts [m] and the
    gathered K and V (or V alone) of every selecting layer, [2 or 1, L, m, KVH, k, D] on the host (pinned on CUDA):
    only those rows cross to the device, in one copy (started early by `OffloadKV.upload`: then staged is that copy)."""

    first: int
    rows: list[int]
    keep: torch.Tensor
    staged: torch.Tensor
    ready: torch.cuda.Event | None = None  # staged is on the device once this event has passed (`upload`)

    @property
    def slots(self) -> list[int]:
        return [self.first + b for b in self.rows]


@dataclass(frozen=True)
class OffloadSize:
    slots: int
    capacity: int
    per_row: int   # P: selected keys a region holds per slot
    block: int     # B: a block buffer's positions
    scratch: int   # device full caches for rows that prefill or make their first selection

    @property
    def scratch_rows(self) -> int:
        return self.scratch * (self.capacity + 1)

    @property
    def block_rows(self) -> int:  # first row of the block buffers
        return self.scratch_rows + 2 * self.slots * self.per_row

    @property
    def rows(self) -> int:
        return self.block_rows + self.slots * (self.block + 1)


class _Shared:
    """The host-side state every view of the store shares: which scratch cache each slot holds (the device copy `of`
    [slots] is what captured steps read), each slot's host-pool row, the prefix copies to the host pool in flight,
    and the block copies whose
    device-to-host transfer is issued but not yet written into the pool (`writes`: whichever thread reads the pool
    next writes them, under `lock`)."""

    def __init__(self, scratch: int, slots: int, device: torch.device):
        self.free = list(range(scratch))
        self.held: list[int | None] = [None] * slots
        self.of = torch.zeros(slots, dtype=torch.long, device=device)
        self.pending: dict[int, torch.cuda.Event] = {}  # slot -> its prefix copy to the host pool, in flight
        # the block copies to the host and the selections' copies to the device run on streams of their own, so
        # that PCIe overlaps the steps instead of queueing on the compute stream (HERALD's dual-stream pipeline)
        cuda = device.type == "cuda"
        self.down = torch.cuda.Stream(device) if cuda else None
        self.up = torch.cuda.Stream(device) if cuda else None
        # slot -> its row of the host pools: a slot move swaps two entries instead of copying a row's whole prefix
        self.host_row = list(range(slots))
        self.writes: list[Callable[[], None]] = []
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = {}  # the engine thread's time in the store's host-side methods (`_timed`)
        # the host worker's time in a scan's parts: waiting for the device (its inputs, the pool's pending writes and
        # prefix copies: `ready`), ext/'s selection (`select`), the gather into staging (`gather`)
        self.worker_seconds: dict[str, float] = {}

    def count(self, part: str, t0: float) -> float:
        """Adds the seconds since t0 to worker_seconds[part]; returns now."""
        now = time.perf_counter()
        self.worker_seconds[part] = self.worker_seconds.get(part, 0.0) + now - t0
        return now

    def flush(self) -> None:
        """Write every issued block copy into the host pool (waiting for its transfer)."""
        with self.lock:
            for write in self.writes:
                write()
            self.writes.clear()


def _flat(pool: torch.Tensor) -> torch.Tensor:
    """A stacked host pool [L, slots, KVH, capacity, D] as its [L * slots, ...] entries (a view)."""
    return pool.view(-1, *pool.shape[2:])


def _timed(method):
    """Adds the seconds a call of `method` takes to the store's `seconds[method name]` (the host hooks' split)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            seconds = self.shared.seconds
            seconds[method.__name__] = seconds.get(method.__name__, 0.0) + time.perf_counter() - t
    return timed


class OffloadKV(SelectionStore):
    """The store (kv/store.KVStore) over slots [first, first + n)."""

    def __init__(self, k: list, v: list, pools: tuple[torch.Tensor, torch.Tensor], host_k: torch.Tensor | None,
                 host_v: torch.Tensor, dense_layers: int, size: OffloadSize, index: torch.Tensor, length: torch.Tensor,
                 region: torch.Tensor, kept: torch.Tensor, shared: _Shared, kfull: torch.Tensor | None = None,
                 next_pos: torch.Tensor | None = None, first: int = 0, n: int | None = None):
        # k / v: every layer's device tensor, the selecting layers' being views of `pools` (K, V: [L, rows, KVH, D]
        # stacked, so the host hooks move every selecting layer in one op); host_*: [L, slots, KVH, capacity, D]; with
        # `keys: device` no host keys, and kfull [L, slots * (capacity + 1), KVH, D]: every selecting layer's full key
        # cache on the device (slot s, position p at s * (capacity + 1) + p) with next_pos [L, slots, KVH, P], the
        # positions the device scan chose last
        self.k, self.v, self.pools, self.host_k, self.host_v = k, v, pools, host_k, host_v
        self.kfull, self.next_pos = kfull, next_pos
        self.dense_layers, self.size = dense_layers, size
        self.index, self.length, self.region, self.kept, self.shared = index, length, region, kept, shared
        self.first, self.n = first, size.slots - first if n is None else n
        self.device = index.device

    def _slots(self) -> torch.Tensor:
        return self.first + torch.arange(self.n, device=self.device)

    # --- addressing ------------------------------------------------------------------------------------------------
    def _dense_full(self, t: torch.Tensor) -> torch.Tensor:
        s = self.size
        return t.view(s.slots, s.capacity + 1, *t.shape[1:])[self._rows()]

    def _scratch_base(self) -> torch.Tensor:
        return self.shared.of[self._rows()] * (self.capacity + 1)

    def _region_base(self, region: torch.Tensor) -> torch.Tensor:
        s = self.size
        return s.scratch_rows + (region * s.slots + self._slots()) * s.per_row

    def _block_base(self) -> torch.Tensor:
        return self.size.block_rows + self._slots() * (self.size.block + 1)

    def _key_base(self) -> torch.Tensor:
        return self._slots() * (self.capacity + 1)

    def _key_args(self, i: int) -> dict:
        if self.kfull is None:
            return {}
        return {"keys": self.kfull[i - self.dense_layers], "key_base": self._key_base(), "key_span": self.capacity}

    def keys(self, layer: int) -> torch.Tensor:
        """[n, capacity, KVH, D]: a selecting layer's full key cache on the device (`keys: device`)."""
        s, t = self.size, self.kfull[layer - self.dense_layers]
        return t.view(s.slots, s.capacity + 1, *t.shape[1:])[self._rows(), :-1]

    def _selection_index(self, region: torch.Tensor) -> torch.Tensor:
        j = torch.arange(self.capacity, device=self.device)
        return self._region_base(region)[:, None] + j.clamp(max=self.per_row - 1)  # past P: never read

    # --- views -----------------------------------------------------------------------------------------------------
    def layer(self, i: int):
        if i < self.dense_layers:
            return CacheLayer(self._dense_full(self.k[i]), self._dense_full(self.v[i]))
        r = self._rows()
        return PoolLayer(self.k[i], self.v[i], self.index[r], self.length[r], self._block_base(), self.size.block,
                         **self._key_args(i))

    def rows(self, start: int, end: int, indexed: bool | None = None) -> "OffloadKV":
        return OffloadKV(self.k, self.v, self.pools, self.host_k, self.host_v, self.dense_layers, self.size, self.index,
                         self.length, self.region, self.kept, self.shared, self.kfull, self.next_pos,
                         self.first + start, end - start)

    def prefill_rows(self, start: int, end: int) -> "ScratchView":
        return ScratchView(self.rows(start, end))

    # --- scratch -----------------------------------------------------------------------------------------------
    def admit(self, slot: int) -> bool:
        """Lend slot `slot` (of the whole store) a scratch cache for its prefill; False: none is free."""
        lend = self.shared
        if lend.held[slot] is None:
            if not lend.free:
                return False
            lend.held[slot] = lend.free.pop(0)
            lend.of[slot] = lend.held[slot]
        return True

    def holds_scratch(self, slot: int) -> bool:
        return self.shared.held[slot] is not None

    @_timed
    def release(self, slot: int) -> None:
        """Give slot `slot`'s scratch cache back (once its prefix is in the host pool and it reads a selection). It
        waits for the prefix copy on purpose: not waiting spread admissions out, and rows out of step with the others
        take select and draft steps of their own (docs/results.md, HERALD at 32K, twenty-third session)."""
        lend = self.shared
        if lend.held[slot] is not None:
            event = lend.pending.pop(slot, None)
            if event is not None:
                event.synchronize()  # the copy out of the scratch cache must end before another row writes it
            lend.free.append(lend.held[slot])
            lend.held[slot] = None

    free = release  # a vacated slot (the session's call) gives its scratch back

    # --- modes ---------------------------------------------------------------------------------------------------
    def reads_full(self) -> torch.Tensor:
        return self.index[self._rows(), 0] < self.size.scratch_rows

    @_timed
    def read_full(self, rows: torch.Tensor, prefix: torch.Tensor) -> None:
        """Rows where `rows` [n] is True (each holding a scratch cache) read it up to `prefix` [n] from now on."""
        r = self._rows()
        full = self._scratch_base()[:, None] + torch.arange(self.capacity, device=self.device)
        self.index[r] = torch.where(rows[:, None], full, self.index[r])
        self.length[r] = torch.where(rows, prefix, self.length[r])

    def select(self, rows: torch.Tensor, importance: torch.Tensor, prefix: torch.Tensor, keep: torch.Tensor) -> None:
        """MAGE's selection from the rows' scratch caches (their first block): as kv/sparse.SparseKV.select. Only rows
        that hold a scratch cache select, `scratch` at most: those are gathered (a fixed count, so that a captured step
        keeps its shapes), not every row of the bucket (at 64 rows and 32K, 8x the K/V moved)."""
        taken, at = torch.topk(rows.int(), min(self.size.scratch, rows.shape[0]))  # [m] distinct rows, selecting first
        live = taken > 0
        chosen = top_positions(importance[:, at], prefix[at], keep[at], self.per_row, self.capacity)  # [L, m, KVH, P]
        r = self._rows()
        region = self.region[r]
        for t in self.pools:
            self._fill(t, live, self._region_base(region)[at], t, self._scratch_base()[at], chosen)
        self.index[r] = torch.where(rows[:, None], self._selection_index(region), self.index[r])
        self.length[r] = torch.where(rows, keep, self.length[r])

    def _fill(self, t: torch.Tensor, rows: torch.Tensor, dest: torch.Tensor, src: torch.Tensor, base: torch.Tensor,
              chosen: torch.Tensor) -> None:
        """In every selecting layer l, for the entries b where `rows` [m]: t's rows dest[b] + j ([L, rows, KVH, D]; a
        region), KV head h's j-th key := src's row base[b] + chosen[l, b, h, j] ([L, m, KVH, P] positions; the
        capacity: the spare row). The other entries write t's last row (a block buffer's spare, never a region's) back
        onto itself, so they never touch a live entry's rows."""
        L, _, KVH, P = chosen.shape
        lay = torch.arange(L, device=self.device)[:, None, None, None]
        heads = torch.arange(KVH, device=self.device)
        dest = torch.where(rows[:, None], dest[:, None] + torch.arange(P, device=self.device), t.shape[1] - 1)
        picked = src[lay, base[None, :, None, None] + chosen, heads[:, None]].transpose(2, 3)  # [L, m, P, KVH, D]
        at = (lay, dest[None, :, :, None], heads)
        t[at] = torch.where(rows[None, :, None, None, None], picked, t[at])

    @_timed
    def swap(self, rows: torch.Tensor, block: torch.Tensor, size: int) -> None:
        """Rows where `rows` is True: append their block buffer (the block at `block` [n], `size` positions) to the
        idle region's selection and read that region from now on (HERALD's pool swap)."""
        r = self._rows()
        idle, kept = 1 - self.region[r], self.kept[r]
        j = torch.arange(size, device=self.device)
        src = self._block_base()[:, None] + (block[:, None] + j) % self.size.block  # [n, size]
        dest = self._region_base(idle)[:, None] + (kept[:, None] + j).clamp(max=self.per_row - 1)
        for t in self.pools:
            t[:, dest] = torch.where(rows[None, :, None, None, None], t[:, src], t[:, dest])
        self.region[r] = torch.where(rows, idle, self.region[r])
        self.index[r] = torch.where(rows[:, None], self._selection_index(self.region[r]), self.index[r])
        self.length[r] = torch.where(rows, kept + size, self.length[r])

    @_timed
    def block_to_scratch(self, slots: list[int], block: torch.Tensor, size: int) -> None:
        """The block buffers of `slots` (store slots holding scratch) into their scratch caches at [block, block +
        size) ([n] over this view): a row that reads its full prefix again sees the block it completed."""
        j = torch.arange(size, device=self.device)
        for s in slots:
            b = s - self.first
            src = self._block_base()[b] + (block[b] + j) % self.size.block
            dest = self.shared.held[s] * (self.capacity + 1) + block[b] + j
            for t in self.pools:
                t[:, dest] = t[:, src]

    # --- the host pool ---------------------------------------------------------------------------------------------
    @_timed
    def offload_prefix(self, slots: list[int], prefix: list[int], stream: torch.cuda.Stream | None = None) -> None:
        """Each slot's scratch cache [0, prefix) -> the host pool, on `stream` where given (asynchronous; `release`
        and `retrieve` wait for it)."""
        cap = self.capacity
        for s, p in zip(slots, prefix):
            base, r = self.shared.held[s] * (cap + 1), self.shared.host_row[s]
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for t, host in self._host_pairs():
                    for j in range(host.shape[0]):
                        for h in range(host.shape[2]):  # contiguous host rows: the copy stays asynchronous
                            host[j, r, h, :p].copy_(t[j, base : base + p, h], non_blocking=stream is not None)
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                self.shared.pending[s] = event

    @_timed
    def fetch_prefix(self, slots: list[int], prefix: list[int]) -> None:
        """Each slot's host-pool positions [0, prefix) into the scratch cache it holds, on the current stream
        (MAGE-Offload's second form: the full KV fetched to the device for a block's selection)."""
        self.shared.flush()
        self._wait_prefix(slots)
        cap = self.capacity
        for s, p in zip(slots, prefix):
            base, r = self.shared.held[s] * (cap + 1), self.shared.host_row[s]
            for t, host in self._host_pairs():
                for j in range(host.shape[0]):
                    for h in range(host.shape[2]):  # contiguous host rows: the copy stays asynchronous
                        t[j, base : base + p, h].copy_(host[j, r, h, :p], non_blocking=True)

    @_timed
    def offload_block(self, slots: list[int], block: list[int]) -> None:
        """Each slot's block buffer (the block at `block`: a draft's K/V or the final one) -> the host pool: one gather
        of every selecting layer on the device and one transfer, issued here without waiting; the rows are written
        into the pool by the next reader of it (`_Shared.flush`: the host worker's scan, as a rule)."""
        B = self.size.block
        if not slots:
            return
        at = torch.tensor([[self.size.block_rows + s * (B + 1), start] for s, start in zip(slots, block)])
        src = (at[:, :1] + (at[:, 1:] + torch.arange(B)) % B).to(self.device, non_blocking=True)  # [rows, B]
        pairs = self._host_pairs()
        staged = torch.stack([t[:, src] for t, _ in pairs])  # [K and V, or V, L, rows, B, KVH, D]
        cuda = self.device.type == "cuda"
        out = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=cuda)
        event = None
        if cuda:  # the transfer on the store's down stream, after the gather (the next step may refill the buffers)
            down = self.shared.down
            down.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(down):
                out.copy_(staged, non_blocking=True)
            staged.record_stream(down)
            event = torch.cuda.Event()
            event.record(down)
        else:
            out.copy_(staged)
        ends = [min(start + B, self.capacity) for start in block]
        rows = [self.shared.host_row[s] for s in slots]  # (a move flushes the writes before it swaps rows)

        def write() -> None:
            if event is not None:
                event.synchronize()
            for (_, host), x in zip(pairs, out):
                for i, (r, start, end) in enumerate(zip(rows, block, ends)):
                    host[:, r, :, start:end] = x[:, i, : end - start].transpose(1, 2)

        with self.shared.lock:
            self.shared.writes.append(write)

    def _host_pairs(self) -> tuple:
        """(device pool, host pool) of the selecting layers' keys (unless they stay on the device) and values."""
        v = (self.pools[1], self.host_v)
        return (v,) if self.host_k is None else ((self.pools[0], self.host_k), v)

    def retrieve(self, slots: list[int], q: torch.Tensor, prefix: torch.Tensor, end: torch.Tensor,
                 keep: torch.Tensor, threads: int = 0) -> None:
        """`scan` then `place`, in one call."""
        self.place(self.scan(slots, q, prefix, end, keep, threads))

    def scan(self, slots: list[int], q: torch.Tensor, prefix: torch.Tensor, end: torch.Tensor, keep: torch.Tensor,
             threads: int = 0) -> "Scanned":
        """HERALD's CPU retrieval for `slots` (store slots), host work only (a worker thread may run it while the
        device steps): in every selecting layer j the query q[b, j] ([n, L, H, D] on the CPU; row b = slot first +
        b) scores the host pool's keys [0, end[b]), and the keep[b] positions before prefix[b] of largest mass (per
        KV head the G heads' softmax probabilities summed; ties: the lower position) are gathered into host staging
        (Scanned). bf16 pools go through the fused kernel (kv/cpu_select.py; one call for every layer and row), others
        through the same math in torch. prefix, end, keep: [n] CPU tensors."""
        n, L = q.shape[0], len(self.selecting_layers)
        t = time.perf_counter()
        on, _ = self._ready(slots, n)
        t = self.shared.count("ready", t)
        rows = on.nonzero()[:, 0]
        m, H, D = rows.numel(), q.shape[2], q.shape[3]
        prefix, end, keep = prefix[rows], end[rows].clamp(max=self.capacity), keep[rows]
        entries = self._entries(rows)
        if self.fused:  # one call for every selecting layer's rows (ext/ reads the stacked pool's entries in place)
            chosen = cpu_select.select(q[rows].transpose(0, 1).reshape(L * m, H, 1, D), _flat(self.host_k), None,
                                       end.repeat(L), keep.repeat(L), rank_lengths=prefix.repeat(L), rows=entries,
                                       want_output=False, want_lse=False, threads=threads).topk_idx
        else:
            hosts = self.host_rows(rows)
            chosen = torch.cat([host_attention(q[rows, j][:, :, None], self.host_k[j, hosts], None, end, keep,
                                               prefix)[2] for j in range(L)])
        t = self.shared.count("select", t)
        out = Scanned(self.first, rows.tolist(), keep, self._gather(entries, chosen, 2, threads))
        self.shared.count("gather", t)
        return out

    def host_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[m] the host-pool rows of the view's rows [m]."""
        return torch.tensor([self.shared.host_row[self.first + int(b)] for b in rows], dtype=torch.long)

    def _entries(self, rows: torch.Tensor) -> torch.Tensor:
        """[L * m] the stacked host pools' entries (layer-major) of the view's rows [m]."""
        slots = self.host_v.shape[1]
        return (torch.arange(len(self.selecting_layers))[:, None] * slots + self.host_rows(rows)[None]).reshape(-1)

    def _gather(self, entries: torch.Tensor, idx: torch.Tensor, kinds: int, threads: int) -> torch.Tensor:
        """The host pools' rows idx [L * m, KVH, k] (int32, -1: none) of `entries` into staging [kinds, L, m, KVH,
        k, D] (pinned where the pool is): K and V (kinds 2) or V alone (1), in one call of ext/'s gather."""
        hv = self.host_v
        KVH, k, D = hv.shape[2], idx.shape[2], hv.shape[4]
        pools = (_flat(hv),) if kinds == 1 else (_flat(self.host_k), _flat(hv))
        if self.fused:
            out = torch.empty(kinds, entries.numel(), KVH, k, D, dtype=hv.dtype, pin_memory=hv.is_pinned())
            cpu_select.gather(None if kinds == 1 else pools[0], pools[-1], idx, out=out, rows=entries, threads=threads)
        else:
            safe = idx.clamp(min=0).long()
            at = (entries[:, None, None], torch.arange(KVH)[None, :, None], safe)
            out = torch.stack([pool[at] for pool in pools])
        return out.view(kinds, len(self.selecting_layers), entries.numel() // len(self.selecting_layers), KVH, k, D)

    @property
    def fused(self) -> bool:
        """Whether the host pool goes through ext/'s fused kernel (bf16 pools, the extension built)."""
        return self.host_v[0].dtype == torch.bfloat16 and cpu_select.extension_available()

    def gathered(self, on: torch.Tensor, keep: torch.Tensor, chosen: list[torch.Tensor], threads: int = 0
                 ) -> "Scanned":
        """The view's rows where `on` [n]: per selecting layer the K/V of the positions chosen[j] ([n, KVH, k] int32,
        -1: none) gathered from the host pool into staging."""
        rows = on.nonzero()[:, 0]
        idx = torch.stack(chosen)[:, rows].flatten(0, 1).int()
        return Scanned(self.first, rows.tolist(), keep[rows], self._gather(self._entries(rows), idx, 2, threads))

    def host_attend(self, lengths: torch.Tensor, keep: torch.Tensor, prefix: torch.Tensor) -> "HostAttendView":
        """A forward's store where the selecting layers attend on the CPU over the host pool's keys [0, lengths)
        and choose, per KV head, the keep positions before prefix of largest mass (HERALD's retrieval forward);
        the dense layers read their device caches. [n] CPU tensors; n: the view's rows."""
        self.shared.flush()
        self._wait_prefix(range(self.first, self.first + self.n))
        return HostAttendView(self, lengths, keep, prefix)

    @_timed
    def place(self, scanned: "Scanned", only: list[int] | None = None) -> None:
        """A scan's selections into its rows' idle regions (one host-to-device copy per layer), for the store slots
        `only` (default all of its rows) keeps; their kept := its keep counts."""
        slots = scanned.slots
        pick = [i for i, s in enumerate(slots) if only is None or s in only]
        if not pick:
            return
        staged = scanned.staged  # [K and V or V, L, m, KVH, k, D]
        if scanned.ready is not None:  # uploaded already: the device waits for the copy's end, the host does not
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(scanned.ready)
            staged.record_stream(stream)
            x = staged
        else:
            x = torch.empty(staged.shape, dtype=staged.dtype, device=self.device)
            x.copy_(staged, non_blocking=True)  # one transfer (pinned on CUDA)
        at = torch.tensor(pick).to(self.device, non_blocking=True)
        rows = torch.tensor([slots[i] for i in pick]).to(self.device, non_blocking=True)
        base = self.size.scratch_rows + ((1 - self.region[rows]) * self.size.slots + rows) * self.per_row
        dest = base[:, None] + torch.arange(staged.shape[4], device=self.device)  # [picked, k]: their idle regions
        for t, new in zip(self.pools[2 - staged.shape[0]:], x[:, :, at]):  # [K, V] or [V]
            t[:, dest] = new.transpose(2, 3).to(t.dtype)  # [L, picked, k, KVH, D]
        self.kept[rows] = scanned.keep[pick].to(self.device, non_blocking=True)

    def upload(self, scanned: Scanned) -> Scanned:
        """A finished scan's staged K/V sent to the device now, on the store's up stream (CUDA), while the steps run:
        the Scanned that `place` reads, at the boundary, without a transfer on the compute stream. Elsewhere: as is."""
        if self.device.type != "cuda" or scanned.ready is not None:
            return scanned
        with torch.cuda.stream(self.shared.up):
            x = torch.empty(scanned.staged.shape, dtype=scanned.staged.dtype, device=self.device)
            x.copy_(scanned.staged, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return replace(scanned, staged=x, ready=ready)

    def select_next_keys(self, rows: torch.Tensor, importance: torch.Tensor, prefix: torch.Tensor,
                         keep: torch.Tensor) -> None:
        """`keys: device`: the positions a device scan ranked (as SparseKV.select_next ranks them) into next_pos, their
        keys from the device key cache into the rows' idle regions, kept := keep; the values follow from the host
        pool (`values_scan`, `place`)."""
        chosen = top_positions(importance, prefix, keep, self.per_row, self.capacity)  # [L, n, KVH, P]
        r = self._rows()
        self.next_pos[:, r] = torch.where(rows[None, :, None, None], chosen, self.next_pos[:, r])
        self._fill(self.pools[0], rows, self._region_base(1 - self.region[r]), self.kfull, self._key_base(), chosen)
        self.kept[r] = torch.where(rows, keep, self.kept[r])

    def _ready(self, slots: list[int], n: int) -> tuple[torch.Tensor, slice]:
        """([n] bool: `slots` among the view's first n rows, their host-pool rows), once the slots' prefix copies into
        the host pool have ended."""
        on = torch.zeros(n, dtype=torch.bool)
        on[[s - self.first for s in slots]] = True
        self.shared.flush()
        self._wait_prefix(slots)
        return on, slice(self.first, self.first + n)

    def _wait_prefix(self, slots) -> None:
        """Until the slots' prefix copies into the host pool (offload_prefix) have ended."""
        for s in slots:
            event = self.shared.pending.get(s)
            if event is not None:
                event.synchronize()

    def values_scan(self, slots: list[int], chosen: torch.Tensor, keep: torch.Tensor, threads: int = 0) -> "Scanned":
        """Host work: the values of the positions chosen [L, n, KVH, P] (CPU; the capacity pads) gathered from the
        host pool for `slots`, as a Scanned of values only."""
        t = time.perf_counter()
        on, _ = self._ready(slots, chosen.shape[1])
        t = self.shared.count("ready", t)
        rows = on.nonzero()[:, 0]
        idx = chosen[:, rows].clamp(max=self.capacity - 1).flatten(0, 1).int()
        out = self._gather(self._entries(rows), idx, 1, threads)
        self.shared.count("gather", t)
        return Scanned(self.first, rows.tolist(), keep[rows], out)

    def copy_idle(self, src: int, dst: int) -> None:
        """Slot src's idle region and kept count to slot dst (a selection placed after the slot moved)."""
        a, b = self.rows(src, src + 1), self.rows(dst, dst + 1)
        j = torch.arange(self.per_row, device=self.device)
        for t in self.pools:
            t[:, b._region_base(1 - self.region[dst : dst + 1])[:, None] + j] = \
                t[:, a._region_base(1 - self.region[src : src + 1])[:, None] + j]
        self.kept[dst] = self.kept[src]

    @_timed
    def move(self, src: int, dst: int, length: int) -> None:
        s = self.size
        self.shared.flush()
        a, b = self.rows(src, src + 1), self.rows(dst, dst + 1)
        for i in range(self.dense_layers):
            for t in (self.k[i], self.v[i]):
                b._dense_full(t)[:, :length] = a._dense_full(t)[:, :length]
        j = torch.arange(s.per_row, device=self.device)
        for t in self.pools:
            for r in (0, 1):
                reg = torch.tensor([r], device=self.device)
                t[:, b._region_base(reg)[:, None] + j] = t[:, a._region_base(reg)[:, None] + j]
            t[:, b._block_base()[0] : b._block_base()[0] + s.block + 1] = \
                t[:, a._block_base()[0] : a._block_base()[0] + s.block + 1]
        lend = self.shared
        lend.host_row[dst], lend.host_row[src] = lend.host_row[src], lend.host_row[dst]  # src's pool row, not a copy
        if self.kfull is not None:
            cap = s.capacity + 1
            self.kfull[:, dst * cap : dst * cap + length] = self.kfull[:, src * cap : src * cap + length]
        if self.next_pos is not None:
            self.next_pos[:, dst] = self.next_pos[:, src]
        if lend.held[dst] is not None:
            self.release(dst)
        lend.held[dst], lend.held[src] = lend.held[src], None
        lend.of[dst] = lend.of[src]
        if src in lend.pending:
            lend.pending[dst] = lend.pending.pop(src)
        for buf in (self.length, self.region, self.kept):
            buf[dst] = buf[src]
        scratch = bool((self.index[src, 0] < s.scratch_rows).item())
        self.index[dst] = (b._scratch_base()[:, None] + torch.arange(s.capacity, device=self.device) if scratch
                           else b._selection_index(self.region[dst : dst + 1]))[0]


class ScratchView:
    """What prefill chunks see: the dense layers' full caches, and each row's scratch cache in the others."""

    def __init__(self, kv: OffloadKV):
        self.kv = kv

    def layer(self, i: int):
        kv = self.kv
        if i < kv.dense_layers:
            return kv.layer(i)
        base = kv._scratch_base()
        index = base[:, None] + torch.arange(kv.capacity, device=kv.device)
        return PoolLayer(kv.k[i], kv.v[i], index, None, base, kv.capacity, **kv._key_args(i))


def host_pool(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """One zeroed host tensor, page-locked in place where `pin` (cudaHostRegister: torch's pinned allocator would round
    tens of GB up to the next power of two), unlocked when it is freed."""
    t = torch.zeros(shape, dtype=dtype)
    if pin and t.numel():
        nbytes = t.numel() * t.element_size()
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the {nbytes / 2**30:.1f} GiB host KV pool failed: {err}")
        weakref.finalize(t.untyped_storage(), rt.cudaHostUnregister, t.data_ptr())
    return t


@dataclass(frozen=True)
class OffloadLayout:
    """Dense layers' full caches on the device, the selecting layers' full caches in a host pool (pinned on CUDA),
    `scratch` device full caches lent to rows from admission to their first prepared selection, two selection
    regions of `per_row` positions and a block buffer per slot on the device."""

    full: DeviceKV
    dense_layers: int
    per_row: int
    block: int
    scratch: int
    keys_on_device: bool = False  # HERALD's variant 5c: every key stays on the device, only values in the host pool

    @property
    def size(self) -> OffloadSize:
        f = self.full
        return OffloadSize(f.slots, f.capacity, self.per_row, self.block, min(self.scratch, f.slots))

    def _row_bytes(self) -> int:  # one position of one layer, K and V
        f = self.full
        return 2 * f.kv_heads * f.head_dim * (torch.finfo(f.dtype).bits // 8)

    def tiers(self) -> list[Tier]:
        f, s, per = self.full, self.size, self._row_bytes()
        dev = torch.device(f.device)
        sel = f.num_layers - self.dense_layers
        keys = per // 2 * sel * f.slots * (f.capacity + 1) if self.keys_on_device else 0
        host = per * sel * f.slots * f.capacity // (2 if self.keys_on_device else 1)
        return [Tier("device KV cache (dense layers)", dev, per * self.dense_layers * f.slots * (f.capacity + 1)),
                Tier("device scratch, selections, block buffers", dev, per * sel * s.rows),
                *([Tier("device key cache", dev, keys)] if keys else []),
                Tier("host KV pool", torch.device("cpu"), host)]

    def allocate(self) -> OffloadKV:
        f, s = self.full, self.size
        dev = torch.device(f.device)
        pin = dev.type == "cuda"
        sel = f.num_layers - self.dense_layers
        pools = tuple(torch.zeros(sel, s.rows, f.kv_heads, f.head_dim, dtype=f.dtype, device=dev) for _ in range(2))
        dense = [[torch.zeros(f.slots * (f.capacity + 1), f.kv_heads, f.head_dim, dtype=f.dtype, device=dev)
                  for _ in range(self.dense_layers)] for _ in range(2)]
        k, v = (d + list(p.unbind(0)) for d, p in zip(dense, pools))
        kinds = 1 if self.keys_on_device else 2
        pool = host_pool((kinds, sel, f.slots, f.kv_heads, f.capacity, f.head_dim), f.dtype, pin)
        host_k, host_v = (None if self.keys_on_device else pool[0]), pool[-1]
        kfull = next_pos = None
        if self.keys_on_device:
            kfull = torch.zeros(sel, f.slots * (f.capacity + 1), f.kv_heads, f.head_dim, dtype=f.dtype, device=dev)
            next_pos = torch.zeros(sel, f.slots, f.kv_heads, self.per_row, dtype=torch.long, device=dev)
        zeros = lambda: torch.zeros(f.slots, dtype=torch.long, device=dev)  # noqa: E731
        index = torch.zeros(f.slots, f.capacity, dtype=torch.long, device=dev)
        kv = OffloadKV(k, v, pools, host_k, host_v, self.dense_layers, s, index, zeros(), zeros(), zeros(),
                       _Shared(s.scratch, f.slots, dev), kfull, next_pos)
        kv.index.copy_(kv._selection_index(kv.region))  # nothing read before a row's first step sets it
        return kv
