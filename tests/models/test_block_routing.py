"""LLaDA2.2's block routing (compiledllm/models/block_routing.py), on tiny random LLaDA2 checkpoints:

* config and loading: `expert_capacity` (with `block_size`) in config.json turns it on, a checkpoint without it
  routes as before; bad values and a policy block other than the routing block are one-line errors; a recipe's
  model.expert_capacity turns it on for a built model;
* capacity = every expert: the standard routing's logits (torch.equal) and tokens where n_group is 1, and the
  ungrouped top-k where the checkpoint has groups (the released rule has no group-limited step);
* capacity 3 of 8: the logits equal tests/oracle.py's literal float64 forward (blocks of positions), the engine's
  tokens equal the literal no-cache decoder over that forward (threshold here; FlowBlock's windows in
  tests/policies/test_flowblock.py), batched ==
  alone, compiled == eager, and the routing shows in the tokens;
* dead tokens take no part; a block's tokens use at most `capacity` experts;
* on CUDA: the Triton router == the torch routing, and captured / compiled steps == eager.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from checkpoints import MASK_ID, write_checkpoint
from oracle import OracleModel, literal_decode

import compiledllm
from compiledllm.attention.spec import AttentionSpec, BlockCausal
from compiledllm.engine import Engine, generate
from compiledllm.errors import UserError
from compiledllm.models.block_routing import BlockRoutedMoE, block_route, block_routed, group_index, route_index
from compiledllm.models.layers import MoE
from compiledllm.policies.plan import Forward

BLOCK = 4
E = 8  # tests/checkpoints.py's llada2: 8 experts, top-2, 4 groups of 2 (2 kept), one shared expert
NEAR_TIE = 1e-5
POLICY = {"name": "threshold", "threshold": 0.5, "block_size": BLOCK}
PROMPTS = [[5, 9, 17, 33, 2, 71], [40, 41], [7, 7, 8, 90, 12, 3, 60, 61, 62], [88]]


def checkpoint(tmp_path_factory, name: str, **overrides):
    return write_checkpoint(tmp_path_factory.mktemp(name), "llada2", 3, **overrides)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The same weights (the tensors depend on the shapes only) under four configs."""
    return {"standard": checkpoint(tmp_path_factory, "std"),
            "ungrouped": checkpoint(tmp_path_factory, "ungrouped", n_group=1, topk_group=1),
            "all": checkpoint(tmp_path_factory, "all", expert_capacity=E, block_size=BLOCK),
            "all_ungrouped": checkpoint(tmp_path_factory, "all_ungrouped", expert_capacity=E, block_size=BLOCK,
                                        n_group=1, topk_group=1),
            "three": checkpoint(tmp_path_factory, "three", expert_capacity=3, block_size=BLOCK)}


@pytest.fixture(scope="module")
def models(ckpts):
    return {k: compiledllm.load_model(p, device="cpu", dtype=torch.float32) for k, p in ckpts.items()}


def ids_of(seed: int, B: int, L: int) -> torch.Tensor:
    return torch.randint(2, 96, (B, L), generator=torch.Generator().manual_seed(seed))


def decode(model, prompts, batch_size: int, n: int = 9, policy: dict = POLICY, **kw):
    return [list(r.output_ids) for r in generate(model, prompts, policy, max_new_tokens=n, batch_size=batch_size,
                                                 max_seq_len=32, **kw)]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    """Equal to float32 rounding (a forward of another shape rounds its GEMMs differently on the CPU)."""
    return (a.double() - b.double()).abs().max().item() <= tol * max(1.0, b.abs().max().item())


# ----------------------------------------------------------------------------- config and loading


