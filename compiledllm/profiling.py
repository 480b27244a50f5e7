"""Phase labels for `compiledllm profile`: named ranges that a PhaseClock times over a whole run and torch.profiler
sees while it records (free otherwise).

The clock is module state because the ranges sit deep inside the model's layers: passing it through every forward
would thread a profiling argument through all model code. It is only ever set by `with PhaseClock(...)`.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

PHASES = ("projections", "attention", "mlp", "moe", "head", "acceptance", "prefill")
STEP_PHASE = "acceptance"  # each decode forward of the engine ends with one (engine/step.py run_phase)

_clock: "PhaseClock | None" = None


class PhaseClock:
    """Milliseconds per phase (outermost ranges only: prefill holds its own layers) and the engine's decode
    forwards, over everything run inside `with PhaseClock(...)`. On CUDA a range is timed by two events on the
    current stream (its span on the GPU's timeline, no host sync); on the CPU by the host clock, which is the
    compute time there. `on_forward` runs after each decode forward (the profiler's schedule step)."""

    def __init__(self, device: torch.device, on_forward: Callable[[], None] | None = None):
        self.cuda = device.type == "cuda"
        self.on_forward = on_forward
        self.forwards = 0
        self.depth = 0
        self._ms = {p: 0.0 for p in PHASES}
        self._spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def __enter__(self) -> "PhaseClock":
        global _clock
        if _clock is not None:
            raise RuntimeError("a PhaseClock is already running")
        _clock = self
        return self

    def __exit__(self, *exc) -> None:
        global _clock
        _clock = None

    def totals(self) -> dict[str, float]:
        """Milliseconds per phase; on CUDA this waits for the device."""
        if self._spans:
            torch.cuda.synchronize()
            for name, start, end in self._spans:
                self._ms[name] += start.elapsed_time(end)
            self._spans.clear()
        return dict(self._ms)


class _Timed:
    """A labelled range under a running clock: the profiler's range plus, when outermost, the clock's timing."""

    def __init__(self, clock: PhaseClock, name: str):
        self.clock, self.name = clock, name
        self.label = torch.profiler.record_function(f"phase::{name}")

    def __enter__(self) -> None:
        c = self.clock
        c.depth += 1
        if c.depth == 1:
            if c.cuda:
                self.start = torch.cuda.Event(enable_timing=True)
                self.start.record()
            else:
                self.t0 = time.perf_counter()
        self.label.__enter__()

    def __exit__(self, *exc) -> None:
        self.label.__exit__(*exc)
        c = self.clock
        c.depth -= 1
        if c.depth:
            return
        if c.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            c._spans.append((self.name, self.start, end))
        else:
            c._ms[self.name] += (time.perf_counter() - self.t0) * 1000.0
        if self.name == STEP_PHASE:
            c.forwards += 1
            if c.on_forward is not None:
                c.on_forward()


def phase(name: str):
    """A range around one phase of a step: timed under a PhaseClock, seen by torch.profiler, a no-op while
    torch.compile traces."""
    if torch.compiler.is_compiling():
        return nullcontext()
    if _clock is not None:
        return _Timed(_clock, name)
    return torch.profiler.record_function(f"phase::{name}")
