"""Runs a step's phases on a batch-size bucket: eagerly, through torch.compile, or as replayed CUDA graphs.

A bucket is the first `b` slots (views of the static buffers); the engine picks the smallest bucket that holds
every active slot. On CUDA every (phase, bucket) is captured once at start-up (a narrowed phase "<phase>@<W>" is a
phase of its own: policies/windows.py), all graphs sharing one memory pool (kernel scratch allocated during capture
lives in that pool, so it lives as long as this Stepper's graphs); a replay runs the whole phase (plan, forward,
update, bookkeeping) with no host work.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from compiledllm.attention.spec import Kernels
from compiledllm.compile_cache import CacheReport, counts, describe, use_cache
from compiledllm.engine.hooks import PhaseRun, Schedule
from compiledllm.engine.compile import INDUCTOR_OPTIONS, compile_room, compiled_regions
from compiledllm.engine.phase_times import PhaseTimer
from compiledllm.engine.state import SlotState
from compiledllm.engine.step import run_phase
from compiledllm.kv.store import KVStore
from compiledllm.policies.base import Policy
from compiledllm.policies.windows import split


def default_buckets(slots: int) -> list[int]:
    sizes = [1 << i for i in range(slots.bit_length()) if 1 << i < slots]
    return sizes + [slots]


log = logging.getLogger(__name__)


class Stepper:
    def __init__(self, model, policy: Policy, st: SlotState, kv: KVStore | None, buckets: list[int], compile: bool,
                 cuda_graphs: bool, regional: bool = True, kernels: Kernels | None = None, eos_id: int | None = None,
                 on_startup: Callable[[int, int, str], None] | None = None, phases: Sequence[str] | None = None):
        """kernels: the implementations every forward uses instead of the policy's default (benchmarks' A/B);
        eos_id: the token that ends a request (default the model's; -1: none, every request runs to its length);
        on_startup(done, total, what): the start-up's progress, (phase, bucket) pieces compiled and / or captured
        (called before each piece and once at the end; not at all when there is nothing to do before a step);
        phases: those compiled / captured at start-up, and a step's when `run` is given none (default: one step's
        where every row fills the capacity, Policy.phases_for); another phase runs uncaptured."""
        self.model, self.policy = model, policy
        T = st.seq.shape[1]
        self.phases = tuple(phases) if phases is not None else policy.phases_for(T, T)
        self.buckets = sorted(set(buckets))
        cache_dir = use_cache() if compile else None  # before the first compile (compile_cache.py)
        whole = compile and not regional
        self.views = {b: (st.view(b), None if kv is None else kv.rows(0, b, indexed=whole)) for b in self.buckets}
        self.compiled = compile
        if whole:  # each phase as one graph per bucket (benchmarks' A/B; slow to compile)
            fn = torch.compile(run_phase, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
        elif compile:
            fn = functools.partial(run_phase, regions=compiled_regions(model))
        else:
            fn = run_phase
        fn = functools.partial(fn, eos_id=model.eos_token_id if eos_id is None else eos_id)
        self.fn = fn if kernels is None else functools.partial(fn, kernels=kernels)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.cache: CacheReport | None = None  # what the start-up's compile found in Inductor's cache
        self.startup_s = self._start(cuda_graphs, cache_dir, on_startup)

    @torch.no_grad()  # as EngineSession.step runs the steps: grad mode is part of the compiled graphs' guards (a
    # session made outside no_grad, as the server's worker makes it, recompiled every graph at its first step)
    def _start(self, cuda_graphs: bool, cache_dir: str | None, on_startup) -> float:
        """Compile and / or capture every (phase, bucket) before the first step: captured largest bucket first
        (later graphs reuse its pool memory); compiled only, up front, so that the first requests do not pay for
        it; else nothing. Returns its seconds (0: nothing ran)."""
        order = sorted(self.buckets, reverse=True) if cuda_graphs else self.buckets if self.compiled else []
        pieces = [(ph, b) for b in order for ph in self.phases]
        if not pieces:
            return 0.0
        what = "compile + capture" if self.compiled and cuda_graphs else "capture" if cuda_graphs else "compile"
        before = counts() if self.compiled else None
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        for i, (ph, b) in enumerate(pieces):
            if on_startup is not None:
                on_startup(i, len(pieces), f"{what} · bucket {b} · {ph}")
            if cuda_graphs:
                self._capture(ph, b, pool)
            else:
                self._call(ph, b)
        seconds = time.perf_counter() - t0
        if self.compiled:
            self.cache = CacheReport.between(cache_dir, before, counts())
        if on_startup is not None:
            on_startup(len(pieces), len(pieces), what)
        log.info("start-up %.2f s: %s of %d (phase, bucket) steps, buckets %s%s", seconds, what, len(pieces),
                 ", ".join(map(str, self.buckets)), f"; {describe(self.cache)}" if self.cache else "")
        return seconds

    def _call(self, phase: str, bucket: int) -> None:
        with compile_room() if self.compiled else contextlib.nullcontext():
            self.fn(self.model, self.policy, phase, *self.views[bucket],
                    subset=split(phase)[0] in self.policy.row_phases)

    def _capture(self, ph: str, b: int, pool) -> None:
        """Warm up (and compile) the phase on bucket b on a side stream, then capture it into `pool`. Runs while
        every slot is idle, so the warm-up steps change no request's tokens."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._call(ph, b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._call(ph, b)
        self.graphs[ph, b] = graph

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(self, rows: int, phases: Schedule | None = None, selected: torch.Tensor | None = None,
            timer: PhaseTimer | None = None) -> None:
        """One step over (at least) the first `rows` slots: the given phases (default all) in order. A PhaseRun runs
        on its rows only, on the smallest bucket that holds them; `selected` (st.selected) takes its row mask;
        `timer` times each phase run."""
        for ph in phases if phases is not None else self.phases:
            if isinstance(ph, PhaseRun):
                if not ph.rows:
                    continue
                mask = torch.zeros(selected.shape[0], dtype=torch.bool)
                mask[list(ph.rows)] = True
                selected.copy_(mask, non_blocking=True)
                b, ph = self.bucket_for(1 + max(ph.rows)), ph.phase
            else:
                b = self.bucket_for(rows)
            graph = self.graphs.get((ph, b))
            with timer.phase(ph, graph is not None) if timer is not None else contextlib.nullcontext():
                if graph is not None:
                    graph.replay()
                else:
                    self._call(ph, b)
