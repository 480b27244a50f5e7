"""`elastic_cache` (compiledllm/policies/elastic_cache.py, Elastic-Cache's adaptive KV cache for a bidirectional
model): at gamma 1 every step is recomputed from layer 0 and its tokens are those of the no-cache decode with the
same rule (`threshold`, rule fast_dllm); lower, the drift test recomputes from deeper layers (rows resuming at their
own layer inside a recompute group), batched == alone, compiled == eager; a forward resumed at any layer of an
unchanged sequence is the full forward; the drift test picks the first layer whose watched keys moved."""
from __future__ import annotations

import pytest
import torch
from cache_cases import BLOCK, CAPACITY, no_cache_outputs, prompts, run
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.attention.spec import AttentionSpec, Bidirectional
from compiledllm.engine import Engine, EngineConfig
from compiledllm.errors import UserError
from compiledllm.policies import make_policy, policy_config
from compiledllm.policies.plan import Forward, Resume


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("llada"), "llada", 6, n_layers=6))


def elastic(tau: float, gamma: float, window: int = BLOCK, **kw) -> dict:
    return {"name": "elastic_cache", "block_size": BLOCK, "threshold": tau, "gamma": gamma, "window": window} | kw


@pytest.mark.parametrize("tau", [0.9, 0.3])
@pytest.mark.parametrize("batch", [1, 2])
def test_gamma_one_recomputes_every_step_and_is_the_no_cache_decode(model, tau, batch):
    ps = prompts([5, 9, 3, 12, 7])
    got = run(model, elastic(tau, 1.0), ps, batch)
    assert [r.output_ids for r in got] == no_cache_outputs(model, ps, batch, tau)
    # every step after the first (the refresh) failed the test at layer 0 and recomputed all 6 layers
    for r in got:
        steps = r.extra["nfe"] - 1
        assert r.extra["recomputes"] == steps > 0 and r.extra["recomputed_layers"] == 6 * steps


@pytest.mark.parametrize("steps", [1, 3])
def test_fixed_steps_at_gamma_one_are_the_no_cache_fixed_steps(model, steps):
    ps = prompts([5, 9, 3], seed=5)
    got = run(model, elastic(0.0, 1.0, steps=steps), ps, 2)
    assert [r.output_ids for r in got] == no_cache_outputs(model, ps, 2, 0.0, steps=steps)
    assert [r.extra["nfe"] for r in got] == [16 // BLOCK * steps] * 3


def test_adaptive_recompute_from_deeper_layers_is_batch_invariant(model):
    """At gamma 0.9 some steps keep the cache and others recompute from layers past 0, rows resuming at their own
    layer inside a group's forward (6 layers in 2 groups: first layers 0 and 3); batched == alone; the tokens differ
    from the exact decode's (the cache is approximate)."""
    ps = prompts([5, 9, 3, 12, 7], seed=3)
    policy = elastic(0.5, 0.9, resume_groups=2)
    alone = [run(model, policy, [p], 1)[0] for p in ps]
    engine = Engine(model, EngineConfig(policy, max_new_tokens=16, batch_size=3, max_seq_len=CAPACITY,
                                        ignore_eos=True, buckets=(1, 2, 3)))
    batched = engine.generate(ps)
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]
    assert [r.extra for r in batched] == [r.extra for r in alone]
    stats = engine.stats.policy  # the host's count (bench's policy_stats) == the rows' own
    assert stats["recomputes"] == sum(r.extra["recomputes"] for r in batched) > 0
    assert stats["recompute_layers"] == pytest.approx(sum(r.extra["recomputed_layers"] for r in batched)
                                                      / stats["recomputes"], abs=0.01)
    assert 0 <= stats["discarded_layers"] < 3  # at most the layers of a group of 3, before the row's own
    assert stats["recompute_layers"] < 6, "no recompute started past layer 0"
    assert sum(r.extra["recomputes"] for r in batched) < sum(r.extra["nfe"] - 1 for r in batched)
    exact = run(model, elastic(0.5, 1.0), ps, 3)
    assert [r.output_ids for r in batched] != [r.output_ids for r in exact], "the cache changed nothing"


def test_gamma_zero_never_recomputes_and_a_smaller_window_changes_tokens(model):
    ps = prompts([5, 9, 3, 12], seed=4)
    never = run(model, elastic(0.5, 0.0), ps, 2)
    assert all(r.extra["recomputes"] == 0 for r in never)
    assert [r.output_ids for r in run(model, elastic(0.5, 0.0, window=2), ps, 2)] != [r.output_ids for r in never]


