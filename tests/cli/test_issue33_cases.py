"""Issue #33 ("Nothing lost, second pass"): the cases the issue lists that the other tests of it (test_signals.py,
test_output_collisions.py, test_hostile_inputs.py, test_config_bounds.py, test_trust_links.py,
tests/parallel/test_torchrun_env.py) leave out or only reach part of the way: SIGINT during eval, a second SIGINT
while eval / bench keep what finished, nesting 100,000 deep, 10^15 positions in a random config, export on a full
disk and under a 300-character name, two real evals on one report, a failed bench's error on stderr, an exported
engine's mask_token_id. Each ends as the issue asks: its exit code, one line on stderr naming the file / key / value,
no traceback, nothing left behind, earlier results intact."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import compiledllm
from compiledllm.cli import app
from compiledllm.errors import UserError
from compiledllm.export.runtime import EXPORT_FILE, FORMAT, WEIGHTS_FILE
from compiledllm.models.presets import TINY_LLADA2
from user_errors import assert_user_error

ROOT = Path(compiledllm.__file__).resolve().parents[1]
EARLIER = "earlier results\n"
runner = CliRunner()
POLICY = {"name": "threshold", "block_size": 8}


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", "COLUMNS": "400", "HF_HUB_OFFLINE": "1"}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".lock")))


def write(path: Path, data: dict | str) -> Path:
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return path


# ---- signals: SIGINT during eval; a second SIGINT while eval / bench keep what finished ------------------------

def start(tmp_path: Path, *args, script: str | None = None) -> subprocess.Popen:
    head = ["-c", script] if script else ["-m", "compiledllm"]
    with open(tmp_path / "stderr.txt", "w") as err:
        return subprocess.Popen([sys.executable, *head, *map(str, args)], cwd=tmp_path, env=env(),
                                stdout=subprocess.PIPE, stderr=err, text=True)


def wait_for(proc: subprocess.Popen, ready, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"ended before it was signalled: {proc.returncode}\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "nothing finished in time"
        time.sleep(0.02)


def ended(proc: subprocess.Popen, tmp_path: Path) -> list[str]:
    """The exit code is checked by the caller; stderr (log lines left out) must hold no traceback."""
    out, _ = proc.communicate(timeout=60)
    err = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in out + err, err
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("INFO ")]


def slow_eval(tmp_path: Path) -> Path:
    """Two policies over 16 tasks: the first ends quickly ("fast: 16 tasks" logged at info), the second decodes
    one token per step, long enough to be signalled in."""
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt_ids": [5 + i % 50, 6, 7], "reference_ids": [9, 10]})
                                              + "\n" for i in range(16)))
    recipe = {"model": {"path": "tiny-llada2-random"}, "tasks": ["t.jsonl"], "max_new_tokens": 64, "batch_size": 4,
              "policies": [{"label": "fast", "name": "threshold", "block_size": 32, "threshold": 0.01},
                           {"label": "slow", "name": "threshold", "block_size": 32, "threshold": 1.0}],
              "output": "report.json"}
    return write(tmp_path / "e.yaml", recipe)


def test_eval_sigint_keeps_the_finished_policy_runs_and_exits_130(tmp_path):
    """The issue: SIGINT during `eval` exited 130 without a word."""
    slow_eval(tmp_path)
    (tmp_path / "report.json").write_text(EARLIER)
    proc = start(tmp_path, "--log-level", "info", "eval", "e.yaml")
    wait_for(proc, lambda: "fast: 16 tasks" in (tmp_path / "stderr.txt").read_text())
    proc.send_signal(signal.SIGINT)
    lines = ended(proc, tmp_path)
    assert proc.returncode == 130, (proc.returncode, lines)
    assert lines == ["interrupted: kept the 1 finished policy run in report.partial.json; report.json is unchanged"]
    partial = json.loads((tmp_path / "report.partial.json").read_text())
    assert partial["interrupted"] is True and partial["signal"] == "SIGINT"
    assert list(partial["files"]["t.jsonl"]["policies"]) == ["fast"]
    assert (tmp_path / "report.json").read_text() == EARLIER and leftovers(tmp_path) == []


# The CLI, with the temporary of every file written after a first stop signal (the kept report) followed by a second
# SIGINT before its rename: deterministically the moment the "a second SIGINT exits -2" was about.
SECOND_SIGINT = """
import os, signal, sys, time
from compiledllm import outputs, signals

