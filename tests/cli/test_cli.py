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


def test_profile_writes_trace_report_and_chart(tmp_path):
    res = run_cli("profile", write_recipe(tmp_path), "--out", tmp_path / "prof")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "prof" / "profile.json").read_text())
    phases = {r["phase"]: r for r in report["phases"]}
    assert {"attention", "moe", "mlp", "projections", "head", "acceptance"} <= set(phases)
    assert 0 < report["steps"] <= report["summary"]["forwards"]  # engine steps; forwards count each slot's
    assert all(r["total_ms"] >= 0 for r in phases.values()) and phases["attention"]["total_ms"] > 0
    ops = report["top_cpu_ops"]
    assert ops and all(a["total_ms"] >= b["total_ms"] > 0 for a, b in zip(ops, ops[1:]))
    assert any(o["name"] == "aten::mm" or o["name"] == "aten::addmm" for o in ops)
    assert (tmp_path / "prof" / "trace.json").stat().st_size > 0
    assert (tmp_path / "prof" / "profile.png").read_bytes()[:4] == b"\x89PNG"


def test_profile_attributes_each_cuda_kernel_once():
    """On CUDA a labelled range also shows up as a device-side annotation spanning its kernels' GPU wall time:
    only the CPU range counts, and busy time counts each kernel once (synthetic profiler events)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from compiledllm.profiler import busy_ms, phase_times

    def event(i, name, start, end, device=DeviceType.CPU):
        return FunctionEvent(id=i, name=name, thread=0, start_us=start, end_us=end, use_device="cuda",
                             device_type=device)

    attn, inner = event(1, "phase::attention", 0, 100), event(2, "aten::mm", 10, 20)
    inner.append_kernel("gemm", 0, 30.0)
    attn.append_kernel("attn_kernel", 0, 50.0)
    inner.set_cpu_parent(attn)
    attn.append_cpu_child(inner)
    loose = event(3, "aten::add", 120, 130)
    loose.append_kernel("add", 0, 5.0)
    span = event(4, "phase::attention", 0, 400, DeviceType.CUDA)  # the GPU-side annotation: a 400 us span
    events = [attn, inner, loose, span]
    assert phase_times(events, cuda=True)["attention"] == pytest.approx(0.080)
    assert busy_ms(events) == pytest.approx(0.085)


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
