"""torch.compile of a step's phases: regional (each decoder layer a compiled region) or whole, and Dynamo's
recompile budget for them."""
from __future__ import annotations

import torch

from compiledllm.engine.step import Regions, finish_phase

# No autotuning of generated pointwise kernels: Inductor benchmarks a kernel that writes into an input on a clone of
# every byte the input's strides span, and the KV write's input is a layer's view of the slot-major cache, which
# spans the whole cache (all layers): ~80 GB at 32K context and batch 60, an out-of-memory error at start-up.
INDUCTOR_OPTIONS = {"triton.autotune_pointwise": False}


def make_room(variants: int) -> None:
    """Raise Dynamo's recompile limit by the compiled variants one more stepper can add to a code object. The
    layers' regions share one code object, and every engine in the process shares them and the finish step:
    each engine adds its (layer kind x bucket x phase) variants, and a policy's settings are guarded values, so
    `eval` over several policies adds variants per policy. A fixed limit would end a long process with a hard
    failure."""
    cfg = torch._dynamo.config
    cfg.recompile_limit += variants
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, cfg.recompile_limit)  # per code object


def compiled_regions(model, buckets: int, phases: int) -> Regions:
    """Regional compilation: each decoder layer is a compiled region, and the layers of a kind share one compiled
    graph per (bucket, phase shape) (same code, parameters as inputs), so start-up compiles ~2 layers and the finish
    per bucket and phase instead of the whole unrolled model; the few ops between regions (plan, embedding, rotary
    tables, head) run eagerly, inside the CUDA graph like the rest. The model itself stays uncompiled (prefill
    chunks of every length run it eagerly). Static shapes per bucket keep the generated kernels specialised."""
    kinds = len({type(layer.mlp) for layer in model.layers})
    make_room(kinds * buckets * phases)
    layers = tuple(torch.compile(layer, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
                   for layer in model.layers)
    return Regions(layers, torch.compile(finish_phase, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS))

