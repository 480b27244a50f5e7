"""tools/train/train_tiny.py --init-from / --expert-capacity: a tiny-llada2.1 checkpoint fine-tuned with LLaDA2.2
block routing on the CPU (a smoke test, not a training run): the checkpoint says it is block-routed and loads as
such, every training forward passes route groups (the noisy copy by block, the clean copy's blocks apart, dummy
slots nowhere), the expert loads are the block-routed assignment's, and the options that contradict it fail."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledllm
from compiledllm.attention.spec import AttentionSpec, BlockCausal
from compiledllm.models.block_routing import BlockRoutedMoE, use_block_routing
from compiledllm.policies.plan import Forward

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "compiledllm" / "assets" / "tiny-llada2.1"
sys.path.insert(0, str(ROOT / "tools" / "train"))

import synth_tasks as S  # noqa: E402
import tiny_common as C  # noqa: E402
import tiny_fast  # noqa: E402
import tiny_mix as M  # noqa: E402
import train_kinds as K  # noqa: E402
import train_tiny  # noqa: E402

FAST = ["--kind", "tiny-llada2.1", "--preset", "tiny", "--max-files", "30", "--device", "cpu", "--warmup", "2",
        "--decay-frac", "0"]


def _train(out: Path, *extra: str) -> dict:
    return train_tiny.main([*FAST, "--out", str(out), *extra])


@pytest.fixture
def route_calls(monkeypatch):
    """Every BlockRoutedMoE routing call's (route groups, expert ids)."""
    calls, route = [], BlockRoutedMoE.route

    def recording(self, x, backend="auto", groups=None, index=None):
        ids, w = route(self, x, backend, groups, index)
        calls.append((None if groups is None else groups.clone(), ids.clone()))
        return ids, w
    monkeypatch.setattr(BlockRoutedMoE, "route", recording)
    return calls


def _finite_history(results: dict, out: Path) -> None:
    hist = json.loads((out / "training_history.json").read_text())
    assert hist and all(math.isfinite(h["loss"]) and math.isfinite(h["masked_loss"]) for h in hist)
    assert math.isfinite(results["training"]["final"]["held_masked_loss"])


def _assert_block_routed(ckpt: Path, capacity: int) -> compiledllm.models.base.BlockDiffusionLM:
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["expert_capacity"] == capacity and cfg["block_size"] == 32
    model = compiledllm.load_model(ckpt)
    moes = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "expert_bias")]
    assert moes and all(isinstance(m, BlockRoutedMoE) for m in moes)
    assert (model.config.moe.expert_capacity, model.config.moe.route_block) == (capacity, 32)
    ids = torch.arange(40)[None] % model.config.vocab_size
    assert torch.isfinite(model.reference_forward(ids)).all()  # with route groups: fine
    with pytest.raises(ValueError, match="route groups"):  # without them a forward fails, so training passed them
        model(Forward(ids, torch.arange(40)[None], AttentionSpec(BlockCausal(32)), float_logits=True))
    return model


