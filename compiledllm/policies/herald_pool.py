"""`herald`'s host pool (`pool: host`, HERALD's system form; kv/offload.py): the hooks that copy between the device
and the host pool, run the retrieval over the pool on the CPU (the scan on the host worker, or the forward with each
selecting layer's attention on the CPU) and place its selections at a row's block boundary. Mixed into HeraldPolicy,
whose algorithm (policies/herald.py) calls them where the device pool does its own work."""
from __future__ import annotations

import os
import time

import torch


class HostPool:
    """HeraldPolicy's host-pool hooks (they use its config, host state, scan and retrieval forward)."""

    @property
    def host_threads(self) -> int:
        """Cores for the host worker's scans (`host_threads`; 0: all but four, which the engine's thread (launching
        the steps, spinning on their sync), torch's and the CUDA driver's threads keep: measured on a 16-core H100
        host at 32K, B = 56, 12 threads decoded 1,096 tokens/s where 15 decoded 912, the scans 26 % shorter)."""
        return self.config.host_threads or max(1, (os.cpu_count() or 2) - 4)

    def host_boundary(self, host, rows: list[int], boundary: list[int]) -> None:
        """The host pool's part of a block boundary: the completed block's exact K/V to the host pool; an admitted
        row's prefix too (on the side stream); rows without a prepared selection get one now (the retrieval with the
        completed block, as without lookahead): every such row without lookahead, with it those that hold no scratch
        cache (from the centre query of the last draft step; a row that still holds its scratch cache, its block ended
        before the draft step, reads its full prefix again, with the block it completed)."""
        h, st, kv, Bk = self._rows(host), host.st, host.kv, self.block_size
        starts = st.block_start.tolist()
        if boundary:
            kv.offload_block(boundary, [starts[s] - Bk for s in boundary])
        admitted = [s for s in rows if s not in boundary]
        if admitted:
            kv.offload_prefix(admitted, [starts[s] for s in admitted], host.side_stream)
        unprepared = [s for s in boundary if not h["ready"][s]]
        now = [s for s in unprepared if not self.lookahead or not kv.holds_scratch(s)]
        if now and self.fetch:  # the prefix to a scratch cache; the block begins with MAGE's select step
            self.host_fetch(host, now)
        elif now:
            if self.device_keys:
                n = max(now) + 1
                view, prefix = kv.rows(0, n), st.block_start[:n] - Bk
                mass = self.scan_mass(st.policy["rep_q"][:n], st.block_start[:n], view)
                view.select_next_keys(row_mask(st.active[:n], now), mass, prefix, self.next_keep(prefix))
                self.host_values(host, now, wait=True)
            elif self.scan:
                self.host_retrieve(host, now, st.block_start - Bk)
            else:
                self.retrieve(host, now, draft=False)
            for s in now:
                h["ready"][s] = True
                kv.release(s)  # a row prepared without lookahead needs its full prefix on the device no more
        keep = [s for s in unprepared if s not in now]
        if keep:
            kv.rows(0, max(keep) + 1).block_to_scratch(keep, st.block_start - Bk, Bk)

    def host_fetch(self, host, rows: list[int]) -> None:
        """`retrieval: fetch`: each row's prefix (its completed block included) from the host pool into a scratch
        cache, or the row waits for one (it takes no part in steps until then)."""
        h, kv, starts = self._rows(host), host.kv, host.st.block_start.tolist()
        for s in rows:
            if kv.admit(s):
                kv.fetch_prefix([s], [starts[s]])
            else:
                h["waiting"].add(s)

    def host_fetched(self, host, selected: list[int]) -> None:
        """`retrieval: fetch`, after a step: the rows that made their selection give their scratch cache back, and
        waiting rows take the free ones (their prefix fetched, read in full by their next step)."""
        h, kv, st = self._rows(host), host.kv, host.st
        for s in selected:
            kv.release(s)
        for s in sorted(h["waiting"]):
            if not kv.admit(s):
                break
            h["waiting"].discard(s)
            kv.fetch_prefix([s], [int(st.block_start[s])])
            kv.read_full(row_mask(st.active, [s]), st.block_start)

    def host_retrieve(self, host, rows: list[int], prefix: torch.Tensor, wait: bool = True) -> None:
        """The CPU scan for `rows`: each selecting layer's centre query (from the row's last draft step) against the
        host pool's keys [0, prefix + B), the keys before prefix ([slots]) ranked, for the rows' idle regions; on
        the worker thread, placed at the rows' boundaries (`wait`: placed now)."""
        n = max(rows) + 1
        view = host.kv.rows(0, n)
        q, at = to_host(host.st.policy["rep_q"][:n]), to_host(prefix[:n])  # issued now, waited for by the worker

        def scan():
            t = time.perf_counter()
            p, qs = at(), q()
            host.kv.shared.count("device", t)
            return view.scan(rows, qs, p, p + self.block_size, self.next_keep(p), self.host_threads)

        job = self._submit(host, rows, scan)
        if wait:
            self.host_place(host, job)

    def host_values(self, host, rows: list[int], wait: bool) -> None:
        """`keys: device`: the values of the positions the device scan chose for `rows`, gathered from the host pool
        on the worker thread, placed at the rows' boundaries (`wait`: now)."""
        n = max(rows) + 1
        view = host.kv.rows(0, n)
        chosen, kept = to_host(host.kv.next_pos[:, :n]), to_host(host.kv.kept[:n])

        def gather():
            t = time.perf_counter()
            c, k = chosen(), kept()
            host.kv.shared.count("device", t)
            return view.values_scan(rows, c, k, self.host_threads)

        job = self._submit(host, rows, gather)
        if wait:
            self.host_place(host, job)

    def _submit(self, host, rows: list[int], work):
        """`work` (host work that returns a Scanned) on the worker, its seconds counted in `scan_s`; the rows wait
        for it (`pending`) until their boundary places it."""
        h = self._rows(host)

        def timed():
            t = time.perf_counter()
            out = work()
            h["scan_s"] += time.perf_counter() - t
            return out

        h["scans"] += 1
        job = host.worker.submit(timed)
        for s in rows:
            h["pending"][s] = job
        return job

    def host_place(self, host, job) -> None:
        """A scan job's selections into the idle regions of the rows still waiting for it (waits for the job; the
        seconds waited add up in the host state's `stall_s`)."""
        if job is None:
            return
        h = self._rows(host)
        t = time.perf_counter()
        scanned = h["uploads"].get(job) or job.result()
        h["stall_s"] += time.perf_counter() - t
        waiting = [s for s in scanned.slots if h["pending"][s] is job]
        host.kv.place(scanned, waiting)
        for s in waiting:
            h["pending"][s] = None
        if not any(p is job for p in h["pending"]):
            h["uploads"].pop(job, None)

    def host_upload(self, host, active: list[bool]) -> None:
        """The scans that have ended since the last step: their selections start for the device now (kv.upload), so
        the transfer overlaps the next steps instead of stalling the compute stream at the boundary. Only for scans
        an active row waits for (a finished request's lookahead is never placed; its device copy is dropped)."""
        h = self._rows(host)
        live = {h["pending"][s] for s, a in enumerate(active) if a and h["pending"][s] is not None}
        for job in [j for j in h["uploads"] if j not in live]:
            del h["uploads"][job]
        for job in live:
            if job.done() and job not in h["uploads"] and job.exception() is None:
                h["uploads"][job] = host.kv.upload(job.result())

    def host_stats(self, host) -> dict:
        """The draft forwards (lookahead); the host pool's scans (or value gathers): how many, their CPU seconds (on
        the worker) and the seconds rows waited for them at their boundaries (HERALD's pipeline stall); the engine
        thread's seconds in the boundary hooks (placing, copying blocks out, swapping pools; the stall included),
        after draft steps, and in each of the store's host-side methods (`store_s`); the worker's seconds by part
        (`scan_split_s`: waiting for the device, ext/'s selection, the gather)."""
        h = host.state
        if "scans" not in h:
            return {}
        drafts = {"draft_forwards": h["draft_forwards"]} if self.lookahead else {}
        if not self.host_pool:
            return drafts
        split = dict(host.kv.shared.worker_seconds)
        return drafts | {"scans": h["scans"], "scan_s": h["scan_s"], "scan_split_s": split,
                         "boundary_stall_s": h["stall_s"], "boundary_hooks_s": h["boundary_s"],
                         "draft_hooks_s": h["draft_s"], "store_s": dict(host.kv.shared.seconds)}

    def host_forward(self, host, view, on: torch.Tensor, target: torch.Tensor) -> None:
        """The retrieval forward with the host pool (HERALD §IV-B, faithfully): layer by layer, the representative
        query's q, k, v on the device, its attention over the host pool's [0, target) on the CPU fused with the choice
        of each KV head's positions before the block at target - B (ext/), the output back to the device for the
        next layer; the choices gathered and copied into the rows' idle regions."""
        onc = on.cpu()
        prefix = (target - self.block_size).clamp(min=0)
        keep = self.next_keep(prefix).cpu() * onc
        attend = view.host_attend(target.cpu().clamp(max=view.capacity) * onc, keep, prefix.cpu() * onc)
        host.model(self.representative_forward(on, target, target, self.config.query, view.capacity), attend)
        view.place(view.gathered(onc, keep, attend.chosen))


def to_host(t: torch.Tensor):
    """A copy of device tensor t to the host, issued now without waiting: returns the call (for the host worker) that
    waits for it and gives the copy."""
    if t.device.type != "cuda":
        out = t.clone()
        return lambda: out
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))

    def get() -> torch.Tensor:
        event.synchronize()
        return out
    return get


def row_mask(like: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """[len(like)] bool, True at `rows`."""
    out = torch.zeros_like(like, dtype=torch.bool)
    out[rows] = True
    return out
