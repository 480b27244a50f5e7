"""`compiledllm bench` end to end on a tiny random model (CliRunner, CPU, eager), its pieces, and its user errors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from compiledllm import bench, bench_probe
from compiledllm.cli import app
from compiledllm.engine import Engine, EngineConfig
from compiledllm.loader import build_random
from compiledllm.models.presets import TINY_LLADA2
from compiledllm.recipe import load_recipe
from compiledllm.runner import load_from_spec
from user_errors import assert_user_error

runner = CliRunner()
# the tiny LLaDA2 layout with a 16-expert router (so that touched experts say something), one MoE layer
MODEL = {"init": "random", "config": dict(TINY_LLADA2, num_hidden_layers=2, num_experts=16, num_experts_per_tok=4,
                                          n_group=4, topk_group=2)}
POLICY = {"name": "threshold", "block_size": 8, "threshold": 0.9}
POINT_KEYS = {"prompt_len", "output_len", "batch_asked", "batch", "requests", "prompt_tokens", "generated_tokens",
              "wall_s", "startup_s", "compile_cache", "prefill_tokens", "prefill_forwards", "prefill_s",
              "prefill_tokens_per_s", "prefill_first_ms",
              "decode_steps", "decode_s", "decode_tokens_per_s", "decode_step_ms", "stalled_steps", "stall_max_ms",
              "stall_mean_ms", "output_tokens_per_s", "first_block_p50_s",
              "latency_p50_s", "latency_p90_s", "latency_p99_s", "peak_memory_bytes", "touched_experts",
              "touched_rows", "experts", "touched_uniform", "hooks_s", "sync_s", "policy_stats", "phases", "opening"}


def write_recipe(tmp_path: Path, **sections) -> Path:
    recipe = {"model": MODEL, "policy": POLICY,
              "generation": {"max_new_tokens": 8}, "prompts": [{"ids": [1, 2]}], "batch_size": 2}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe | sections))
    return path


def run_cli(*args):
    return runner.invoke(app, ["bench", *(str(a) for a in args)])


def test_bench_grid_end_to_end(tmp_path):
    res = run_cli(write_recipe(tmp_path), "--prompt-len", "24,40", "--output-len", "8,16", "--batch", "1,2",
                  "--requests", "3", "--out", tmp_path / "b.json", "--plot", tmp_path / "b.png")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "b.json").read_text())
    assert {"recipe", "model", "policy", "device", "torch", "settings", "points", "block"} <= set(report)
    assert report["device"] == "cpu" and report["routing"] == "balanced" and report["block"] == 8
    # the recipe asks for CUDA graphs (the default) but a CPU run has none: the report says what was used
    assert report["cuda_graphs"] is False and report["cuda_graphs_asked"] is True
    assert report["compile"] is False and report["compile_asked"] == "auto"  # auto: not compiled on the CPU
    assert report["prefill_compile"] is False and report["prefill_compile_asked"] == "auto"  # nor its prefill
    assert report["settings"]["rate"] == "inf" and report["settings"]["batches"] == [1, 2]
    points = report["points"]
    assert [(p["prompt_len"], p["output_len"], p["batch"]) for p in points] == [
        (pl, o, b) for pl in (24, 40) for o in (8, 16) for b in (1, 2)]
    for p in points:
        assert set(p) == POINT_KEYS, set(p) ^ POINT_KEYS
        assert p["requests"] == 3 and p["generated_tokens"] == 3 * p["output_len"]  # ignore_eos: every token made
        assert p["compile_cache"] is None  # not compiled
        # prefill: each prompt's whole blocks (24 -> 24, 40 -> 40 with block 8), once
        assert p["prefill_tokens"] == 3 * p["prompt_len"] and p["prompt_tokens"] == 3 * p["prompt_len"]
        assert p["output_tokens_per_s"] == pytest.approx(p["generated_tokens"] / p["wall_s"])
        assert p["decode_tokens_per_s"] == pytest.approx(p["generated_tokens"] / p["decode_s"])
        assert 0 < p["first_block_p50_s"] <= p["latency_p50_s"] <= p["latency_p90_s"] <= p["latency_p99_s"]
        assert p["latency_p99_s"] <= p["wall_s"] and p["peak_memory_bytes"] is None
        assert len(p["touched_experts"]) == 1 and 1 <= p["touched_experts"][0] <= 16 and p["experts"] == 16
        assert p["touched_rows"] == p["batch"]
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [ln for ln in res.output.splitlines() if ln.strip()]
    assert all(len(ln) <= 80 for ln in table), max(table, key=len)
    assert "…" not in res.output  # no column cut short
    # 3 requests on 2 slots: the third one's prefill runs while the other row decodes, and the table says so
    assert any(p["stalled_steps"] for p in report["points"]) and "waited for a prefill forward" in res.output
    assert all(0 <= p["stall_max_ms"] <= 1e3 * p["prefill_s"] for p in report["points"])
    rows = [ln.split() for ln in table if ln.split()[:1] in (["24"], ["40"]) and len(ln.split()) == 13]
    assert [r[:3] for r in rows] == [[str(p["prompt_len"]), str(p["output_len"]), str(p["batch"])] for p in points]


def test_phase_times_account_for_every_decode_step(tmp_path):
    """phase_times: true times each decode phase: one run a step for a one-phase policy (every run uncaptured on the
    CPU), its seconds inside the decode time, and the table under the bench's; off (the default) records none."""
    res = run_cli(write_recipe(tmp_path, phase_times=True), "--prompt-len", "24", "--output-len", "16", "--batch",
                  "2", "--requests", "3", "--out", tmp_path / "p.json")
    assert res.exit_code == 0, res.output
    (p,) = json.loads((tmp_path / "p.json").read_text())["points"]
    assert set(p["phases"]) == {"decode"}, p["phases"]
    decode = p["phases"]["decode"]
    assert decode["runs"] == decode["uncaptured"] == p["decode_steps"] > 0
    assert 0 < decode["seconds"] <= p["decode_s"]
    assert "decode phases on the device" in res.output
    res = run_cli(write_recipe(tmp_path), "--prompt-len", "24", "--output-len", "8", "--batch", "1", "--out",
                  tmp_path / "q.json")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "q.json").read_text())["points"][0]["phases"] == {}
    assert "decode phases" not in res.output


