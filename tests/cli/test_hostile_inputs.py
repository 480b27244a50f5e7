"""Hostile input files (issue 33 item 2): FIFOs, devices and directories given as recipes, prompt files or task
files, and resource bombs in them (nesting 50,000 deep, 5,000-digit integers, YAML alias bombs). Each runs the CLI
as a subprocess under a timeout (a hang fails the test instead of the suite) and must end in exit code 2 with one
line naming the file (and key), no traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import compiledllm

ROOT = Path(compiledllm.__file__).resolve().parents[1]
MODEL = {"path": "tiny-llada2-random"}
RECIPE = {"model": MODEL, "policy": {"name": "threshold", "block_size": 8}, "generation": {"max_new_tokens": 4},
          "prompts": [{"ids": [3, 4, 5]}], "batch_size": 1, "output": None}
EVAL = {"model": MODEL, "tasks": ["t.jsonl"], "policies": [{"name": "threshold", "block_size": 8}],
        "max_new_tokens": 4, "output": None}
TASK = {"prompt_ids": [3, 4], "reference_ids": [5]}
DEEP = "[" * 50_000 + "]" * 50_000  # one command-line argument holds at most 128 KiB
HUGE = "1" * 5000                   # past Python's 4300-digit limit of int(str)


def cli(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "COLUMNS": "400",
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "compiledllm", *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_refused(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert "Traceback" not in res.stdout + res.stderr, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), (res.returncode, lines[:5])
    for n in needles:
        assert n in lines[0], (n, lines[0])


def special(path: Path, kind: str) -> Path:
    {"fifo": os.mkfifo, "zero": lambda p: p.symlink_to("/dev/zero"), "directory": Path.mkdir}[kind](path)
    return path


KINDS = {"fifo": "is a FIFO, not a regular file", "zero": "is a character device, not a regular file",
         "directory": "is a directory, not a regular file"}


def raw(base: dict, key: str, text: str) -> str:
    """`base` as YAML with `key`'s value written as the YAML `text` (what yaml.safe_dump cannot write: aliases)."""
    return yaml.safe_dump({**base, key: "@@"}).replace("'@@'", text)


def write(path: Path, data: dict | str) -> Path:
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return path


