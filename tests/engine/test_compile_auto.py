"""`compile: auto` (issue 31 item 3): resolved for the model's device once, in the Engine (compiled on CUDA, not on
the CPU), true / false as given, anything else a one-line error; Inductor's and Triton's caches in the user's
cache directory unless the user chose one; the start-up's progress and what Inductor's cache held, reported.
CPU only and fast: nothing here runs a real torch.compile (tests/engine/test_gpu_engine.py runs the default on
CUDA)."""
from __future__ import annotations

import io
import os

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

import compiledllm
from compiledllm import compile_cache
from compiledllm.cli import app, startup_line
from compiledllm.compile_cache import INDUCTOR, TRITON, CacheReport, cache_root, cache_state, planned
from compiledllm.engine import Engine, EngineConfig
from compiledllm.engine.compile import resolve_compile
from compiledllm.errors import UserError
from compiledllm.recipe import load_recipe
from user_errors import assert_user_error

POL = {"name": "threshold", "block_size": 8}
RECIPE = {"model": {"path": "tiny-llada2-random"}, "policy": POL, "generation": {"max_new_tokens": 8},
          "prompts": [{"ids": [3, 4, 5]}, {"ids": [6, 7]}], "batch_size": 2, "output": None}
EVAL = {"model": {"path": "tiny-llada2-random"}, "tasks": ["t.jsonl"], "policies": [POL], "max_new_tokens": 4,
        "output": None}
runner = CliRunner()


@pytest.fixture(scope="module")
def model():
    return compiledllm.load_model("tiny-llada2-random")


# ---- resolving auto --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, device, want", [
    ("auto", "cpu", False), ("auto", "cuda", True), ("auto", "cuda:1", True),
    (True, "cpu", True), (False, "cuda", False), (True, "cuda:0", True), (False, "cpu", False),
])
def test_auto_compiles_on_cuda_only_and_true_false_are_kept(value, device, want):
    import torch

    assert resolve_compile(value, device) is want
    assert resolve_compile(value, torch.device(device)) is want  # no GPU needed to say what CUDA would do


def test_the_engine_resolves_auto_for_its_model(model):
    for given, want in (("auto", False), (True, True), (False, False)):
        engine = Engine(model, EngineConfig(POL, max_new_tokens=4, compile=given))
        assert engine.config.compile == given and engine.compile is want  # what was asked, what runs


def test_recipes_default_to_auto_and_take_true_false_auto():
    assert load_recipe(RECIPE).compile == "auto"
    for value, want in (("auto", "auto"), ("true", True), ("false", False), ("True", True)):
        assert load_recipe(RECIPE, [f"compile={value}"]).compile == want
    assert EngineConfig.from_recipe(load_recipe(RECIPE)).compile == "auto"  # the Engine resolves it


def test_a_cpu_run_with_the_default_is_not_compiled():
    """CPU behaviour as before auto: eager, nothing before the first step, no cache touched or reported."""
    from compiledllm.runner import execute

    results, summary = execute(load_recipe(RECIPE))
    assert len(results) == 2 and summary.compile is False and summary.startup_s == 0.0
    assert summary.compile_cache is None and startup_line(False, summary.startup_s, None) is None


def test_llm_defaults_to_auto_and_takes_it(model):
    assert compiledllm.LLM(model).config.compile == "auto"
    assert compiledllm.LLM(model, compile=True).config.compile is True
    llm = compiledllm.LLM(model, compile="auto", policy=POL)
    llm.generate([[3, 4, 5]], compiledllm.SamplingParams(max_tokens=4))
    assert llm.engine.compile is False  # on the CPU
    with pytest.raises(UserError, match="compile: true or false, or auto") as e:
        compiledllm.LLM(model, compile="on")
    assert "\n" not in str(e.value)


# ---- bad values: one line naming the key and what it takes -------------------------------------------------------

@pytest.mark.parametrize("value", ["yes", "Auto", "1", "null", "[auto]", "on"])
def test_bad_compile_values_are_one_line_cli_errors(tmp_path, value):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    res = runner.invoke(app, ["run", str(path), "--set", f"compile={value}"])
    assert_user_error(res, "r.yaml", "compile", "true or false", "auto")


