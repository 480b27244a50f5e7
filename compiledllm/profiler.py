"""`compiledllm profile`: run a recipe under torch.profiler and split a step's time into phases.

The run is eager (no compile, no CUDA graphs) so that each phase's kernels are attributable; the
labelled ranges come from compiledllm.profiling.phase. An unprofiled warm-up run goes first, so that kernel
compilation (Triton JIT), library start-up and allocator growth are not counted. A step is one decode step of
the engine (every active slot). Outputs a Chrome trace, a JSON report and a PNG chart.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from compiledllm.profiling import PHASES
from compiledllm.recipe import Recipe, load_recipe
from compiledllm.runner import Summary, execute


@dataclass(frozen=True)
class PhaseRow:
    phase: str
    total_ms: float
    per_step_ms: float
    per_block_ms: float
    share: float  # of the decode wall time


def phase_times(events, cuda: bool) -> dict[str, float]:
    """Milliseconds per phase label, counting only outermost labelled ranges (prefill holds its own layers).
    Only the CPU-side ranges count: on CUDA a labelled range also appears as a device-side annotation spanning
    its kernels' wall time on the GPU (idle time and other ranges' queued kernels included), which would
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
    """GPU kernels (CPU ops without CUDA) of the whole run, prefill included, by self time, largest first.
    Per-kernel times do not depend on how launches are attributed to the labelled ranges, so they
    cross-check the phase table."""
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if e.device_type == kind and us > 0 and not e.key.startswith("phase::"):
            rows.append({"name": e.key, "calls": e.count, "total_ms": us / 1000.0})
    return sorted(rows, key=lambda r: -r["total_ms"])[:limit]


def decode_steps(events) -> int:
    """Decode steps of the engine: each runs the acceptance once (an outermost labelled range)."""
    cpu = torch.autograd.DeviceType.CPU
    return sum(1 for ev in events if ev.name == "phase::acceptance" and ev.device_type == cpu)


def busy_ms(events) -> float:
    """Total time the GPU ran kernels: each kernel once, through the CPU event that launched it (device-side
    annotation ranges are spans, not kernels, and are left out)."""
    cpu = torch.autograd.DeviceType.CPU
    return sum(k.duration for ev in events if ev.device_type == cpu for k in ev.kernels) / 1000.0


def profile_recipe(source: str | Path | Recipe, out_dir: Path, overrides: list[str] | None = None):
    recipe = load_recipe(source, overrides)
    recipe = recipe.model_copy(update={"compile": False, "cuda_graphs": False})
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = recipe.model.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    execute(recipe)  # warm-up, not profiled
    with profile(activities=activities) as prof:
        results, summary = execute(recipe)
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    times = phase_times(events, cuda)
    steps = max(decode_steps(events), 1)
    blocks = max(sum(r.blocks for r in results), 1)
    decode_ms = summary.wall_s * 1000.0  # the whole generate: prefill included, so it is a row of its own
    rows = [(p, t) for p, t in times.items() if t > 0]
    labelled = sum(t for _, t in rows)
    if cuda:
        gpu_busy = busy_ms(events)
        rows.append(("other kernels (norms, rope, embed)", max(gpu_busy - labelled, 0.0)))
        rows.append(("host gaps (GPU idle)", max(decode_ms - gpu_busy, 0.0)))
    else:
        rows.append(("other (norms, rope, embed, host)", max(decode_ms - labelled, 0.0)))
    table = [PhaseRow(p, t, t / steps, t / blocks, t / decode_ms if decode_ms else 0.0) for p, t in rows]
    ops = top_ops(prof, cuda)
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    report = {"summary": summary.__dict__, "steps": steps, "blocks": blocks, "decode_ms": decode_ms,
              "prefill_ms": times["prefill"], "phases": [r.__dict__ for r in table], "trace": str(trace),
              "top_kernels" if cuda else "top_cpu_ops": ops}
    (out_dir / "profile.json").write_text(json.dumps(report, indent=2) + "\n")
    chart = write_chart(table, summary, out_dir / "profile.png")
    return table, summary, chart, ops


def write_chart(table: list[PhaseRow], summary: Summary, path: Path) -> Path | None:
    """A horizontal bar chart of per-step milliseconds by phase (None when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(table) + 1.4))
    bars = ax.barh([r.phase for r in table][::-1], [r.per_step_ms for r in table][::-1], color="#4477aa")
    ax.bar_label(bars, fmt="%.2f", padding=3, fontsize=8)
    ax.margins(x=0.15)
    ax.set_xlabel("ms per step")
    ax.set_title(f"{summary.model} · {summary.policy} · {summary.device}\nwhere a step's time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
