"""`compiledllm run MODEL --prompt TEXT` (issue 32 item 2): a built-in name, a checkpoint directory or ORG/NAME where a
recipe goes, read as the minimal recipe {model: {path: MODEL}, policy: {name: POLICY}, prompts: [...]}; `recipe show`
prints that recipe; a recipe file's prompts are replaced by --prompt / --prompts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from compiledllm.builtin import ASSETS
from compiledllm.cli import app, source_recipe
from compiledllm.recipe import load_recipe, resolved_recipe
from user_errors import assert_user_error

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def shown(res) -> dict:
    assert res.exit_code == 0, res.output
    return yaml.safe_load(res.stdout)


def test_a_model_and_prompts_mean_the_minimal_recipe(tmp_path):
    minimal = tmp_path / "m.yaml"
    minimal.write_text(yaml.safe_dump({"model": {"path": "tiny-llada2"}, "policy": {"name": "t2t"},
                                       "prompts": [{"text": "def f("}, {"text": "héllo 😀 \"x\"\n\ty"}]}))
    overrides = ["generation.max_new_tokens=8"]
    from_file = load_recipe(minimal, overrides)
    rec, path = source_recipe("tiny-llada2", overrides, ["def f(", "héllo 😀 \"x\"\n\ty"], None, "t2t")
    assert path is None
    assert rec.model_dump() == from_file.model_dump()
    assert resolved_recipe(rec) == resolved_recipe(from_file)
    res = cli("recipe", "show", "tiny-llada2", "--prompt", "def f(", "--prompt", "héllo 😀 \"x\"\n\ty", "--policy",
              "t2t", "--set", "generation.max_new_tokens=8")
    assert shown(res) == resolved_recipe(from_file)
    assert res.stdout.startswith("# the recipe `compiledllm run tiny-llada2`")
    assert shown(cli("recipe", "show", "tiny-llada2", "--prompt", "x"))["policy"]["name"] == "threshold"


def test_run_a_builtin_with_prompts_and_a_prompts_file(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"ids": [3, 4, 5]}) + "\n")
    out = tmp_path / "out.jsonl"
    res = cli("run", "tiny-llada2", "--prompt", "def fibonacci(n):", "--prompts", prompts, "--set",
              "generation.max_new_tokens=4", "-o", out)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and "text" in rows[0]
    assert rows[1]["prompt_ids"] == [3, 4, 5]
    assert "tiny-llada2 · threshold" in res.output


def test_run_a_checkpoint_directory(tmp_path):
    res = cli("run", ASSETS / "tiny-llada2", "--prompt", "import os", "--policy", "t2t", "--set",
              "generation.max_new_tokens=4", "--set", "output=null")
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    assert len(rows) == 1 and 1 <= len(rows[0]["output_ids"]) <= 4


def test_prompts_on_the_command_line_replace_a_recipe_files(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": "tiny-llada2-random"}, "prompts": [{"ids": [1, 2]}],
                                      "prompts_file": "other.jsonl", "output": None}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"ids": [7, 8]}) + "\n")
    data = shown(cli("recipe", "show", recipe, "--prompt", "a b"))
    assert data["prompts"] == [{"text": "a b"}] and data["prompts_file"] is None
    data = shown(cli("recipe", "show", recipe, "--prompts", prompts))
    assert data["prompts"] == [] and data["prompts_file"] == str(prompts.resolve())
    res = cli("run", recipe, "--prompts", prompts, "--set", "generation.max_new_tokens=2")
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    assert [r["prompt_ids"] for r in rows] == [[7, 8]]


@pytest.mark.parametrize("args, needles", [
    (("run", "nosuch"), ("nosuch", "not a recipe file", "checkpoint directory", "tiny-llada2-random", "ORG/NAME")),
    (("run", "a/b/c", "--prompt", "x"), ("a/b/c", "not a recipe file")),
    (("recipe", "show", "nosuch", "--prompt", "x"), ("nosuch", "not a recipe file")),
    (("run", "tiny-llada2"), ("tiny-llada2", "no prompts", "--prompt TEXT", "--prompts FILE")),
    (("recipe", "show", "tiny-llada2"), ("tiny-llada2", "no prompts")),
    (("run", "tiny-llada2", "--prompt", "x", "--policy", "nope"), ("tiny-llada2", "policy.name", "'nope'")),
    (("run", "tiny-llada2", "--prompt", "x", "--set", "policy.treshold=0.5"),
     ("tiny-llada2", "policy.treshold", "did you mean threshold")),
    (("run", "tiny-llada2", "--prompt", "x", "--set", "generation.max_tokens=32"),
     ("tiny-llada2: generation.max_tokens", "did you mean max_new_tokens")),
    (("run", "tiny-llada2", "--prompt", ""), ("prompts.0.text",)),
    (("recipe", "show", "tiny-llada2", "--prompt", "x", "--eval"), ("--eval", "not a recipe file")),
])
def test_model_form_errors_are_one_line(tmp_path, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)
    assert_user_error(cli(*args), *needles)


def test_policy_with_a_recipe_file_and_a_missing_prompts_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": "tiny-llada2-random"}, "prompts": [{"ids": [1, 2]}]}))
    assert_user_error(cli("run", recipe, "--policy", "t2t"), "--policy t2t", "--set policy.name=t2t")
    assert_user_error(cli("run", "tiny-llada2", "--prompts", tmp_path / "none.jsonl"), "--prompts", "not found")
    assert_user_error(cli("run", "tiny-llada2", "--prompts", tmp_path), "--prompts", "is a directory")


def test_a_recipe_path_in_a_missing_folder_is_still_recipe_not_found(tmp_path):
    assert_user_error(cli("run", tmp_path / "no" / "r.yml"), "r.yml", "recipe not found")
    assert_user_error(cli("run", "missing.yaml", "--prompt", "x"), "missing.yaml", "recipe not found")
