"""The engine on CUDA: captured steps == eager steps, compiled == eager, batch invariance (GPU only)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.engine import Engine, EngineConfig, generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device (run on the GPU machine)")]

POLICIES = [{"name": "threshold", "block_size": 8, "threshold": 0.6},
            {"name": "t2t", "block_size": 8, "threshold": 0.6, "edit_threshold": 0.4, "max_post_steps": 3},
            {"name": "threshold", "block_size": 8, "threshold": 0.6, "commit": "fused"}]  # its 2-block phase too


def gpu_model(tmp_path, arch: str, dtype, seed: int = 11):
    # head_dim 64 so a packed-attention kernel (D 64/128: Triton, else CuPy) is what runs in bf16
    ckpt = write_checkpoint(tmp_path / f"{arch}{seed}", arch, seed, head_dim=64)
    return compiledllm.load_model(ckpt, device="cuda", dtype=dtype)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("arch", ["llada2", "sdar"])
@pytest.mark.parametrize("policy", POLICIES, ids=["threshold", "t2t", "threshold-fused"])
def test_cuda_graph_replay_equals_eager(tmp_path, arch, policy):
    model = gpu_model(tmp_path, arch, torch.bfloat16)
    ps = prompts(6, model.config.vocab_size)
    kw = dict(max_new_tokens=21, batch_size=4, max_seq_len=64)
    eager = generate(model, ps, policy, cuda_graphs=False, **kw)
    graphs = generate(model, ps, policy, cuda_graphs=True, **kw)
    assert [r.output_ids for r in graphs] == [r.output_ids for r in eager]
    assert [r.steps for r in graphs] == [r.steps for r in eager]


def test_compiled_graphs_equal_eager(tmp_path):
    model = gpu_model(tmp_path, "llada2", torch.float32)
    ps = prompts(4, model.config.vocab_size, seed=1)
    kw = dict(max_new_tokens=13, batch_size=4, max_seq_len=48)
    eager = generate(model, ps, POLICIES[0], cuda_graphs=False, **kw)
    compiled = generate(model, ps, POLICIES[0], compile=True, cuda_graphs=True, **kw)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_batch_invariance(tmp_path, dtype):
    """Every prompt gives the same tokens alone and in batches of 3 and 8 (CUDA graphs, default buckets)."""
    model = gpu_model(tmp_path, "llada2", dtype, seed=12)
    ps = prompts(8, model.config.vocab_size, seed=2)
    kw = dict(max_new_tokens=17, max_seq_len=64)
    alone = [Engine(model, POLICIES[0], batch_size=1, **kw).generate([p])[0].output_ids for p in ps]
    for size in (3, 8):
        assert [r.output_ids for r in Engine(model, POLICIES[0], batch_size=size, **kw).generate(ps)] == alone, size


def test_kv_write_in_place_eager_and_compiled():
    """The KV write on a layer's strided view of the slot-major cache, eager and compiled as the regions are, lands
    in place and touches nothing else."""
    from compiledllm.engine.compile import INDUCTOR_OPTIONS
    from compiledllm.kv.cache import KVCache

    kv = KVCache.allocate(4, 6, 300, 4, 128, torch.bfloat16, "cuda")
    kv.k.normal_()
    kv.v.normal_()
    positions = torch.stack([torch.randperm(300, device="cuda")[:32] for _ in range(6)])
    k, v = torch.randn(6, 32, 4, 128, device="cuda").bfloat16(), torch.randn(6, 32, 4, 128, device="cuda").bfloat16()
    ref_k, ref_v = kv.k.clone(), kv.v.clone()
    rows = torch.arange(6, device="cuda")[:, None].expand_as(positions)
    ref_k[:, 2].index_put_((rows, positions), k)
    ref_v[:, 2].index_put_((rows, positions), v)
    kv.layer(2).write(positions, k, v)
    assert torch.equal(kv.k, ref_k) and torch.equal(kv.v, ref_v)
    write = torch.compile(lambda layer, p, a, b: layer.write(p, a, b), fullgraph=True, options=INDUCTOR_OPTIONS)
    write(kv.layer(3), positions, k, v)
    ref_k[:, 3].index_put_((rows, positions), k)
    ref_v[:, 3].index_put_((rows, positions), v)
    assert torch.equal(kv.k, ref_k) and torch.equal(kv.v, ref_v)


@pytest.mark.parametrize("name", ["two_block", "draft_decode", "flowblock", "flowblock_sync"])
def test_new_step_shapes_graphs_equal_eager(tmp_path, name):
    """The test-only policies of tests/policies on CUDA - two blocks per step (advance up to two), a two-phase step
    whose first phase is a QueryGroups 2B forward (the packed kernel's groups rule inside the engine) - and FlowBlock
    (ungated: windows of two blocks) and its lock-step variant; each
    phase captured per bucket == eager in bf16 (the Triton kernels), and compiled + captured == eager in float32
    (Inductor's fusions round bf16 differently, as in test_compiled_graphs_equal_eager)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "policies"))  # the modules tests/policies imports
    from draft_decode import DraftDecodeConfig, DraftDecodePolicy
    from two_block import TwoBlockConfig, TwoBlockPolicy

    from compiledllm.policies import register_policy

    register_policy("two_block", TwoBlockConfig, TwoBlockPolicy)
    register_policy("draft_decode", DraftDecodeConfig, DraftDecodePolicy)
    pol = {"name": name, "block_size": 8, "threshold": 0.6} | ({"spawn": 0.0} if "flowblock" in name else {})
    kw = dict(max_new_tokens=21, batch_size=4, max_seq_len=64)
    forms = ((torch.bfloat16, dict(cuda_graphs=True)), (torch.float32, dict(compile=True, cuda_graphs=True)))
    for dtype, fast in forms:
        model = gpu_model(tmp_path / str(dtype), "llada2", dtype, seed=13)
        ps = prompts(6, model.config.vocab_size, seed=3)
        eager = generate(model, ps, pol, cuda_graphs=False, **kw)
        captured = generate(model, ps, pol, **fast, **kw)
        assert [r.output_ids for r in captured] == [r.output_ids for r in eager], dtype
        assert [r.steps for r in captured] == [r.steps for r in eager], dtype


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled-graphs"])
def test_sampling_inside_captured_steps_equals_eager(tmp_path, compile):
    """temperature / top-k / top-p noise is computed inside the captured step: graphs == eager, batch-invariant."""
    model = gpu_model(tmp_path, "llada2", torch.float32, seed=13)
    ps = prompts(6, model.config.vocab_size, seed=3)
    pol = POLICIES[1] | {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 7}
    kw = dict(max_new_tokens=17, max_seq_len=64)
    eager = generate(model, ps, pol, cuda_graphs=False, batch_size=4, **kw)
    graphs = generate(model, ps, pol, cuda_graphs=True, compile=compile, batch_size=4, **kw)
    one = generate(model, ps, pol, cuda_graphs=True, batch_size=1, **kw)
    assert [r.output_ids for r in graphs] == [r.output_ids for r in eager] == [r.output_ids for r in one]
    assert [r.output_ids for r in eager] != [r.output_ids for r in generate(model, ps, POLICIES[1], batch_size=4, **kw)]


def test_the_recipe_default_compiles_the_decode_step_on_cuda(tmp_path):
    """compile: auto (the recipe's default, not given here) on CUDA: the run compiles its step, captures it and
    reports what Inductor's cache held; its tokens are compile: false's (float32: Inductor's fusions round bf16
    differently, as in test_compiled_graphs_equal_eager)."""
    from compiledllm.compile_cache import CacheReport
    from compiledllm.recipe import load_recipe
    from compiledllm.runner import execute

    ckpt = write_checkpoint(tmp_path / "auto", "llada2", 11, head_dim=64)
    recipe = {"model": {"path": str(ckpt), "device": "cuda", "dtype": "float32"}, "policy": POLICIES[0],
              "generation": {"max_new_tokens": 13, "max_seq_len": 48},
              "prompts": [{"ids": p} for p in prompts(4, 96, seed=1)], "batch_size": 4, "output": None}
    assert load_recipe(recipe).compile == "auto"
    compiled, summary = execute(load_recipe(recipe))
    assert summary.compile is True and summary.startup_s > 0
    assert isinstance(summary.compile_cache, CacheReport)
    assert summary.compile_cache.state in ("cold", "warm", "partly warm", "in process")
    eager, off = execute(load_recipe(recipe, ["compile=false"]))
    assert off.compile is False and off.compile_cache is None
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]


def test_phase_times_under_cuda_graphs(tmp_path):
    """phase_times on CUDA: every decode step's phase replays a graph (none uncaptured), its event time is positive
    and inside the decode time, and the tokens are those of the untimed run."""
    model = gpu_model(tmp_path, "llada2", torch.bfloat16, seed=13)
    ps = prompts(4, model.config.vocab_size, seed=3)
    runs = {}
    for timed in (False, True):
        engine = Engine(model, EngineConfig(POLICIES[0], max_new_tokens=16, batch_size=4, max_seq_len=48,
                                            phase_times=timed))
        runs[timed] = ([r.output_ids for r in engine.generate(ps)], engine.stats)
    assert runs[True][0] == runs[False][0]
    stats = runs[True][1]
    # commit: auto is fused on CUDA: a step runs "commit" where a row begins a block, else "decode"
    assert runs[False][1].phases == {} and "decode" in stats.phases and set(stats.phases) <= {"decode", "commit"}
    phases = stats.phases.values()
    assert sum(p["runs"] for p in phases) == stats.decode_steps > 0 and all(p["uncaptured"] == 0 for p in phases)
    assert all(p["seconds"] > 0 for p in phases) and sum(p["seconds"] for p in phases) <= stats.decode_s
