"""Prefill on CUDA: compiled chunk forwards == eager ones, through the selection stores too, and prefill interleaved
with captured decode steps (GPU only). A file of its own so that the GPU list runs it beside test_gpu_engine.py
(tools/bench/gpu_session.sh's GPULIST_OWN): together they outlasted a device call."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.engine import Engine, EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device (run on the GPU machine)")]

POLICY = {"name": "threshold", "block_size": 8, "threshold": 0.6}


def long_prompts(tmp_path, seed: int):
    """A float32 CUDA model and four prompts of 90-1,500 tokens (several prefill chunks of 512 each)."""
    ckpt = write_checkpoint(tmp_path / "long", "llada2", 13, head_dim=64, max_position_embeddings=4096)
    model = compiledllm.load_model(ckpt, device="cuda", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return model, [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (1500, 700, 1100, 90)]


def test_gpu_compiled_prefill_equals_eager(tmp_path, monkeypatch):
    """prefill.compile on CUDA: the full chunk forwards through compiled regions (static shapes per (rows, C),
    compiled by the start-up's warm-up) give the eager prefill's tokens (float32: Inductor's fusions round bf16
    differently); forced here for forwards of every size (by default >= COMPILE_MIN_TOKENS)."""
    import compiledllm.engine.prefill as prefill

    model, ps = long_prompts(tmp_path, seed=5)
    kw = dict(max_new_tokens=13, batch_size=4, compile=False, prefill_chunk=512, prefill_tokens=2048)
    monkeypatch.setattr(prefill, "COMPILE_MIN_TOKENS", 0)
    runs = {}
    for compiled in (False, True):
        eng = Engine(model, EngineConfig(POLICY, prefill_compile=compiled, **kw))
        runs[compiled] = eng.generate(ps), eng.stats.prefill_tokens
        assert eng.prefill_compile is compiled
    assert [r.output_ids for r in runs[True][0]] == [r.output_ids for r in runs[False][0]]
    assert runs[True][1] == runs[False][1] == sum(len(p) // 8 * 8 for p in ps)
    assert Engine(model, EngineConfig(POLICY, max_new_tokens=4, compile="auto")).prefill_compile  # CUDA: on


HOST_POOL = {"name": "herald", "budget": 0.3, "retrieval": "scan", "pool": "host", "scratch": 4}


@pytest.mark.parametrize("store", [{"name": "mage", "budget": 0.3}, HOST_POOL], ids=["sparse-store", "host-pool-store"])
def test_gpu_compiled_prefill_through_the_selection_stores(tmp_path, monkeypatch, store):
    """prefill.compile: true through MAGE's sparse store and HERALD's host pool (its rows prefill into lent scratch
    caches) on CUDA: the eager prefill's tokens (float32), compiled forwards built at start-up. What `auto` needs
    before it compiles these stores' prefill too (the host pool's: 1.24x its eager prefill on an H100, 2026-12-07)."""
    import compiledllm.engine.prefill as prefill

    model, ps = long_prompts(tmp_path, seed=7)
    kw = dict(max_new_tokens=13, batch_size=4, compile=False, prefill_chunk=512, prefill_tokens=2048, ignore_eos=True)
    monkeypatch.setattr(prefill, "COMPILE_MIN_TOKENS", 0)  # forced for forwards of every size
    outs = {}
    for compiled in (False, True):
        eng = Engine(model, EngineConfig(POLICY | store, prefill_compile=compiled, **kw))
        outs[compiled] = [r.output_ids for r in eng.generate(ps)]
        assert bool(eng.session(4).prefiller.compiled_shapes) is compiled  # compiled through this store, or not
    assert outs[True] == outs[False]


def test_gpu_compiled_batched_prefill_and_interleaving_equal_eager(tmp_path):
    """Long prompts on CUDA (chunks of 512, 4 rows per forward): a compiled, captured engine == eager, and
    requests arriving while others decode (prefill interleaved with captured steps) get the tokens they get
    alone."""
    model, ps = long_prompts(tmp_path, seed=3)
    policy = POLICY
    kw = dict(max_new_tokens=13, prefill_chunk=512, prefill_tokens=2048)
    eager = Engine(model, EngineConfig(policy, batch_size=4, cuda_graphs=False, **kw)).generate(ps)
    eng = Engine(model, EngineConfig(policy, batch_size=4, compile=True, **kw))
    compiled = eng.generate(ps)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    assert eng.stats.prefill_tokens == sum(len(p) // 8 * 8 for p in ps)
    alone = [Engine(model, EngineConfig(policy, batch_size=1, cuda_graphs=False, **kw)).generate([p])[0].output_ids
             for p in ps]
    arriving = Engine(model, EngineConfig(policy, batch_size=2, **kw)).generate(ps, arrivals=[0, 0, 0.05, 0.1])
    assert [r.output_ids for r in arriving] == alone
