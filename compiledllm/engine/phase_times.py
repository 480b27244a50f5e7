"""Device time of each decode phase (recipe `phase_times: true`): where a step's time goes when its phases replay as
CUDA graphs, which `compiledllm profile` (eager, its kernels labelled by phase) cannot show.

Each phase run is bracketed by two CUDA events on the current stream and read after the step's one host sync, so the
timing adds no sync of its own; on the CPU a phase runs synchronously and its wall time is taken. A run's time spans
its stream work from the first kernel to the last, idle gaps included (e.g. an uncaptured phase's launch gaps).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch


@dataclass
class PhaseTime:
    runs: int = 0
    uncaptured: int = 0   # runs that did not replay a CUDA graph (eager or compiled calls)
    seconds: float = 0.0


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times: dict[str, PhaseTime] = {}
        self._pending: list[tuple[PhaseTime, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def phase(self, name: str, captured: bool) -> Iterator[None]:
        t = self.times.setdefault(name, PhaseTime())
        t.runs += 1
        t.uncaptured += not captured
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((t, start, end))
        else:
            t0 = time.perf_counter()
            yield
            t.seconds += time.perf_counter() - t0

    def collect(self) -> None:
        """After the step's host sync: the recorded runs' event times into the totals."""
        for t, start, end in self._pending:
            end.synchronize()  # already done after the step's sync; cheap, and never reads an unfinished event
            t.seconds += start.elapsed_time(end) / 1e3
        self._pending.clear()

    def report(self) -> dict[str, dict]:
        return {name: asdict(t) for name, t in self.times.items()}
