"""A session's scheduling rules and accounting: which prefill forward runs before a step, and where the time went.

Each `EngineSession.step` admits queued requests into free slots, runs prefill, then one step of the decoding rows.
While no row decodes, every prefilling row gets a chunk per step (batched where slots are contiguous); while rows
decode, prefill gets one forward per step (at most `prefill_tokens` tokens), the earliest admitted request first,
so a new request stalls the decoding rows for one chunk forward at a time (chunked prefill as SGLang and vLLM
schedule it). Prefill writes only its own rows' KV, so decoding rows keep their tokens. With `prefill.priority:
first_block` prefill waits while a decoding row is still in its first block, and runs one forward at a time even
when nothing decodes: the rows of the first forward reach their first block before the next rows are prefilled.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from compiledllm.engine.prefill import Prefiller, Progress

OPENING = 16  # steps whose timeline RunStats.opening keeps


@dataclass(frozen=True)
class RunStats:
    """Where a session's time went (seconds; startup = compile / capture, before the clock starts)."""

    wall_s: float
    startup_s: float
    prefill_tokens: int
    prefill_s: float
    prefill_forwards: int
    decode_steps: int
    decode_s: float          # the decode steps and the host work around them (hooks_s)
    generated_tokens: int
    prefill_first_s: float = 0.0  # the first prefill turn (its forwards, synchronised): before it no row decodes
    stalled_steps: int = 0   # decode steps whose rows first waited for a prefill forward of another request
    stall_s: float = 0.0     # the waiting, in total
    stall_max_s: float = 0.0 # the longest wait of one step (bounded by one prefill forward)
    hooks_s: float = 0.0     # host work around the steps: the policy's hooks, collecting results (part of decode_s)
    # the engine thread waiting in each step's one host sync for the device (part of decode_s): decode_s - hooks_s -
    # sync_s is the host's scheduling and launching while nothing of the step was left to wait for
    sync_s: float = 0.0
    policy: dict = field(default_factory=dict)  # the policy's own counters (Policy.host_stats)
    phases: dict = field(default_factory=dict)  # per decode phase: runs, uncaptured runs, device seconds (phase_times)
    opening: list = field(default_factory=list)  # the session's first OPENING steps, one dict each (Counters.note)


@dataclass
class Counters:
    """RunStats as they accumulate during a session."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    prefill_forwards: int = 0
    prefill_first_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    generated_tokens: int = 0
    stalled_steps: int = 0
    stall_s: float = 0.0
    stall_max_s: float = 0.0
    hooks_s: float = 0.0
    sync_s: float = 0.0
    opening: list = field(default_factory=list)

    def note(self, **step) -> None:
        """One step's timeline while fewer than OPENING are noted (where a burst's first blocks go): `at` on the
        session clock, then seconds admitting requests, in prefill, the host before the launch, the launch, the
        sync's wait and the host after it; the decoding rows and the phases."""
        if len(self.opening) < OPENING:
            self.opening.append({k: round(v, 6) if isinstance(v, float) else v for k, v in step.items()})

    def hooks(self, since: float) -> None:
        """Host-hook time since `since` (perf_counter): counted as decode time too."""
        dt = time.perf_counter() - since
        self.hooks_s += dt
        self.decode_s += dt

    def stalled(self, wait: float) -> None:
        self.stalled_steps += 1
        self.stall_s += wait
        self.stall_max_s = max(self.stall_max_s, wait)

    def stats(self, wall_s: float, startup_s: float, policy: dict | None = None, phases: dict | None = None
              ) -> RunStats:
        return RunStats(wall_s=wall_s, startup_s=startup_s, policy=policy or {}, phases=phases or {},
                        **{f.name: getattr(self, f.name) for f in fields(self)})


def prefill_turn(priority: str, decoding: int, in_first_block: int) -> str | None:
    """Which prefill runs before this step (when rows wait for it): "all" (every waiting piece: nothing decodes),
    "one" (the earliest admitted request's piece), or None (first_block priority while `in_first_block` of the
    `decoding` rows have not finished a block)."""
    if priority == "first_block":
        return None if in_first_block else "one"
    return "one" if decoding else "all"


def prefill_pieces(prefiller: Prefiller, prefilling: Sequence[int], admitted: Mapping[int, int],
                   progress: Mapping[int, Progress], everyone: bool) -> list[tuple[int, int]]:
    """(first slot, rows) of the prefill forwards to run now: one per contiguous piece of prefilling rows
    (`everyone`: no row is decoding), else only the piece of the earliest admitted request (admitted: slot ->
    admission order; progress: slot -> its prefill so far)."""
    pieces = prefiller.pieces(prefilling, progress)
    if everyone:
        return pieces
    first = min(prefilling, key=admitted.__getitem__)
    return [next(p for p in pieces if p[0] <= first < p[0] + p[1])]