real = outputs._write

def _write(tmp, content):
    real(tmp, content)
    if signals._state.signum is not None:  # keeping what finished, after the first signal
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        raise AssertionError("the second SIGINT did not stop the command")

outputs._write = _write
from compiledllm.cli import app
app(sys.argv[1:], prog_name="compiledllm")
"""


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_a_second_sigint_while_keeping_exits_130_at_once_leaving_the_files(tmp_path, command):
    if command == "eval":
        slow_eval(tmp_path)
        earlier, kept = tmp_path / "report.json", tmp_path / "report.partial.json"
        earlier.write_text(EARLIER)
        proc = start(tmp_path, "--log-level", "info", "eval", "e.yaml", script=SECOND_SIGINT)
        wait_for(proc, lambda: "fast: 16 tasks" in (tmp_path / "stderr.txt").read_text())
    else:
        write(tmp_path / "b.yaml", {"model": {"path": "tiny-llada2-random"}, "policy": POLICY,
                                    "generation": {"max_new_tokens": 8}, "prompts": [{"ids": [1]}], "batch_size": 1})
        earlier, kept = tmp_path / "b.json", tmp_path / "b.partial.json"
        earlier.write_text(EARLIER)
        lengths = ",".join(str(16 * i) for i in range(1, 40))
        proc = start(tmp_path, "bench", "b.yaml", "--prompt-len", lengths, "--output-len", "32", "--out", "b.json",
                     script=SECOND_SIGINT)
        wait_for(proc, lambda: kept.exists())  # the points so far, kept after each
    proc.send_signal(signal.SIGINT)
    lines = ended(proc, tmp_path)
    assert proc.returncode == 130, (proc.returncode, lines)  # not -2: the second SIGINT is handled too
    assert lines == ["stopped at once by a second signal (SIGINT); files already in place are as they were"]
    assert earlier.read_text() == EARLIER and leftovers(tmp_path) == []  # the temporary and the locks removed
    if command == "eval":
        assert not kept.exists()  # the kept report was not yet in place
    else:  # the one kept after the last point stays as it was: whole, not marked interrupted
        report = json.loads(kept.read_text())
        assert report["points"] and "interrupted" not in report


# ---- resource bombs: nesting 100,000 deep; 10^15 positions in a random config -----------------------------------

DEEPEST = "[" * 100_000 + "]" * 100_000  # the top of the range (in-process: no 128 KiB argument limit)
RUN = {"model": {"path": "tiny-llada2-random"}, "policy": POLICY, "generation": {"max_new_tokens": 4},
       "prompts": [{"ids": [3, 4, 5]}], "batch_size": 1, "output": None}


def raw(base: dict, key: str, text: str) -> str:
    return yaml.safe_dump({**base, key: "@@"}).replace("'@@'", text)


@pytest.mark.parametrize("where", ["recipe", "--set", "prompts file", "task file"])
def test_nesting_100000_deep_is_one_line(tmp_path, where):
    r = tmp_path / "r.yaml"
    if where == "recipe":
        write(r, raw(RUN, "prompts", DEEPEST))
        args, needles = ["run", r], ("r.yaml", "prompts.0.0")
    elif where == "--set":
        args, needles = ["run", write(r, RUN), "--set", f"prompts={DEEPEST}"], ("--set prompts=[[[",)
    elif where == "prompts file":
        (tmp_path / "p.jsonl").write_text('{"ids": [3]}\n' + DEEPEST + "\n")
        args, needles = ["run", "tiny-llada2", "--prompts", tmp_path / "p.jsonl"], ("p.jsonl:2",)
    else:
        (tmp_path / "t.jsonl").write_text('{"prompt_ids": [3, 4], "reference_ids": [5]}\n' + DEEPEST + "\n")
        e = write(tmp_path / "e.yaml", {"model": {"path": "tiny-llada2-random"}, "tasks": ["t.jsonl"],
                                        "policies": [POLICY], "max_new_tokens": 4, "output": None})
        args, needles = ["eval", e], ("t.jsonl:2",)
    assert_user_error(runner.invoke(app, list(map(str, args))), *needles, "nested deeper than 64 levels")


def test_a_yaml_alias_bomb_in_an_eval_recipe_through_recipe_show(tmp_path):
    bomb = "{a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol], " + ", ".join(
        f"{k}: &{k} [{', '.join([f'*{p}'] * 9)}]" for p, k in zip("abcdefgh", "bcdefghi")) + "}"
    e = write(tmp_path / "e.yaml", raw({"model": {"path": "tiny-llada2-random"}, "tasks": ["t.jsonl"],
                                        "policies": [POLICY], "output": None}, "lol", bomb))
    t0 = time.perf_counter()
    assert_user_error(runner.invoke(app, ["recipe", "show", str(e)]), "e.yaml", "aliases expand the document by")
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("how", ["inline config", "--set"])
def test_a_random_config_with_1e15_positions_is_refused(tmp_path, how):
    """The issue: max_position_embeddings 10^15 was accepted in a random config (as in a checkpoint's, which
    test_config_bounds.py covers through the CLI)."""
    config = dict(TINY_LLADA2, **({"max_position_embeddings": 10 ** 15} if how == "inline config" else {}))
    r = write(tmp_path / "r.yaml", {**RUN, "model": {"init": "random", "config": config}})
    extra = ["--set", f"model.config.max_position_embeddings={10 ** 15}"] if how == "--set" else []
    t0 = time.perf_counter()
    res = runner.invoke(app, ["run", str(r), *extra])
    assert_user_error(res, "model.config", "max_position_embeddings", "1000000000000000", "<= 16777216")
    assert time.perf_counter() - t0 < 10


def test_a_task_file_linked_to_dev_zero_is_refused_at_once(tmp_path):
    """The issue: a MemoryError traceback after 34 s (the CLI's case is test_hostile_inputs.py's; here the time)."""
    from compiledllm.evaluate import load_tasks

    (tmp_path / "t.jsonl").symlink_to("/dev/zero")
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="t.jsonl.*is a character device, not a regular file"):
        load_tasks(tmp_path / "t.jsonl")
    assert time.perf_counter() - t0 < 1


# ---- filesystem limits: export on a full disk; 300-character names for export and profile -------------------------

EXPORT_RECIPE = {"model": {"path": "tiny-llada2-random"}, "policy": POLICY, "generation": {"max_new_tokens": 4},
                 "prompts": [{"ids": [1, 2]}], "batch_size": 2, "buckets": [2]}


def fake_compiler(monkeypatch, fail_at: int | None = None) -> None:
    """AOTInductor's packaging stands in by a file (compiling takes a minute on the CPU); the `fail_at`-th package
    fills the disk half-way."""
    calls = []

    def package(program, package_path, **kw):
        calls.append(package_path)
        Path(package_path).write_bytes(b"PK new package"[: 7 if len(calls) == fail_at else None])
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return package_path

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", package)


def earlier_export(out: Path) -> dict[Path, bytes]:
    """An earlier export's files (one bucket the new export does not have), to check that a failure keeps them."""
    out.mkdir()
    for name, data in ((EXPORT_FILE, b'{"earlier": true}\n'), ("step_b1.pt2", b"PK earlier 1"),
                       ("step_b4.pt2", b"PK earlier 4"), (WEIGHTS_FILE, b"earlier weights")):
        (out / name).write_bytes(data)
    return {p: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("before, fills", [("earlier export", "first package"), ("earlier export", "second package"),
                                           ("earlier export", "weights"), ("earlier export", "metadata"),
                                           ("nothing", "second package")])
def test_export_on_a_full_disk(tmp_path, monkeypatch, fills, before):
    import safetensors.torch

    out = tmp_path / "exp"
    files = earlier_export(out) if before == "earlier export" else {}
    fake_compiler(monkeypatch, {"first package": 1, "second package": 2}.get(fills))
    if fills == "weights":
        def save_file(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    if fills == "metadata":
        real = Path.write_text

        def write_text(self, data, *args, **kw):
            if self.name == EXPORT_FILE:
                real(self, data[:10])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(self, data, *args, **kw)
        monkeypatch.setattr(Path, "write_text", write_text)
    recipe = write(tmp_path / "r.yaml", EXPORT_RECIPE)
    res = runner.invoke(app, ["export", str(recipe), "--out", str(out)])
    assert_user_error(res, "--out", str(out), "No space left on device")
    assert leftovers(tmp_path) == []  # the temporary folder is gone
    if files:
        assert {p: p.read_bytes() for p in out.iterdir()} == files  # the earlier export, whole
    else:
        assert not out.exists()


def test_an_export_replaces_an_earlier_one_whole(tmp_path, monkeypatch):
    out = tmp_path / "exp"
    earlier_export(out)
    (out / "NOTES.txt").write_text("mine\n")  # not the export's: stays
    fake_compiler(monkeypatch)
    res = runner.invoke(app, ["export", str(write(tmp_path / "r.yaml", EXPORT_RECIPE)), "--out", str(out)])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / EXPORT_FILE).read_text())
    assert meta["buckets"] == [1, 2] and meta["files"] == {"1": "step_b1.pt2", "2": "step_b2.pt2"}
    assert (out / "step_b1.pt2").read_bytes() == (out / "step_b2.pt2").read_bytes() == b"PK new package"
    assert not (out / "step_b4.pt2").exists()  # the earlier export's other bucket does not linger
    assert (out / WEIGHTS_FILE).read_bytes() != b"earlier weights" and (out / "NOTES.txt").read_text() == "mine\n"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("command", ["export", "profile"])
