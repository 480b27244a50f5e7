"""Output files survive failed, interrupted and concurrent runs (README: what is never overwritten)."""
from __future__ import annotations

import fcntl
import json

import pytest
import yaml
from typer.testing import CliRunner

from compiledllm.cli import app
from compiledllm.engine.engine import Engine
from user_errors import assert_user_error

runner = CliRunner()


def recipe(tmp_path, **sections):
    data = {"model": {"path": "tiny-llada2-random"}, "policy": {"name": "threshold", "block_size": 8},
            "generation": {"max_new_tokens": 8}, "prompts": [{"ids": [3, 4, 5]}, {"ids": [6, 7]}], "batch_size": 1,
            "output": str(tmp_path / "out.jsonl")} | sections
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def previous(tmp_path):
    """A finished run's files, to check that later runs leave them as they were."""
    assert runner.invoke(app, ["run", str(recipe(tmp_path))]).exit_code == 0
    files = {p: p.read_bytes() for p in (tmp_path / "out.jsonl", tmp_path / "out.summary.json")}
    assert len(files[tmp_path / "out.jsonl"].splitlines()) == 2
    return files


def unchanged(files):
    return all(p.read_bytes() == b for p, b in files.items())


def test_a_run_writes_results_and_summary_together_and_leaves_no_temporaries(tmp_path, previous):
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["prompts"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.summary.json", "r.yaml"]  # no lock file


def test_a_rerun_that_fails_validation_keeps_the_previous_results(tmp_path, previous):
    res = runner.invoke(app, ["run", str(recipe(tmp_path, prompts=[{"ids": [10**9]}]))])
    assert_user_error(res, "outside the vocabulary")
    assert unchanged(previous)


def test_a_run_that_fails_mid_way_keeps_the_previous_results(tmp_path, previous, monkeypatch):
    real = Engine.generate

    def failing(self, prompts, on_result=None, on_startup=None):
        def cb(r):
            on_result(r)
            raise RuntimeError("device lost")
        return real(self, prompts, on_result=cb)

    monkeypatch.setattr(Engine, "generate", failing)
    res = runner.invoke(app, ["run", str(recipe(tmp_path))])
    assert res.exit_code != 0 and isinstance(res.exception, RuntimeError)
    assert unchanged(previous)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_ctrl_c_keeps_what_finished_under_a_clear_name_and_says_so(tmp_path, previous, monkeypatch):
    real = Engine.generate

    def interrupted(self, prompts, on_result=None, on_startup=None):
        def cb(r):
            on_result(r)
            raise KeyboardInterrupt
        return real(self, prompts, on_result=cb)

    monkeypatch.setattr(Engine, "generate", interrupted)
    res = runner.invoke(app, ["run", str(recipe(tmp_path))])
    assert res.exit_code == 130, res.output
    partial = tmp_path / "out.partial.jsonl"
    assert f"interrupted: kept 1 finished results in {partial}" in " ".join(res.output.split())
    assert len(partial.read_text().splitlines()) == 1
    assert json.loads((tmp_path / "out.partial.summary.json").read_text())["interrupted"] is True
    assert unchanged(previous)


@pytest.mark.parametrize("target", ["prompts", "recipe", "summary_is_prompts"])
def test_an_output_that_is_an_input_of_the_run_is_refused(tmp_path, target):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"ids": [3, 4]}\n')
    out = {"prompts": prompts, "recipe": tmp_path / "r.yaml", "summary_is_prompts": tmp_path / "p.jsonl"}[target]
    if target == "summary_is_prompts":
        prompts = prompts.rename(tmp_path / "x.summary.json")
        out = tmp_path / "x.jsonl"
    path = recipe(tmp_path, prompts=[], prompts_file=str(prompts), output=str(out))
    before = {p: p.read_bytes() for p in (prompts, path)}
    assert_user_error(runner.invoke(app, ["run", str(path)]), "also an input of this run")
    assert unchanged(before)


