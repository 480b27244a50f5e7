"""CPU checks of the block-routing benchmark tools: tools/bench/bench_block_routing.py's --cpu-smoke path (the
torch routing on a tiny shape, eager timing) and the two end-to-end recipes the gpu_session.sh `blockroute` stage
runs (they load, and one tiny CPU bench of each goes through the engine)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compiledllm.models.llada2_moe import parse_config
from compiledllm.models.presets import PRESETS
from compiledllm.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"bench_block48_standard": None, "bench_block48": 48}  # recipe -> the preset's expert capacity


def test_cpu_smoke_writes_both_routings_within_capacity(tmp_path):
    out = tmp_path / "smoke.json"
    subprocess.run([sys.executable, str(ROOT / "tools/bench/bench_block_routing.py"), "--cpu-smoke",
                    "--batches", "1,8", "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=60)
    data = json.loads(out.read_text())
    rows = data["records"]
    assert {(r["routing"], r["batch"]) for r in rows} == {(k, b) for k in ("standard", "block") for b in (1, 8)}
    for r in rows:
        assert r["forward_ms"] > 0 and r["router_ms"] > 0 and r["experts_per_forward"] >= r["experts_per_block_max"]
        if r["routing"] == "block":
            assert r["experts_per_block_max"] <= r["capacity"] == data["capacity"] and "speedup" in r
    assert "command" in data and data["torch"] and data["shared_experts"] == 0


def test_cpu_smoke_with_the_shared_expert_counts_its_bytes(tmp_path):
    """--shared 1: the layer runs its shared expert under both routings, and its weights count in each record's
    bytes (one expert more than the routed experts read)."""
    runs = {}
    for shared in (0, 1):
        out = tmp_path / f"smoke{shared}.json"
        subprocess.run([sys.executable, str(ROOT / "tools/bench/bench_block_routing.py"), "--cpu-smoke", "--batches",
                        "1", "--shared", str(shared), "--out", str(out)], check=True, cwd=ROOT, capture_output=True,
                       timeout=60)
        runs[shared] = json.loads(out.read_text())
    assert runs[1]["shared_experts"] == 1
    shape = runs[1]["shapes"]["smoke"]
    expert = 3 * shape["dim"] * shape["expert_dim"] * 2
    for plain, with_shared in zip(runs[0]["records"], runs[1]["records"]):
        # a block's 32 tokens reach all 16 experts, or the 6 admitted: the same routed reads either way
        assert with_shared["experts_per_forward"] == plain["experts_per_forward"]
        assert with_shared["weight_bytes"] == plain["weight_bytes"] + expert


@pytest.mark.parametrize("name", RECIPES)
def test_blockroute_recipes_load_and_bench_on_a_tiny_model(name, tmp_path):
    recipe = load_recipe(ROOT / f"recipes/{name}.yaml", ["model.device=cpu"])  # cuda is checked where it runs
    moe = parse_config(PRESETS[recipe.model.config]).moe
    assert moe.expert_capacity == RECIPES[name] and recipe.policy["block_size"] == 32
    assert recipe.policy["threshold"] == 1.0 and recipe.policy["steps"]  # fixed steps: tokens per forward fixed
    if moe.expert_capacity is not None:
        assert moe.route_block == recipe.policy["block_size"]
    out = tmp_path / "bench.json"
    sets = ["model.device=cpu", "model.dtype=float32", "model.config=tiny-random-llada2"]
    if moe.expert_capacity is not None:
        sets.append("model.expert_capacity=3")  # the tiny model has 8 experts
    cmd = [sys.executable, "-m", "compiledllm", "bench", str(ROOT / f"recipes/{name}.yaml"), "--prompt-len", "32",
           "--output-len", "32", "--batch", "1", "--threads", "2", "--out", str(out)]
    subprocess.run(cmd + [a for s in sets for a in ("--set", s)], check=True, cwd=tmp_path, capture_output=True,
                   timeout=60)
    point = json.loads(out.read_text())["points"][0]
    assert point["generated_tokens"] == 32
    if moe.expert_capacity is not None:
        assert max(point["touched_experts"]) <= 3