def test_a_300_character_folder_name_is_one_line(tmp_path, command):
    """The issue's 300-character output name, for the commands that write a folder (run, eval and bench:
    test_output_collisions.py). It was an OSError traceback from the first look at the folder."""
    recipe = write(tmp_path / "r.yaml", EXPORT_RECIPE)
    out = tmp_path / ("x" * 300)
    res = runner.invoke(app, [command, str(recipe), "--out", str(out)])
    assert_user_error(res, "--out", "is 300 bytes, longer than the", "this filesystem allows")
    assert res.stderr.startswith("error:") and not res.stdout.strip()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


# ---- outputs that collide: two real evals on one report --------------------------------------------------------

# An eval whose work waits for the file "go": the test starts a second eval on the same report meanwhile.
HELD_EVAL = """
import sys, time
from pathlib import Path
import compiledllm.evaluate as evaluate

real = evaluate.run_eval

def run_eval(*args, **kwargs):
    Path("waiting").touch()
    while not Path("go").exists():
        time.sleep(0.02)
    return real(*args, **kwargs)

evaluate.run_eval = run_eval
from compiledllm.cli import app
app(sys.argv[1:], prog_name="compiledllm")
"""


def test_two_evals_on_one_report_the_second_is_refused_and_the_first_report_is_whole(tmp_path, monkeypatch):
    """The issue: both reported "wrote" and one report was lost."""
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"prompt_ids": [5 + i, 6, 7], "reference_ids": [9, 10]})
                                              + "\n" for i in range(2)))
    e = write(tmp_path / "e.yaml", {"model": {"path": "tiny-llada2-random"}, "tasks": ["t.jsonl"],
                                    "policies": [POLICY], "max_new_tokens": 4, "output": "report.json"})
    (tmp_path / "report.json").write_text(EARLIER)
    first = start(tmp_path, "eval", "e.yaml", script=HELD_EVAL)
    wait_for(first, lambda: (tmp_path / "waiting").exists())  # it holds the report's locks now
    try:
        monkeypatch.chdir(tmp_path)  # the recipe's output, report.json, is the first one's
        second = runner.invoke(app, ["eval", str(e)])
        assert_user_error(second, "eval output", "report.json", "is being written by another run",
                          ".report.json.lock")
        assert "wrote" not in second.output and (tmp_path / "report.json").read_text() == EARLIER
    finally:
        (tmp_path / "go").touch()
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, (tmp_path / "stderr.txt").read_text()
    assert "wrote report.json" in out
    assert json.loads((tmp_path / "report.json").read_text())["files"]["t.jsonl"]["tasks"] == 2  # the first's, whole
    assert leftovers(tmp_path) == []


