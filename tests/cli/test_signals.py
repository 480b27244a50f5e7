"""SIGINT and SIGTERM during run, eval and bench (issue 33 item 1): the command stops, keeps every finished result
(marked partial), prints one line saying what it kept and where, and exits 130 / 143; a second signal exits at once
and leaves the files in place as they were. The CLI runs as a subprocess on the built-in tiny models and is
signalled once some results are finished."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from compiledllm import signals

ROOT = Path(__file__).resolve().parents[2]
EARLIER = "earlier results\n"
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
SAID = {signal.SIGINT: "interrupted: ", signal.SIGTERM: "interrupted by SIGTERM: "}


def start(tmp_path: Path, *args) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                        "OMP_NUM_THREADS": "1", "COLUMNS": "400", "HF_HUB_OFFLINE": "1"}
    with open(tmp_path / "stderr.txt", "w") as err:  # a file, so that a test can wait for a log line in it
        return subprocess.Popen([sys.executable, "-m", "compiledllm", *map(str, args)], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)


def wait_for(proc: subprocess.Popen, ready, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"ended before it was signalled: {proc.returncode}\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "nothing finished in time"
        time.sleep(0.02)


def stop(proc: subprocess.Popen, tmp_path: Path, sig: int) -> list[str]:
    """Send `sig`; the exit code is the signal's, and stderr (other than log lines) one line, no traceback."""
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    err = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in out + err, err
    assert proc.returncode == CODES[sig], (proc.returncode, err)
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("INFO ")]


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def hidden(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".lock")))


def finished_lines(tmp_path: Path, name: str) -> int:
    """Results `run` has written so far to its temporary file (hidden until the run ends)."""
    return sum(len(p.read_text().splitlines()) for p in tmp_path.glob(f".{name}.*.tmp"))


PROMPTS = [{"text": f"def f{i}(a, b):"} for i in range(60)]  # far more than are decoded before the signal


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_keeps_the_finished_results_and_a_partial_summary(tmp_path, sig):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (tmp_path / "out.jsonl").write_text(EARLIER)
    proc = start(tmp_path, "run", "tiny-llada2", "--prompts", "p.jsonl", "--set", "generation.max_new_tokens=8",
                 "--set", "batch_size=1", "-o", "out.jsonl")
    wait_for(proc, lambda: finished_lines(tmp_path, "out.jsonl") >= 1)
    (line,) = stop(proc, tmp_path, sig)
    kept = lines_of(tmp_path / "out.partial.jsonl")
    assert len(kept) >= 1 and [r["index"] for r in kept] == sorted(r["index"] for r in kept)
    assert line == (f"{SAID[sig]}kept {len(kept)} finished results in out.partial.jsonl (summary: "
                    "out.partial.summary.json); out.jsonl is unchanged")
    summary = json.loads((tmp_path / "out.partial.summary.json").read_text())
    assert summary["interrupted"] is True and summary["signal"] == signal.Signals(sig).name
    assert summary["prompts"] == len(kept) and summary["prompts_given"] == len(PROMPTS)
    assert (tmp_path / "out.jsonl").read_text() == EARLIER and not (tmp_path / "out.summary.json").exists()
    assert hidden(tmp_path) == []


def test_eval_sigterm_keeps_the_finished_policy_runs(tmp_path):
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt_ids": [5 + i % 50, 6, 7], "reference_ids": [9, 10]})
                                              + "\n" for i in range(16)))
    recipe = {"model": {"path": "tiny-llada2-random"}, "tasks": ["t.jsonl"], "max_new_tokens": 64, "batch_size": 4,
              "policies": [{"label": "fast", "name": "threshold", "block_size": 32, "threshold": 0.01},
                           {"label": "slow", "name": "threshold", "block_size": 32, "threshold": 1.0}],
              "output": "report.json"}
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "report.json").write_text(EARLIER)
    proc = start(tmp_path, "--log-level", "info", "eval", "e.yaml")
    wait_for(proc, lambda: "fast: 16 tasks" in (tmp_path / "stderr.txt").read_text())  # the first one finished
    (line,) = stop(proc, tmp_path, signal.SIGTERM)
    assert line == ("interrupted by SIGTERM: kept the 1 finished policy run in report.partial.json; report.json is "
                    "unchanged")
    partial = json.loads((tmp_path / "report.partial.json").read_text())
    assert partial["interrupted"] is True and partial["signal"] == "SIGTERM"
    assert list(partial["files"]["t.jsonl"]["policies"]) == ["fast"]
    assert (tmp_path / "report.json").read_text() == EARLIER and not (tmp_path / "report.png").exists()
    assert hidden(tmp_path) == []


def test_bench_sigint_keeps_the_finished_points(tmp_path):
    recipe = {"model": {"path": "tiny-llada2-random"}, "policy": {"name": "threshold", "block_size": 8},
              "generation": {"max_new_tokens": 8}, "prompts": [{"ids": [1]}], "batch_size": 1}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "b.json").write_text(EARLIER)
    lengths = ",".join(str(16 * i) for i in range(1, 40))  # 39 points; each a fraction of a second
    proc = start(tmp_path, "bench", "b.yaml", "--prompt-len", lengths, "--output-len", "32", "--out", "b.json")
    wait_for(proc, lambda: (tmp_path / "b.partial.json").exists())  # kept after each point
    (line,) = stop(proc, tmp_path, signal.SIGINT)
    partial = json.loads((tmp_path / "b.partial.json").read_text())
    n = len(partial["points"])
    assert 1 <= n < 39 and all("error" not in p for p in partial["points"])
    assert partial["interrupted"] is True and partial["signal"] == "SIGINT"
    assert line == f"interrupted: kept the {n} finished point{'s' * (n != 1)} in b.partial.json; b.json is unchanged"
    assert (tmp_path / "b.json").read_text() == EARLIER and hidden(tmp_path) == []