def test_directories_in_the_way_are_one_line_errors(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    assert_user_error(runner.invoke(app, ["run", str(recipe(tmp_path, output=str(tmp_path / "d.jsonl")))]),
                   "is a directory")
    (tmp_path / "e.summary.json").mkdir()
    assert_user_error(runner.invoke(app, ["run", str(recipe(tmp_path, output=str(tmp_path / "e.jsonl")))]),
                   "e.summary.json is a directory")


def test_a_second_run_on_the_same_output_is_refused_while_the_first_holds_it(tmp_path, previous):
    with open(tmp_path / ".out.jsonl.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `compiledllm run` holds it
        assert_user_error(runner.invoke(app, ["run", str(recipe(tmp_path))]), "being written by another run")
    assert unchanged(previous)
    assert runner.invoke(app, ["run", str(recipe(tmp_path))]).exit_code == 0  # released: runs again
    assert not (tmp_path / ".out.jsonl.lock").exists()  # taken over, then removed on release


@pytest.mark.parametrize("end", ["commit", "keep_partial", "discard"])
def test_the_lock_file_is_removed_when_the_run_releases_it(tmp_path, end):
    from compiledllm.errors import UserError
    from compiledllm.outputs import ResultSink

    out = tmp_path / "out.jsonl"
    sink = ResultSink(out)
    assert (tmp_path / ".out.jsonl.lock").exists()
    with pytest.raises(UserError, match="being written by another run"):
        ResultSink(out)  # a concurrent writer is still refused
    sink.write({"index": 0})
    getattr(sink, end)(*([] if end == "discard" else [{"prompts": 1}]))
    assert not (tmp_path / ".out.jsonl.lock").exists()
    again = ResultSink(out)  # and the next run takes the output
    again.discard()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_run_that_locked_a_removed_lock_file_locks_the_new_one(tmp_path, monkeypatch):
    # run B opened the lock file just before run A removed it on release and then locked that removed file; meanwhile
    # run C created a new lock file at the path and holds it: B must see that its file is gone and be refused by C's
    import compiledllm.outputs as outputs
    from compiledllm.errors import UserError

    out, path = tmp_path / "out.jsonl", tmp_path / ".out.jsonl.lock"
    real, calls, held = outputs.fcntl.flock, [], []

    def flock(f, op):
        calls.append(op)
        if len(calls) == 1:  # B's first try: A releases (removes the file), C takes the path
            path.unlink()
            held.append(open(path, "w"))
            real(held[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        return real(f, op)

    monkeypatch.setattr(outputs.fcntl, "flock", flock)
    with pytest.raises(UserError, match="being written by another run"):
        outputs.ResultSink(out)
    assert len(calls) == 2  # locked the removed file, saw it gone, tried the new one
    monkeypatch.setattr(outputs.fcntl, "flock", real)
    held[0].close()  # C ends (killed: its file stays); the next run takes it over and removes it
    sink = outputs.ResultSink(out)
    sink.discard()
    assert not path.exists()


def test_eval_profile_and_export_check_their_outputs_before_working(tmp_path):
    task = tmp_path / "t.jsonl"
    task.write_text('{"prompt_ids": [3, 4], "reference_ids": [5]}\n')
    ev = tmp_path / "e.yaml"
    ev.write_text(yaml.safe_dump({"model": {"path": "tiny-llada2-random"}, "tasks": [str(task)],
                                  "policies": [{"name": "threshold", "block_size": 8}]}))
    (tmp_path / "dir").mkdir()
    assert_user_error(runner.invoke(app, ["eval", str(ev), "-o", str(tmp_path / "dir")]), "is a directory")
    assert_user_error(runner.invoke(app, ["eval", str(ev), "-o", str(task)]), "also an input")
    assert task.read_text().startswith('{"prompt_ids"')
    afile = tmp_path / "a_file"
    afile.write_text("keep me")
    assert_user_error(runner.invoke(app, ["profile", str(recipe(tmp_path)), "--out", str(afile)]), "is a file")
    assert_user_error(runner.invoke(app, ["export", str(recipe(tmp_path)), "--out", str(afile)]), "is a file")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert_user_error(runner.invoke(app, ["export", str(recipe(tmp_path)), "--out", str(tmp_path / "busy")]),
                   "other files in it")
    assert afile.read_text() == "keep me" and (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_results_are_in_prompt_order_whatever_order_requests_end_in(tmp_path):
    from compiledllm.outputs import ResultSink, partial_path

    for finish in ("commit", "keep_partial"):
        sink = ResultSink(tmp_path / f"{finish}.jsonl")
        for i in (2, 0, 3, 1):  # completion order
            sink.write({"index": i})
        path = getattr(sink, finish)({"prompts": 4})
        assert path == (tmp_path / f"{finish}.jsonl" if finish == "commit" else partial_path(tmp_path / f"{finish}.jsonl"))
        assert [json.loads(x)["index"] for x in path.read_text().splitlines()] == [0, 1, 2, 3]