def test_finetune_a_tiny_checkpoint_with_block_routing(tmp_path, route_calls):
    base = _train(tmp_path / "base", "--holdout", "0.3", "--steps", "1", "--eval", "none")
    assert not route_calls and "expert_capacity" not in base["config"]
    init = tmp_path / "base" / "checkpoint"
    # --noisy-cap 48: a long window's noisy copy holds one 32-token block and 16 dummy slots
    ft = _train(tmp_path / "ft", "--holdout", "0.3", "--steps", "3", "--eval", "quick", "--init-from", str(init),
                "--expert-capacity", "4", "--noisy-cap", "48")
    out = tmp_path / "ft"
    _assert_block_routed(out / "checkpoint", 4)
    _finite_history(ft, out)

    # every routing call had route groups; the long steps' dummy slots were routed nowhere
    assert route_calls and all(g is not None for g, _ in route_calls)
    shapes = {tuple(g.shape) for g, _ in route_calls}
    assert {(2, 128), (2, 176)} <= shapes  # the training forwards: short [x0 ; x_t], long [x0 ; 48 noisy slots]
    assert any((g < 0).any() for g, _ in route_calls if g.shape == (2, 176))
    # the objective: block 32 only, no bidirectional windows; no curriculum: long steps from step 0
    obj, sh = ft["args"]["objective"], ft["training"]["shapes"]
    assert tuple(obj["block_sizes"]) == (32,) and obj["p_bidir"] == 0 and sh["long_from"] == 0
    assert ft["data"]["mix"]["grow_steps"] == 0
    # the checkpoint's tokenizer, and the same task files as its run (same split, seed and tokenizer)
    assert (out / "checkpoint" / "tokenizer.json").read_bytes() == (init / "tokenizer.json").read_bytes()
    for f in sorted((tmp_path / "base" / "tasks").glob("*.jsonl")):
        assert (out / "tasks" / f.name).read_text() == f.read_text(), f.name
    assert ft["data"]["held_file_list"] == base["data"]["held_file_list"]

    card = (out / "checkpoint" / "README.md").read_text()
    for words in ("# tiny-llada2.1, block-routed (4 of 16 experts a block)", "Fine-tuned from `tiny-llada2.1`",
                  "for 3 steps with block routing at capacity 4 of 16 experts", "no bidirectional windows",
                  "`expert_capacity` 4", f"--init-from {init} --expert-capacity 4", "3 steps (stopped by steps)"):
        assert words in card, words
    assert "block-routed (4 of 16 experts a block): 3 steps" in ft["summary"]

    # another split than the checkpoint's run (its results.json lies beside it) would train on held-out files
    with pytest.raises(SystemExit, match="holdout"):
        train_tiny.parse_args([*FAST, "--out", str(tmp_path / "x"), "--init-from", str(init), "--expert-capacity", "4"])


@pytest.mark.parametrize("extra, error", [
    (["--kind", "tiny-llada2", "--expert-capacity", "4"], "only the tiny-llada2.1 kind"),
    (["--kind", "tiny-llada", "--expert-capacity", "4"], "no MoE layers"),
    (["--kind", "tiny-llada", "--init-from", str(SHIPPED)], "llada2_moe checkpoint"),
    (["--expert-capacity", "4", "--p-bidir", "0.2"], "no bidirectional windows"),
    (["--init-from", str(SHIPPED), "--resume", "/tmp/state"], "--resume: not with --init-from"),
    (["--expert-capacity", "4", "--resume", "/tmp/state"], "--resume: not with --expert-capacity"),
    (["--init-from", str(SHIPPED), "--vocab", "512"], "--vocab: not with --init-from"),
    (["--init-from", str(ROOT / "recipes")], "no config.json"),
    (["--init-from", str(SHIPPED), "--expert-capacity", "17"], "--expert-capacity 17: between"),
    (["--expert-capacity", "1", "--preset", "tiny"], "--expert-capacity 1: between"),
])
def test_options_that_contradict_a_finetune_fail(extra, error, tmp_path):
    kind = [] if "--kind" in extra else ["--kind", "tiny-llada2.1"]
    with pytest.raises(SystemExit, match=error):
        train_tiny.parse_args([*kind, *extra, "--out", str(tmp_path)])


def _batch(L: int = 128, cap: int = 48) -> dict:
    """One long window (sparse: one noisy 32-block + dummies) and one short window (every position noisy), each a
    row of its own batch as train_kinds.forward_loss takes them."""
    rng = np.random.default_rng(0)
    obj = M.Objective("bd", block_sizes=(32,), p_bidir=0.0, noisy_cap=cap)
    ids = rng.integers(3, 384, L).astype(np.int32)
    roles = np.full(L, S.ROLE_TEXT, np.uint8)
    roles[70:74] = S.ROLE_ANSWER
    rows = {"long": [M.bd_noise(ids, roles, obj, rng, 384, 3, 2, 1, sparse=True, bidir=False)],
            "short": [M.bd_noise(ids[:64], roles[:64], obj, rng, 384, 3, 2, 1, sparse=False, bidir=False)]}
    return {k: {"n_clean": len(r[0]["tokens"]) - (cap if k == "long" else 64),
                **{f: torch.from_numpy(np.stack([x[f] for x in r])) for f in r[0]}} for k, r in rows.items()}


