"""What the host sees around a step, and what a policy's host hooks get (docs/design.md §2).

Per step the session calls, on the host: `Policy.on_blocks` for rows that begin a block, `Policy.schedule` (which
phases run, each on every decoding row or on a subset), `Policy.before_step`, the step itself (replayed graphs or
eager phases), the one host sync (`StepReport`), then `Policy.after_step`. Host work that must overlap the GPU step
goes to `HostContext.worker` (one thread, owned by the session) or queues device work on `side_stream`.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from compiledllm.engine.state import SlotState


@dataclass(frozen=True)
class StepReport:
    """The one host sync of a step: per slot, whether it still decodes, how many blocks it retired, and where its
    unretired positions begin after the step."""

    active: list[bool]
    retired: list[int]
    block_start: list[int]


@dataclass(frozen=True)
class StepView:
    """The step about to run: the decoding slots, and those that begin a block with it (admitted, or whose last
    step retired a block); slots as they are now, after any compaction. `schedule` reads the host hooks' state here."""

    rows: tuple[int, ...]
    begun: tuple[int, ...]
    state: dict = field(default_factory=dict)  # the policy's host state (HostContext.state), as its hooks left it
    capacity: int = 0  # the session's KV positions per slot
    admitted: tuple[int, ...] = ()  # of `begun`, those that begin decoding with this step (their first step)


@dataclass(frozen=True)
class PhaseRun:
    """A phase that runs on some rows only: `rows` (slots) run it on the smallest bucket that holds them, the others
    take no part (no token, KV or count changes). A policy lists the phases that may run so in `Policy.row_phases`."""

    phase: str
    rows: tuple[int, ...]


Schedule = Sequence[str | PhaseRun]


@dataclass
class HostContext:
    """Handed to a policy's host hooks: the engine's buffers, its KV store, the side stream (None on the CPU), a
    one-thread worker for host work that overlaps the GPU step (HERALD's selection, for one) and `state`, the
    policy's host state for this session (kept off the policy object, which several sessions may share)."""

    model: object
    st: SlotState
    kv: object | None
    side_stream: torch.cuda.Stream | None
    state: dict = field(default_factory=dict)
    _worker: ThreadPoolExecutor | None = field(default=None, repr=False)
    _step_done: torch.cuda.Event | None = field(default=None, repr=False)

    @property
    def worker(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compiledllm-host")
        return self._worker

    def wait_for(self) -> torch.cuda.Event | None:
        """What the step's host sync waits on: with the worker running host work beside the steps (CUDA), an event
        whose wait sleeps, so the engine thread does not spin a core the worker's threads need; else None (the sync
        spins: the lowest latency)."""
        if self._worker is None or self.side_stream is None:
            return None
        if self._step_done is None:
            self._step_done = torch.cuda.Event(blocking=True)
        return self._step_done

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
