"""Runs a step's phases on a batch-size bucket: eagerly, through torch.compile, or as replayed CUDA graphs.

A bucket is the first `b` slots (views of the static buffers); the engine picks the smallest bucket that holds
every active slot. On CUDA every (phase, bucket) is captured once at start-up, all graphs sharing one memory pool
(kernel scratch allocated during capture lives in that pool, so it lives as long as this Stepper's graphs); a
replay runs the whole phase (plan, forward, update, bookkeeping) with no host work.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence

import torch

from compiledllm.attention.spec import Kernels
from compiledllm.engine.hooks import PhaseRun, Schedule
from compiledllm.engine.compile import INDUCTOR_OPTIONS, compile_room, compiled_regions
from compiledllm.engine.state import SlotState
from compiledllm.engine.step import run_phase
from compiledllm.kv.store import KVStore
from compiledllm.policies.base import Policy


def default_buckets(slots: int) -> list[int]:
    sizes = [1 << i for i in range(slots.bit_length()) if 1 << i < slots]
    return sizes + [slots]


class Stepper:
    def __init__(self, model, policy: Policy, st: SlotState, kv: KVStore | None, buckets: list[int], compile: bool,
                 cuda_graphs: bool, regional: bool = True, kernels: Kernels | None = None, eos_id: int | None = None):
        """kernels: the implementations every forward uses instead of the policy's default (benchmarks' A/B);
        eos_id: the token that ends a request (default the model's; -1: none, every request runs to its length)."""
        self.model, self.policy = model, policy
        self.buckets = sorted(set(buckets))
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
        self.startup_s = 0.0
        t0 = time.perf_counter()
        if cuda_graphs:
            self._capture()
        elif compile:
            for b in self.buckets:  # compile up front so the first requests do not pay for it
                for ph in policy.phases:
                    self._call(ph, b)
        self.startup_s = time.perf_counter() - t0

    def _call(self, phase: str, bucket: int) -> None:
        with compile_room() if self.compiled else contextlib.nullcontext():
            self.fn(self.model, self.policy, phase, *self.views[bucket], subset=phase in self.policy.row_phases)

    def _capture(self) -> None:
        """Warm up (and compile) each (phase, bucket) on a side stream, then capture it. Runs while every slot is
        idle, so the warm-up steps change no request's tokens."""
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):  # largest first: later graphs reuse its pool memory
            for ph in self.policy.phases:
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

    def run(self, rows: int, phases: Schedule | None = None, selected: torch.Tensor | None = None) -> None:
        """One step over (at least) the first `rows` slots: the given phases (default all) in order. A PhaseRun runs
        on its rows only, on the smallest bucket that holds them; `selected` (st.selected) takes its row mask."""
        for ph in phases if phases is not None else self.policy.phases:
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
            if graph is not None:
                graph.replay()
            else:
                self._call(ph, b)
