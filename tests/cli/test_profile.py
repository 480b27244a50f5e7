"""`compiledllm profile`: the mode it states, its one step count (the engine's decode forwards), a bounded gzipped
trace, no tracer noise, and each CUDA kernel counted once."""
from __future__ import annotations

import gzip
import json

import pytest
import yaml
from typer.testing import CliRunner

from compiledllm.cli import app

runner = CliRunner()
RECIPE = {"model": {"path": "tiny-llada2-random"},
          "policy": {"name": "threshold", "block_size": 8, "threshold": 0.9},
          "generation": {"max_new_tokens": 12},
          "prompts": [{"ids": [3, 4, 5]}, {"ids": list(range(10, 30))}], "batch_size": 2}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One profile run (recording 3 steps) and the number of decode forwards the engine ran meanwhile, counted
    independently of the profiler: calls of run_phase while the phase clock runs (the warm-up is not counted)."""
    import compiledllm.engine.stepper as stepper
    from compiledllm import profiling

    tmp = tmp_path_factory.mktemp("profile")
    path = tmp / "r.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    forwards = []
    real = stepper.run_phase

    def counted(*args, **kwargs):
        if profiling._clock is not None:
            forwards.append(args[2])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stepper, "run_phase", counted)
        res = runner.invoke(app, ["profile", str(path), "--out", str(tmp / "prof"), "--record-steps", "3"])
    assert res.exit_code == 0, res.output
    return res, tmp / "prof", len(forwards)


def test_profile_writes_report_chart_and_states_its_mode(profiled):
    res, out, _ = profiled
    report = json.loads((out / "profile.json").read_text())
    assert report["mode"] == "eager, profiled" and "eager, profiled" in res.output
    phases = {r["phase"]: r for r in report["phases"]}
    assert {"attention", "moe", "mlp", "projections", "head", "acceptance", "prefill"} <= set(phases)
    assert all(r["total_ms"] >= 0 for r in phases.values()) and phases["attention"]["total_ms"] > 0
    assert phases["prefill"]["per_step_ms"] is None  # a run total: prefill runs at admission, not per step
    totals = [r["total_ms"] for r in report["phases"]]
    assert totals == sorted(totals, reverse=True)
    assert sum(r["share"] for r in report["phases"]) == pytest.approx(1.0, abs=0.02)  # shares of the wall time
    ops = report["top_cpu_ops"]
    assert ops and all(a["total_ms"] >= b["total_ms"] > 0 for a, b in zip(ops, ops[1:]))
    assert any(o["name"] in ("aten::mm", "aten::addmm") for o in ops)
    assert (out / "profile.png").read_bytes()[:4] == b"\x89PNG"


def test_one_step_count_the_engines_forwards(profiled):
    res, out, forwards = profiled
    report = json.loads((out / "profile.json").read_text())
    assert report["steps"] == forwards > 3
    assert forwards < report["summary"]["forwards"]  # the per-request count (each slot's forwards) is another
    for r in report["phases"]:
        if r["per_step_ms"] is not None:
            assert r["per_step_ms"] == pytest.approx(r["total_ms"] / forwards)
    assert f"{forwards} steps" in " ".join(res.output.split())  # the table's title
    assert f"{report['summary']['forwards']} steps" not in " ".join(res.output.split())
    # one word across commands: `forwards` is what `run` counts (per request), shown beside the engine's steps
    assert f"{forwards} steps ({report['summary']['forwards']} forwards, as run counts them)" in " ".join(
        res.output.split())
    assert report["forwards"] == report["summary"]["forwards"] and "compiledllm run" in report["forwards_are"]
    assert "engine steps" in report["steps_are"]


def test_trace_is_gzipped_bounded_to_the_recorded_steps_and_quiet(profiled):
    res, out, forwards = profiled
    assert not (out / "trace.json").exists()
    trace = json.loads(gzip.decompress((out / "trace.json.gz").read_bytes()))
    events = trace["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 3 < forwards  # skip one, warm up one, record 3: not the whole run
    assert sum(e.get("name") == "phase::acceptance" for e in events) == 3
    assert (out / "trace.json.gz").stat().st_size < 2_000_000
    assert json.loads((out / "profile.json").read_text())["recorded_steps"] == 3
    for noise in ("profiler_start", "profiler_stop", "USDT", "Warning"):
        assert noise not in res.output


def test_profile_attributes_each_cuda_kernel_once():
    """On CUDA a labelled range also shows up as a device-side annotation spanning its kernels' GPU wall time:
    only the CPU range counts, and busy time counts each kernel once (synthetic profiler events)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from compiledllm.profiler import busy_ms, phase_times

    def event(i, name, start, end, device=DeviceType.CPU):
        return FunctionEvent(id=i, name=name, thread=0, start_us=start, end_us=end, use_device="cuda",
                             device_type=device)

    attn, inner = event(1, "phase::attention", 0, 100), event(2, "aten::mm", 10, 20)
    inner.append_kernel("gemm", 0, 30.0)
    attn.append_kernel("attn_kernel", 0, 50.0)
    inner.set_cpu_parent(attn)
    attn.append_cpu_child(inner)
    loose = event(3, "aten::add", 120, 130)
    loose.append_kernel("add", 0, 5.0)
    span = event(4, "phase::attention", 0, 400, DeviceType.CUDA)  # the GPU-side annotation: a 400 us span
    events = [attn, inner, loose, span]
    assert phase_times(events, cuda=True)["attention"] == pytest.approx(0.080)
    assert busy_ms(events) == pytest.approx(0.085)


def test_the_phase_clock_counts_outermost_ranges_and_steps():
    import time

    import torch

    from compiledllm.profiling import PhaseClock, phase

    seen = []
    with PhaseClock(torch.device("cpu"), on_forward=lambda: seen.append(1)) as clock:
        with phase("prefill"):
            with phase("attention"):  # inside prefill: prefill's time, not attention's
                time.sleep(0.01)
        for _ in range(2):
            with phase("acceptance"):
                pass
    totals = clock.totals()
    assert totals["prefill"] >= 10 and totals["attention"] == 0
    assert clock.forwards == 2 == len(seen)
    with phase("attention"):  # no clock: only the profiler's range
        pass


def test_profile_forwards_are_run_forwards(profiled, tmp_path):
    # the same recipe through `run`: its summary's forwards are the number the profile shows as forwards
    res, out, _ = profiled
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(RECIPE | {"output": str(tmp_path / "out.jsonl")}))
    ran = runner.invoke(app, ["run", str(path)])
    assert ran.exit_code == 0, ran.output
    run_forwards = json.loads((tmp_path / "out.summary.json").read_text())["forwards"]
    assert json.loads((out / "profile.json").read_text())["forwards"] == run_forwards
    assert f"({run_forwards} forwards, as run counts them)" in " ".join(res.output.split())