def test_the_moe_column_only_for_a_model_with_routed_experts(tmp_path):
    dense = {**MODEL, "config": {**MODEL["config"], "first_k_dense_replace": 2}}  # both layers dense: no router
    res = run_cli(write_recipe(tmp_path, model=dense), "--prompt-len", "24", "--output-len", "8", "--batch", "1")
    assert res.exit_code == 0, res.output
    assert "MoE" not in res.output and "routed experts" not in res.output
    assert [len(ln.split()) for ln in res.output.splitlines() if ln.split()[:1] == ["24"]] == [12]


def test_bench_defaults_prompts_file_and_rate(tmp_path):
    first, second = list(range(3, 19)), list(range(5, 29))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"ids": first}) + "\n" + json.dumps({"ids": second}) + "\n")
    # EOS := the first token the model makes for the first prompt: only ignore_eos makes all 8 tokens then
    model = load_from_spec(load_recipe({"model": MODEL, "prompts": [{"ids": [1]}]}).model)
    eos = Engine(model, EngineConfig(POLICY, max_new_tokens=8)).generate([first])[0].output_ids[0]
    recipe = write_recipe(tmp_path, model={**MODEL, "eos_token_id": eos})
    res = run_cli(recipe, "--prompts", prompts, "--rate", "200", "--requests", "3", "--out", tmp_path / "b.json")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "b.json").read_text())
    (p,) = report["points"]  # the recipe's max_new_tokens and batch_size
    assert (p["output_len"], p["batch"], p["requests"], p["generated_tokens"]) == (8, 2, 3, 24)
    assert p["prompt_tokens"] == 16 + 24 + 16 and p["prompt_len"] == round(56 / 3)  # cycled through the file
    assert report["settings"]["rate"] == 200 and report["settings"]["prompts_file"] == str(prompts)


def test_poisson_arrivals_and_percentiles():
    assert bench.poisson_arrivals(4, math.inf, 0) is None
    a = bench.poisson_arrivals(4000, 50.0, 1)
    assert a == bench.poisson_arrivals(4000, 50.0, 1) and a != bench.poisson_arrivals(4000, 50.0, 2)
    gaps = [y - x for x, y in zip([0.0, *a], a)]
    assert all(g > 0 for g in gaps) and abs(sum(gaps) / len(gaps) - 1 / 50) < 0.002  # mean gap 1 / rate
    assert bench.percentile([3.0, 1.0, 2.0], 50) == 2.0 and bench.percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert bench.percentile([5.0], 99) == 5.0