def test_config_turns_block_routing_on_and_its_absence_routes_as_before(models):
    three, standard = models["three"], models["standard"]
    assert block_routed(three) and not block_routed(standard)
    assert all(type(layer.mlp) is BlockRoutedMoE for layer in three.layers[1:])
    assert all(type(layer.mlp) is MoE for layer in standard.layers[1:])
    moe = three.config.moe
    assert (moe.expert_capacity, moe.route_block, three.config.default_block_size) == (3, BLOCK, BLOCK)
    assert standard.config.moe.expert_capacity is None and standard.config.default_block_size == 32
    # the policy's default block is the routing block; another block size is refused, naming both
    assert Engine(three, {"name": "threshold"}, max_new_tokens=4).block == BLOCK
    with pytest.raises(UserError, match=r"policy.block_size 8 differs from the model's routing block 4"):
        Engine(three, {"name": "threshold", "block_size": 8}, max_new_tokens=4)


@pytest.mark.parametrize("bad, match", [
    ({"expert_capacity": 1}, r"expert_capacity must be >= 2"),
    ({"expert_capacity": 9}, r"expert_capacity=9 exceeds num_experts=8"),
    ({"expert_capacity": "48"}, r"expert_capacity must be an integer"),
    ({"expert_capacity": 4, "block_size": 0}, r"block_size must be >= 1"),
    ({"expert_capacity": 4, "block_size": True}, r"block_size must be an integer"),
])
def test_bad_capacity_is_a_one_line_error_naming_the_key(tmp_path, bad, match):
    ckpt = write_checkpoint(tmp_path, "llada2", 0, **bad)
    with pytest.raises(UserError, match=match) as info:
        compiledllm.load_model(ckpt)
    assert "config.json" in str(info.value) and "\n" not in str(info.value)


def test_recipe_expert_capacity_turns_it_on(ckpts, tmp_path):
    from compiledllm.recipe import load_recipe
    from compiledllm.runner import load_from_spec

    recipe = load_recipe({"model": {"path": str(ckpts["standard"]), "expert_capacity": 3}, "prompts": [{"text": "a"}]})
    model = load_from_spec(recipe.model)
    assert block_routed(model) and model.config.moe.expert_capacity == 3
    assert model.config.moe.route_block == model.config.default_block_size == 32
    random = load_recipe({"model": {"init": "random", "config": "tiny-random-llada2", "expert_capacity": 4},
                          "prompts": [{"text": "a"}]})
    assert type(load_from_spec(random.model).layers[1].mlp) is BlockRoutedMoE
    with pytest.raises(UserError, match=r"model.expert_capacity: expert_capacity=9 exceeds num_experts=8"):
        load_from_spec(recipe.model.model_copy(update={"expert_capacity": 9}))
    dense = write_checkpoint(tmp_path / "sdar", "sdar", 0)
    with pytest.raises(UserError, match=r"model.expert_capacity: sdar has no MoE layers"):
        load_from_spec(recipe.model.model_copy(update={"path": str(dense)}))


def test_preset_is_the_llada2_mini_shape_with_the_reports_capacity():
    from compiledllm.loader import parse_model_config
    from compiledllm.models.presets import LLADA2_MINI, PRESETS

    cfg = parse_model_config(PRESETS["llada2-mini-block48"], "preset")
    assert (cfg.moe.expert_capacity, cfg.moe.route_block, cfg.moe.num_experts) == (48, 32, 256)
    assert dataclasses.replace(cfg.moe, expert_capacity=None, route_block=None) == \
        parse_model_config(LLADA2_MINI, "preset").moe
    assert json.dumps(PRESETS["llada2-mini-block48"])  # a config.json mapping like the others


# ----------------------------------------------------------------------------- capacity = every expert


def test_capacity_all_experts_is_the_standard_routing(models):
    for seed, (B, L) in enumerate([(1, 7), (3, 12)]):
        ids = ids_of(seed, B, L)
        # n_group 1: exactly the standard routing, bitwise
        assert torch.equal(models["all_ungrouped"].reference_forward(ids, BLOCK),
                           models["ungrouped"].reference_forward(ids, BLOCK))
        # with groups: the ungrouped top-k (no group-limited step under block routing), not the grouped routing
        grouped = models["all"].reference_forward(ids, BLOCK)
        assert torch.equal(grouped, models["ungrouped"].reference_forward(ids, BLOCK))
    assert decode(models["all_ungrouped"], PROMPTS, 4) == decode(models["ungrouped"], PROMPTS, 4)


