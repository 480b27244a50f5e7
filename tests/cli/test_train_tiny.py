"""tools/train_tiny.py runs end to end on the CPU (a smoke test, not a training run), and save_model round-trips."""
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
    cmd = [sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--preset", "tiny", "--steps", "3",
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
    sys.path.insert(0, str(ROOT / "tools"))
    import train_tiny

    return train_tiny.main(["--kind", kind, "--preset", "tiny", "--max-files", "30", "--holdout", "0.3",
                            "--device", "cpu", "--warmup", "2", "--decay-frac", "0", "--rewarm", "0",
                            "--out", str(out), *extra])


def _state(path: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted((path / "state").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("kind", ["tiny-llada2.1", "tiny-llada"])
def test_new_kind_trains_saves_evaluates_and_resumes_exactly(tmp_path, kind):
    full = _train(kind, tmp_path / "a", "--steps", "3", "--eval", "quick")
    _train(kind, tmp_path / "b", "--steps", "2", "--eval", "none")
    resumed = _train(kind, tmp_path / "c", "--steps", "3", "--eval", "none", "--resume", str(tmp_path / "b" / "state"))

    # the resumed run trained step 3 only, and ends with the uninterrupted run's parameters and optimizer state
    assert [(c["first_step"], c["steps"]) for c in resumed["training"]["calls"]] == [(0, 2), (2, 1)]
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
