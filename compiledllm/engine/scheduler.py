"""One generate() call's schedule: arrivals, admission, prefill chunks interleaved with decode steps, results.

Each loop admits the requests that have arrived into free slots, runs prefill, then one decode step of the rows
that are decoding. While no row decodes, every prefilling row gets a chunk per loop (batched where slots are
contiguous); while rows decode, prefill gets one forward per step (at most `prefill_tokens` tokens), the earliest
admitted request first, so a new request stalls the decoding rows for one chunk forward at a time (chunked prefill
as SGLang and vLLM schedule it). Prefill writes only its own rows' KV, so decoding rows keep their tokens.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from compiledllm.engine.hooks import HostContext, StepReport
from compiledllm.engine.prefill import Prefiller, Progress
from compiledllm.profiling import phase as profile_range


@dataclass(frozen=True)
class RunStats:
    """Where one generate() call's time went (seconds; startup = compile / capture, before the clock starts)."""

    wall_s: float
    startup_s: float
    prefill_tokens: int
    prefill_s: float
    prefill_forwards: int
    decode_steps: int
    decode_s: float
    generated_tokens: int
    stalled_steps: int = 0   # decode steps whose rows first waited for a prefill forward of another request
    stall_s: float = 0.0     # the waiting, in total
    stall_max_s: float = 0.0 # the longest wait of one step (bounded by one prefill forward)


@dataclass
class _Slot:
    index: int
    arrival: float
    admitted: int            # admission order (prefill serves the earliest first)
    prefill: Progress
    first_block: float | None = None


@dataclass
class Scheduler:
    engine: object
    st: object
    kv: object
    stepper: object
    prefiller: Prefiller | None
    prompts: list[list[int]]
    arrivals: list[float]
    on_result: Callable | None = None
    _counts: dict = field(default_factory=lambda: dict.fromkeys(
        ("prefill_tokens", "prefill_forwards", "decode_steps", "prefill_s", "decode_s", "stalled_steps", "stall_s",
         "stall_max_s"), 0))

    def loop(self) -> list:
        eng, st, policy = self.engine, self.st, self.engine.policy
        slots = st.seq.shape[0]
        host = HostContext(eng.model, st, self.kv, eng.side_stream)
        queue = deque(sorted(range(len(self.prompts)), key=self.arrivals.__getitem__))
        owner: list[_Slot | None] = [None] * slots
        results = [None] * len(self.prompts)
        report = StepReport([False] * slots, [0] * slots)
        admitted = 0
        self.t0 = time.perf_counter()
        while queue or any(o is not None for o in owner):
            ready = []
            for s in range(slots):  # admit what has arrived
                if owner[s] is None and queue and self.arrivals[queue[0]] <= self._now():
                    i = queue.popleft()
                    owner[s] = _Slot(i, self.arrivals[i], admitted, eng._admit(st, s, i, self.prompts[i]))
                    admitted += 1
                    if owner[s].prefill.left == 0:
                        ready.append(s)
            prefilling = [s for s, o in enumerate(owner) if o is not None and o.prefill.left > 0]
            decoding = [s for s, o in enumerate(owner) if o is not None and o.prefill.left == 0 and s not in ready]
            if prefilling:
                t = time.perf_counter()
                ready += self._prefill(prefilling, owner, everyone=not decoding)
                if decoding:  # those rows waited for this forward before their next step
                    self._stalled(time.perf_counter() - t)
            if ready:
                st.active[ready] = True
                policy.on_blocks(host, ready)
            decoding = sorted(decoding + ready)
            if not decoding:
                if not prefilling and queue:  # idle until the next request arrives
                    time.sleep(max(0.0, self.arrivals[queue[0]] - self._now()))
                continue
            t = time.perf_counter()
            self.stepper.run(1 + max(decoding), policy.schedule(report))
            report = StepReport(*st.host_view())  # the one host sync of a step
            st.retired.zero_()
            self._counts["decode_s"] += time.perf_counter() - t
            self._counts["decode_steps"] += 1
            begun, now = [], self._now()
            for s in decoding:
                o = owner[s]
                if report.retired[s] and o.first_block is None:
                    o.first_block = now
                if report.active[s]:
                    if report.retired[s]:
                        begun.append(s)
                    continue
                res = eng._collect(st, s, o.index, self.prompts[o.index])
                res.arrival_s, res.latency_s = o.arrival, now - o.arrival
                res.first_block_s = (o.first_block if o.first_block is not None else now) - o.arrival
                results[o.index] = res
                if self.on_result is not None:
                    self.on_result(res)
                owner[s] = None
            if begun:
                policy.on_blocks(host, begun)
        self.wall_s = self._now()
        self.results = results
        return results

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _prefill(self, prefilling: list[int], owner: list, everyone: bool) -> list[int]:
        """Prefill chunks: one per prefilling row (everyone), else one forward for the earliest admitted request's
        rows. Returns the slots whose prefill is complete."""
        progress = {s: owner[s].prefill for s in prefilling}
        pieces = self.prefiller.pieces(prefilling)
        if not everyone:
            first = min(prefilling, key=lambda s: owner[s].admitted)
            pieces = [next(p for p in pieces if p[0] <= first < p[0] + p[1])]
        t = time.perf_counter()
        with profile_range("prefill"):
            for first, rows in pieces:
                self._counts["prefill_tokens"] += self.prefiller.run(self.st, self.kv, first, rows, progress)
                self._counts["prefill_forwards"] += 1
            if self.st.seq.device.type == "cuda":
                torch.cuda.synchronize(self.st.seq.device)  # prefill time as spent, not as queued
        self._counts["prefill_s"] += time.perf_counter() - t
        return [s for s in prefilling if progress[s].left == 0]

    def _stalled(self, wait: float) -> None:
        c = self._counts
        c["stalled_steps"] += 1
        c["stall_s"] += wait
        c["stall_max_s"] = max(c["stall_max_s"], wait)

    def stats(self) -> RunStats:
        c = self._counts
        generated = sum(len(r.output_ids) for r in self.results if r is not None)
        return RunStats(self.wall_s, self.engine.startup_s, c["prefill_tokens"], c["prefill_s"], c["prefill_forwards"],
                        c["decode_steps"], c["decode_s"], generated, c["stalled_steps"], c["stall_s"],
                        c["stall_max_s"])