# ----------------------------------------------------------------------------- capacity 3 of 8


def test_logits_equal_the_literal_float64_forward(models, ckpts):
    three, oracle = models["three"], OracleModel(ckpts["three"])
    for seed, (B, L) in enumerate([(1, 8), (2, 11), (2, 3)]):  # whole blocks, a partial last block, one block
        ids = ids_of(10 + seed, B, L)
        got, want = three.reference_forward(ids, BLOCK), oracle(ids, BLOCK)
        assert close(got, want)
        assert not close(models["standard"].reference_forward(ids, BLOCK), want, 1e-2)  # the routing differs
    # a row's blocks route alone: bitwise independent of the other rows, and of later blocks up to rounding
    ids = ids_of(20, 3, 12)
    full = three.reference_forward(ids, BLOCK)
    assert torch.equal(three.reference_forward(ids[1:2], BLOCK), full[1:2])
    assert close(three.reference_forward(ids[:, :8], BLOCK), full[:, :8])


def literal_tokens(model, oracle, prompt, n, policy=POLICY):
    stats = {}
    want = literal_decode(oracle, prompt, policy=policy["name"], block_size=BLOCK, max_new_tokens=n, mask_id=MASK_ID,
                          eos_id=model.eos_token_id, threshold=policy["threshold"], stats=stats)
    return want, stats["min_margin"]


def test_engine_tokens_are_the_literal_decoders_batched_and_alone(models, ckpts):
    three, oracle, n = models["three"], OracleModel(ckpts["three"]), 9
    alone = [decode(three, [p], 1, n)[0] for p in PROMPTS]
    for prompt, got in zip(PROMPTS, alone):
        want, margin = literal_tokens(three, oracle, prompt, n)
        if got != want and margin < NEAR_TIE:
            pytest.skip(f"numerical near-tie (margin {margin:.2e})")
        assert got == want, (prompt, got, want)
    assert decode(three, PROMPTS, 4, n) == alone
    assert alone != decode(models["standard"], PROMPTS, 4, n, policy={**POLICY})  # the routing shows in the tokens


def test_long_prompts_prefill_each_block_as_its_own_group(models, ckpts):
    """Prompts of several whole blocks: prefill routes each prompt block alone (the literal decoder's no-cache
    forward routes blocks of positions), chunked or not."""
    three, oracle = models["three"], OracleModel(ckpts["three"])
    prompts = [ids_of(40, 1, 14)[0].tolist(), ids_of(41, 1, 9)[0].tolist()]
    got = decode(three, prompts, 2, 6)
    for prompt, tokens in zip(prompts, got):
        want, margin = literal_tokens(three, oracle, prompt, 6)
        if tokens != want and margin < NEAR_TIE:
            pytest.skip(f"numerical near-tie (margin {margin:.2e})")
        assert tokens == want


def test_compiled_equals_eager(models, compile_kw):
    three = models["three"]
    eager = [list(r.output_ids) for r in generate(three, PROMPTS, POLICY, max_new_tokens=9, **compile_kw)]
    compiled = [list(r.output_ids) for r in generate(three, PROMPTS, POLICY, max_new_tokens=9, compile=True,
                                                     **compile_kw)]
    assert compiled == eager


# ----------------------------------------------------------------------------- the routing itself


