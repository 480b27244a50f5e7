"""`herald`: HERALD's algorithm (../shared/papers/herald.txt §IV-A, IV-B2) on the engine: a block's later steps and
its next block read a selection made once per block, the next block's selection prepared while this block denoises.

Per row and block n (the first `dense_layers` layers always read the whole prefix):

* the request's first block, or a block whose selection was not prepared: `mage`'s select step (its first step
  reads the full prefix and counts the block's [MASK] queries' attention mass; the selection follows);
* step 0 (phase "decode") with threshold acceptance; the draft = the argmax at every masked position of its logits;
* step 1 (phase "draft"): one 2B-token forward, the block and its draft as two query groups that both see the
  selection and not each other; the draft's K/V is written at the block's positions (copied out by the host hook)
  and the block's tokens are decided from the block group alone, so the draft never changes a token (`draft_wait`
  W: the draft step comes at step 1 to 1 + W, rows out of step drafting in one forward; neither group sees the other,
  so the draft's K/V and the selection it prepares do not depend on the step; `draft_fold`: the rows that do not
  draft take their step in the same forward, their draft group dead);
* the retrieval for block n+1 (host hook after step 1, `lookahead: draft`): one forward of the representative query,
  the [MASK] at block n+1's centre (`query: block`: all its B [MASK] queries), over the full prefix with block n's
  positions read from the draft's K/V; in every selecting layer and KV head the positions before block n with the
  largest mass from that query (the keep count below) are gathered into the row's idle region;
* the remaining steps; the forward that sees block n final writes its K/V; at the boundary (host hook) block n's
  exact K/V is appended to the idle region and the row reads that region from then on (the pools swap).

`lookahead: none` makes the retrieval at the boundary instead, with the completed block n in place of the draft (no
draft step): HERALD without its lookahead. With budget 1.0 every prefix position is selected, in order: the tokens are
dense `threshold`'s, with or without lookahead.

`retrieval: scan` (HERALD's K-only variant): the centre [MASK] rides in the draft step as a third query group (it
sees what the block sees of the prefix, the draft and itself; nothing written); its q in each selecting layer, kept by
the attention, scores every key of [0, block n end) in the captured post-forward hook, and that mass ranks the prefix
as the retrieval's does: no retrieval forward. `scan_keys: int8` scores the keys as an int8 copy (one scale per row,
layer, KV head and channel) would give them back.

The keep count is min(ceil(budget x (prefix + B)), prefix): the budget's share of the next block's prefix, before
the block appended whole (so a prepared pool holds up to B more keys than MAGE's at the same budget).

`pool: device` keeps the full cache on the device and runs the retrieval on the main stream between steps. `pool:
host` is HERALD's system form (kv/offload.py): the selecting layers' full cache in pinned host memory, the draft and
each completed block copied there from a per-slot block buffer, the retrieval on the CPU through ext/ (the scan on the
host worker while the device steps, placed at the row's boundary; or the forward with each selecting layer's
attention and top-k on the CPU), and a scratch device cache per row from admission to its first prepared selection.
Its CPU attention normalises over the pool's keys (the query's own key is on the device), so its choices may differ
from the device form's at near-ties; with budget 1.0 both give dense `threshold`'s tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Literal

import torch

from compiledllm.attention.spec import AttentionSpec, BlockCausal, QueryGroups
from compiledllm.kv.offload import OffloadLayout
from compiledllm.kv.sparse import SparseLayout
from compiledllm.kv.store import DeviceKV
from compiledllm.policies.base import confidence
from compiledllm.policies.herald_pool import HostPool, row_mask
from compiledllm.policies.mage import MageConfig, MagePolicy
from compiledllm.policies.plan import Forward, route_groups


@dataclass(frozen=True)
class HeraldConfig(MageConfig):
    query: Literal["center", "block"] = "center"    # the retrieval's queries: the centre [MASK], or all B of them
    lookahead: Literal["draft", "none"] = "draft"   # retrieve during block n with its draft, or after it ends
    # forward: the retrieval's own forward, layer by layer over the full prefix (HERALD); scan: the centre [MASK]
    # rides in the draft step as a third query group and its q scores every key of each selecting layer (keys only)
    # fetch (pool: host, lookahead: none): MAGE-Offload's second form, each block's full prefix copied from the host
    # pool into a scratch cache for MAGE's selection (rows wait for a free one)
    retrieval: Literal["forward", "scan", "fetch"] = "forward"
    # scan: the keys it scores, as cached ("exact") or as an int8 copy with one scale per (row, layer, KV head, channel)
    # over the scanned keys (HERALD's variant 5b: a quarter of the bytes to scan; the selected K/V stay exact)
    scan_keys: Literal["exact", "int8"] = "exact"
    # where the selecting layers' full cache lives: on the device, or in a host pool (HERALD's system form: the scan
    # runs on the CPU over it, the selection crosses to the device once per block; kv/offload.py), with `scratch`
    # device full caches lent to rows from admission until their first prepared selection
    pool: Literal["device", "host"] = "device"
    scratch: int = 4
    # pool: host, retrieval: scan: where the keys stay ("host": in the pool with the values; "device": every key on
    # the device, scanned there once per block, only the values in the host pool: HERALD's variant 5c)
    keys: Literal["host", "device"] = "host"
    # a row's draft step may come up to this many steps after step 1, so that rows out of step draft in one forward
    # (the draft, its K/V and the selection it prepares are the same at any step of the block; the paper: 0)
    draft_wait: int = 0
    # a step with drafting rows runs every row in its one 2B-token forward, the others' draft group dead (no K/V, no
    # expert, no selection), instead of a draft forward for the drafting rows and a decode forward for the rest (false):
    # a PhaseRun's attention and dense layers compute its whole bucket, so the second forward cost nearly a full step
    # (H100, 32K, 64 rows: 45 ms folded against 36 + 27 ms; docs/results.md, HERALD's twenty-fourth session)
    draft_fold: bool = True
    # pool: host: cores for the host worker's scans and gathers (0: all but four)
    host_threads: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.query not in ("center", "block"):
            raise ValueError(f"query: must be center or block, got {self.query!r}")
        if self.lookahead not in ("draft", "none"):
            raise ValueError(f"lookahead: must be draft or none, got {self.lookahead!r}")
        if self.retrieval not in ("forward", "scan", "fetch"):
            raise ValueError(f"retrieval: must be forward, scan or fetch, got {self.retrieval!r}")
        if self.retrieval == "fetch" and (self.pool != "host" or self.lookahead != "none"):
            raise ValueError("retrieval: fetch copies each block's prefix from the host pool for MAGE's selection "
                             "(pool: host, lookahead: none)")
        if self.scan_keys not in ("exact", "int8"):
            raise ValueError(f"scan_keys: must be exact or int8, got {self.scan_keys!r}")
        if self.scan_keys == "int8" and self.retrieval != "scan":
            raise ValueError("scan_keys: int8 keys are for retrieval: scan")
        if self.retrieval == "scan" and (self.lookahead != "draft" or self.query != "center"):
            raise ValueError("retrieval: scan takes the centre query from the draft step (lookahead: draft, query: "
                             "center)")
        if self.pool not in ("device", "host"):
            raise ValueError(f"pool: must be device or host, got {self.pool!r}")
        if self.pool == "host" and self.scan_keys != "exact":
            raise ValueError("pool: host scans the host pool's keys as they are (scan_keys: exact)")
        if self.scratch < 1:
            raise ValueError(f"scratch: must be >= 1, got {self.scratch}")
        if self.host_threads < 0:
            raise ValueError(f"host_threads: must be >= 0 (0: all cores but one), got {self.host_threads}")
        if self.draft_wait < 0:
            raise ValueError(f"draft_wait: must be >= 0, got {self.draft_wait}")
        if self.draft_wait and self.lookahead != "draft":
            raise ValueError("draft_wait: delays the draft step (lookahead: draft)")
        if self.keys not in ("host", "device"):
            raise ValueError(f"keys: must be host or device, got {self.keys!r}")
        if self.keys == "device" and (self.pool != "host" or self.retrieval != "scan"):
            raise ValueError("keys: device keeps the keys of a host pool on the device for its scan (pool: host, "
                             "retrieval: scan)")


class HeraldPolicy(HostPool, MagePolicy):
    name = "herald"
    config: HeraldConfig
    phases = ("decode", "select", "draft")
    row_phases = phases

    @property
    def lookahead(self) -> bool:
        return self.config.lookahead == "draft"

    @property
    def scan(self) -> bool:
        return self.config.retrieval == "scan"

    @property
    def fetch(self) -> bool:
        return self.config.retrieval == "fetch"

    @property
    def host_pool(self) -> bool:
        return self.config.pool == "host"

    @property
    def device_keys(self) -> bool:
        return self.config.keys == "device"

    def kv_layout(self, model, slots, capacity):
        super().kv_layout(model, slots, capacity)  # checks dense_layers, sets the selecting layers
        Bk = self.block_size
        per_row = SparseLayout.budget_rows(self.config.budget, capacity, extra=Bk)
        if self.host_pool:
            return OffloadLayout(DeviceKV.for_model(model, slots, capacity), self.config.dense_layers, per_row, Bk,
                                 self.config.scratch, keys_on_device=self.device_keys)
        return SparseLayout(DeviceKV.for_model(model, slots, capacity), self.config.dense_layers, per_row, regions=2,
                            draft=Bk if self.lookahead and not self.scan else 0)

    def init_state(self, batch, device):
        state = {"draft": torch.zeros(batch, self.block_size, dtype=torch.long, device=device),
                 # the rows whose draft group is live in a draft step (the host's choice, written before the step)
                 "drafting": torch.zeros(batch, dtype=torch.bool, device=device)}
        if self.scan:  # the centre query's q in each selecting layer, from the draft step
            state["rep_q"] = torch.zeros(batch, len(self.layers), self.heads, self.head_dim, device=device)
        return super().init_state(batch, device) | state

    # --- the main steps --------------------------------------------------------------------------------------------
    def plan(self, phase, st):
        if phase != "draft":
            return super().plan(phase, st)
        idx, tokens, gen = self.block_window(st)
        B, Bk = idx.shape
        final = ((tokens == self.mask_id) & gen).sum(1) == 0  # no MASK: this forward commits the block
        live = st.active[:, None].expand(B, Bk)
        drafts = live & st.policy["drafting"][:, None]  # the other rows take their step in the block group alone
        group = (torch.arange(2 * Bk, device=idx.device) >= Bk).int()[None]  # [block | draft]
        see = 1 << torch.arange(2, dtype=torch.int32, device=idx.device)
        spec = AttentionSpec(QueryGroups(group, see), prefix_len=st.block_start)
        commit = live & final[:, None]
        write = torch.cat([torch.where(commit, idx, -1), torch.where(drafts & ~commit, idx, -1)], 1)
        draft = torch.where(gen, st.policy["draft"], tokens)
        groups = torch.cat([route_groups(idx, Bk, live), route_groups(idx, Bk, drafts, copy=1)], 1)
        fwd = Forward(torch.cat([tokens, draft], 1), idx.repeat(1, 2), spec, kv_write=write,
                      logits_at=torch.arange(Bk, device=idx.device).expand(B, Bk),
                      logits_rows=self.needed(tokens, gen, st.policy), route_groups=groups)
        return self.with_scan_query(fwd, st) if self.scan else fwd

    def with_scan_query(self, fwd: Forward, st) -> Forward:
        """The draft step plus the next block's centre [MASK] as a third group (it sees the draft and itself, and the
        prefix as the block does), its q kept per selecting layer, nothing written."""
        B, Bk = fwd.tokens.shape[0], self.block_size
        dev = fwd.tokens.device
        centre = (st.block_start + Bk + Bk // 2).clamp(max=st.seq.shape[1] - 1)[:, None]
        group = torch.cat([fwd.attention.rule.group, torch.full((1, 1), 2, dtype=torch.int32, device=dev)], 1)
        see = torch.cat([fwd.attention.rule.see, torch.full((1,), 0b110, dtype=torch.int32, device=dev)])
        spec = AttentionSpec(QueryGroups(group, see), prefix_len=st.block_start, stats_layers=self.layers,
                             capture=st.policy["rep_q"].transpose(0, 1),
                             capture_at=torch.full((B,), 2 * Bk, dtype=torch.long, device=dev))
        mask = torch.full_like(centre, self.mask_id)
        return replace(fwd, tokens=torch.cat([fwd.tokens, mask], 1), positions=torch.cat([fwd.positions, centre], 1),
                       attention=spec, kv_write=torch.cat([fwd.kv_write, torch.full_like(centre, -1)], 1),
                       route_groups=torch.cat([fwd.route_groups, route_groups(
                           centre, Bk, (st.active & st.policy["drafting"])[:, None], copy=2)], 1))

    def decide(self, tokens, logits, gen, state, keys):
        masked = self.needed(tokens, gen, state)
        v, p = self.choose(logits, masked, keys)
        new, done, out = self.accept(tokens, masked, v, p, state)
        if not self.lookahead:
            return new, done, out
        # a block's first step: the draft is the argmax at every masked position (greedy: the tokens just chosen)
        argmax = v if keys is None else confidence(logits, self.mask_id, masked)[0]
        first = (state["block_step"] == 0)[:, None]
        draft = torch.where(first, torch.where(masked, argmax, tokens), state["draft"])
        return new, done, out | {"draft": draft}

    def after_forward(self, phase, st, fwd, upd, kv):
        if phase == "select":
            self.select(st, st.active & (upd.advance > 0), kv)
        if phase == "draft" and self.scan and (self.device_keys or not self.host_pool):  # else: on the CPU
            self.scan_select(st, upd, kv)
        # a retired block's row: the boundary host hook (on_blocks) swaps its pools or has it read the full prefix

    def scan_select(self, st, upd, kv) -> None:
        """The K-only scan: in each selecting layer the centre query's q (from this draft step) against every key of
        [0, block end), the block's being the draft's this forward wrote; the mass of the prefix before the block
        ranks it, and the choice goes to the idle region (as the retrieval's does)."""
        drafted = st.active & st.policy["drafting"] & (upd.advance == 0)  # a block committed now has no draft
        select = kv.select_next_keys if self.device_keys else kv.select_next
        mass = self.scan_mass(st.policy["rep_q"], st.block_start + self.block_size, kv)
        select(drafted, mass, st.block_start, self.next_keep(st.block_start))

    def scan_mass(self, q: torch.Tensor, end: torch.Tensor, kv, keys_form: str | None = None) -> torch.Tensor:
        """[L, B, KVH, capacity]: per selecting layer j, the softmax over the keys [0, end) ([B]) of the centre query's
        scores (q [B, L, H, D]: its q in each selecting layer, captured in the draft step), summed over each KV
        head's query heads (keys_form: scan_keys, default the config's)."""
        int8 = (keys_form or self.config.scan_keys) == "int8"
        keys = torch.arange(kv.capacity, device=end.device)
        B, L, H, D = q.shape
        mass = []
        for j, layer in enumerate(self.layers):
            k = kv.keys(layer)  # [B, capacity, KVH, D], the cache's dtype (no float32 copy of it)
            if int8:
                k = int8_copy(k.float(), keys[None, :, None, None] < end[:, None, None, None])
            qj = q[:, j].view(B, self.kv_heads, H // self.kv_heads, D).to(k.dtype)
            s = torch.einsum("bkgd,bskd->bkgs", qj, k).float() * D ** -0.5
            s = s.masked_fill(keys >= end[:, None, None, None], float("-inf"))
            mass.append(torch.softmax(s, dim=-1).nan_to_num(0.0).sum(2))  # [B, KVH, capacity]
        return torch.stack(mass)

    # --- the host side -----------------------------------------------------------------------------------------------
    def _rows(self, host) -> dict:
        h = host.state
        if "bstep" not in h:
            n = host.st.active.shape[0]
            h.update(bstep=[0] * n, full=[True] * n, ready=[False] * n, rows=(), pending=[None] * n,
                     drafted=[False] * n, drafting=(), draft_forwards=0, stall_s=0.0, scans=0, scan_s=0.0,
                     boundary_s=0.0, draft_s=0.0, waiting=set(), uploads={})
        return h

    def schedule(self, step):
        """The rows `before_step` chose draft; the others "select" when one of them begins a block without a prepared
        selection, else "decode" — folded into the draft forward (`draft_fold`) when there is one and no row selects.
        (Every phase is a row phase: each comes as a PhaseRun.)"""
        from compiledllm.engine.hooks import PhaseRun  # the engine imports the policies: not at module level

        h = step.state
        rows, drafting = running(h, step.rows), h["drafting"]
        rest = tuple(s for s in rows if s not in drafting)
        phase = "select" if any(h["full"][s] and h["bstep"][s] == 0 for s in rest) else "decode"
        if drafting and phase == "decode" and self.config.draft_fold:
            return (PhaseRun("draft", rows),)
        return tuple(PhaseRun(ph, rs) for ph, rs in (("draft", drafting), (phase, rest)) if rs)

    def before_step(self, host, step):
        """Rows past their block's step 0 that have not drafted draft in this step, together, once one of them is
        `draft_wait` steps past step 1: the choice goes to the device (st.policy["drafting"]) and to `schedule`."""
        h = self._rows(host)
        rows = h["rows"] = running(h, step.rows)
        due = [s for s in rows if self.lookahead and h["bstep"][s] >= 1 and not h["drafted"][s]]
        h["drafting"] = tuple(due) if any(h["bstep"][s] >= 1 + self.config.draft_wait for s in due) else ()
        if h["drafting"]:  # (a CPU mask: a captured step reads the device copy)
            on = row_mask(torch.empty(host.st.active.shape[0], dtype=torch.bool), list(h["drafting"]))
            host.st.policy["drafting"].copy_(on, non_blocking=True)

    def after_step(self, host, report):
        h = self._rows(host)
        drafted = [s for s in h["drafting"] if report.active[s] and not report.retired[s]]
        h["draft_forwards"] += bool(h["drafting"])
        for s in h["drafting"]:
            h["drafted"][s] = True
        h["drafting"] = ()
        selected = [s for s in h["rows"] if h["full"][s] and h["bstep"][s] == 0]  # ran MAGE's select step
        for s in h["rows"]:
            h["bstep"][s] += 1
        if self.host_pool:
            self.host_upload(host, report.active)
        if self.fetch:
            self.host_fetched(host, selected)
        if drafted:  # the draft's K/V is in place: prepare the next block's selection (a scan made it already)
            if self.host_pool:  # the draft's K/V to the host pool, then the retrieval over it
                t = time.perf_counter()
                starts = host.st.block_start.tolist()
                host.kv.offload_block(drafted, [starts[s] for s in drafted])
                if self.device_keys:  # the device scan chose in the step's hook: the values, on the worker thread
                    self.host_values(host, drafted, wait=not host.st.seq.is_cuda)
                elif self.scan:  # on the worker thread (a CPU model waits for it: the same cores would run both)
                    self.host_retrieve(host, drafted, host.st.block_start, wait=not host.st.seq.is_cuda)
                else:
                    self.retrieve(host, drafted, draft=True)
                for s in drafted:  # a prepared selection: the row needs its full prefix on the device no more
                    host.kv.release(s)
                h["draft_s"] += time.perf_counter() - t
            elif not self.scan:
                self.retrieve(host, drafted, draft=True)
            for s in drafted:
                h["ready"][s] = True

    def on_blocks(self, host, rows):
        h, st = self._rows(host), host.st
        boundary = [s for s, n in zip(rows, st.steps[rows].tolist()) if n > 0]  # the others were just admitted
        if self.host_pool:
            t = time.perf_counter()
            for s in boundary:  # its scan's selection, placed when the row needs it (the stall, if the scan is late),
                self.host_place(host, h["pending"][s])  # before the exact block replaces the draft the scan reads
            self.host_boundary(host, rows, boundary)
            h["boundary_s"] += time.perf_counter() - t
        if boundary and not self.lookahead and not self.host_pool:  # retrieve now, with the completed block
            self.retrieve(host, boundary, draft=False)
            for s in boundary:
                h["ready"][s] = True
        warm = [s for s in boundary if h["ready"][s]]
        cold = [s for s in rows if s not in warm]  # admitted, or the block ended before its draft step
        if cold:
            host.kv.read_full(row_mask(st.active, cold), st.block_start)
        if warm:
            host.kv.swap(row_mask(st.active, warm), st.block_start - self.block_size, self.block_size)
        for s in rows:
            h["bstep"][s], h["full"][s], h["ready"][s], h["pending"][s] = 0, s in cold, False, None
            h["drafted"][s] = False

    def on_move(self, host, src, dst):
        h = self._rows(host)
        if h["pending"][src] is not None:  # the scan for src lands in src's idle region: then dst's
            self.host_place(host, h["pending"][src])
            host.kv.copy_idle(src, dst)
        for key in ("bstep", "full", "ready", "drafted"):
            h[key][dst] = h[key][src]
        if src in h["waiting"]:
            h["waiting"].discard(src)
            h["waiting"].add(dst)

    def retrieve(self, host, rows: list[int], draft: bool) -> None:
        """The selection for the block after each row's current one (`draft`: during the current block, which the
        draft's K/V stands in for; else at the boundary, the block that begins now), into the rows' idle regions."""
        st, Bk = host.st, self.block_size
        n = max(rows) + 1
        on = row_mask(st.active[:n], rows)
        target = st.block_start[:n] + (Bk if draft else 0)  # the block the selection is for
        view = host.kv.rows(0, n)
        if self.host_pool:  # the draft (or the completed block) is in the host pool already
            self.host_forward(host, view, on, target)
            return
        if draft:
            view.stage_draft(on, target - Bk)
        stats = self.representative_mass(host, on, target, target, draft, self.config.query)
        prefix = (target - Bk).clamp(min=0)
        view.select_next(on, stats, prefix, self.next_keep(prefix))

    def next_keep(self, prefix: torch.Tensor) -> torch.Tensor:
        """[B] positions a prepared selection keeps before the block at `prefix` (which it appends whole): the
        budget's share of the next block's prefix (prefix + B), at most `prefix`."""
        return torch.minimum(torch.ceil((prefix + self.block_size).double() * self.config.budget).long(), prefix)

    def representative_mass(self, host, on: torch.Tensor, target: torch.Tensor, context: torch.Tensor, draft: bool,
                            query: str) -> torch.Tensor:
        """[L, n, KVH, capacity + q] the mass every key gets, in each selecting layer and KV head, from the [MASK]
        queries of the blocks at `target` [n] (query "center": its centre one; "block": all) of the rows where `on`
        [n] is True, which see the keys [0, context) ([n]; with `draft`, the block before `target` read from the
        draft region) and themselves: one forward, writing nothing."""
        kv, n = host.kv, on.shape[0]
        q = 1 if query == "center" else self.block_size
        stats = torch.zeros(len(self.layers), n, self.kv_heads, kv.capacity + q, device=on.device)
        fwd = self.representative_forward(on, target, context, query, kv.capacity, stats)
        host.model(fwd, host.kv.retrieval_rows(0, n, target - self.block_size if draft else None))
        return stats

    def representative_forward(self, on: torch.Tensor, target: torch.Tensor, context: torch.Tensor, query: str,
                               capacity: int, stats: torch.Tensor | None = None) -> Forward:
        """The retrieval's forward: the [MASK] queries of the blocks at `target` (centre or all) of the rows where
        `on`, seeing the keys [0, context) and themselves, writing nothing; `stats` collects each selecting layer's
        per-KV-head mass."""
        Bk, n, dev = self.block_size, on.shape[0], on.device
        q = 1 if query == "center" else Bk
        offsets = torch.full((q,), Bk // 2, device=dev) if q == 1 else torch.arange(Bk, device=dev)
        positions = (target[:, None] + offsets).clamp(max=capacity - 1)
        live = on[:, None].expand(n, q)
        spec = AttentionSpec(BlockCausal(q), prefix_len=context.clamp(max=capacity), stats=stats,
                             stats_queries=live if stats is not None else None,
                             stats_layers=self.layers if stats is not None else None)
        mask = torch.full((n, q), self.mask_id, dtype=torch.long, device=dev)
        return Forward(mask, positions, spec, kv_write=None, logits_at=torch.zeros(n, 1, dtype=torch.long, device=dev),
                       logits_rows=torch.zeros(n, 1, dtype=torch.bool, device=dev),
                       route_groups=route_groups(positions, Bk, live, copy=1))


def running(h: dict, rows: tuple[int, ...]) -> tuple[int, ...]:
    """The rows that take part in a step: all but those whose prefix waits for a scratch cache (retrieval: fetch)."""
    return tuple(s for s in rows if s not in h["waiting"])


def int8_copy(k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """k [B, S, KVH, D] as an int8 copy reads back: per (row, KV head, channel) scale = max |k| over the valid
    ([B, S, 1, 1]) keys / 127, values rounded to the nearest step."""
    scale = (k.abs() * valid).amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(k / scale).clamp(-127, 127) * scale
