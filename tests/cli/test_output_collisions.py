"""Outputs that collide, cannot be written, or fill the disk (issue 33 items 4 and 6): every one a one-line error
(exit 2) before any work where it can be known then, earlier results intact, no temporary or lock file left."""
from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from compiledllm import outputs
from compiledllm.cli import app
from compiledllm.models.presets import TINY_LLADA2
from user_errors import assert_user_error

runner = CliRunner()
MODEL = {"init": "random", "config": dict(TINY_LLADA2, num_hidden_layers=1)}
POLICY = {"name": "threshold", "block_size": 8}
EARLIER = "earlier results\n"


def run_recipe(tmp_path: Path, **change) -> Path:
    data = {"model": {"path": "tiny-llada2-random"}, "policy": POLICY, "generation": {"max_new_tokens": 8},
            "prompts": [{"ids": [3, 4, 5]}, {"ids": [6, 7]}], "batch_size": 1,
            "output": str(tmp_path / "out.jsonl")} | change
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def eval_recipe(tmp_path: Path, tasks: str | None = None, **change) -> Path:
    (tmp_path / "t.jsonl").write_text(tasks or "".join(
        json.dumps({"prompt_ids": [5 + i, 6, 7], "reference_ids": [9, 10]}) + "\n" for i in range(2)))
    data = {"model": {"path": "tiny-llada2-random"}, "tasks": ["t.jsonl"], "policies": [POLICY],
            "max_new_tokens": 4, "output": str(tmp_path / "report.json")} | change
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def bench_recipe(tmp_path: Path, **change) -> Path:
    data = {"model": MODEL, "policy": POLICY, "generation": {"max_new_tokens": 8}, "prompts": [{"ids": [1]}],
            "batch_size": 1} | change
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def bench(tmp_path: Path, *args, **change):
    lengths = [] if "--prompt-len" in args else ["--prompt-len", "8"]
    return runner.invoke(app, ["bench", str(bench_recipe(tmp_path, **change)), *lengths, *map(str, args)])


def earlier(*paths: Path) -> dict[Path, bytes]:
    """Files an earlier command wrote, to check that a failing one leaves them as they were."""
    for p in paths:
        p.write_text(EARLIER)
    return {p: p.read_bytes() for p in paths}


def intact(files: dict[Path, bytes]) -> bool:
    return all(p.read_bytes() == b for p, b in files.items())


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".lock")))


# --- outputs checked against each other and against the inputs, before any work -------------------------------

def test_bench_out_and_plot_on_one_file_is_refused_before_the_run(tmp_path):
    files = earlier(tmp_path / "x.json", tmp_path / "same")
    assert_user_error(bench(tmp_path, "--out", tmp_path / "x.json", "--plot", tmp_path / "x.json"),
                      "--plot", "x.json", "also this command's --out")
    # without a suffix: matplotlib used to write same.png while the CLI printed "chart: same"
    assert_user_error(bench(tmp_path, "--out", tmp_path / "same", "--plot", tmp_path / "same"), "--plot", "same")
    # the plot on the report kept after each point
    assert_user_error(bench(tmp_path, "--out", tmp_path / "b.json", "--plot", tmp_path / "b.partial.json"),
                      "--out partial report", "b.partial.json", "--plot")
    assert intact(files) and not leftovers(tmp_path)


def test_eval_report_and_chart_on_one_file_is_refused(tmp_path):
    files = earlier(tmp_path / "r.png")
    assert_user_error(runner.invoke(app, ["eval", str(eval_recipe(tmp_path)), "-o", str(tmp_path / "r.png")]),
                      "eval chart", "r.png", "also this command's eval output")
    assert intact(files) and not leftovers(tmp_path)


def test_run_refuses_an_output_whose_partial_file_is_an_input(tmp_path):
    prompts = tmp_path / "x.partial.jsonl"  # where an interrupted run would keep its results
    prompts.write_text('{"ids": [3, 4]}\n')
    recipe = run_recipe(tmp_path, prompts=[], prompts_file=str(prompts), output=str(tmp_path / "x.jsonl"))
    assert_user_error(runner.invoke(app, ["run", str(recipe)]), "partial output", "also an input")
    assert prompts.read_text() == '{"ids": [3, 4]}\n' and not leftovers(tmp_path)


# --- a second writer of one report is refused by the lock `run` uses --------------------------------------------

def test_a_second_eval_or_bench_on_a_report_being_written_is_refused(tmp_path):
    files = earlier(tmp_path / "report.json", tmp_path / "b.json")
    for lock, cmd in ((".report.json.lock", ["eval", str(eval_recipe(tmp_path))]),
                      (".b.json.lock", ["bench", str(bench_recipe(tmp_path)), "--out", str(tmp_path / "b.json")])):
        with open(tmp_path / lock, "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running eval / bench holds it
            assert_user_error(runner.invoke(app, cmd), "being written by another run", lock)
        (tmp_path / lock).unlink()
    assert intact(files) and not leftovers(tmp_path)


def test_an_eval_or_bench_that_finishes_releases_its_locks_and_kept_points(tmp_path):
    res = runner.invoke(app, ["eval", str(eval_recipe(tmp_path))])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "report.json").read_text())["files"]["t.jsonl"]["tasks"] == 2
    res = bench(tmp_path, "--out", tmp_path / "b.json", "--plot", tmp_path / "b.png")
    assert res.exit_code == 0, res.output
    assert len(json.loads((tmp_path / "b.json").read_text())["points"]) == 1 and (tmp_path / "b.png").exists()
    assert "chart: " + str(tmp_path / "b.png") in " ".join(res.output.split())
    assert not (tmp_path / "b.partial.json").exists() and not leftovers(tmp_path)  # the report replaces it