def test_dead_tokens_take_no_part_and_blocks_use_at_most_capacity_experts(models):
    moe = models["three"].layers[1].mlp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, moe.gate.shape[1], generator=g)
    groups = torch.tensor([[0, 0, 0, 0, 1, 1, -1, -1], [-1, 5, 5, -1, 5, -1, -1, -1]])
    live = groups >= 0
    with torch.no_grad():
        ids, w = moe.route(x.reshape(-1, x.shape[-1]), "auto", groups)
        flat = live.reshape(-1)
        assert (ids[~flat] == E).all() and (w[~flat] == 0).all() and (ids[flat] < E).all()
        for r, blk in [(0, 0), (0, 1), (1, 5)]:
            assert ids[((groups == blk) & (torch.arange(2)[:, None] == r)).reshape(-1)].unique().numel() <= 3
        out = moe(x, "auto", groups)
        noise = torch.where(live[..., None], x, torch.randn(x.shape, generator=g) * 10)
        assert torch.equal(moe(noise, "auto", groups)[live], out[live])  # dead inputs take no part, bitwise
        for r in range(2):  # the live tokens alone
            assert close(moe(x[r:r + 1, live[r]], "auto", groups[r:r + 1, live[r]]), out[r:r + 1, live[r]])
        with pytest.raises(ValueError, match="route groups"):
            moe(x)