# ---- special files: refused by kind, before they can block (a FIFO) or never end (/dev/zero) --------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", [("run",), ("recipe", "show"), ("eval",)])
def test_a_special_file_as_recipe(tmp_path, kind, command):
    file = special(tmp_path / "r.yaml", kind)
    assert_refused(cli(tmp_path, *command, file), "r.yaml", "recipe", KINDS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_file_as_prompts(tmp_path, kind):
    file = special(tmp_path / "prompts.txt", kind)
    assert_refused(cli(tmp_path, "run", "tiny-llada2", "--prompts", file), "--prompts", "prompts.txt", KINDS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_file_as_prompts_file(tmp_path, kind):
    special(tmp_path / "p.jsonl", kind)
    r = write(tmp_path / "r.yaml", {**RECIPE, "prompts": [], "prompts_file": "p.jsonl"})
    assert_refused(cli(tmp_path, "run", r), "p.jsonl", "prompts_file", KINDS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_file_as_task_file(tmp_path, kind):
    special(tmp_path / "t.jsonl", kind)
    assert_refused(cli(tmp_path, "eval", write(tmp_path / "e.yaml", EVAL)), "t.jsonl", "task file", KINDS[kind])


def test_an_oversized_prompts_file(tmp_path):
    from compiledllm.inputs import MAX_LINES_BYTES

    with open(tmp_path / "p.jsonl", "wb") as f:  # sparse: the size is checked before anything is read
        f.truncate(MAX_LINES_BYTES + 1)
    r = write(tmp_path / "r.yaml", {**RECIPE, "prompts": [], "prompts_file": "p.jsonl"})
    assert_refused(cli(tmp_path, "run", r), "p.jsonl", "larger than 256 MiB")


# ---- resource bombs: nesting, integer length, alias expansion ---------------------------------------------------

@pytest.mark.parametrize("command", [("run",), ("recipe", "show")])
def test_prompts_nested_deep_in_a_recipe(tmp_path, command):
    r = write(tmp_path / "r.yaml", raw(RECIPE, "prompts", DEEP))
    assert_refused(cli(tmp_path, *command, r), "r.yaml", "prompts.0.0", "nested deeper than 64 levels")


@pytest.mark.parametrize("command", [("run",), ("recipe", "show")])
def test_prompts_nested_deep_through_set(tmp_path, command):
    r = write(tmp_path / "r.yaml", RECIPE)
    assert_refused(cli(tmp_path, *command, r, "--set", f"prompts={DEEP}"), "--set prompts=[[[",
                   "nested deeper than 64 levels")


def test_prompts_nested_deep_in_a_prompts_file(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"ids": [3]}\n' + DEEP + "\n")
    assert_refused(cli(tmp_path, "run", "tiny-llada2", "--prompts", "p.jsonl"), "p.jsonl:2",
                   "nested deeper than 64 levels")


@pytest.mark.parametrize("command", [("run",), ("recipe", "show")])
def test_a_huge_integer_in_a_recipe(tmp_path, command):
    r = write(tmp_path / "r.yaml", raw(RECIPE, "prompts", f"[{{ids: [3, {HUGE}]}}]"))
    assert_refused(cli(tmp_path, *command, r), "r.yaml", "prompts.0.ids.1", "an integer of 5000 digits (at most 100)")


def test_a_huge_integer_through_set(tmp_path):
    res = cli(tmp_path, "run", write(tmp_path / "r.yaml", RECIPE), "--set", f"generation.max_new_tokens={HUGE}")
    assert_refused(res, "--set generation.max_new_tokens=111", "an integer of 5000 digits")
    assert len(res.stderr) < 300  # the value is not echoed


def test_a_huge_integer_in_a_prompts_file(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"ids": [3]}\n{"ids": [3, %s]}\n' % HUGE)
    assert_refused(cli(tmp_path, "run", "tiny-llada2", "--prompts", "p.jsonl"), "p.jsonl:2", "ids.1",
                   "an integer of 5000 digits")


@pytest.mark.parametrize("line, needles", [
    (DEEP, ("t.jsonl:2", "nested deeper than 64 levels")),
    ('{"prompt_ids": [3, %s], "reference_ids": [5]}' % HUGE, ("t.jsonl:2", "prompt_ids.1", "5000 digits")),
], ids=["deep", "huge-int"])
def test_bombs_in_a_task_file(tmp_path, line, needles):
    (tmp_path / "t.jsonl").write_text(json.dumps(TASK) + "\n" + line + "\n")
    assert_refused(cli(tmp_path, "eval", write(tmp_path / "e.yaml", EVAL)), *needles)


# nine levels of nine aliases: 9**9 nodes once expanded, from a few hundred bytes (validated or dumped, it never ends)
BILLION_LAUGHS = "{a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol], " + ", ".join(
    f"{k}: &{k} [{', '.join([f'*{p}'] * 9)}]" for p, k in zip("abcdefgh", "bcdefghi")) + "}"


@pytest.mark.parametrize("command", [("run",), ("recipe", "show")])
def test_a_yaml_alias_bomb(tmp_path, command):
    r = write(tmp_path / "r.yaml", raw(RECIPE, "policy", f"{{name: threshold, block_size: 8, lol: {BILLION_LAUGHS}}}"))
    assert_refused(cli(tmp_path, *command, r), "r.yaml", "aliases expand the document by", "(at most 100000)")


def test_a_recursive_alias(tmp_path):
    r = write(tmp_path / "r.yaml", raw(RECIPE, "prompts", "&p [*p]"))
    assert_refused(cli(tmp_path, "recipe", "show", r), "r.yaml", "prompts.0", "a recursive alias")


# ---- ordinary inputs still work ---------------------------------------------------------------------------------

def test_ordinary_inputs_still_work(tmp_path):
    """Anchors, aliases and merge keys within bounds; a recipe, prompts file and task file reached by symlinks."""
    (tmp_path / "p.real.jsonl").write_text('{"ids": [3, 4]}\n{"ids": [6]}\n')
    (tmp_path / "p.jsonl").symlink_to("p.real.jsonl")
    write(tmp_path / "real.yaml", "model: {path: tiny-llada2-random}\npolicy: {name: threshold, block_size: 8, "
          "seed: 7}\ngeneration: {max_new_tokens: 4}\nprompts: [&p {ids: [3, 4, 5]}, *p]\n"
          "prompts_file: p.jsonl\nbatch_size: 2\noutput: out.jsonl\n")
    (tmp_path / "r.yaml").symlink_to("real.yaml")
    res = cli(tmp_path, "run", "r.yaml")
    assert res.returncode == 0, res.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 4
    shown = cli(tmp_path, "recipe", "show", "r.yaml")
    assert shown.returncode == 0 and "prompts_file: p.jsonl" in shown.stdout, shown.stderr

    (tmp_path / "t.real.jsonl").write_text(json.dumps(TASK) + "\n" + json.dumps({**TASK, "id": 12345}) + "\n")
    (tmp_path / "t.jsonl").symlink_to("t.real.jsonl")
    policies = "[&b {name: threshold, block_size: 8}, {<<: *b, threshold: 0.9, label: t9}]"
    e = write(tmp_path / "e.yaml", raw(EVAL, "policies", policies))
    res = cli(tmp_path, "eval", e)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


# ---- the bounds themselves, in-process ---------------------------------------------------------------------------

def test_the_bounds_are_exact():
    from compiledllm.errors import UserError
    from compiledllm.inputs import MAX_ALIAS_NODES, MAX_DEPTH, MAX_INT_DIGITS, parse_json, parse_yaml

    nest = lambda n: "[" * n + "]" * n  # noqa: E731 (n levels: the root is one)
    assert parse_yaml(nest(MAX_DEPTH), "x") is not None and parse_json(nest(MAX_DEPTH), "x") is not None
    assert parse_yaml("9" * MAX_INT_DIGITS, "x") == parse_json("9" * MAX_INT_DIGITS, "x") == 10 ** MAX_INT_DIGITS - 1
    shared = lambda k: f"a: &a [{', '.join(['1'] * 1000)}]\nb: [{', '.join(['*a'] * k)}]"  # noqa: E731 (+k * 1001)
    assert len(parse_yaml(shared(MAX_ALIAS_NODES // 1001), "x")["b"]) == MAX_ALIAS_NODES // 1001
    for text, problem in [(nest(MAX_DEPTH + 1), "nested deeper"), ("9" * (MAX_INT_DIGITS + 1), "101 digits"),
                          (shared(MAX_ALIAS_NODES // 1001 + 1), "aliases expand")]:
        with pytest.raises(UserError, match=f"^x: .*{problem}"):
            parse_yaml(text, "x")
        if "aliases" not in problem:
            with pytest.raises(UserError, match=f"^x: .*{problem}"):
                parse_json(text, "x")