def test_synthetic_prompts_avoid_special_tokens():
    model = build_random("tiny-random-llada2", routing="random")
    prompts = bench.synthetic_prompts(model, 8, 500, seed=3)
    assert len(prompts) == 8 and {len(p) for p in prompts} == {500}
    ids = {t for p in prompts for t in p}
    assert model.mask_token_id not in ids and model.eos_token_id not in ids
    assert len(ids) > 900  # spread over the vocabulary (1024 ids, 2 special)
    assert prompts == bench.synthetic_prompts(model, 8, 500, seed=3) != bench.synthetic_prompts(model, 8, 500, seed=4)


def test_largest_batch_probe_bisects_and_reuses_what_it_found(monkeypatch):
    tried = []

    def fits(model, config, block, batch, prompt_len, capacity, prompts):
        tried.append((capacity, batch))
        return batch * capacity <= 100 * 4096

    monkeypatch.setattr(bench_probe, "fits", fits)
    monkeypatch.setattr(bench_probe.MaxProbe, "_kv_bound", lambda self, capacity: 1000)
    probe = bench_probe.MaxProbe(None, None, 32, None)
    assert probe(4000, 4096) == 100
    assert len(tried) <= 1 + math.ceil(math.log2(1000))
    tried.clear()
    assert probe(4000, 4096 * 2) == 50 and all(b <= 101 for _, b in tried)  # within what 4096 found
    tried.clear()
    assert probe(1000, 1024) == 400 and all(b >= 100 for _, b in tried)
    before = len(tried)
    assert probe(1000, 1024) == 400 and len(tried) == before  # cached
    largest = bench_probe.largest_batch
    assert largest(lambda b: b <= 7, 1, 8) == 7 and largest(lambda b: b <= 1, 1, 2) == 1


@pytest.mark.parametrize("args,needles", [
    (["--batch", "1,0"], ["--batch", "'0'"]),
    (["--batch", "8,many"], ["--batch", "'many'"]),
    (["--prompt-len", "12,abc"], ["--prompt-len", "'abc'"]),
    (["--output-len", "-4"], ["--output-len", "'-4'"]),
    (["--rate", "0"], ["--rate", "'0'"]),
    (["--rate", "fast"], ["--rate", "'fast'"]),
    (["--prompts", "missing.jsonl"], ["--prompts", "missing.jsonl"]),
    (["--prompts", "p.jsonl", "--prompt-len", "8"], ["--prompts", "--prompt-len"]),
    (["--batch", "max"], ["--batch max", "CPU"]),
])
def test_bench_user_errors(tmp_path, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"ids": [1, 2, 3]}\n')
    assert_user_error(run_cli(write_recipe(tmp_path), *args), *needles)


def test_bench_recipe_and_output_errors(tmp_path):
    assert_user_error(run_cli(tmp_path / "none.yaml"), "none.yaml", "not found")
    (tmp_path / "d").mkdir()
    assert_user_error(run_cli(write_recipe(tmp_path), "--out", tmp_path / "d"), "--out", "directory")
    recipe = write_recipe(tmp_path)
    assert_user_error(run_cli(recipe, "--plot", recipe), "--plot", "input")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="--batch max probes GPU memory")
def test_bench_max_batch_runs_on_the_gpu(tmp_path):
    # a wide vocabulary makes each slot's logits large, so the probe stops at a few thousand rows
    model = {**MODEL, "config": {**MODEL["config"], "vocab_size": 65536, "mask_token_id": 65535,
                                 "eos_token_id": 65534}, "device": "cuda", "dtype": "bfloat16"}
    # eager steps: a probe of thousands of rows then costs no CUDA-graph capture (with capture the test did not
    # finish in 130 s on the H200); and this process may use 4 GiB beyond what it holds already (the probe's upper
    # bound honours the fraction): the probe then stops at a few hundred rows where the whole card took it past 5
    # minutes (the GPU list never got past it). A share of the card instead (3 %) left an H100 process that held
    # 7.9 GiB from earlier tests no room at all (2026-12-06)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + (4 << 30)) / total))
    try:
        res = run_cli(write_recipe(tmp_path, model=model, cuda_graphs=False, compile=False), "--prompt-len", "64",
                      "--output-len", "8", "--batch", "1,max", "--out", tmp_path / "b.json")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert res.exit_code == 0, res.output
    one, most = json.loads((tmp_path / "b.json").read_text())["points"]
    assert "error" not in most and most["batch"] > 1 and most["generated_tokens"] == 8 * most["batch"]
    assert 0 < one["peak_memory_bytes"] < most["peak_memory_bytes"]
