"""Fast failures (issue 32 item 4): the command line checks its arguments, the recipe and the model's path before
torch or the model code is imported. Each case runs in a fresh interpreter and asserts on what it imported (not on
the time it took: this machine's load varies); the times measured are in the issue's report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import compiledllm

ROOT = Path(compiledllm.__file__).resolve().parents[1]

# Runs the CLI in-process, then reports its exit code, its stderr and whether torch (or the engine) was imported.
PROBE = """\
import contextlib, io, json, sys
from compiledllm.cli import main
err = io.StringIO()
sys.argv = ["compiledllm", *json.loads(sys.argv[1])]
code = 0
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
heavy = sorted(m for m in ("torch", "compiledllm.engine", "compiledllm.loader", "compiledllm.policies",
                           "compiledllm.runner", "compiledllm.tokenizer") if m in sys.modules)
print(json.dumps({"code": code, "stderr": err.getvalue(), "heavy": heavy}))
"""


def env(tmp_path: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "COLUMNS": "400",
            "PYTHONPATH": str(ROOT)}


def probe(tmp_path: Path, *args: str) -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], cwd=tmp_path, env=env(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_python_m_compiledllm_run_missing_recipe_imports_no_torch(tmp_path):
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "compiledllm", "run", "missing.yaml"],
                         cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert imported and "typer" in imported  # -X importtime did report
    assert "torch" not in imported and "compiledllm.engine" not in imported, sorted(imported)
    errors = [line for line in res.stderr.splitlines() if not line.startswith("import time:") and line.strip()]
    assert errors == ["error: missing.yaml: recipe not found"], errors


@pytest.mark.parametrize("args, code, needles", [
    (["--help"], 0, ()),
    (["run", "--help"], 0, ()),
    (["recipe", "show", "--help"], 0, ()),
    (["run", "missing.yaml"], 2, ("missing.yaml: recipe not found",)),
    (["-q", "--log-level", "error", "run", "missing.yaml"], 2, ("missing.yaml: recipe not found",)),
    (["recipe", "show", "missing.yaml"], 2, ("missing.yaml: recipe not found",)),
    (["eval", "missing.yaml"], 2, ("missing.yaml: eval recipe not found",)),
    (["profile", "missing.yaml"], 2, ("missing.yaml: recipe not found",)),
    (["bench", "missing.yaml"], 2, ("missing.yaml: recipe not found",)),
    (["export", "missing.yaml", "--out", "x"], 2, ("missing.yaml: recipe not found",)),
    (["run", "nosuch"], 2, ("nosuch", "not a recipe file", "tiny-llada2", "ORG/NAME")),
    (["run", "tiny-llada2"], 2, ("tiny-llada2", "no prompts", "--prompt")),
    (["run", "tiny-llada2", "--prompt", "x", "--set", "generation.max_tokens=3"], 2,
     ("generation.max_tokens", "did you mean max_new_tokens")),
    (["run", "tiny-llada2", "--prompts", "none.jsonl"], 2, ("--prompts", "none.jsonl", "not found")),
    (["run", "acme/absent", "--prompt", "x"], 2, ("acme/absent", "HF_HUB_OFFLINE", "hf download acme/absent")),
])
def test_failures_before_torch(tmp_path, args, code, needles):
    out = probe(tmp_path, *args)
    assert out["code"] == code, out
    assert out["heavy"] == [], out
    for n in needles:
        assert n in out["stderr"], (n, out)
    if code == 2:
        assert len(out["stderr"].strip().splitlines()) == 1, out


def test_a_hub_recipe_without_the_model_fails_before_torch(tmp_path):
    (tmp_path / "r.yaml").write_text("model: {path: acme/absent}\nprompts: [{text: hi}]\n")
    out = probe(tmp_path, "run", "r.yaml")
    assert out["code"] == 2 and out["heavy"] == [], out
    assert "acme/absent" in out["stderr"] and "hf download" in out["stderr"], out


def test_import_compiledllm_is_light_and_its_names_still_resolve(tmp_path):
    code = ("import sys, compiledllm; assert 'torch' not in sys.modules, 'import compiledllm imported torch'; "
            "import compiledllm.recipe, compiledllm.cli; assert 'torch' not in sys.modules, 'recipe/cli: torch'; "
            "names = [getattr(compiledllm, n) for n in compiledllm.__all__]; "
            "from compiledllm import load_model, run, generate, LLM, SamplingParams, Recipe, UserError; "
            "from compiledllm.recipe import POLICIES, PolicyConfig; assert 'threshold' in POLICIES; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_builtin_names_agree_with_the_builtins():
    from compiledllm.builtin import BUILTINS
    from compiledllm.builtin_names import BUILTIN_NAMES

    assert list(BUILTIN_NAMES) == list(BUILTINS)
