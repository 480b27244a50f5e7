"""tools/train/train_tiny.py runs end to end on the CPU (a smoke test, not a training run), and save_model round-trips."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compiledllm
from compiledllm.engine import generate
from compiledllm.save import save_model

ROOT = Path(__file__).resolve().parents[2]


def test_train_tiny_three_steps_then_loads(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "tools" / "train" / "train_tiny.py"), "--preset", "tiny", "--steps", "3",
           "--max-files", "60", "--holdout", "0.3", "--eval", "quick", "--device", "cpu", "--out", str(out),
           "--package", str(tmp_path / "pkg")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    ckpt = out / "checkpoint"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (ckpt / name).exists(), name
    assert (tmp_path / "pkg" / "model.safetensors").exists() and (tmp_path / "pkg" / "bundle.tar.gz").exists()
    results = json.loads((out / "results.json").read_text())
    assert results["training"]["steps"] == 3
    assert results["training"]["tokens_seen"] == 3 * results["training"]["batch"] * results["training"]["seq_len"]
    assert "masked_accuracy" in results and set(results["tasks"]) == {"code_short.jsonl", "code_long.jsonl"}
    card = (ckpt / "README.md").read_text()
    for words in ("Data and split", "Objective", "3 steps", "tokens seen", "Held-out metrics"):
        assert words in card

    model = compiledllm.load_model(ckpt)
    cfg = model.config
    assert cfg.architecture == "llada2_moe" and cfg.moe.first_dense_layers == 1 and cfg.moe.n_group > 1
    assert cfg.qk_norm and cfg.rotary_dim == cfg.head_dim // 2 and cfg.moe.num_shared == 1
    assert model.tokenizer is not None and (model.mask_token_id, model.eos_token_id) == (2, 0)
    assert model.tokenizer.mask_id() == 2
    prompt = model.tokenizer.encode("def add(a, b):\n    return")
    res = generate(model, [prompt], {"name": "threshold", "block_size": 8}, max_new_tokens=8)
    assert 1 <= len(res[0].output_ids) <= 8 and isinstance(res[0].text, str)
    for line in (out / "tasks" / "code_short.jsonl").read_text().splitlines():
        task = json.loads(line)
        assert task["prompt_ids"] and task["reference_ids"] and model.tokenizer.decode(task["prompt_ids"])


def _random_model():
    return compiledllm.load_model("tiny-llada2-random")


def _hf_config():
    from compiledllm.builtin import BUILTINS
    from compiledllm.models.presets import PRESETS

    return dict(PRESETS[BUILTINS["tiny-llada2-random"]["preset"]])


def test_save_model_round_trip_single_file(tmp_path):
    model = _random_model()
    files = save_model(model, tmp_path, _hf_config(), dtype=torch.float32)
    assert [f.name for f in files] == ["model.safetensors"]
    again = compiledllm.load_model(tmp_path)
    ids = torch.arange(40)[None] % model.config.vocab_size
    assert torch.equal(model.reference_forward(ids), again.reference_forward(ids))
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"


def test_save_model_shards_with_index(tmp_path):
    model = _random_model()
    with torch.no_grad():
        for layer in model.layers[1:]:
            layer.mlp.expert_bias.copy_(torch.linspace(-0.1, 0.1, layer.mlp.expert_bias.numel()))
    files = save_model(model, tmp_path, _hf_config(), dtype=torch.bfloat16, max_shard_bytes=300_000)
    assert len(files) > 1 and all(f.stat().st_size < 300_000 + 20_000 for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.hf_weight_map())
    again = compiledllm.load_model(tmp_path)
    for name, t in model.hf_weight_map().items():
        expect = t.float() if name.endswith("expert_bias") else t.to(torch.bfloat16).float()
        assert torch.equal(again.hf_weight_map()[name].float(), expect), name
    # saving again with one file removes the old shards and the index
    save_model(model, tmp_path, _hf_config())
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


# --- the tiny-llada2.1 and tiny-llada kinds (issue 15): 3 steps, and 2 steps + resume == 3 steps ----------------

def _train(kind: str, out: Path, *extra: str) -> dict:
    sys.path.insert(0, str(ROOT / "tools" / "train"))
    import train_tiny

    return train_tiny.main(["--kind", kind, "--preset", "tiny", "--max-files", "30", "--holdout", "0.3",
                            "--device", "cpu", "--warmup", "2", "--decay-frac", "0", "--rewarm", "0",
                            "--out", str(out), *extra])


def _state(path: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted((path / "state").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("kind", ["tiny-llada2.1", "tiny-llada"])
def test_new_kind_trains_saves_evaluates_and_resumes_exactly(tmp_path, kind):
    full = _train(kind, tmp_path / "a", "--steps", "3", "--eval", "quick", "--workers", "2")
    _train(kind, tmp_path / "b", "--steps", "2", "--eval", "none")
    resumed = _train(kind, tmp_path / "c", "--steps", "3", "--eval", "none", "--resume", str(tmp_path / "b" / "state"))

    # the resumed run trained step 3 only, and ends with the uninterrupted run's parameters and optimizer state;
    # the uninterrupted run's batches came from two worker processes, the others' from the main process
    assert [(c["first_step"], c["steps"]) for c in resumed["training"]["calls"]] == [(0, 2), (2, 1)]
    assert full["training"]["calls"][0]["workers"] == 2 and resumed["training"]["calls"][-1]["workers"] == 0
    a, c = _state(tmp_path / "a"), _state(tmp_path / "c")
    assert set(a) == set(c) and any(k.startswith("opt.") for k in a)
    for name in a:
        if not name.startswith("rng."):
            assert torch.equal(a[name], c[name]), name
    assert resumed["training"]["tokens_seen"] == full["training"]["tokens_seen"]

    out = tmp_path / "a"
    ckpt = out / "checkpoint"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (ckpt / name).exists(), name
    assert (out / "loss_curve.png").stat().st_size > 1000
    card = (ckpt / "README.md").read_text()
    for words in ("Data and split", "Objective", "3 steps", "tokens seen", "Held-out metrics", "arithmetic.jsonl"):
        assert words in card, words
    synth = {"arithmetic.jsonl", "lists.jsonl", "retrieval_128.jsonl", "var_binding.jsonl"}
    assert synth <= set(full["tasks"]) and "threshold-0.95" in full["tasks"]["arithmetic.jsonl"]["policies"]
    assert set(full["needle_ablation"]) == {"retrieval_128.jsonl"}
    summary = (out / "summary.txt").read_text()  # the compact table printed at the end
    assert summary == full["summary"] and len(summary.splitlines()) < 16
    assert all(name.removesuffix(".jsonl") in summary for name in synth) and "EM>=0.95" in summary

    model = compiledllm.load_model(ckpt)
    cfg = model.config
    if kind == "tiny-llada2.1":
        assert cfg.architecture == "llada2_moe" and cfg.moe.num_experts >= 16 and cfg.moe.top_k >= 2
        assert cfg.moe.n_group > 1 and not model.bidirectional
    else:
        assert cfg.architecture == "llada" and model.bidirectional and cfg.num_kv_heads == cfg.num_heads
        assert all(k.startswith("model.transformer.") for k in model.hf_weight_map())
    assert cfg.max_position_embeddings == 128
    res = generate(model, [model.tokenizer.encode("12 + 34 =")], {"name": "threshold", "block_size": 8},
                   max_new_tokens=8)
    assert 1 <= len(res[0].output_ids) <= 8


def test_bf16_state_comes_back_in_a_package_and_resumes(tmp_path):
    """--state-dtype bfloat16 --package-state: the package holds the state's shards (bf16, no first moments) beside
    the checkpoint weights and the bundle; --resume takes the package folder as it is and trains on."""
    from safetensors.torch import load_file

    pkg = tmp_path / "pkg"
    first = _train("tiny-llada2.1", tmp_path / "a", "--steps", "2", "--eval", "none", "--state-dtype", "bfloat16",
                   "--package", str(pkg), "--package-state")
    names = sorted(p.name for p in pkg.iterdir())
    assert names[:2] == ["bundle.tar.gz", "model.safetensors"] and names[2:]
    assert all(n.startswith("train_state-") for n in names[2:])
    state = {k: v for f in sorted(pkg.glob("train_state-*.safetensors")) for k, v in load_file(str(f)).items()}
    assert not any(k.endswith(".exp_avg") for k in state) and any(k.endswith(".exp_avg_sq") for k in state)
    assert all(v.dtype == torch.bfloat16 for k, v in state.items() if k.startswith("model.") and "expert_bias" not in k)
    params = first["parameters"]
    assert sum(v.numel() * v.element_size() for v in state.values()) < 4.5 * params  # vs 12 B a parameter in float32

    resumed = _train("tiny-llada2.1", tmp_path / "b", "--steps", "3", "--eval", "none", "--resume", str(pkg))
    assert [(c["first_step"], c["steps"]) for c in resumed["training"]["calls"]] == [(0, 2), (2, 1)]
    again = compiledllm.load_model(tmp_path / "b" / "checkpoint")
    assert again.config.architecture == "llada2_moe"
    with pytest.raises(SystemExit, match="package-state"):
        _train("tiny-llada2.1", tmp_path / "c", "--steps", "1", "--package", str(tmp_path / "p2"), "--package-state")


def test_in_run_eval_plan_fits_every_file_in_the_time_left(tmp_path):
    sys.path.insert(0, str(ROOT / "tools" / "train"))
    import train_kinds as K

    files = {}
    for name, prompt in (("code_long", "x" * 6000), ("arithmetic", "12 + 34 ="), ("retrieval_8k", "y" * 24000)):
        files[f"{name}.jsonl"] = tmp_path / f"{name}.jsonl"
        files[f"{name}.jsonl"].write_text(json.dumps({"prompt": prompt, "reference": " 1\n"}) + "\n")
    plan = K.eval_plan(files)
    assert [i.name for i in plan] == ["arithmetic.jsonl", "retrieval_8k.jsonl", "code_long.jsonl"]  # targets first
    assert plan[0].policies == K.ALL_POLICIES and plan[1].policies == ("threshold-0.95",)
    assert plan[1].context == 8000 and plan[0].cap == 64 and plan[1].cap == 32
    rest = sum(i.units() for i in plan)
    assert K.eval_limit(plan[0], rest, seconds_left=1e6, rate=0.05) == 64  # time enough: the cap
    n = K.eval_limit(plan[0], rest, seconds_left=rest * 0.05 / 2, rate=0.05)  # half the time: half of each cap
    assert n == 32 and K.eval_limit(plan[1], rest, rest * 0.05 / 2, 0.05) == 16
    assert K.eval_limit(plan[0], rest, seconds_left=rest * 0.05 / 20, rate=0.05) == 4  # at least 4 while they fit
    assert K.eval_limit(plan[1], rest, seconds_left=1.0, rate=0.05) == 0  # not even 4 fit: skipped


def test_weights_only_state_restores_with_a_fresh_optimizer(tmp_path):
    import argparse

    sys.path.insert(0, str(ROOT / "tools" / "train"))
    import tiny_state
    import train_kinds as K
    import train_tiny as T

    args = argparse.Namespace(weight_decay=0.1, lr=1e-3, device=torch.device("cpu"))
    model = T.build_model(K.hf_config("tiny-llada2.1", "tiny", 384), torch.device("cpu"), 0)
    opt = T.make_optimizer(model, args)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    tiny_state.save_state(tmp_path, model, opt, {"step": 1}, dtype=torch.bfloat16, moments=False)
    (tmp_path / "tokenizer.json").write_text("{}")
    info, tensors, _ = tiny_state.read_state(tmp_path)
    assert info == {"step": 1} and tensors and not any(k.startswith("opt.") for k in tensors)
    again = T.build_model(K.hf_config("tiny-llada2.1", "tiny", 384), torch.device("cpu"), 1)
    opt2 = T.make_optimizer(again, args)
    tiny_state.restore(again, opt2, tensors)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        want = a if name.endswith("expert_bias") else a.to(torch.bfloat16).float()
        assert torch.equal(b, want), name
    assert not opt2.state  # AdamW starts afresh