# ---- silently accepted: a bench whose every point failed; an exported engine's mask_token_id ----------------------

def test_bench_where_every_point_failed_says_so_on_stderr(tmp_path):
    """The issue: exit 0 with the error only on stdout. Now exit 2, one line on stderr, nothing on stdout."""
    b = write(tmp_path / "b.yaml", {"model": {"path": "tiny-llada2-random"}, "policy": POLICY,
                                    "generation": {"max_new_tokens": 8, "max_seq_len": 16}, "prompts": [{"ids": [1]}],
                                    "batch_size": 1})
    (tmp_path / "b.json").write_text(EARLIER)
    res = runner.invoke(app, ["bench", str(b), "--prompt-len", "24", "--out", str(tmp_path / "b.json")])
    assert_user_error(res, "every point failed", "KV capacity 16", "nothing was written")
    assert res.stdout.strip() == "" and res.stderr.strip().startswith("error: bench: every point failed")
    assert (tmp_path / "b.json").read_text() == EARLIER and leftovers(tmp_path) == []


class Loaded:
    """Stands in for ExportedModel (whose packages take a minute to export on the CPU)."""

    def __init__(self, path: Path, meta):
        self.config, self.dtype = meta.config, meta.dtype


@pytest.fixture
def fake_exported(tmp_path, monkeypatch) -> Path:
    from safetensors.torch import save_file

    from checkpoints import write_checkpoint
    from compiledllm.export import runtime

    config = dataclasses.asdict(compiledllm.load_model(write_checkpoint(tmp_path / "m", "sdar", 0)).config)
    meta = {"format": FORMAT, "torch": torch.__version__, "config": config, "dtype": "bfloat16", "device": "cpu",
            "block_size": 4, "capacity": 32, "buckets": [1], "files": {"1": "step_b1.pt2"},
            "weights": {"file": WEIGHTS_FILE, "tensors": {"w": {"dtype": "bfloat16", "shape": [2]}}}}
    out = tmp_path / "exp"
    out.mkdir()
    (out / "step_b1.pt2").write_bytes(b"PK not a package")
    save_file({"w": torch.zeros(2, dtype=torch.bfloat16)}, str(out / WEIGHTS_FILE))
    (out / EXPORT_FILE).write_text(json.dumps(meta))
    monkeypatch.setattr(runtime, "ExportedModel", Loaded)
    return out


