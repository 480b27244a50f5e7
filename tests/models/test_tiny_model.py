"""The shipped trained checkpoint (compiledllm/assets/tiny-llada2): loads, decodes deterministically, is trained."""
from __future__ import annotations

import json

import torch

import compiledllm
from compiledllm.builtin import ASSETS
from compiledllm.engine import generate

CKPT = ASSETS / "tiny-llada2"
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
SNIPPET = '''class Counter:
    """Count how often each key was seen."""

    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1

    def most_common(self, n=None):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return items if n is None else items[:n]
'''


def test_checkpoint_layout():
    names = sorted(p.name for p in CKPT.iterdir())
    assert names == ["README.md", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (CKPT / "model.safetensors").stat().st_size <= 16_000_000
    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDA2MoeModelLM"] and cfg["first_k_dense_replace"] == 1
    assert cfg["num_experts"] >= 4 and cfg["num_shared_experts"] == 1 and cfg["n_group"] > 1
    assert cfg["partial_rotary_factor"] == 0.5 and cfg["use_qk_norm"] and cfg["max_position_embeddings"] >= 2048
    card = (CKPT / "README.md").read_text()
    for words in ("Data and split", "Objective", "tokens seen", "H200", "Held-out metrics", "bigram"):
        assert words in card


def test_loads_by_name_and_by_path():
    by_name = compiledllm.load_model("tiny-llada2")
    by_path = compiledllm.load_model(str(CKPT))
    a, b = by_name.hf_weight_map(), by_path.hf_weight_map()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert by_name.tokenizer is not None and by_name.mask_token_id == 2 and by_name.eos_token_id == 0
    assert any(layer.mlp.expert_bias.abs().sum() > 0 for layer in by_name.layers[1:])  # router bias was trained


def test_decodes_deterministically():
    model = compiledllm.load_model("tiny-llada2")
    prompt = model.tokenizer.encode(PROMPT)
    policy = {"name": "threshold", "block_size": 32, "threshold": 0.9}
    first = generate(model, [prompt], policy, max_new_tokens=32)[0]
    again = generate(model, [prompt], policy, max_new_tokens=32)[0]
    assert first.output_ids == again.output_ids and len(first.output_ids) > 0
    assert first.text == model.tokenizer.decode(first.output_ids) and first.text.strip()
    assert model.mask_token_id not in first.output_ids


def test_is_trained():
    """Masked tokens of unseen code are predicted far better than by chance (ln 4096 = 8.3 nats)."""
    model = compiledllm.load_model("tiny-llada2")
    ids = torch.tensor(model.tokenizer.encode(SNIPPET))[None]
    masked = torch.zeros_like(ids, dtype=torch.bool)
    masked[:, 3::5] = True
    noisy = torch.where(masked, model.mask_token_id, ids)
    for block in (None, 32):
        logits = model.reference_forward(noisy, block_size=block)
        ce = torch.nn.functional.cross_entropy(logits[masked], ids[masked])
        acc = (logits[masked].argmax(-1) == ids[masked]).float().mean()
        assert ce < 3.0 and acc > 0.4, (block, ce, acc)
