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
def keep_threads():
    before = torch.get_num_threads()
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
    torch.set_num_threads(8)
    for busy, want in [(0.0, 8), (2.6, 5), (7.0, 1), (30.0, 1)]:
        monkeypatch.setattr(threads, "busy_cores", lambda busy=busy: busy)
        assert default_threads() == want
    torch.set_num_threads(4)  # never above torch's own default (physical cores)
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)
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