def test_an_exported_engine_takes_mask_token_id_from_the_recipe_not_silently_ignoring_it(tmp_path, fake_exported):
    """The issue: an exported engine ignored model.mask_token_id without a word. The engine (not its packages) uses
    the mask id, so the override is taken, and checked as a checkpoint's: a wrong one is one line naming it."""
    from compiledllm.recipe import load_recipe
    from compiledllm.runner import load_from_spec

    model = {"path": str(fake_exported), "trust_exported": True, "dtype": "bfloat16"}  # the export's dtype
    r = write(tmp_path / "r.yaml", {**RUN, "model": model})
    model = load_from_spec(load_recipe(r, ["model.mask_token_id=5"]).model)
    assert model.config.mask_token_id == 5
    res = runner.invoke(app, ["run", str(r), "--set", "model.mask_token_id=500"])
    assert_user_error(res, "mask_token_id 500 is outside the vocabulary")
    assert res.stderr.startswith("error:")


def test_a_recipe_without_model_dtype_lets_an_exported_engine_keep_its_own(monkeypatch):
    """runner.load_from_spec passes model.dtype only when the recipe (or --set) gives it: an exported engine then
    runs its own dtype instead of being refused for a float32 nobody asked for."""
    from compiledllm import runner
    from compiledllm.recipe import ModelSpec

    seen = []
    monkeypatch.setattr(runner, "load_model", lambda path, **kw: seen.append(kw["dtype"]))
    runner.load_from_spec(ModelSpec.model_validate({"path": "engine/"}))
    runner.load_from_spec(ModelSpec.model_validate({"path": "engine/", "dtype": "bfloat16"}))
    assert seen == [None, "bfloat16"]