def test_signals_after_the_first_exit_at_once_and_leave_the_files_in_place(tmp_path):
    # SIGTERM then more, as fast as they can be sent: whichever of them lands during the first one's handling exits
    # at once; the earlier results stay, no temporary is left, and a kept file (if any) is whole
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (tmp_path / "out.jsonl").write_text(EARLIER)
    proc = start(tmp_path, "run", "tiny-llada2", "--prompts", "p.jsonl", "--set", "generation.max_new_tokens=8",
                 "--set", "batch_size=1", "-o", "out.jsonl")
    wait_for(proc, lambda: finished_lines(tmp_path, "out.jsonl") >= 1)
    while proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.0005)
    proc.communicate(timeout=60)
    err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 143 and "Traceback" not in err, (proc.returncode, err)
    assert (tmp_path / "out.jsonl").read_text() == EARLIER and hidden(tmp_path) == []
    if (tmp_path / "out.partial.jsonl").exists():
        assert lines_of(tmp_path / "out.partial.jsonl")
        assert json.loads((tmp_path / "out.partial.summary.json").read_text())["interrupted"] is True


SECOND = """
import os, signal, sys, time
from pathlib import Path
from compiledllm import signals

tmp = Path(sys.argv[1])
tmp.write_text("half")
with signals.stop_on_signals(), signals.on_exit_now(lambda: tmp.unlink()):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    except signals.Stopped:
        print("stopping", flush=True)  # keeping what finished, when the second one comes
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
print("not reached")
"""


def test_a_second_signal_exits_at_once_removing_the_temporaries():
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f".second-signal-{os.getpid()}.tmp"
    res = subprocess.run([sys.executable, "-c", SECOND, str(tmp)], capture_output=True, text=True, timeout=30,
                         env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert res.returncode == 130 and res.stdout == "stopping\n", (res.returncode, res.stdout, res.stderr)
    assert res.stderr == "stopped at once by a second signal (SIGINT); files already in place are as they were\n"
    assert not tmp.exists()


# --- the policy itself, in this process ------------------------------------------------------------------------------

def test_a_signal_inside_a_shielded_section_waits_for_its_end():
    before = signal.getsignal(signal.SIGTERM)
    with signals.stop_on_signals():
        done = []
        with pytest.raises(signals.Stopped) as stopped:
            with signals.shielded():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler has run by now: it waits
                done.append("recorded")
        assert done == ["recorded"] and stopped.value.signum == signal.SIGTERM
        assert isinstance(stopped.value, KeyboardInterrupt)  # what keeps finished work on Ctrl-C handles it too
        assert signals.received() == signal.SIGTERM and signals.exit_code() == 143
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handlers are back
    assert signals.received() == signal.SIGINT  # outside: a KeyboardInterrupt is Ctrl-C


def test_after_finishing_a_signal_lets_the_command_finish():
    with signals.stop_on_signals():
        signals.finishing()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # no Stopped: the outputs are being written
        assert signals.received() == signal.SIGTERM


@pytest.mark.parametrize("command,unit,out", [("run", "result", "out.jsonl"), ("eval", "policy", "report.json"),
                                              ("bench", "point", "b.json")])
def test_a_signal_before_anything_finished_writes_nothing(tmp_path, monkeypatch, command, unit, out):
    # SIGTERM while the model loads (in this process: CliRunner); an earlier run's partial file stays as it was
    from typer.testing import CliRunner

    import compiledllm.runner
    from compiledllm.cli import app

    def loading(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in here
        raise AssertionError("not stopped")

    monkeypatch.setattr(compiledllm.runner, "load_from_spec", loading)
    monkeypatch.chdir(tmp_path)
    model, policy = {"path": "tiny-llada2-random"}, {"name": "threshold", "block_size": 8}
    recipe = {"run": {"model": model, "policy": policy, "prompts": [{"ids": [3, 4]}], "output": out},
              "eval": {"model": model, "tasks": ["t.jsonl"], "policies": [policy], "output": out},
              "bench": {"model": model, "policy": policy, "prompts": [{"ids": [1]}]}}[command]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "t.jsonl").write_text('{"prompt_ids": [5, 6], "reference_ids": [9]}\n')
    stem, suffix = out.split(".")
    files = {tmp_path / name: EARLIER for name in (out, f"{stem}.partial.{suffix}")}
    for path, text in files.items():
        path.write_text(text)
    res = CliRunner().invoke(app, [command, "r.yaml", *(["--out", out] if command == "bench" else [])])
    assert res.exit_code == 143, res.output
    assert res.output.strip() == (f"interrupted by SIGTERM: no {unit} had finished; nothing was written ({out} is "
                                  "unchanged)")
    assert all(p.read_text() == t for p, t in files.items()) and hidden(tmp_path) == []
