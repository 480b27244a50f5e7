"""The CLI end to end (typer CliRunner) and every bad input a user can give: one line, exit 2, no traceback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from compiledllm.cli import app
from checkpoints import EOS_ID, MASK_ID, write_checkpoint, write_tokenizer
from user_errors import assert_user_error

runner = CliRunner()


def write_recipe(tmp_path: Path, **sections) -> Path:
    recipe = {
        "model": {"path": "tiny-llada2-random"},
        "policy": {"name": "threshold", "block_size": 8, "threshold": 0.9},
        "generation": {"max_new_tokens": 12},
        "prompts": [{"ids": [3, 4, 5]}, {"ids": list(range(10, 30))}],
        "batch_size": 2,
        "output": str(tmp_path / "out.jsonl"),
    }
    recipe.update(sections)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_run_writes_results_and_summary(tmp_path):
    res = run_cli("run", write_recipe(tmp_path))
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == [0, 1]
    for r in rows:
        assert set(r) >= {"prompt_ids", "output_ids", "steps", "latency_s"}
        assert 1 <= len(r["output_ids"]) <= 12 and r["steps"] >= 1
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["tokens"] == sum(len(r["output_ids"]) for r in rows)
    assert summary["forwards"] == sum(r["steps"] for r in rows)
    assert "tokens/s" in res.output


def test_set_overrides_and_stdout_output(tmp_path):
    res = run_cli("run", write_recipe(tmp_path), "--set", "output=null", "--set", "generation.max_new_tokens=3",
                  "--set", "policy.name=t2t", "--set", "policy.threshold=0.6")
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    assert len(rows) == 2 and all(len(r["output_ids"]) <= 3 for r in rows)


def test_text_prompts_and_prompts_file(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    write_tokenizer(ckpt)
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n"
                                      + json.dumps({"messages": [{"role": "user", "content": "the fox"}]}) + "\n")
    path = write_recipe(tmp_path, model={"path": str(ckpt)}, prompts=[{"ids": [5, 6]}], prompts_file="p.jsonl",
                        policy={"name": "threshold", "block_size": 4, "threshold": 0.5})
    res = run_cli("run", path)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(isinstance(r["text"], str) for r in rows)


def test_python_api_run_matches_cli(tmp_path):
    import compiledllm

    path = write_recipe(tmp_path)
    results = compiledllm.run(path)
    assert run_cli("run", path).exit_code == 0
    rows = {r["index"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert [r.output_ids for r in results] == [rows[i]["output_ids"] for i in range(2)]


# ---- bad input -------------------------------------------------------------------------------------------

def ckpt_recipe(tmp_path, ckpt: Path, **kw) -> Path:
    return write_recipe(tmp_path, model={"path": str(ckpt)}, policy={"name": "threshold", "block_size": 4}, **kw)


def test_missing_recipe(tmp_path):
    assert_user_error(run_cli("run", tmp_path / "nope.yaml"), "nope.yaml", "not found")


@pytest.mark.parametrize("section,needle", [
    ({"batch_size": 0}, "batch_size"),
    ({"bogus_key": 1}, "bogus_key"),
    ({"policy": {"name": "threshold", "threshold": 2.0}}, "policy.threshold"),
    ({"policy": {"name": "threshold", "treshold": 0.5}}, "policy.treshold"),
    ({"policy": {"name": "nope"}}, "policy.name"),
    ({"generation": {"max_new_tokens": "many"}}, "generation.max_new_tokens"),
    ({"model": {"path": "tiny-llada2-random", "dtype": "int4"}}, "model.dtype"),
    ({"prompts": [{"ids": [1], "text": "x"}]}, "prompts.0"),
])
def test_bad_recipe_values(tmp_path, section, needle):
    assert_user_error(run_cli("run", write_recipe(tmp_path, **section)), needle)


def test_malformed_yaml(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: [unclosed\n")
    assert_user_error(run_cli("run", path), "r.yaml", "malformed YAML")


def test_bad_set_syntax(tmp_path):
    assert_user_error(run_cli("run", write_recipe(tmp_path), "--set", "novalue"), "--set")


def test_missing_config(tmp_path):
    (tmp_path / "m").mkdir()
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, tmp_path / "m")), "config.json", "not found")


def test_malformed_config(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "llada2", 0)
    (ckpt / "config.json").write_text("{not json")
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt)), "config.json", "malformed JSON")


def test_config_missing_key(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt)), "hidden_size")


def test_unknown_architecture(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt)), "unknown architecture", "GPT2LMHeadModel")


def _edit_tensors(ckpt: Path, edit) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_tensor(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "llada2", 0)
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt)), "lacks", "experts.3.up_proj")


def test_extra_tensor(tmp_path):
    import torch

    ckpt = write_checkpoint(tmp_path / "m", "llada", 0)
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.transformer.extra.weight", torch.zeros(2)))
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt)), "does not use", "extra.weight")


def test_misshapen_tensor(tmp_path):
    import torch

    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.ones(3)))
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt)), "model.norm.weight", "shape")


def test_pickle_checkpoint_refused(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"not unpickled")
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt)), "pytorch_model.bin", "safetensors only")


def test_corrupt_safetensors(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage")
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt)), "model.safetensors")


def test_prompt_longer_than_context(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0, max_position_embeddings=64)
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt, prompts=[{"ids": [5] * 60}])), "context", "64")


def test_ids_out_of_vocabulary(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt, prompts=[{"ids": [5, 100000]}])),
                      "100000", "vocabulary")


def test_text_prompt_without_tokenizer(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    assert_user_error(run_cli("run", ckpt_recipe(tmp_path, ckpt, prompts=[{"text": "hi"}])), "tokenizer")


def test_mask_id_out_of_vocabulary(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    path = write_recipe(tmp_path, model={"path": str(ckpt), "mask_token_id": 5000})
    assert_user_error(run_cli("run", path), "mask_token_id", "5000")


def test_batch_larger_than_memory(tmp_path, monkeypatch):
    from compiledllm.engine import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 10)
    monkeypatch.setattr(memory, "check_weights_fit", lambda *a: None)  # the weights' own check (loader.place)
    assert_user_error(run_cli("run", write_recipe(tmp_path)), "batch_size", "GiB")


def test_special_ids_resolution_order(tmp_path):
    """Recipe value, else config, else tokenizer special tokens, else the architecture default."""
    import compiledllm

    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    write_tokenizer(ckpt)
    assert compiledllm.load_model(ckpt).mask_token_id == MASK_ID  # from config
    assert compiledllm.load_model(ckpt, mask_token_id=7).mask_token_id == 7  # recipe wins
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["mask_token_id"], cfg["eos_token_id"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model = compiledllm.load_model(ckpt)  # from the tokenizer's special tokens
    assert (model.mask_token_id, model.eos_token_id) == (MASK_ID, EOS_ID)
    assert model.tokenizer.decode(model.tokenizer.encode("hello world")) == "hello world"


def test_output_into_new_folder_and_unwritable_output(tmp_path):
    res = run_cli("run", write_recipe(tmp_path), "--output", tmp_path / "new" / "dir" / "r.jsonl")
    assert res.exit_code == 0 and (tmp_path / "new" / "dir" / "r.jsonl").exists(), res.output
    (tmp_path / "file").write_text("x")
    assert_user_error(run_cli("run", write_recipe(tmp_path), "--output", tmp_path / "file" / "r.jsonl"), "output")


@pytest.mark.parametrize("name", ["flowblock", "flowblock_sync"])
def test_flowblock_runs_from_a_recipe_with_its_statistics(tmp_path, name):
    pol = {"name": name, "block_size": 4, "window": 2, "spawn": 0.0, "threshold": 0.9}
    res = run_cli("run", write_recipe(tmp_path, policy=pol))
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["output_ids"] for r in rows)
    assert all(set(r["policy_stats"]) == {"front_drafts", "down_drafts", "front_edits", "down_edits"} for r in rows)
    assert_user_error(run_cli("run", write_recipe(tmp_path, policy={**pol, "readiness": "later"})), "readiness")


# ---- global options, tables at 80 columns, recipe show ---------------------------------------------------

def rendered(table) -> str:
    from rich.console import Console

    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(table)
    return console.export_text()


def test_summary_table_fits_80_columns():
    from compiledllm.cli import summary_table
    from compiledllm.runner import Summary

    summary = Summary(model="tiny-llada2", policy="threshold", device="cuda:0", prompts=1024, tokens=2_621_440,
                      forwards=1_048_576, tokens_per_forward=2.5, wall_s=12345.67, tokens_per_s=21234.5,
                      load_s=123.45, startup_s=1234.56, compile=True)
    text = rendered(summary_table(summary))
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    for word in ("prompts", "tokens", "forwards", "per", "forward", "tokens/s", "wall s", "load s", "startup s",
                 "2621440", "1048576", "21234.5", "12345.67", "1234.56"):
        assert word in text, (word, text)


def test_version_option_and_command():
    from compiledllm import __version__

    for args in (["--version"], ["--version", "run", "missing.yaml"], ["version"]):
        res = run_cli(*args)
        assert res.exit_code == 0 and res.output.strip() == __version__, (args, res.output)


def test_help_names_what_the_tool_does():
    res = run_cli("--help")
    assert res.exit_code == 0 and "Run, evaluate, profile, export and serve" in res.output
    assert "serve" in res.output.split("Commands")[1]  # the command it names is there


def test_the_policy_option_names_every_registered_policy():
    from compiledllm.cli import POLICY_HELP
    from compiledllm.policies import POLICIES

    named = set(POLICY_HELP.split("(")[1].split(";")[0].split(", "))
    builtin = {n for n, (_, cls) in POLICIES.items() if cls.__module__.startswith("compiledllm.policies.")}
    assert named == builtin, named ^ builtin  # (tests register policies of their own)


@pytest.mark.parametrize("level", ["loud", "", "WARN"])
def test_bad_log_level_is_one_line(level):
    assert_user_error(run_cli("--log-level", level, "version"), "--log-level", repr(level))


def test_log_level_sets_the_compiledllm_logger():
    import logging

    assert run_cli("--log-level", "DEBUG", "version").exit_code == 0
    assert logging.getLogger("compiledllm").getEffectiveLevel() == logging.DEBUG
    assert logging.getLogger("torch._dynamo").getEffectiveLevel() == logging.WARNING  # torch stays quiet
    assert run_cli("--log-level", "error", "version").exit_code == 0
    assert logging.getLogger("compiledllm").getEffectiveLevel() == logging.ERROR
    assert logging.getLogger("torch._inductor").getEffectiveLevel() == logging.ERROR
    assert run_cli("version").exit_code == 0  # back to the default: nothing carries over
    assert logging.getLogger("compiledllm").getEffectiveLevel() == logging.WARNING


def test_quiet_run_prints_no_table_but_writes_results(tmp_path):
    res = run_cli("-q", "run", write_recipe(tmp_path), "--set", "generation.max_new_tokens=4")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "", res.stdout
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    assert_user_error(run_cli("--quiet", "run", tmp_path / "nope.yaml"), "nope.yaml")  # errors still shown


def test_recipe_show_round_trips(tmp_path):
    from compiledllm.recipe import load_recipe, resolved_recipe

    path = write_recipe(tmp_path)
    data = yaml.safe_load(path.read_text())  # JSON is YAML whose strings are quoted: "1e-3" stays a string
    path.write_text(json.dumps({**data, "prompts": [{"ids": [3, 4]}, {"text": "1e-3"}, {"text": "yes"}]}))
    res = run_cli("recipe", "show", path, "--set", "batch_size=3")
    assert res.exit_code == 0, res.output
    shown = tmp_path / "shown.yaml"
    shown.write_text(res.stdout)
    given = load_recipe(path, ["batch_size=3"])
    again = load_recipe(shown)
    assert again.policy_config() == given.policy_config()
    assert resolved_recipe(again) == resolved_recipe(given)
    assert again.prompts[1].text == "1e-3" and again.prompts[2].text == "yes"
    data = yaml.safe_load(res.stdout)  # every default written out, the policy's included
    assert data["batch_size"] == 3 and data["compile"] == "auto" and data["model"]["dtype"] == "float32"
    assert data["policy"] == {"name": "threshold", "block_size": 8, "temperature": 0.0, "top_k": None,
                              "top_p": None, "seed": 0, "threshold": 0.9, "steps": None,
                              "rule": "engine", "commit": "auto", "verify": False, "gamma": 0.8,
                              "verify_rule": "agree", "search": 8}
    assert data["generation"] == {"max_new_tokens": 12, "max_seq_len": None, "ignore_eos": False}
    assert data["prefill"] == {"chunk": 4096, "tokens": 16384, "compile": "auto", "priority": "throughput",
                               "first_step": True, "compile_small": False}
    assert run_cli("recipe", "show", shown).stdout.splitlines()[2:] == res.stdout.splitlines()[2:]


def test_recipe_show_errors_are_one_line(tmp_path):
    assert_user_error(run_cli("recipe", "show", tmp_path / "nope.yaml"), "nope.yaml", "not found")
    assert_user_error(run_cli("recipe", "show", write_recipe(tmp_path, batch_size=0)), "batch_size")
    assert_user_error(run_cli("recipe", "show", write_recipe(tmp_path), "--set", "policy.treshold=1"),
                      "policy.treshold")
    assert_user_error(run_cli("recipe", "show", write_recipe(tmp_path), "--eval"), "tasks")


@pytest.mark.parametrize("quiet", [[], ["-q"]])
def test_log_lines_show_under_quiet(tmp_path, quiet):
    """-q silences progress bars and tables, not the log lines asked for (issue 32 item 6)."""
    res = run_cli(*quiet, "--log-level", "debug", "run", write_recipe(tmp_path), "--set",
                  "generation.max_new_tokens=4")
    assert res.exit_code == 0, res.output
    logged = [line for line in res.stderr.splitlines() if line.startswith(("INFO ", "DEBUG "))]
    assert any(line.startswith("INFO compiledllm.cli: ") and "tiny-llada2-random" in line for line in logged), res.stderr
    assert any(line.startswith("DEBUG compiledllm.cli: ") for line in logged), res.stderr
    assert any("2 prompts" in line and "forwards" in line for line in logged), res.stderr
    if quiet:
        assert res.stdout.strip() == "", res.stdout
    res = run_cli(*quiet, "--log-level", "warning", "run", write_recipe(tmp_path), "--set",
                  "generation.max_new_tokens=4")
    assert res.exit_code == 0 and "INFO" not in res.stderr, res.stderr


def test_progress_without_a_terminal_prints_lines(monkeypatch):
    """Where stderr is no terminal rich draws no bar: LineProgress prints a line when the description or count
    changed, at most one every EVERY seconds and none before the first EVERY seconds (a short run stays quiet)."""
    import io

    from rich.console import Console
    from rich.progress import BarColumn, TextColumn

    from compiledllm.cli import LineProgress

    def run(every):
        monkeypatch.setattr(LineProgress, "EVERY", every)
        sink = io.StringIO()
        with LineProgress(TextColumn("[bold]eval[/] {task.description}"), BarColumn(), transient=True,
                          console=Console(file=sink, force_terminal=False, width=200)) as bar:
            task = bar.add_task("loading", total=None)
            bar.update(task, description="lists.jsonl: t2t", total=4)
            bar.advance(task)
            bar.advance(task, 0)  # nothing changed: no line
            bar.update(task, description="lists.jsonl: flowblock")
        return [ln for ln in sink.getvalue().splitlines() if ln]  # rich ends a transient display with a newline

    assert run(30.0) == []
    lines = run(0.0)
    assert [ln.rsplit("  ", 1)[0] for ln in lines] == ["eval lists.jsonl: t2t  0/4", "eval lists.jsonl: t2t  1/4",
                                                       "eval lists.jsonl: flowblock  1/4"]
    assert all(ln.endswith(" s") for ln in lines)