# --- names too long for the filesystem, unwritable folders: before any work ---------------------------------------

@pytest.mark.parametrize("length", [300, 250])  # 250 fits NAME_MAX (255), its temporary file does not
def test_a_name_too_long_for_the_filesystem_is_one_line_up_front(tmp_path, length):
    name = "r" * (length - 5) + ".json"
    for cmd, needle in ((["run", str(run_recipe(tmp_path)), "-o", str(tmp_path / (name + "l"))], "output"),
                        (["eval", str(eval_recipe(tmp_path)), "-o", str(tmp_path / name)], "eval output"),
                        (["bench", str(bench_recipe(tmp_path)), "--out", str(tmp_path / name)], "--out"),
                        (["bench", str(bench_recipe(tmp_path)), "--plot", str(tmp_path / "d" / name)], "--plot")):
        assert_user_error(runner.invoke(app, cmd), needle, "longer than the", "this filesystem allows")
    assert not leftovers(tmp_path) and not (tmp_path / "d").exists()


def test_a_plot_into_an_unwritable_folder_is_refused_before_the_run(tmp_path, monkeypatch):
    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path / "ro" else real(p, mode))
    assert_user_error(bench(tmp_path, "--plot", tmp_path / "ro" / "b.png"), "--plot", "ro", "not writable")


# --- a full disk: one line, the earlier files intact, no temporary left --------------------------------------------

def full_disk(monkeypatch, after: int) -> None:
    """Every file outputs.py opens for writing after the first `after` ones fills the disk half-way through."""
    real, opened = outputs._open, []

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, text: str) -> int:
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def flush(self) -> None:
            self.f.flush()

        def close(self) -> None:
            self.f.close()

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.close()

    def fake(path: Path):
        opened.append(path)
        f = real(path)
        return f if len(opened) <= after else Full(f)

    monkeypatch.setattr(outputs, "_open", fake)


@pytest.mark.parametrize("after,named", [(0, "out.jsonl"), (1, "out.jsonl"), (2, "out.summary.json")])
def test_run_on_a_full_disk(tmp_path, monkeypatch, after, named):
    # the disk fills at the first result's line, the results in prompt order, or the summary
    files = earlier(tmp_path / "out.jsonl", tmp_path / "out.summary.json")
    full_disk(monkeypatch, after)
    assert_user_error(runner.invoke(app, ["run", str(run_recipe(tmp_path))]), "output", named,
                      "No space left on device")
    assert intact(files) and not leftovers(tmp_path)


def test_eval_on_a_full_disk(tmp_path, monkeypatch):
    files = earlier(tmp_path / "report.json", tmp_path / "report.png")
    full_disk(monkeypatch, 0)
    assert_user_error(runner.invoke(app, ["eval", str(eval_recipe(tmp_path))]), "eval output", "report.json",
                      "No space left on device")
    assert intact(files) and not leftovers(tmp_path)


def test_bench_on_a_full_disk(tmp_path, monkeypatch):
    files = earlier(tmp_path / "b.json")
    full_disk(monkeypatch, 0)  # the report kept after the first point
    assert_user_error(bench(tmp_path, "--out", tmp_path / "b.json"), "--out", "b.partial.json",
                      "No space left on device")
    assert intact(files) and not leftovers(tmp_path) and not (tmp_path / "b.partial.json").exists()


def test_a_chart_that_fills_the_disk_leaves_the_earlier_report_and_chart(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def savefig(self, path, **kw):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", savefig)
    files = earlier(tmp_path / "b.json", tmp_path / "b.png", tmp_path / "report.json", tmp_path / "report.png")
    assert_user_error(bench(tmp_path, "--out", tmp_path / "b.json", "--plot", tmp_path / "b.png"), "--plot",
                      "b.png", "No space left on device")
    assert_user_error(runner.invoke(app, ["eval", str(eval_recipe(tmp_path))]), "eval chart", "report.png",
                      "No space left on device")
    assert intact(files) and not leftovers(tmp_path)  # report and chart are renamed into place together


# --- silently accepted before ---------------------------------------------------------------------------------------

def test_bench_where_every_point_failed_exits_2_saying_why(tmp_path):
    files = earlier(tmp_path / "b.json")
    res = bench(tmp_path, "--prompt-len", "24", "--out", tmp_path / "b.json",
                generation={"max_new_tokens": 8, "max_seq_len": 16})  # no point fits its KV capacity
    assert_user_error(res, "every point failed", "KV capacity 16", "nothing was written")
    assert intact(files) and not leftovers(tmp_path) and not (tmp_path / "b.partial.json").exists()


def test_duplicate_task_ids_in_an_eval_file_are_refused(tmp_path):
    tasks = "".join(json.dumps({"id": i, "prompt_ids": [5, 6], "reference_ids": [9]}) + "\n" for i in ("a", "b", "a"))
    assert_user_error(runner.invoke(app, ["eval", str(eval_recipe(tmp_path, tasks))]), "t.jsonl:3", "'a'", "line 1")
    assert not (tmp_path / "report.json").exists() and not leftovers(tmp_path)
