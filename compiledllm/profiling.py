"""Phase labels for `compiledllm profile`: named ranges the profiler sees in eager runs (free otherwise)."""
from __future__ import annotations

from contextlib import nullcontext

import torch

PHASES = ("projections", "attention", "mlp", "moe", "head", "acceptance", "prefill")


def phase(name: str):
    """A profiler range around one phase of a step; a no-op while torch.compile traces."""
    if torch.compiler.is_compiling():
        return nullcontext()
    return torch.profiler.record_function(f"phase::{name}")