def test_padding_after_the_live_blocks_changes_nothing(models):
    three = models["three"]
    ids, B, L = ids_of(30, 2, 8), 2, 12
    pos = torch.arange(L).clamp(max=7).expand(B, L)
    dead = torch.where(torch.arange(L) < 8, pos // BLOCK, -1).expand(B, L)

    def padded(fill, groups):
        with torch.no_grad():
            return three(Forward(torch.cat([ids, fill], 1), pos, AttentionSpec(BlockCausal(BLOCK)), float_logits=True,
                                 route_groups=groups))

    got = padded(torch.full((B, 4), 3), dead)
    assert torch.equal(got[:, :8], padded(ids_of(31, B, 4), dead)[:, :8])
    assert close(got[:, :8], three.reference_forward(ids, BLOCK))
    assert not close(padded(torch.full((B, 4), 3), pos // BLOCK)[:, :8], got[:, :8])  # padding would count if live


def test_block_route_ties_go_to_the_lower_expert_id():
    cfg = dataclasses.replace(models_cfg(), expert_capacity=3, route_block=4)
    logits = torch.zeros(4, E)  # every score equal: experts 0, 1, 2 admitted, each token picks 0 and 1
    ids, w = block_route(logits, torch.zeros(E), torch.zeros(1, 4, dtype=torch.long), cfg)
    assert ids.tolist() == [[0, 1]] * 4
    assert torch.allclose(w, torch.full((4, 2), 0.5 * cfg.routed_scaling))
    logits[2, 7] = 5.0  # token 2 nominates expert 7 (max aggregation): admitted with 0 and 1; token 2 picks it
    ids, _ = block_route(logits, torch.zeros(E), torch.zeros(1, 4, dtype=torch.long), cfg)
    assert ids.tolist() == [[0, 1], [0, 1], [7, 0], [0, 1]]


def models_cfg():
    from compiledllm.models.config import MoEConfig

    return MoEConfig(num_experts=E, expert_dim=4, top_k=2, num_shared=0, routed_scaling=2.5)


def test_group_index_is_dense_per_row_and_block():
    groups = torch.tensor([[3, 3, 4, -1], [3, 4, 4, -1]])
    index = group_index(groups).view(2, 4)
    assert index[0, 0] == index[0, 1] and len({int(index[0, 0]), int(index[0, 2]), int(index[1, 0]),
                                                 int(index[1, 1])}) == 4
    assert index[1, 1] == index[1, 2] and (index >= 0).all() and (index < 8).all()


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.parametrize("capacity, T, blocks", [(48, 32, 1), (48, 256, 8), (8, 96, 3), (256, 64, 2)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_router_equals_the_torch_routing(capacity, T, blocks):
    from compiledllm.models import moe_triton
    from compiledllm.models.config import MoEConfig

    cfg = MoEConfig(num_experts=256, expert_dim=16, top_k=8, num_shared=0, routed_scaling=2.5,
                    expert_capacity=capacity, route_block=32)
    g = torch.Generator(device="cuda").manual_seed(capacity + T)
    logits = torch.randn(T, 256, device="cuda", generator=g)
    logits[:, 100:104] = logits[:, 100:101]  # exact ties: the lower id first on both paths
    bias = torch.randn(256, device="cuda", generator=g) * 0.1
    for groups in ((torch.arange(T, device="cuda") // (T // blocks))[None],  # one row of `blocks` groups
                   torch.arange(blocks, device="cuda")[:, None].expand(-1, T // blocks).clone()):  # a row a group
        groups[-1, -3:] = -1  # dead tokens take no part
        want_ids, want_w = block_route(logits, bias, groups, cfg)
        index, row = route_index(groups), groups.shape[1]
        ids, w = torch.ops.compiledllm.moe_block_route(logits, bias, index, row, capacity, 8, True, 2.5)
        assert torch.equal(ids, want_ids) and (ids[-3:] == 256).all() and (w[-3:] == 0).all()  # dead: no expert
        assert torch.allclose(w, want_w, rtol=1e-6, atol=1e-7)
        forms = [(0, True, True), (0, False, False), (row, None, False), (row, None, True)]
        for row_max, admit_sort, topk_sort in forms:
            ids, w = moe_triton.block_route_launch(logits, bias, index, row, capacity, 8, True, 2.5,
                                                   admit_sort=admit_sort, topk_sort=topk_sort, row_max=row_max)
            assert torch.equal(ids, want_ids), (row, row_max, admit_sort, topk_sort)
            assert torch.allclose(w, want_w, rtol=1e-6, atol=1e-7)
    assert moe_triton.block_route_supported(logits, 256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_and_compiled_steps_equal_eager_on_cuda(ckpts):
    """bf16 (the Triton router and experts): CUDA graphs == eager, batched == alone; float32: compiled + captured ==
    eager (bf16 compiled kernels round differently from eager ones)."""
    kw = dict(max_new_tokens=9, max_seq_len=32)

    def run(model, prompts=PROMPTS, batch_size=4, **fast):
        return [list(r.output_ids) for r in generate(model, prompts, POLICY, batch_size=batch_size, **kw, **fast)]

    bf16 = compiledllm.load_model(ckpts["three"], device="cuda", dtype=torch.bfloat16)
    graphs = run(bf16, cuda_graphs=True)
    assert graphs == run(bf16, cuda_graphs=False)
    assert [run(bf16, [p], 1, cuda_graphs=True)[0] for p in PROMPTS] == graphs
    f32 = compiledllm.load_model(ckpts["three"], device="cuda", dtype=torch.float32)
    assert run(f32, compile=True, cuda_graphs=True) == run(f32, cuda_graphs=False)
    assert math.isfinite(bf16.reference_forward(torch.tensor([PROMPTS[0]]), BLOCK).float().sum().item())


@pytest.mark.slow
def test_an_exported_block_routed_engine_decodes_the_eager_tokens(ckpts, tmp_path):
    """Export traces the window forward with its route groups; the exported engine (the model kind with static
    shapes) keeps the routing block and decodes the live model's tokens."""
    import yaml
    from typer.testing import CliRunner

    from compiledllm.cli import app

    recipe = {"model": {"path": str(ckpts["three"])}, "policy": POLICY, "generation": {"max_new_tokens": 9,
              "max_seq_len": 32}, "prompts": [{"ids": p} for p in PROMPTS[:2]], "batch_size": 2, "buckets": [2],
              "output": str(tmp_path / "eager.jsonl")}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "exp")])
    assert res.exit_code == 0, res.output
    for name, extra in (("eager", []), ("aoti", ["--set", f"model.path={tmp_path / 'exp'}", "--trust-exported"])):
        res = runner.invoke(app, ["run", str(tmp_path / "r.yaml"), *extra, "--set", f"output={tmp_path / name}.jsonl"])
        assert res.exit_code == 0, res.output
    rows = [[json.loads(r)["output_ids"] for r in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
            for n in ("eager", "aoti")]
    assert rows[0] == rows[1] and len(rows[0]) == 2
    exported = compiledllm.load_model(str(tmp_path / "exp"), trust_exported=True)
    assert exported.config.moe.route_block == BLOCK and block_routed(exported)