@pytest.mark.parametrize("first", [0, 2])
def test_a_forward_resumed_at_any_layer_of_an_unchanged_sequence_is_the_full_forward(model, first):
    """The full forward keeps every layer's input (keep_hidden); a forward resumed from those inputs, row 0 at layer
    `first`, row 1 at layer 4, row 2 at the last layer, gives the same logits and rewrites the same K/V; resumed
    from changed inputs, it does not (the negative control)."""
    from dataclasses import replace

    from compiledllm.kv.pooled import PooledLayout

    B, T, L = 3, 12, model.config.num_layers
    kv = replace(PooledLayout.for_model(model, B, T), hidden=model.config.hidden_size).allocate()
    tokens = torch.randint(2, 96, (B, T), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T).expand(B, T)
    spec = AttentionSpec(Bidirectional(torch.full((B,), T)))
    full = model(Forward(tokens, pos, spec, kv_write=pos, keep_hidden=True, float_logits=True), kv)
    k_before = [k.clone() for k in kv.k]
    resume = Resume(first, torch.tensor([first, 4, L - 1]))
    again = model(Forward(tokens, pos, spec, kv_write=pos, keep_hidden=True, resume=resume, float_logits=True), kv)
    torch.testing.assert_close(again, full, rtol=1e-5, atol=1e-5)
    kept = torch.arange(B * (T + 1)) % (T + 1) < T  # not the spare rows, where the skipped writes land
    for a, b in zip(kv.k, k_before):
        torch.testing.assert_close(a[kept], b[kept], rtol=1e-5, atol=1e-5)
    bounded = Resume(first, torch.tensor([first, 4, 4]), last=4)  # no row resumes past layer 4: nothing read there
    again = model(Forward(tokens, pos, spec, kv_write=pos, keep_hidden=True, resume=bounded, float_logits=True), kv)
    torch.testing.assert_close(again, full, rtol=1e-5, atol=1e-5)
    kv.hidden[L - 1].mul_(2.0)
    moved = model(Forward(tokens, pos, spec, kv_write=pos, resume=resume, float_logits=True), kv)
    assert not torch.allclose(moved, full, rtol=1e-3, atol=1e-3)


def test_the_watched_tokens_and_the_first_layer_whose_attention_on_them_moved(model):
    """Watched: each layer's most-attended working position (heads summed), united over the layers. The drift test:
    the first layer where the cosine of the last and this step's mass on the watched tokens, over (KV head, token),
    is <= gamma; one watched token still gives a test, through its heads."""
    policy = make_policy(policy_config(elastic(0.9, 0.9)), model.mask_token_id, bidirectional=True)
    policy.layers = 3
    prev = torch.zeros(2, 3, 2, 6)  # [B, L, KVH, T]
    prev[..., 1], prev[..., 4], prev[..., 5] = 3.0, 2.0, 0.5
    prev[:, 2, :, 4] = 4.0  # layer 2's most attended is key 4, the other layers' key 1
    working = torch.ones(2, 6, dtype=torch.bool)
    assert policy.watch(prev, working)[0].nonzero().flatten().tolist() == [1, 4]
    working[1, 1] = False  # outside the working sequence: never watched
    assert policy.watch(prev, working)[1].nonzero().flatten().tolist() == [4]
    watched = policy.watch(prev, torch.ones(2, 6, dtype=torch.bool))
    now = prev.clone()
    now[0, 1, :, 4] = 0.0  # row 0: layer 1's attention on key 4 is gone (cosine 0.83)
    now[1, :, :, 5] = 9.0  # row 1: an unwatched key changed only
    assert policy.drift_layer(prev, now, watched).tolist() == [1, 3]
    watched[0, 4] = False  # key 4 not watched: layer 1 holds
    now[0, 2, 0, 1] = 0.0  # layer 2: key 1's attention gone in one of its two heads (cosine 0.71)
    assert policy.drift_layer(prev, now, watched).tolist() == [2, 3]


def test_refuses_a_block_causal_model_and_bad_settings(tmp_path):
    sdar = compiledllm.load_model(write_checkpoint(tmp_path / "s", "sdar", 1))
    with pytest.raises(UserError, match="elastic_cache"):
        Engine(sdar, EngineConfig(elastic(0.9, 0.9), max_new_tokens=4))
    with pytest.raises(UserError, match="gamma: must be within"):
        policy_config(elastic(0.9, 1.5))
    with pytest.raises(UserError, match="window: must be >= 1"):
        policy_config(elastic(0.9, 0.9, window=0))


def test_compiled_equals_eager(model, compile_kw):
    ps = prompts([5, 2, 9, 3], seed=6)
    kw = dict(max_new_tokens=8, ignore_eos=True, **compile_kw)
    policy = elastic(0.6, 0.9, resume_groups=2)
    eager = Engine(model, EngineConfig(policy, **kw)).generate(ps)
    compiled = Engine(model, EngineConfig(policy, compile=True, **kw)).generate(ps)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    assert [r.extra for r in compiled] == [r.extra for r in eager]
    assert any(r.extra["recomputes"] for r in eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_graphs_equal_eager(tmp_path, dtype):
    """The refresh and the recompute groups on row subsets, the decode's query set, the resumed forward and the
    layer inputs' pools, captured once per (phase, bucket)."""
    ckpt = write_checkpoint(tmp_path / "l", "llada", 11, d_model=256, n_heads=4, n_kv_heads=4, n_layers=6)
    model = compiledllm.load_model(ckpt, device="cuda", dtype=dtype, eos_token_id=0)
    ps = prompts([5, 11, 2, 8, 3, 14], seed=8)
    kw = dict(max_new_tokens=21, batch_size=4, max_seq_len=48)
    policy = elastic(0.9, 0.9, window=6)
    eager = Engine(model, EngineConfig(policy, cuda_graphs=False, **kw)).generate(ps)
    graphs = Engine(model, EngineConfig(policy, cuda_graphs=True, **kw)).generate(ps)
    assert [r.output_ids for r in graphs] == [r.output_ids for r in eager]
    assert [r.extra for r in graphs] == [r.extra for r in eager]
