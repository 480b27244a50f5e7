"""`compiledllm profile`: where a recipe's run spends its time, per phase, plus a short torch.profiler trace.

The run is eager and profiled (no compile, no CUDA graphs, MODE) so that each phase's work is attributable. A
short warm-up (one block per prompt, the same KV capacity) goes first, so that kernel compilation (Triton JIT),
library start-up and allocator growth are not counted. Then the whole run is timed per phase by the labelled
ranges of compiledllm.profiling (a PhaseClock: cheap), while torch.profiler records only a few steps (its
schedule: skip one, warm up one, record `record_steps`), which bounds the trace. A step is one decode forward of
the engine (every active slot at once); prefill is a run total, not a per-step cost. `forwards` means what it means
in `compiledllm run` (and eval): per request, the decode forwards it took part in, summed over the requests, so a
step of 4 active requests is 4 forwards; the profile shows both counts. Outputs trace.json.gz
(chrome://tracing and Perfetto open it), profile.json and profile.png.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from compiledllm.profiling import PHASES, PhaseClock
from compiledllm.recipe import Recipe, load_recipe
from compiledllm.runner import Summary, make_summary, prepare

MODE = "eager, profiled"
RECORD_STEPS = 5
TRACE_FILE = "trace.json.gz"
STEPS_MEANING = ("engine steps (one batched decode forward each, over every active request; `run`'s forwards count "
                 "each request in a step, so they add up to more); prefill not counted")
FORWARDS_MEANING = ("as `compiledllm run` counts them: per request, the decode forwards it took part in, summed "
                    "(a step over 4 active requests is 4 forwards); prefill not counted")


@dataclass(frozen=True)
class PhaseRow:
    phase: str
    total_ms: float            # over the whole run
    per_step_ms: float | None  # None for prefill: it runs at admission, not once per step
    share: float               # of the run's wall time


@dataclass(frozen=True)
class ProfileResult:
    rows: list[PhaseRow]  # largest total first
    summary: Summary
    steps: int            # the engine's decode forwards: every per-step figure divides by this
    recorded_steps: int   # steps in the trace
    ops: list[dict]
    trace: Path | None    # None when the run was too short to reach the recorded steps
    chart: Path | None    # None when matplotlib is missing
    gpu_busy_ms: float | None = None  # CUDA: kernel time of the recorded steps (the rest is host work and gaps)


def phase_times(events, cuda: bool) -> dict[str, float]:
    """Milliseconds per phase label in profiler events, counting only outermost labelled ranges (prefill holds its
    own layers). Only the CPU-side ranges count: on CUDA a labelled range also appears as a device-side annotation
    spanning its kernels' wall time on the GPU (idle time and other ranges' queued kernels included), which would
    count twice. A CPU range's device time is the time of the kernels launched inside it."""
    out = {p: 0.0 for p in PHASES}
    for ev in events:
        if not ev.name.startswith("phase::") or ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        parent, nested = ev.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("phase::"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            us = ev.device_time_total if cuda else ev.cpu_time_total
            out[ev.name.removeprefix("phase::")] += us / 1000.0
    return out


def top_ops(prof, cuda: bool, limit: int | None = 30) -> list[dict]:
    """GPU kernels (CPU ops without CUDA) of the recorded steps by self time, largest first. Per-kernel times do
    not depend on how launches are attributed to the labelled ranges, so they cross-check the phase table."""
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if e.device_type == kind and us > 0 and not e.key.startswith("phase::") and not e.key.startswith("Profiler"):
            rows.append({"name": e.key, "calls": e.count, "total_ms": us / 1000.0})
    return sorted(rows, key=lambda r: -r["total_ms"])[:limit]


def busy_ms(events) -> float:
    """Total time the GPU ran kernels: each kernel once, through the CPU event that launched it (device-side
    annotation ranges are spans, not kernels, and are left out)."""
    cpu = torch.autograd.DeviceType.CPU
    return sum(k.duration for ev in events if ev.device_type == cpu for k in ev.kernels) / 1000.0


@contextmanager
def quiet():
    """Keep the profiler's own output off the console while it starts, steps and stops: Python warnings, and
    kineto's C++ log lines ("profiler_start", "profiler_stop") that go straight to file descriptor 2."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass
class TimedRun:
    results: list
    wall_s: float       # the run's wall time, the profiler's own calls left out
    clock: PhaseClock
    prof: profile
    recorded: int       # steps in the trace (0: the run ended before them)
    profiler_s: float   # time inside the profiler's calls


def timed_run(engine, prompts: list[list[int]], record_steps: int) -> TimedRun:
    """The whole run under a PhaseClock, torch.profiler recording steps 3 .. 2 + record_steps only."""
    cuda = engine.model.device.type == "cuda"
    ready, spent = [], [0.0]

    def step() -> None:
        t = time.perf_counter()
        with quiet():
            prof.step()  # the recorded window's end stops the trace here (it is written after the run)
        spent[0] += time.perf_counter() - t

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                   schedule=schedule(wait=1, warmup=1, active=record_steps, repeat=1), on_trace_ready=ready.append)
    with quiet():
        prof.start()
    try:
        with PhaseClock(engine.model.device, on_forward=step) as clock:
            t0 = time.perf_counter()
            results = engine.generate(prompts)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0 - spent[0]
    finally:
        with quiet():
            prof.stop()  # a run that ends inside the recorded window stops its trace here
    recorded = min(max(clock.forwards - 2, 0), record_steps) if ready else 0
    return TimedRun(results, wall, clock, prof, recorded, spent[0])


def profile_recipe(source: str | Path | Recipe, out_dir: Path, overrides: list[str] | None = None,
                   record_steps: int = RECORD_STEPS) -> ProfileResult:
    from compiledllm.engine import Engine

    recipe = load_recipe(source, overrides)
    recipe = recipe.model_copy(update={"compile": False, "cuda_graphs": False})
    out_dir.mkdir(parents=True, exist_ok=True)
    model, prompts, engine, load_s = prepare(recipe)
    capacity = engine.capacity_for(prompts)
    short = dataclasses.replace(engine.config, max_new_tokens=1, max_seq_len=capacity)  # one block, same shapes
    Engine(model, short).generate(prompts)  # the warm-up

    trace = out_dir / TRACE_FILE
    trace.unlink(missing_ok=True)
    run = timed_run(engine, prompts, record_steps)
    summary = make_summary(recipe, engine, run.results, run.wall_s, load_s)
    steps, cuda = max(run.clock.forwards, 1), model.device.type == "cuda"
    events, ops = [], []
    if run.recorded:
        with quiet():
            events, ops = run.prof.events(), top_ops(run.prof, cuda)
            run.prof.export_chrome_trace(str(trace))  # gzipped: the name ends in .gz
    rows = phase_rows(run.clock.totals(), steps, run.wall_s * 1000.0)
    busy = busy_ms(events) if cuda and run.recorded else None
    report = {"mode": MODE, "summary": dataclasses.asdict(summary), "steps": steps, "steps_are": STEPS_MEANING,
              "forwards": summary.forwards, "forwards_are": FORWARDS_MEANING,
              "wall_ms": run.wall_s * 1000.0, "profiler_ms_left_out": run.profiler_s * 1000.0,
              "phases": [r.__dict__ for r in rows], "trace": str(trace) if run.recorded else None,
              "recorded_steps": run.recorded,
              "recorded": {"phase_ms": phase_times(events, cuda), **({"gpu_busy_ms": busy} if cuda else {})},
              "top_kernels" if cuda else "top_cpu_ops": ops}
    (out_dir / "profile.json").write_text(json.dumps(report, indent=2) + "\n")
    chart = write_chart(rows, summary, steps, out_dir / "profile.png")
    return ProfileResult(rows, summary, steps, run.recorded, ops, trace if run.recorded else None, chart, busy)


def phase_rows(times: dict[str, float], steps: int, wall_ms: float) -> list[PhaseRow]:
    """The labelled phases and the rest of the wall time, largest first."""
    labelled = sum(times.values())
    items = [(p, t) for p, t in times.items() if t > 0] + [("other (norms, rope, embed, host)",
                                                            max(wall_ms - labelled, 0.0))]
    rows = [PhaseRow(p, t, None if p == "prefill" else t / steps, t / wall_ms if wall_ms else 0.0) for p, t in items]
    return sorted(rows, key=lambda r: -r.total_ms)


def title(summary: Summary, steps: int) -> str:
    return (f"{summary.model} · {summary.policy} · {summary.device} · {MODE} · {steps} steps "
            f"({summary.forwards} forwards, as run counts them) · {summary.wall_s:.2f} s")


def write_chart(rows: list[PhaseRow], summary: Summary, steps: int, path: Path) -> Path | None:
    """Horizontal bars of each phase's total over the run, largest on top, labelled with its share and its ms per
    step (prefill: run total only). None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    bars = ax.barh([r.phase for r in rows][::-1], [r.total_ms for r in rows][::-1],
                   color=["#aa7744" if r.per_step_ms is None else "#4477aa" for r in rows][::-1])
    labels = [f"{r.total_ms:.0f} ms · {r.share:.1%} · " + ("run total" if r.per_step_ms is None
                                                          else f"{r.per_step_ms:.2f} ms/step") for r in rows][::-1]
    ax.bar_label(bars, labels=labels, padding=3, fontsize=8)
    ax.margins(x=0.45)
    ax.set_xlabel(f"ms over the whole run ({summary.wall_s * 1000:.0f} ms wall, {steps} steps)")
    ax.set_title(f"{title(summary, steps)}\nwhere the run's time goes (a step: one decode forward of the engine)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
