"""The shipped yardstick checkpoints of issue 15 (compiledllm/assets/tiny-llada2.1, tiny-llada) and issue 29's
block-routed one (tiny-llada2.1-block8): built in by name, the architectures their cards claim, small enough to ship,
decode deterministically and do their trained task."""
from __future__ import annotations

import json

import pytest
import torch

import compiledllm
from compiledllm.builtin import ASSETS, BUILTINS
from compiledllm.engine import generate

NAMES = ("tiny-llada2.1", "tiny-llada", "tiny-llada2.1-block8")
POLICY = {"name": "threshold", "block_size": 32, "threshold": 0.9}
# An evaluation item of compiledllm/assets/tasks/lists.jsonl (never trained on) that both models answer exactly.
PROMPT, ANSWER = "reverse: [64, 71, 74, 30, 10, 58, 76] =", " [76, 58, 10, 30, 74, 71, 64]\n"


def config(name: str) -> dict:
    return json.loads((ASSETS / name / "config.json").read_text())


def weight_names(name: str) -> list[str]:
    return list(json.loads((ASSETS / name / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("name", NAMES)
def test_shipped_files(name):
    d = ASSETS / name
    assert BUILTINS[name] == {"path": d}
    names = sorted(p.name for p in d.iterdir())
    assert names == ["README.md", "config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
                     "tokenizer_config.json"]
    assert sum(p.stat().st_size for p in d.glob("*.safetensors")) <= 40_000_000  # issue 15: <= 40 MB in bf16
    card = (d / "README.md").read_text()
    for words in ("Data and split", "Objective", "tokens seen", "NVIDIA H", "Held-out metrics", "## Targets",
                  "Shortfall"):
        assert words in card, words


def test_tiny_llada21_is_the_llada2_moe_layout():
    c = config("tiny-llada2.1")
    assert c["architectures"] == ["LLaDA2MoeModelLM"] and c["max_position_embeddings"] == 8192
    assert c["num_experts"] >= 16 and c["num_experts_per_tok"] >= 2 and c["n_group"] > 1 and c["topk_group"] >= 1
    names = weight_names("tiny-llada2.1")
    assert all(f"model.layers.{i}.mlp.gate.expert_bias" in names for i in range(c["first_k_dense_replace"],
                                                                                 c["num_hidden_layers"]))


def test_block_routed_yardstick_is_tiny_llada21_with_block_routing():
    """tiny-llada2.1-block8 declares LLaDA2.2's block routing (8 of 16 experts per 32-token block) in config.json and
    is otherwise tiny-llada2.1's architecture and tokenizer; the engine decodes it only with its routing block."""
    from compiledllm.errors import UserError

    c, base = config("tiny-llada2.1-block8"), config("tiny-llada2.1")
    assert c.pop("expert_capacity") == 8 and c["block_size"] == 32 and c == base
    assert (ASSETS / "tiny-llada2.1-block8" / "tokenizer.json").read_bytes() == \
        (ASSETS / "tiny-llada2.1" / "tokenizer.json").read_bytes()
    model = compiledllm.load_model("tiny-llada2.1-block8")
    assert model.config.moe.expert_capacity == 8 and model.config.moe.route_block == 32
    with pytest.raises(UserError, match="routing block"):
        generate(model, [model.tokenizer.encode(PROMPT)], {**POLICY, "block_size": 16}, max_new_tokens=16)


def test_tiny_llada_is_the_llada_layout():
    c = config("tiny-llada")
    assert c["architectures"] == ["LLaDAModelLM"] and c["max_sequence_length"] == 2048
    assert c["n_kv_heads"] == c["n_heads"]  # MHA
    assert all(n.startswith("model.transformer.") for n in weight_names("tiny-llada"))


@pytest.mark.parametrize("name", NAMES)
def test_loads_by_name_and_decodes_deterministically(name):
    model = compiledllm.load_model(name)
    assert model.tokenizer is not None and model.mask_token_id == 2 and model.eos_token_id == 0
    prompt = model.tokenizer.encode(PROMPT)
    first = generate(model, [prompt], POLICY, max_new_tokens=32)[0]
    again = generate(model, [prompt], POLICY, max_new_tokens=32)[0]
    assert first.output_ids == again.output_ids
    assert first.text == ANSWER  # a trained answer, not merely a repeatable one
    assert model.mask_token_id not in first.output_ids


def test_router_bias_was_trained():
    model = compiledllm.load_model("tiny-llada2.1", dtype=torch.float32)
    assert all(layer.mlp.expert_bias.abs().sum() > 0 for layer in model.layers[1:])


def test_yardstick_recipe_holds_evaluation_items():
    """recipes/yardstick.yaml validates, names tiny-llada2.1, and its list prompts are lists.jsonl's (held out)."""
    from compiledllm.recipe import load_recipe

    recipe = load_recipe(ASSETS.parents[1] / "recipes" / "yardstick.yaml")
    assert recipe.model.path == "tiny-llada2.1" and recipe.policy["threshold"] == 0.9
    held = {json.loads(line)["prompt"] for line in (ASSETS / "tasks" / "lists.jsonl").read_text().splitlines()}
    texts = [p.text for p in recipe.prompts]
    assert all(t in held for t in texts[:3]) and texts[3].startswith("table = {") and texts[3].endswith('] ==')
