"""Tensor and expert parallelism (compiledllm/parallel/) on 2 CPU processes over gloo: the split models (each rank's
share read from the checkpoint alone, as `run` loads it) give one process's float32 logits (to its rounding) and
the engine's tokens on every rank, for SDAR with tensor 2 and LLaDA2 MoE with tensor 2 and with expert 2; each rank
holds only its heads (KV cache) and experts and read only their bytes; size mistakes are one-line UserErrors. One
spawn of 2 processes runs every distributed case (ranks.py)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from checkpoints import default_config
from ranks import (CASES, bench_report, checkpoint_bytes, engine_tokens, free_port, logits, worker,
                   write_checkpoints)

from compiledllm.errors import UserError
from compiledllm.loader import load_model, parse_model_config
from compiledllm.models.config import ModelConfig
from compiledllm.parallel import check_divisible
from compiledllm.recipe import load_recipe


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = write_checkpoints(tmp_path_factory.mktemp("parallel"))
    torch.set_num_threads(1)
    mp.spawn(worker, args=(free_port(), str(root)), nprocs=2, join=True)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    return root, ranks


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process(run, case):
    root, ranks = run
    model = load_model(root / CASES[case][0])
    want_logits, want_tokens = logits(model), engine_tokens(model)
    for r, got in enumerate(ranks):
        split = load_file(str(root / f"{case}.rank{r}.safetensors"))["logits"]
        # summation order: one process's float32 logits (|x| up to 22) lie 3e-5 from the same model in float64
        torch.testing.assert_close(split, want_logits, rtol=1e-5, atol=5e-5)
        assert got[case]["tokens"] == want_tokens, (case, r)
    assert any(len(t) > 1 for t in want_tokens)


def test_each_rank_reads_only_its_slices(run):
    """`run`'s loading on real ranks: each rank's share, read from the files alone, is the whole model loaded and
    then cut by shard_model (equal weights, sizes and hooks), and it read only its slices' bytes."""
    root, ranks = run
    for case, (arch, tensor, expert) in CASES.items():
        for r, got in enumerate(ranks):
            assert got[case]["differs"] == [], (case, r)
            assert got[case]["bytes_read"] == checkpoint_bytes(root / arch, tensor, expert) < checkpoint_bytes(
                root / arch), (case, r)


def test_ranks_hold_their_share(run):
    _, ranks = run
    for got in ranks:
        sdar, tp, ep = got["sdar_tp2"], got["llada2_tp2"], got["llada2_ep2"]
        assert (sdar["heads"], sdar["kv_heads"], sdar["qkv_rows"]) == (2, 1, (2 + 2 * 1) * 16)  # 4 q, 2 kv heads
        assert (tp["heads"], tp["kv_heads"], tp["experts_held"]) == (2, 1, [8, 8])  # experts split by width
        assert (ep["heads"], ep["kv_heads"], ep["experts_held"]) == (4, 2, [4, 4])  # attention replicated


def test_bench_of_a_split_model_runs_one_process_points(run):
    """`compiledllm bench` under torchrun with tensor 2: every rank runs every point, with one process's prefill,
    decode steps and touched experts (only the timings differ)."""
    root, ranks = run
    want = bench_report(str(root), {})
    assert want["parallel"] == {"tensor": 1, "expert": 1} and len(want["points"]) == 2
    for got in ranks:
        assert got["bench"]["parallel"] == {"tensor": 2, "expert": 1}
        assert got["bench"]["parameters"] < want["parameters"]  # each rank timed its share, not a whole model
        assert got["bench"]["points"] == want["points"]


def test_world_must_be_tensor_times_expert(run):
    _, ranks = run
    msg = ranks[0]["world_error"]
    assert "data 1 x tensor 2 x expert 2 = 4 ranks, but 2 processes run" in msg and "\n" not in msg


def _config(arch: str, **overrides) -> ModelConfig:
    return parse_model_config(default_config(arch, **overrides), "config.json")


@pytest.mark.parametrize("arch, overrides, tensor, expert, needle", [
    ("sdar", {}, 3, 1, "parallel.tensor=3 does not divide num_attention_heads=4"),
    ("sdar", {}, 4, 1, "parallel.tensor=4 does not divide num_key_value_heads=2"),
    ("sdar", {"intermediate_size": 65}, 2, 1, "parallel.tensor=2 does not divide intermediate_size=65"),
    ("llada2", {}, 2, 3, "parallel.expert=3 does not divide num_experts=8"),
    ("llada2", {"moe_intermediate_size": 15}, 1, 2,
     ("parallel.tensor=1 x parallel.expert=2 does not divide the shared expert's width "
      "moe_intermediate_size x num_shared_experts=15")),
])
def test_sizes_that_do_not_divide_are_one_line_errors(arch, overrides, tensor, expert, needle):
    with pytest.raises(UserError) as e:
        check_divisible(_config(arch, **overrides), tensor, expert)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_recipe_parallel_section():
    base = {"model": {"path": "tiny-llada2"}, "prompts": [{"text": "hi"}]}
    assert load_recipe({**base, "parallel": {"tensor": 2, "expert": 2}}).parallel.tensor == 2
    assert load_recipe({**base, "parallel": {"data": 2}}).parallel.data == 2  # replicas: test_data_parallel.py
    with pytest.raises(UserError, match=r"parallel\.tensor: .*greater than or equal to 1"):
        load_recipe({**base, "parallel": {"tensor": 0}})


def test_run_of_a_split_recipe_outside_torchrun_says_how_to_start_it(tmp_path, monkeypatch):
    """`compiledllm run` with parallel.tensor 2 in one plain process: a one-line error naming torchrun, and the
    output is not written."""
    import yaml
    from typer.testing import CliRunner
    from user_errors import assert_user_error

    from compiledllm.cli import app

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    recipe = tmp_path / "tp.yaml"
    out = tmp_path / "out.jsonl"
    recipe.write_text(yaml.safe_dump({"model": {"path": "tiny-llada2"}, "parallel": {"tensor": 2},
                                      "prompts": [{"text": "def f(x):"}], "generation": {"max_new_tokens": 8},
                                      "output": str(out)}))
    res = CliRunner().invoke(app, ["run", str(recipe)])
    assert_user_error(res, "torchrun --nproc-per-node 2")
    assert not out.exists()
