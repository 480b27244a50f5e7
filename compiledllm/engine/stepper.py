"""Runs the decode step on a batch-size bucket: eagerly, through torch.compile, or as a replayed CUDA graph.

A bucket is the first `b` slots (views of the static buffers); the engine picks the smallest bucket that
holds every active slot. On CUDA every bucket is captured once at start-up, sharing one memory pool;
a replay runs the whole step (forward, acceptance, bookkeeping) with no host work.
"""
from __future__ import annotations

import functools
import time

import torch

from compiledllm.engine.state import SlotState
from compiledllm.engine.step import Regions, accept_step, decode_step
from compiledllm.kv.cache import KVCache
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.policies.base import Policy


def default_buckets(slots: int) -> list[int]:
    sizes = [1 << i for i in range(slots.bit_length()) if 1 << i < slots]
    return sizes + [slots]


# No autotuning of generated pointwise kernels: Inductor benchmarks a kernel that writes into an input on a clone of
# every byte the input's strides span, and the KV write's input is a layer's view of the slot-major cache, which
# spans the whole cache (all layers): ~80 GB at 32K context and batch 60, an out-of-memory error at start-up.
INDUCTOR_OPTIONS = {"triton.autotune_pointwise": False}


def make_room(variants: int) -> None:
    """Raise Dynamo's recompile limit by the compiled variants one more stepper can add to a code object. The
    layers' regions share one code object, and every engine in the process shares them and the acceptance step:
    each engine adds its (layer kind x bucket) variants, and a policy's settings are guarded values, so `eval`
    over several policies adds buckets per policy. A fixed limit would end a long process with a hard failure."""
    cfg = torch._dynamo.config
    cfg.recompile_limit += variants
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, cfg.recompile_limit)  # per code object


def compiled_regions(model: BlockDiffusionLM, buckets: int) -> Regions:
    """Regional compilation of the decode step: each decoder layer is a compiled region, and the layers of a kind
    share one compiled graph per bucket (same code, parameters as inputs), so start-up compiles ~2 layers and the
    acceptance per bucket instead of the whole unrolled model; the few ops between regions (embedding, rotary
    tables, head) run eagerly, inside the CUDA graph like the rest. The model itself stays uncompiled (prefill
    chunks of every length run it eagerly). Static shapes per bucket keep the generated kernels specialised."""
    kinds = len({type(layer.mlp) for layer in model.layers})
    make_room(kinds * buckets)
    layers = tuple(torch.compile(layer, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
                   for layer in model.layers)
    return Regions(layers, torch.compile(accept_step, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS))


class Stepper:
    def __init__(self, model: BlockDiffusionLM, policy: Policy, st: SlotState, kv: KVCache | None,
                 buckets: list[int], compile: bool, cuda_graphs: bool, regional: bool = True):
        self.model, self.policy = model, policy
        self.buckets = sorted(set(buckets))
        whole = compile and not regional
        self.views = {b: (st.view(b), None if kv is None else kv.rows(0, b, indexed=whole)) for b in self.buckets}
        if whole:  # the whole step as one graph per bucket (benchmarks' A/B; slow to compile)
            make_room(len(self.buckets))
            self.fn = torch.compile(decode_step, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
        elif compile:
            self.fn = functools.partial(decode_step, regions=compiled_regions(model, len(self.buckets)))
        else:
            self.fn = decode_step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.startup_s = 0.0
        if cuda_graphs:
            t0 = time.perf_counter()
            self._capture()
            self.startup_s = time.perf_counter() - t0
        elif compile:
            t0 = time.perf_counter()
            for b in self.buckets:  # compile up front so the first requests do not pay for it
                self.fn(self.model, self.policy, *self.views[b])
            self.startup_s = time.perf_counter() - t0

    def _capture(self) -> None:
        """Warm up (and compile) each bucket on a side stream, then capture it. Runs while every slot is idle,
        so the warm-up steps change no request's tokens."""
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):  # largest first: later graphs reuse its pool memory
            args = (self.model, self.policy, *self.views[b])
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fn(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.fn(*args)
            self.graphs[b] = graph

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(self, rows: int) -> None:
        """One decode step over (at least) the first `rows` slots."""
        b = self.bucket_for(rows)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self.fn(self.model, self.policy, *self.views[b])