def test_bad_compile_values_in_recipe_and_eval_files(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(RECIPE) + "compile: sometimes\n")
    assert_user_error(runner.invoke(app, ["run", str(path)]), "r.yaml", "compile", "auto", "'sometimes'")
    (tmp_path / "t.jsonl").write_text('{"prompt_ids": [3, 4], "reference_ids": [5]}\n')
    ev = tmp_path / "e.yaml"
    ev.write_text(yaml.safe_dump({**EVAL, "compile": "yes"}))
    assert_user_error(runner.invoke(app, ["eval", str(ev)]), "e.yaml", "compile", "auto", "'yes'")
    ev.write_text(yaml.safe_dump(EVAL))
    from compiledllm.evaluate import load_eval_recipe

    assert load_eval_recipe(ev).compile == "auto" and load_eval_recipe(ev, ["compile=false"]).compile is False


def test_recipe_show_writes_the_default_out(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    res = runner.invoke(app, ["recipe", "show", str(path)])
    assert res.exit_code == 0 and "\ncompile: auto\n" in res.output, res.output


# ---- the cache directories -------------------------------------------------------------------------------------

def test_the_cache_root_follows_the_override_then_xdg_then_home(tmp_path):
    home = {"HOME": str(tmp_path / "home")}
    assert cache_root(home) == tmp_path / "home" / ".cache" / "compiledllm"
    assert cache_root({**home, "XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "compiledllm"
    assert cache_root({**home, "XDG_CACHE_HOME": "relative/xdg"}) == tmp_path / "home" / ".cache" / "compiledllm"
    assert cache_root({**home, "XDG_CACHE_HOME": str(tmp_path / "xdg"),
                       "COMPILEDLLM_CACHE_DIR": str(tmp_path / "mine")}) == tmp_path / "mine"


def test_planned_directories_leave_the_users_alone(tmp_path):
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    root = tmp_path / "xdg" / "compiledllm"
    torch_default = "/tmp/torchinductor_someone"
    want = {INDUCTOR: str(root / "inductor"), TRITON: str(root / "triton")}
    assert planned(env, {}, torch_default) == want
    # torch writes its default into the environment itself (importing Dynamo): not the user's choice
    assert planned({**env, INDUCTOR: torch_default, TRITON: torch_default + "/triton/0"}, {}, torch_default) == want
    # the user's: set before the process began (even to torch's default), or set since to another directory
    given = {INDUCTOR: torch_default}
    assert planned({**env, INDUCTOR: torch_default}, given, torch_default) == {TRITON: want[TRITON]}
    assert planned({**env, INDUCTOR: "/data/ind", TRITON: "/data/tri"}, {}, torch_default) == {}


def test_use_cache_sets_only_what_the_user_left(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "GIVEN", {})
    monkeypatch.setenv("COMPILEDLLM_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv(INDUCTOR, raising=False)
    monkeypatch.delenv(TRITON, raising=False)
    assert compile_cache.use_cache() == str(tmp_path / "c" / "inductor")
    assert os.environ[INDUCTOR] == str(tmp_path / "c" / "inductor")
    assert os.environ[TRITON] == str(tmp_path / "c" / "triton")
    assert (tmp_path / "c" / "inductor").is_dir()
    monkeypatch.setenv(INDUCTOR, str(tmp_path / "users"))  # a user's TORCHINDUCTOR_CACHE_DIR stays
    monkeypatch.setenv(TRITON, str(tmp_path / "users_triton"))
    assert compile_cache.use_cache() == str(tmp_path / "users")
    assert os.environ[TRITON] == str(tmp_path / "users_triton")


def test_an_unusable_cache_root_leaves_torchs_default(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(compile_cache, "GIVEN", {})
    monkeypatch.setenv("COMPILEDLLM_CACHE_DIR", str(blocker))
    monkeypatch.delenv(INDUCTOR, raising=False)
    monkeypatch.delenv(TRITON, raising=False)
    compile_cache.use_cache()
    assert INDUCTOR not in os.environ and TRITON not in os.environ


# ---- what a start-up reports ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("counts, state", [
    ((3, 0, 3), "cold"), ((3, 3, 0), "warm"), ((3, 1, 2), "partly warm"), ((0, 0, 0), "in process"),
    ((2, 0, 0), "uncounted"),
])
def test_cache_states(counts, state):
    assert cache_state(*counts) == state
    report = CacheReport.between("/c", (5, 7, 9), tuple(a + b for a, b in zip((5, 7, 9), counts)))
    assert report.state == state and (report.graphs, report.loaded, report.compiled) == counts
    line = startup_line(True, 12.5, report)
    assert line.startswith("start-up 12.50 s: compiled") and "\n" not in line
    assert (f"cache {state}" in line) == (state in ("cold", "warm", "partly warm"))


def test_a_compiled_start_up_reports_its_progress_and_cache(model, tmp_path, monkeypatch):
    """The start-up loop with compile on, its regions left eager (a real compile costs ~30 s on 2 cores): every
    (phase, bucket) reported, the cache directories set first, the report in the engine and the run's summary."""
    from compiledllm.engine import stepper
    from compiledllm.engine.step import Regions, finish_phase

    monkeypatch.setattr(stepper, "compiled_regions", lambda m: Regions(tuple(m.layers), finish_phase))
    monkeypatch.setattr(compile_cache, "GIVEN", {})
    monkeypatch.setenv("COMPILEDLLM_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv(INDUCTOR, raising=False)
    monkeypatch.delenv(TRITON, raising=False)
    seen = []
    engine = Engine(model, EngineConfig(POL, max_new_tokens=8, batch_size=4, compile=True, buckets=[1, 2, 4]))
    eager = Engine(model, EngineConfig(POL, max_new_tokens=8, batch_size=4)).generate([[3, 4, 5], [6, 7], [8]])
    got = engine.generate([[3, 4, 5], [6, 7], [8]], on_startup=lambda *a: seen.append(a))
    assert [r.output_ids for r in got] == [r.output_ids for r in eager]
    n = len(engine.policy.phases) * 3  # three prompts: a session of three slots, buckets 1, 2 and 3
    assert [s[:2] for s in seen] == [(i, n) for i in range(n + 1)]
    assert all(what.startswith("compile · bucket ") for _, _, what in seen[:-1]) and seen[-1][2] == "compile"
    assert os.environ[INDUCTOR] == str(tmp_path / "c" / "inductor")
    assert engine.compile_cache == CacheReport(str(tmp_path / "c" / "inductor"), 0, 0, 0, "in process")
    assert engine.startup_s > 0


def test_the_run_display_shows_the_start_up_then_the_decoding_bar():
    from compiledllm.live import RunDisplay

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100, color_system=None)
    with RunDisplay(console, None, 2, 8) as display:
        display.on_startup(0, 4, "compile + capture · bucket 2 · decode")
        assert display.startup_task is not None
        display.live.refresh()
        display.on_startup(4, 4, "compile + capture")
        assert display.startup_task is None and display.bar.tasks[0].completed == 0
    assert "start-up" in buf.getvalue() and "bucket 2" in buf.getvalue()


def test_bench_shows_the_start_up_as_a_second_row():
    from rich.progress import Progress

    from compiledllm.cli import StartupRow

    bar = Progress(console=Console(file=io.StringIO()))
    bar.add_task("prompt 512 · output 64 · batch 8", total=1)
    row = StartupRow(bar)
    row(0, 3, "compile + capture · bucket 4 · decode")
    assert [t.description for t in bar.tasks][1] == "start-up: compile + capture · bucket 4 · decode"
    row(2, 3, "compile + capture · bucket 1 · decode")
    assert bar.tasks[1].completed == 2 and len(bar.tasks) == 2
    row(3, 3, "compile + capture")
    assert len(bar.tasks) == 1  # gone once the steps are ready; the next engine's start-up gets a new row
