"""A block-routed MoE is a subclass of MoE plugged into a built model, with no edit to the package
(tests/policies/block_routed.py; the forwards' route groups reach it through the decoder layer):

* (a) capacity = every expert: exactly the model's own routing, in logits (torch.equal) and in the engine's tokens;
* (b) capacity 2 of 8: other routing, equal to a literal per-block float64 forward written here, the engine's tokens
  equal to a literal no-cache decoder on the block-routed forward, and a batch gives each prompt's tokens alone;
* (c) dead tokens (route group -1) take no part: a forward with -1 padding gives the live tokens the outputs of the
  forward without it; padding counted in a live group would change them.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from block_routed import BlockRoutedMoE, block_routed
from checkpoints import MASK_ID, write_checkpoint
from oracle import (attention, gated_mlp, linear, literal_decode, load_checkpoint, merge_heads, rms_norm, rope,
                    split_heads, visibility)

import compiledllm
from compiledllm.attention.spec import AttentionSpec, BlockCausal
from compiledllm.engine import Engine
from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE
from compiledllm.policies.plan import Forward, route_groups

BLOCK = 4
E = 8  # tests/checkpoints.py's llada2: 8 experts, top-2, 4 groups of 2, 2 kept, one shared expert
NEAR_TIE = 1e-5
POLICY = {"name": "threshold", "threshold": 0.5, "block_size": BLOCK}
PROMPTS = [[5, 9, 17, 33, 2, 71], [40, 41], [7, 7, 8, 90, 12, 3, 60, 61, 62], [88]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llada2_block_routed"), "llada2", 3)


@pytest.fixture(scope="module")
def model(ckpt):
    return compiledllm.load_model(ckpt, device="cpu", dtype=torch.float32)


def routed(model, capacity: int):
    return block_routed(copy.deepcopy(model), capacity)


def grouped_forward(model, ids: torch.Tensor, block: int = BLOCK, groups: torch.Tensor | None = None):
    """The no-cache block-causal forward from position 0 (reference_forward's) with route groups = blocks."""
    B, L = ids.shape
    pos = torch.arange(L).expand(B, L)
    groups = route_groups(pos, block) if groups is None else groups
    with torch.no_grad():
        return model(Forward(ids, pos, AttentionSpec(BlockCausal(block)), float_logits=True, route_groups=groups))


def ids_of(seed: int, B: int, L: int) -> torch.Tensor:
    return torch.randint(2, 96, (B, L), generator=torch.Generator().manual_seed(seed))


def decode(model, prompts, batch_size: int, n: int = 9):
    engine = Engine(model, POLICY, max_new_tokens=n, batch_size=batch_size, max_seq_len=32)
    return [list(r.output_ids) for r in engine.generate(prompts)]


# ----------------------------------------------------------------------------- a literal block-routed forward


def literal_block_moe(cfg: dict, w: dict, p: str, x: torch.Tensor, blocks: list[int], capacity: int) -> torch.Tensor:
    """x [L, d] float64 of one row; blocks[t]: token t's block. The routing of block_routed.py, one token at a time."""
    k, G, TG = cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"]
    size = E // G
    s = torch.sigmoid(linear(x, w[p + "mlp.gate.weight"]))
    b = (s + w[p + "mlp.gate.expert_bias"][None, :]).tolist()
    out = torch.zeros_like(x)
    for blk in set(blocks):
        members = [t for t in range(len(blocks)) if blocks[t] == blk]
        agg = [max(b[t][e] for t in members) for e in range(E)]
        admitted = sorted(range(E), key=lambda e: (-agg[e], e))[:capacity]
        for t in members:
            score = {}
            for g in range(G):
                best = sorted((b[t][e] for e in admitted if e // size == g), reverse=True)[:2]
                if best:
                    score[g] = sum(best)
            kept = sorted(score, key=lambda g: (-score[g], g))[:TG]
            chosen = sorted((e for e in admitted if e // size in kept), key=lambda e: (-b[t][e], e))[:k]
            total = sum(s[t, e] for e in chosen)
            for e in chosen:
                q = f"{p}mlp.experts.{e}."
                y = gated_mlp(x[t], w[q + "gate_proj.weight"], w[q + "up_proj.weight"], w[q + "down_proj.weight"])
                out[t] += s[t, e] / (total + 1e-20) * cfg["routed_scaling_factor"] * y
    shared = gated_mlp(x, w[p + "mlp.shared_experts.gate_proj.weight"], w[p + "mlp.shared_experts.up_proj.weight"],
                       w[p + "mlp.shared_experts.down_proj.weight"])
    return out + shared


def literal_forward(ckpt, ids: torch.Tensor, block: int, capacity: int) -> torch.Tensor:
    """tests/oracle.py's LLaDA2 forward (float64, block-causal from position 0) with the block-routed MoE."""
    cfg, w = load_checkpoint(ckpt)
    B, L = ids.shape
    H, KVH, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    rot = int(hd * cfg["partial_rotary_factor"])
    x = w["model.word_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = linear(h, w[p + "attention.query_key_value.weight"]).split([H * hd, KVH * hd, KVH * hd], dim=-1)
        q, k, v = split_heads(q, H, hd), split_heads(k, KVH, hd), split_heads(v, KVH, hd)
        q = rope(rms_norm(q, w[p + "attention.query_layernorm.weight"], eps), rot, cfg["rope_theta"])
        k = rope(rms_norm(k, w[p + "attention.key_layernorm.weight"], eps), rot, cfg["rope_theta"])
        x = x + linear(merge_heads(attention(q, k, v, visibility(L, block))), w[p + "attention.dense.weight"])
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            x = x + gated_mlp(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                              w[p + "mlp.down_proj.weight"])
        else:
            blocks = [t // block for t in range(L)]
            x = x + torch.stack([literal_block_moe(cfg, w, p, h[r], blocks, capacity) for r in range(B)])
    return linear(rms_norm(x, w["model.norm.weight"], eps), w["lm_head.weight"])


# ----------------------------------------------------------------------------- (a) capacity = every expert


def test_capacity_all_experts_is_the_models_routing(model):
    full = routed(model, E)
    assert all(isinstance(layer.mlp, BlockRoutedMoE) for layer in full.layers[1:])
    moe = model.layers[1].mlp
    adopted = BlockRoutedMoE.adopt(moe, E)
    assert dict(adopted.state_dict(keep_vars=True)).keys() == dict(moe.state_dict(keep_vars=True)).keys()
    assert all(a is b for a, b in zip(adopted.state_dict(keep_vars=True).values(),
                                      moe.state_dict(keep_vars=True).values()))  # shared, not copied
    for seed, (B, L) in enumerate([(1, 7), (3, 12)]):
        ids = ids_of(seed, B, L)
        want = model.reference_forward(ids, BLOCK)  # no route groups: today's path
        assert torch.equal(grouped_forward(model, ids), want)
        assert torch.equal(grouped_forward(full, ids), want)
    assert decode(full, PROMPTS, batch_size=4) == decode(model, PROMPTS, batch_size=4)


# ----------------------------------------------------------------------------- (b) capacity 2 of 8


def test_small_capacity_routes_per_block_as_the_literal_forward(model, ckpt):
    two = routed(model, 2)
    for seed, (B, L, block) in enumerate([(1, 8, BLOCK), (2, 11, BLOCK), (2, 9, 3)]):
        ids = ids_of(10 + seed, B, L)
        got = grouped_forward(two, ids, block)
        want = literal_forward(ckpt, ids, block, 2)
        scale = max(1.0, want.abs().max().item())
        assert (got.double() - want).abs().max().item() <= 1e-4 * scale
        standard = model.reference_forward(ids, block)
        assert (got - standard).abs().max().item() > 1e-2 * scale  # the restriction changes the routing
    # each block routes alone: a row's blocks do not depend on the other rows (bitwise) or on later blocks (the
    # float32 GEMMs of a shorter forward round differently on the CPU, so only to rounding there)
    ids = ids_of(20, 3, 12)
    full = grouped_forward(two, ids)
    assert torch.equal(grouped_forward(two, ids[1:2]), full[1:2])
    prefix = grouped_forward(two, ids[:, :8])
    assert (prefix - full[:, :8]).abs().max().item() <= 1e-4 * max(1.0, prefix.abs().max().item())


def test_small_capacity_engine_tokens_are_the_literal_decoders_and_batch_invariant(model):
    two = routed(model, 2)
    n = 9

    def logits_fn(ids, block):
        return grouped_forward(two, ids, block)

    alone = [decode(two, [p], batch_size=1, n=n)[0] for p in PROMPTS]
    for prompt, got in zip(PROMPTS, alone):
        stats = {}
        want = literal_decode(logits_fn, prompt, policy="threshold", block_size=BLOCK, max_new_tokens=n,
                              mask_id=MASK_ID, eos_id=two.eos_token_id, threshold=POLICY["threshold"], stats=stats)
        if got != want and stats["min_margin"] < NEAR_TIE:
            pytest.skip(f"numerical near-tie (margin {stats['min_margin']:.2e})")
        assert got == want, (prompt, got, want)
    assert decode(two, PROMPTS, batch_size=4, n=n) == alone
    assert alone != decode(model, PROMPTS, batch_size=4, n=n)  # the routing shows in the tokens


# ----------------------------------------------------------------------------- (c) dead tokens


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float32 rounding: a forward of another shape rounds its GEMMs differently on the CPU."""
    return (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("capacity", [None, E, 2], ids=["standard", "all", "two"])
def test_dead_padding_leaves_the_live_tokens_alone(model, capacity):
    m = model if capacity is None else routed(model, capacity)
    ids = ids_of(30, 2, 8)
    # 4 padding tokens after each row (one more block: no live query sees them), at the last live block's positions
    B, L = 2, 12
    pos = torch.arange(L).clamp(max=7).expand(B, L)
    dead = torch.where(torch.arange(L) < 8, pos // BLOCK, -1).expand(B, L)
    spec = AttentionSpec(BlockCausal(BLOCK))

    def padded(fill: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            return m(Forward(torch.cat([ids, fill], dim=1), pos, spec, float_logits=True, route_groups=groups))

    got = padded(torch.full((B, 4), 3), dead)
    other = padded(ids_of(31, B, 4), dead)
    assert torch.equal(got[:, :8], other[:, :8])  # what the padding holds takes no part, bitwise
    assert torch.isfinite(got).all()  # dead tokens still get finite (unread) outputs
    assert close(got[:, :8], grouped_forward(m, ids))  # the forward without the padding
    if capacity is None:  # the standard routing: bitwise the forward that routes the padding too (no groups)
        assert torch.equal(got[:, :8], padded(torch.full((B, 4), 3), None)[:, :8])
    if capacity == 2:  # padding aggregated into the live block's admission would change the live tokens
        assert not close(padded(torch.full((B, 4), 3), pos // BLOCK)[:, :8], got[:, :8])


def test_dead_tokens_take_no_expert_pairs(model):
    moe = routed(model, 2).layers[1].mlp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, moe.gate.shape[1], generator=g)
    groups = torch.tensor([[0, 0, 0, 0, 1, 1, -1, -1], [-1, 5, 5, -1, 5, -1, -1, -1]])
    live = groups >= 0
    with torch.no_grad():
        ids, w = moe.assign(x.reshape(-1, x.shape[-1]), "auto", groups)
        flat = live.reshape(-1)
        assert (ids[~flat] == E).all() and (w[~flat] == 0).all()
        assert (ids[flat] < E).all()
        for r, blk in [(0, 0), (0, 1), (1, 5)]:  # at most `capacity` experts per block
            assert ids[((groups == blk) & (torch.arange(2)[:, None] == r)).reshape(-1)].unique().numel() <= 2
        out = moe(x, "auto", groups)
        noise = torch.where(live[..., None], x, torch.randn(x.shape, generator=g) * 10)
        assert torch.equal(moe(noise, "auto", groups)[live], out[live])  # dead inputs take no part, bitwise
        for r in range(2):  # the live tokens alone
            keep = live[r]
            assert close(moe(x[r:r + 1, keep], "auto", groups[r:r + 1, keep]), out[r:r + 1, keep])


def test_capacity_bounds():
    cfg = MoEConfig(num_experts=8, expert_dim=4, top_k=2, num_shared=0)
    for bad in (1, 9):
        with pytest.raises(ValueError, match="capacity"):
            BlockRoutedMoE(16, cfg, bad)
    with pytest.raises(ValueError, match="route_groups"):
        BlockRoutedMoE(16, cfg, 2)(torch.zeros(3, 16))
    assert isinstance(BlockRoutedMoE(16, cfg, 2), MoE)
    with torch.no_grad():
        out = BlockRoutedMoE(16, cfg, 8)(torch.zeros(3, 16), "auto", torch.zeros(3, dtype=torch.long))
    assert math.isfinite(out.sum().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_routing_runs_in_cuda_graphs(ckpt):
    """On CUDA (bf16, the Triton experts, every step replayed from a CUDA graph): no host sync in the routing, and
    capacity = every expert decodes the model's own tokens."""
    model = compiledllm.load_model(ckpt, device="cuda", dtype=torch.bfloat16)

    def run(m, batch_size):
        engine = Engine(m, POLICY, max_new_tokens=9, batch_size=batch_size, max_seq_len=32, cuda_graphs=True)
        return [list(r.output_ids) for r in engine.generate(PROMPTS)]

    standard = run(model, 4)
    assert run(routed(model, E), 4) == standard
    two = routed(model, 2)
    assert run(two, 4) == run(two, 1)
