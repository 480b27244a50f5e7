"""torch.compile of a step's phases: regional (each decoder layer a compiled region) or whole, and the context in
which they compile (Dynamo's recompile limits, lifted for the stepper's own calls only)."""
from __future__ import annotations

import torch

from compiledllm.engine.step import Regions, finish_phase

# No autotuning of generated pointwise kernels: Inductor benchmarks a kernel that writes into an input on a clone of
# every byte the input's strides span, and the KV write's input is a layer's view of the slot-major cache, which
# spans the whole cache (all layers): ~80 GB at 32K context and batch 60, an out-of-memory error at start-up.
INDUCTOR_OPTIONS = {"triton.autotune_pointwise": False}


def resolve_compile(value: bool | str, device: torch.device | str) -> bool:
    """The recipe key `compile` for a model on `device`: true and false as given; auto compiles on CUDA (the decode
    step measured 1.6x the captured eager step: SDAR-4B batch 128 on an H200, 7,120 against 4,530 output tokens/s)
    and not on the CPU, where the start-up costs more than a short run gains (the quickstart on 2 cores: 47 s cold,
    4.8 s warm, for a 2.5 s eager run decoding 1.4-1.6x slower; docs/results.md "Quickstart tokens/s")."""
    if isinstance(value, bool):
        return value
    if value != "auto":
        raise ValueError(f"compile: true, false or 'auto', got {value!r}")
    return torch.device(device).type == "cuda"


def compile_room():
    """The context in which a Stepper's compiled regions compile and run: Dynamo's recompile limits lifted for the
    calls inside it only. A stepper compiles what its shapes need (layer kinds x buckets x phase shapes), and every
    engine in a process adds its variants to the same code objects (the layers' regions and the finish), so a
    fixed limit would turn a needed compile into a silent eager fallback in a long process (eval over several
    policies); raising it process-wide would change every other caller's torch.compile behind its back."""
    return torch._dynamo.config.patch(recompile_limit=ROOM, accumulated_recompile_limit=ROOM)


ROOM = 1 << 16  # per code object, inside compile_room only


def compiled_regions(model) -> Regions:
    """Regional compilation: each decoder layer is a compiled region, and the layers of a kind share one compiled
    graph per (bucket, phase shape) (same code, parameters as inputs), so start-up compiles ~2 layers and the finish
    per bucket and phase instead of the whole unrolled model; the few ops between regions (plan, embedding, rotary
    tables, head) run eagerly, inside the CUDA graph like the rest. The model itself stays uncompiled (prefill
    chunks of every length run it eagerly). Static shapes per bucket keep the generated kernels specialised."""
    layers = tuple(torch.compile(layer, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
                   for layer in model.layers)
    return Regions(layers, torch.compile(finish_phase, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS))

