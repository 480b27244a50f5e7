"""Bad recipes, prompts and task files (issue #17): each is one line naming the file, key or value, exit 2, no
traceback, and nothing is guessed. Most cases fail while the recipe is validated, before any model is built."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import compiledllm.runner
from compiledllm.cli import app
from compiledllm.errors import UserError
from compiledllm.evaluate import load_eval_recipe, load_tasks
from compiledllm.recipe import MAX_RECIPE_BYTES, load_recipe
from user_errors import assert_user_error

runner = CliRunner()
MODEL = {"path": "tiny-llada2-random"}
RECIPE = {"model": MODEL, "policy": {"name": "threshold", "block_size": 8}, "generation": {"max_new_tokens": 4},
          "prompts": [{"ids": [3, 4, 5]}], "batch_size": 1, "output": None}
EVAL = {"model": MODEL, "tasks": ["t.jsonl"], "policies": [{"name": "threshold", "block_size": 8}],
        "max_new_tokens": 4, "output": None}
NO_MODEL = ("model.path", "tiny-llada2", "model.init: random", "model.config")


def write(path: Path, data: dict | str | bytes) -> Path:
    if isinstance(data, dict):
        data = yaml.safe_dump(data)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def recipe(tmp_path: Path, drop: tuple[str, ...] = (), **sections) -> Path:
    return write(tmp_path / "r.yaml", {k: v for k, v in {**RECIPE, **sections}.items() if k not in drop})


def cli(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def no_model(monkeypatch):
    """The case must fail before a model is built."""
    def refuse(spec):
        raise AssertionError(f"a model was built for {spec}")
    monkeypatch.setattr(compiledllm.runner, "load_from_spec", refuse)


# ---- 1. a recipe names its model -------------------------------------------------------------------------

@pytest.mark.parametrize("sections, drop, needles", [
    ({}, ("model",), NO_MODEL),
    ({"model": {}}, (), NO_MODEL),
    ({"model": {"dtype": "float32", "device": "cpu"}}, (), NO_MODEL),
    ({"model": {"init": "random"}}, (), ("model", "init: random needs config")),
    ({"model": {"init": "random", "config": "tiny-random-llada2", "path": "tiny-llada2"}}, (), ("model", "path")),
])
def test_a_recipe_without_a_model_is_refused(tmp_path, no_model, sections, drop, needles):
    assert_user_error(cli("run", recipe(tmp_path, drop, **sections)), "r.yaml", *needles)


def test_a_recipe_without_a_model_through_the_api_and_eval(tmp_path, no_model):
    with pytest.raises(UserError, match="no model given"):
        load_recipe({"prompts": [{"ids": [1]}]})
    with pytest.raises(UserError, match="no model given"):
        load_eval_recipe({k: v for k, v in EVAL.items() if k != "model"})
    ev = write(tmp_path / "e.yaml", {k: v for k, v in EVAL.items() if k != "model"})
    assert_user_error(cli("eval", ev), "e.yaml", *NO_MODEL)


def test_exported_engine_and_nonfinite_switches_are_off_unless_given():
    m = load_recipe({**RECIPE}).model
    assert (m.trust_exported, m.allow_nonfinite) == (False, False)
    m = load_recipe({**RECIPE, "model": {**MODEL, "trust_exported": True, "allow_nonfinite": True}}).model
    assert (m.trust_exported, m.allow_nonfinite) == (True, True)
    with pytest.raises(UserError, match=r"model\.trust_exported: .*'yes'"):
        load_recipe({**RECIPE, "model": {**MODEL, "trust_exported": "yes"}})


# ---- 2. YAML: no duplicate keys, no broken --set values, recipe files that are text ------------------------

@pytest.mark.parametrize("text, needles", [
    ("model: {path: tiny-llada2-random}\nprompts: [{ids: [1]}]\nbatch_size: 2\nbatch_size: 4\n",
     ("duplicate key 'batch_size'", "line 4")),
    ("model:\n  path: tiny-llada2-random\n  path: tiny-llada2\nprompts: [{ids: [1]}]\n",
     ("duplicate key 'path'", "line 3")),
    ("model: {path: tiny-llada2-random}\nprompts: [{ids: [1], ids: [2]}]\n", ("duplicate key 'ids'", "line 2")),
    ("model: [unclosed\n", ("malformed YAML",)),
])
def test_duplicate_keys_and_malformed_yaml(tmp_path, no_model, text, needles):
    assert_user_error(cli("run", write(tmp_path / "r.yaml", text)), "r.yaml", *needles)


def test_duplicate_keys_in_an_eval_recipe_and_a_set_value(tmp_path, no_model):
    ev = write(tmp_path / "e.yaml", yaml.safe_dump(EVAL) + "batch_size: 2\nbatch_size: 3\n")
    assert_user_error(cli("eval", ev), "e.yaml", "duplicate key 'batch_size'")
    assert_user_error(cli("run", recipe(tmp_path), "--set", "model={path: a, path: b}"),
                      "--set model={path: a, path: b}", "duplicate key 'path'")


def test_yaml_merge_keys_override_and_only_true_false_are_booleans(tmp_path):
    """A `<<` merge that a key then overrides is not a duplicate; `no` is a string and 1e-3 a float (YAML 1.2)."""
    text = ("model: {path: tiny-llada2-random}\ntasks: [t.jsonl]\npolicies:\n"
            "  - &base {name: threshold, block_size: 8, threshold: 1e-3}\n  - {<<: *base, threshold: 1, label: no}\n")
    rec = load_eval_recipe(write(tmp_path / "e.yaml", text))
    assert rec.policies[0]["threshold"] == 0.001
    assert rec.policies[1] == {"name": "threshold", "block_size": 8, "threshold": 1, "label": "no"}


@pytest.mark.parametrize("item", ["prompts=[", "policy.name={x", "a.b={x: 1"])
def test_a_broken_set_value_names_the_item(tmp_path, no_model, item):
    assert_user_error(cli("run", recipe(tmp_path), "--set", item), f"--set {item}", "malformed YAML")


@pytest.mark.parametrize("content, needles", [
    (None, ("is a directory",)),
    (b"model: {path: tiny-llada2-random}\x00\x01\x02", ("binary",)),
    (b"model: {path: tiny-llada2-random}\nprompts: [{text: caf\xe9}]\n", ("r.yaml:2", "not UTF-8")),
    (b"#" * MAX_RECIPE_BYTES + b"\n", ("larger than 4 MiB",)),
])
def test_a_recipe_that_is_not_a_text_file(tmp_path, no_model, content, needles):
    path = tmp_path / "r.yaml"
    path.mkdir() if content is None else path.write_bytes(content)
    assert_user_error(cli("run", path), "r.yaml", *needles)
    with pytest.raises(UserError, match="r.yaml"):
        load_recipe(path)


def test_an_unreadable_recipe(tmp_path, no_model, monkeypatch):
    path = recipe(tmp_path)
    real_open = os.open

    def guarded(file, *args, **kw):  # chmod 000 does not stop root, so refuse the read (compiledllm.inputs) here
        if Path(file) == path:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kw)

    monkeypatch.setattr(os, "open", guarded)
    assert_user_error(cli("run", path), "r.yaml", "cannot read", "Permission denied")


# ---- 3. strict types ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sections, needles", [
    ({"batch_size": 2.5}, ("batch_size", "integer", "2.5")),
    ({"batch_size": True}, ("batch_size", "integer", "True")),
    ({"generation": {"max_new_tokens": 4.5}}, ("generation.max_new_tokens", "4.5")),
    ({"generation": {"max_new_tokens": "4"}}, ("generation.max_new_tokens", "'4'")),
    ({"compile": "yes"}, ("compile", "boolean", "'yes'")),
    ({"cuda_graphs": 1}, ("cuda_graphs", "boolean")),
    ({"model": {**MODEL, "seed": 1.0}}, ("model.seed", "integer")),
    ({"policy": {"name": "threshold", "threshold": True}}, ("policy.threshold", "True")),
    ({"policy": {"name": "threshold", "block_size": 8.0}}, ("policy.block_size", "8.0")),
    ({"policy": {"name": "threshold", "block_size": 8, "steps": True}}, ("policy.steps", "True")),
    ({"policy": {"name": "flowblock", "block_size": 8, "window": 2.5}}, ("policy.window", "2.5")),
    ({"policy": {"name": ["threshold"]}}, ("policy.name",)),
])
def test_strict_types(tmp_path, no_model, sections, needles):
    assert_user_error(cli("run", recipe(tmp_path, **sections)), "r.yaml", *needles)


def test_yaml_yes_is_not_a_boolean(tmp_path, no_model):
    path = write(tmp_path / "r.yaml", yaml.safe_dump(RECIPE) + "compile: yes\n")
    assert_user_error(cli("run", path), "compile", "'yes'")


def test_ints_are_valid_floats():
    rec = load_recipe({**RECIPE, "policy": {"name": "threshold", "block_size": 8, "threshold": 1}})
    assert rec.policy_config().threshold == 1.0


def test_strict_types_in_an_eval_recipe(tmp_path, no_model):
    bad = {**EVAL, "policies": [{"name": "t2t", "edit_threshold": False}]}
    assert_user_error(cli("eval", write(tmp_path / "e.yaml", bad)), "policies[0]", "policy.edit_threshold")
    assert_user_error(cli("eval", write(tmp_path / "e.yaml", {**EVAL, "limit": 2.5})), "limit", "2.5")
    assert_user_error(cli("eval", write(tmp_path / "e.yaml", {**EVAL, "save_outputs": "no"})), "save_outputs")
    assert_user_error(cli("eval", write(tmp_path / "e.yaml", {**EVAL, "policies": [{"name": "t2t", "label": 3}]})),
                      "policies[0].label")


# ---- 4. the device, checked before a model is built ----------------------------------------------------------

@pytest.mark.parametrize("device, cuda_devices, needles", [
    ("gpu", None, ("gpu", "cpu")),
    ("meta", None, ("meta", "cpu")),
    ("cuda:x", None, ("cuda:x",)),
    ("cuda", 0, ("cuda", "not available", "cpu")),
    ("cuda:0", 0, ("cuda:0", "not available", "cpu")),
    ("cuda:7", 1, ("cuda:7", "cpu, cuda:0")),
])
def test_bad_devices(tmp_path, no_model, monkeypatch, device, cuda_devices, needles):
    if cuda_devices is not None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    assert_user_error(cli("run", recipe(tmp_path, model={**MODEL, "device": device})), "model.device", *needles)


# ---- 5. prompts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lines, needles", [
    (["", "   "], ("p.jsonl", "holds no prompts")),
    (['{"ids": [3]}', '{"ids": [1.5]}'], ("p.jsonl:2", "ids.0", "1.5")),
    (['{"ids": [true]}'], ("p.jsonl:1", "ids.0", "True")),
    (['{"ids": [3, -1]}'], ("p.jsonl:1", "ids.1", "-1")),
    (['{"ids": []}'], ("p.jsonl:1", "ids")),
    (['{"text": ""}'], ("p.jsonl:1", "text")),
    (['{"ids": [3]}', '{"text": "a\\ud800b"}'], ("p.jsonl:2", "text", "surrogate")),
    (['{"messages": [{"role": "user", "content": "\\udfff"}]}'], ("p.jsonl:1", "messages.0.content")),
])
def test_bad_prompts_files(tmp_path, lines, needles):
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    assert_user_error(cli("run", recipe(tmp_path, prompts=[], prompts_file="p.jsonl")), *needles)
    with pytest.raises(UserError, match=needles[0]):
        load_recipe(recipe(tmp_path, prompts=[], prompts_file="p.jsonl")).load_prompts()


@pytest.mark.parametrize("kind, needles", [
    ("directory", ("p.jsonl", "is a directory")),
    ("latin1", ("p.jsonl:2", "not UTF-8")),
    ("missing", ("p.jsonl", "not found")),
])
def test_prompts_files_that_are_not_text(tmp_path, kind, needles):
    p = tmp_path / "p.jsonl"
    if kind == "directory":
        p.mkdir()
    elif kind == "latin1":
        p.write_bytes(b'{"ids": [3]}\n{"text": "caf\xe9"}\n')
    assert_user_error(cli("run", recipe(tmp_path, prompts=[], prompts_file="p.jsonl")), "prompts_file", *needles)


@pytest.mark.parametrize("sections, needles", [
    ({"prompts_file": ""}, ("prompts_file",)),
    ({"prompts": []}, ("give prompts or prompts_file",)),
    ({"prompts": [{"text": ""}]}, ("prompts.0.text",)),
    ({"prompts": [{"text": "\ud800"}]}, ("prompts.0.text", "surrogate")),
    ({"prompts": [{"ids": [3]}, {"ids": [True]}]}, ("prompts.1.ids.0", "True")),
    ({"prompts": [{"ids": [2.0]}]}, ("prompts.0.ids.0", "2.0")),
    ({"prompts": [{"ids": [-3]}]}, ("prompts.0.ids.0", "-3")),
])
def test_bad_recipe_prompts(tmp_path, no_model, sections, needles):
    assert_user_error(cli("run", recipe(tmp_path, **sections)), "r.yaml", *needles)


# ---- 6. eval task files ---------------------------------------------------------------------------------

GOOD_TASK = {"id": "a", "prompt_ids": [3, 4], "reference_ids": [5]}


@pytest.mark.parametrize("task, needles", [
    ({"prompt_ids": ["3"], "reference_ids": [5]}, ("prompt_ids.0", "'3'")),
    ({"prompt_ids": [3.5], "reference_ids": [5]}, ("prompt_ids.0", "3.5")),
    ({"prompt_ids": [3], "reference_ids": [True]}, ("reference_ids.0", "True")),
    ({"prompt_ids": [[3]], "reference_ids": [5]}, ("prompt_ids.0",)),
    ({"prompt_ids": [3], "reference_ids": [-5]}, ("reference_ids.0", "-5")),
    ({"prompt_ids": 3, "reference_ids": [5]}, ("prompt_ids", "list")),
    ({"id": True, "prompt_ids": [3], "reference_ids": [5]}, ("id", "True")),
    ({"id": [1], "prompt_ids": [3], "reference_ids": [5]}, ("id",)),
    ({"prompt": 7, "reference_ids": [5]}, ("prompt", "7")),
    ({"prompt": "x\ud800", "reference_ids": [5]}, ("prompt", "surrogate")),
])
def test_bad_tasks(tmp_path, task, needles):
    file = tmp_path / "t.jsonl"
    file.write_text(json.dumps(GOOD_TASK) + "\n" + json.dumps(task) + "\n")
    with pytest.raises(UserError, match="t.jsonl:2: ") as e:
        load_tasks(file)
    assert all(n in str(e.value) for n in needles), (needles, str(e.value))
    assert_user_error(cli("eval", write(tmp_path / "e.yaml", EVAL)), "t.jsonl:2", *needles)


@pytest.mark.parametrize("kind, needles", [
    ("directory", ("t.jsonl", "is a directory")),
    ("latin1", ("t.jsonl:2", "not UTF-8")),
    ("empty", ("t.jsonl", "holds no tasks")),
])
def test_task_files_that_are_not_tasks(tmp_path, kind, needles):
    file = tmp_path / "t.jsonl"
    if kind == "directory":
        file.mkdir()
    else:
        file.write_bytes(b"\n\n" if kind == "empty" else json.dumps(GOOD_TASK).encode() + b'\n{"prompt": "\xe9"}\n')
    with pytest.raises(UserError, match=needles[0]):
        load_tasks(file)
    assert_user_error(cli("eval", write(tmp_path / "e.yaml", EVAL)), "task file", *needles)


def test_a_task_id_may_be_an_int_and_other_keys_are_kept_out(tmp_path):
    file = tmp_path / "t.jsonl"
    file.write_text(json.dumps({**GOOD_TASK, "id": 7, "meta": {"x": 1}}) + "\n" + json.dumps(GOOD_TASK) + "\n")
    assert [t.id for t in load_tasks(file)] == ["7", "a"]


# ---- 6. unknown keys name the closest allowed key (issue 32 item 6) ----------------------------------------------

@pytest.mark.parametrize("sections, needles", [
    ({"generation": {"max_tokens": 32}}, ("generation.max_tokens", "did you mean max_new_tokens?")),
    ({"model": {**MODEL, "dtyp": "float32"}}, ("model.dtyp", "did you mean dtype?")),
    ({"prompts": [{"txt": "hi"}]}, ("prompts.0.txt", "did you mean text?")),
    ({"batch_sise": 2}, ("batch_sise", "did you mean batch_size?")),
    ({"prefill": {"chunks": 8}}, ("prefill.chunks", "did you mean chunk?")),
    ({"policy": {"name": "threshold", "treshold": 0.9}}, ("policy.treshold", "did you mean threshold?")),
])
def test_unknown_keys_say_did_you_mean(tmp_path, no_model, sections, needles):
    assert_user_error(cli("run", recipe(tmp_path, **sections)), "r.yaml", *needles)
    with pytest.raises(UserError, match="did you mean"):
        load_recipe(recipe(tmp_path, **sections))


def test_unknown_set_keys_say_did_you_mean(tmp_path, no_model):
    path = recipe(tmp_path)
    assert_user_error(cli("run", path, "--set", "generation.max_tokens=32"), "generation.max_tokens",
                      "Extra inputs are not permitted", "did you mean max_new_tokens?")
    assert_user_error(cli("run", path, "--set", "policy.edit_treshold=0.5", "--set", "policy.name=t2t"),
                      "policy.edit_treshold", "did you mean edit_threshold?")
    res = cli("run", path, "--set", "zzz=1")  # nothing close: no guess
    assert_user_error(res, "zzz", "Extra inputs")
    assert "did you mean" not in res.output
    assert_user_error(cli("eval", write(tmp_path / "e.yaml", {**EVAL, "max_tokens": 4})), "max_tokens",
                      "did you mean max_new_tokens?")
