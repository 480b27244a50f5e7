"""Routing of random MoE models (models/routing.py): `routing: balanced` spreads a block of MASK tokens over about as
many experts as uniform routing would, `routing: random` (the plain init) does not; both are deterministic."""
from __future__ import annotations

import pytest
import torch

from compiledllm.loader import build_random
from compiledllm.models.presets import TINY_LLADA2
from compiledllm.models.routing import count_touched, expected_touched, moe_layers, touched_after
from compiledllm.recipe import load_recipe
from compiledllm.runner import load_from_spec

# LLaDA2.0-mini's routing shape scaled down: 64 experts, top-8, 8 groups of which 4 are kept; tiny hidden size
MOE = dict(TINY_LLADA2, vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           intermediate_size=64, moe_intermediate_size=8, num_experts=64, num_experts_per_tok=8, n_group=8,
           topk_group=4, num_hidden_layers=4, mask_token_id=511, eos_token_id=510)
BLOCK = 32
UNIFORM = expected_touched(64, 8, BLOCK)  # 63.1 of 64 for one block's 32 tokens


def prompt(seed: int, length: int = 128) -> list[list[int]]:
    return torch.randint(0, 500, (1, length), generator=torch.Generator().manual_seed(seed)).tolist()


def test_expected_touched_is_the_uniform_independent_expectation():
    # E[distinct] = E (1 - (1 - k/E)^n): each token's top-k a uniform k-subset, tokens independent (exact then)
    trials = torch.rand(4000, BLOCK, 64, generator=torch.Generator().manual_seed(0)).topk(8, dim=-1).indices
    seen = torch.zeros(4000, 64, dtype=torch.bool).scatter_(1, trials.flatten(1), True).sum(1).double()
    assert abs(seen.mean().item() - UNIFORM) < 0.05
    assert expected_touched(64, 8, 1) == pytest.approx(8) and expected_touched(64, 8, 0) == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_balanced_touches_about_what_uniform_routing_would(seed):
    balanced = touched_after(build_random(MOE, seed=seed), prompt(seed), BLOCK)
    plain = touched_after(build_random(MOE, seed=seed, routing="random"), prompt(seed), BLOCK)
    assert len(balanced) == len(plain) == 3  # layer 0 is dense
    # a block of MASK tokens: the plain random router sends all 32 to nearly the same top-8
    assert max(plain) <= 0.25 * UNIFORM, plain
    assert sum(balanced) / 3 >= 0.85 * UNIFORM and min(balanced) >= 0.75 * UNIFORM, balanced


def test_random_prompt_tokens_still_route_uniformly():
    model = build_random(MOE, seed=0)
    with count_touched(model) as found:
        model.reference_forward(torch.tensor(prompt(3, BLOCK)))
    assert min(found.mean_per_layer()) >= 0.9 * UNIFORM


def test_each_routing_is_deterministic_for_a_seed():
    for routing in ("balanced", "random"):
        a, b = build_random(MOE, seed=4, routing=routing), build_random(MOE, seed=4, routing=routing)
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    a, b = build_random(MOE, seed=4), build_random(MOE, seed=5)
    assert not torch.equal(a.layers[1].mlp.gate, b.layers[1].mlp.gate)
    assert touched_after(build_random(MOE, seed=4), prompt(4), BLOCK) == touched_after(a, prompt(4), BLOCK)


def test_count_touched_removes_its_hooks_when_the_block_raises():
    model = build_random(MOE, seed=0)
    with pytest.raises(RuntimeError, match="inside"), count_touched(model):
        raise RuntimeError("inside")
    assert all(not m._forward_pre_hooks for m in moe_layers(model))


def test_count_touched_counts_each_forward_and_restores_the_router():
    model = build_random(MOE, seed=0)
    ids = torch.tensor(prompt(0, 16))
    before = model.reference_forward(ids)
    with count_touched(model) as found:
        inside = model.reference_forward(ids)
        model.reference_forward(ids[:, :1])
    assert [len(c) for c in found.per_layer] == [2, 2, 2]
    assert all(c[1] == 8 for c in found.per_layer)  # one token: its top-8
    assert torch.equal(before, inside)  # counting changes nothing
    assert all("route" not in vars(m) and not m._forward_pre_hooks for m in moe_layers(model))  # hooks removed
    with count_touched(model) as again:
        pass
    assert again.per_layer == [[], [], []]


def test_dense_models_are_untouched_and_count_nothing():
    dense = dict(TINY_LLADA2, architectures=["SDARForCausalLM"], model_type="sdar", tie_word_embeddings=True)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_shared_experts", "n_group",
                "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
                "partial_rotary_factor"):
        dense.pop(key)
    a, b = build_random(dense, seed=0), build_random(dense, seed=0, routing="random")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert touched_after(a, prompt(0), BLOCK) == []


def test_recipe_routing_default_and_errors():
    base = {"prompts": [{"ids": [1]}]}
    rec = load_recipe({**base, "model": {"init": "random", "config": MOE}})
    assert rec.model.routing == "balanced"
    plain = load_recipe({**base, "model": {"init": "random", "config": MOE, "routing": "random"}})
    assert torch.equal(load_from_spec(plain.model).layers[1].mlp.gate,
                       build_random(MOE, routing="random").layers[1].mlp.gate)
    assert load_recipe({**base, "model": {"path": "tiny-llada2"}}).model.routing is None
    from compiledllm.errors import UserError

    with pytest.raises(UserError, match="model.routing"):
        load_recipe({**base, "model": {"init": "random", "config": MOE, "routing": "uniform"}})
    with pytest.raises(UserError, match="routing is for init: random"):
        load_recipe({**base, "model": {"path": "tiny-llada2", "routing": "random"}})
    with pytest.raises(UserError, match="model.routing"):
        build_random(MOE, routing="uniform")
