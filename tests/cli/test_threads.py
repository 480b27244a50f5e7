"""CPU threads (compiledllm/threads.py): the `threads` recipe key and --threads, the default from the idle cores."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from typer.testing import CliRunner

from compiledllm import threads
from compiledllm.cli import app
from compiledllm.threads import default_threads, set_threads
from user_errors import assert_user_error

runner = CliRunner()


@pytest.fixture(autouse=True)
def keep_threads(monkeypatch):
    """torch's count and the policy's own record (threads.py) as they were; no OMP_NUM_THREADS from the caller."""
    before = torch.get_num_threads()
    for k in threads.ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    for k in ("_baseline", "_mine", "_pinned"):
        monkeypatch.setattr(threads, k, getattr(threads, k))
    yield
    torch.set_num_threads(before)


def recipe(tmp_path, **keys):
    data = {"model": {"path": "tiny-llada2"}, "policy": {"name": "threshold", "block_size": 32},
            "generation": {"max_new_tokens": 8}, "prompts": [{"text": "def f(x):\n    return"}],
            "output": str(tmp_path / "out.jsonl")} | keys
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    return str(tmp_path / "r.yaml")


def test_default_counts_the_cores_other_work_leaves_free(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(threads, "_baseline", 8)
    for busy, want in [(0.0, 8), (2.6, 5), (7.0, 1), (30.0, 1)]:
        monkeypatch.setattr(threads, "busy_cores", lambda busy=busy: busy)
        assert default_threads() == want
    monkeypatch.setattr(threads, "_baseline", 4)  # never above torch's own count as first seen (its default)
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)
    torch.set_num_threads(4)
    monkeypatch.setattr(threads, "_mine", None)
    assert default_threads() == 4 and set_threads(None) == 4 and set_threads(3) == 3 == torch.get_num_threads()


def test_busy_cores_sees_processes_running_beside_it():
    idle = threads.busy_cores()
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        import time

        time.sleep(0.5)
        assert threads.busy_cores() >= idle + 2  # instantaneous: no minute-long average to wait for
    finally:
        for p in procs:
            p.kill()


def test_threads_key_and_flag_set_the_run_and_are_reported(tmp_path):
    res = runner.invoke(app, ["run", recipe(tmp_path, threads=1)])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out.summary.json").read_text())["threads"] == 1 and "cpu · 1 thread " in res.output
    res = runner.invoke(app, ["run", recipe(tmp_path, threads=1), "--threads", "2"])  # the flag wins
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out.summary.json").read_text())["threads"] == 2 and "cpu · 2 threads" in res.output


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "true"])
def test_bad_threads_are_one_line_errors(tmp_path, value):
    assert_user_error(runner.invoke(app, ["run", recipe(tmp_path), "--set", f"threads={value}"]), "threads")


def test_the_cli_default_follows_the_load_and_the_flag_pins(tmp_path, monkeypatch):
    """No --threads: the default (1 of 2 cores busy: 1 thread) and the re-check (faked readings: the load leaves,
    two checks later the run takes 2); --threads 2 under the same load: 2, no re-check."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_baseline", 2)
    monkeypatch.setattr(threads, "_mine", None)
    monkeypatch.setattr(threads, "_pinned", None)
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    monkeypatch.setattr(threads, "CHECK_S", 0.0)
    clock = iter(range(1, 10**6))
    monkeypatch.setattr(threads, "machine_reading", lambda: (float(next(clock)), 0.0, 0.0))  # nothing else busy
    res = runner.invoke(app, ["run", recipe(tmp_path, generation={"max_new_tokens": 64})])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out.summary.json").read_text())["threads"] == 2  # 1 at the start, then 2
    monkeypatch.setattr(threads, "machine_reading", lambda: (float(next(clock)), 0.0, 0.0))
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "_mine", None)
    monkeypatch.setattr(threads, "CHECK_S", 1e9)  # no re-check: the start's decision stays
    res = runner.invoke(app, ["run", recipe(tmp_path)])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out.summary.json").read_text())["threads"] == 1 and "cpu · 1 thread " in res.output
    monkeypatch.setattr(threads, "CHECK_S", 0.0)
    res = runner.invoke(app, ["run", recipe(tmp_path), "--threads", "2"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out.summary.json").read_text())["threads"] == 2