def test_training_forward_routes_both_copies_per_block_and_counts_live_loads(route_calls):
    model = C.build_model(K.hf_config("tiny-llada2.1", "tiny", 384), torch.device("cpu"), 0)
    model = use_block_routing(model, 4, 32).requires_grad_(True).train()
    moes = tiny_fast.attach_moe_training(model)
    for name, b in _batch().items():
        route_calls.clear()
        with tiny_fast.training_attention():
            loss, _ = K.forward_loss(model, b, slice(None), use_flex=False)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(moes[0].gate.grad).all() and moes[0].gate.grad.abs().sum() > 0
        groups, ids = route_calls[0]
        n, pos, bids = b["n_clean"], b["positions"].long(), b["bids"].long()
        n_blocks = -(-n // 32)
        assert torch.equal(groups[:, :n], pos[:, :n] // 32 + n_blocks)  # clean copy: its blocks, offset
        live = bids[:, n:] >= 0
        assert torch.equal(groups[:, n:], torch.where(live, pos[:, n:] // 32, -1))  # noisy copy; dummies -1
        assert set(groups[:, :n].unique().tolist()).isdisjoint(groups[:, n:].unique().tolist())
        assert (name == "long") == bool((~live).any())
        # a block admits at most 4 experts; the balancing counts live tokens' pairs only, from that assignment
        flat = groups.reshape(-1)
        for g in flat[flat >= 0].unique():
            assert ids[flat == g].unique().numel() <= 4
        k = model.config.moe.top_k
        assert int(moes[0]._load.sum()) == int((flat >= 0).sum()) * k
        assert torch.equal(moes[0]._load, torch.bincount(ids[flat >= 0].flatten(), minlength=16))
        model.zero_grad(set_to_none=True)
    tiny_fast.detach_load_counters(moes)


def test_cuda_expert_path_takes_a_forward_with_dead_tokens():
    """attach_moe_training's replacement of the routed experts (padded_grouped on CUDA; the per-expert loop here)
    accepts MoE.forward's `skip` and sends dead pairs (id num_experts, weight 0) nowhere that counts."""
    model = C.build_model(K.hf_config("tiny-llada2.1", "tiny", 384), torch.device("cpu"), 0)
    model = use_block_routing(model, 4, 32)
    m = model.layers[1].mlp
    x = torch.randn(2, 40, m.gate.shape[1])
    groups = (torch.arange(40) // 32).expand(2, 40).clone()
    groups[1, 30:] = -1
    want = m(x, "grouped_mm", groups)
    m._routed = tiny_fast.routed_with(tiny_fast.looped, m)
    got = m(x, "grouped_mm", groups)
    assert torch.allclose(got, want, atol=1e-5)
    # where MoE.forward hands it the shared expert (the Triton op would take it on CUDA), the replacement adds it
    flat = x.reshape(-1, x.shape[-1])
    ids, w = m.route(flat, "grouped_mm", groups)
    assert torch.allclose(m._routed(flat, ids, w, skip=True, shared=True),
                          m._routed(flat, ids, w, skip=True) + m.shared(flat), atol=1e-6)


def test_finetune_the_shipped_tiny_llada21_on_the_cpu(tmp_path, route_calls):
    """The real checkpoint, a few tiny-preset steps (its weights and tokenizer; windows of 64 / 128 tokens)."""
    ft = _train(tmp_path / "ft", "--steps", "2", "--eval", "quick", "--init-from", str(SHIPPED),
                "--expert-capacity", "8")
    ckpt = tmp_path / "ft" / "checkpoint"
    model = _assert_block_routed(ckpt, 8)
    assert ft["parameters"] == sum(p.numel() for p in model.parameters()) > 10_000_000
    assert (ckpt / "tokenizer.json").read_bytes() == (SHIPPED / "tokenizer.json").read_bytes()
    shipped_cfg = json.loads((SHIPPED / "config.json").read_text())
    assert json.loads((ckpt / "config.json").read_text()) == shipped_cfg | {"expert_capacity": 8}
    _finite_history(ft, tmp_path / "ft")
    assert route_calls and all(g is not None for g, _ in route_calls)
    card = (ckpt / "README.md").read_text()
    assert "Fine-tuned from `tiny-llada2.1`" in card and "capacity 8 of 16 experts" in card
    # the in-run evaluation ran on the block-routed checkpoint: block-32 masked accuracy only, the engine's tasks
    assert set(ft["masked_accuracy"]) == {"windows", "window_tokens", "block_32"}
    assert "policies" in ft["tasks"]["lists.jsonl"] and "retrieval_128.jsonl" in ft["needle_ablation"]
