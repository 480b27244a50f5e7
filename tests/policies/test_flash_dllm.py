"""`flash_dllm` (compiledllm/policies/flash_dllm.py, Flash-dLLM's selective cache update for a bidirectional model):
with `ahead` and `track` covering the capacity every position is recomputed every step, and its tokens are those of
the no-cache decode with the same rule (`threshold`, rule fast_dllm); with small ones the cache is approximate
(different tokens), batched == alone; the query set is the block, the previous step's tokens, the window ahead and
the tracked positions of largest mass. Flash-Verify (policies/flash_verify.py): at gamma 1 it accepts nothing past
the confident set; lower, it accepts drafts in fewer forwards, batched == alone; its views see what the paper says."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cache_cases import BLOCK, CAPACITY, no_cache_outputs, prompts, run
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.engine import Engine, EngineConfig
from compiledllm.errors import UserError
from compiledllm.policies import make_policy, policy_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("llada"), "llada", 6))


def flash(tau: float, ahead: int, track: int) -> dict:
    return {"name": "flash_dllm", "block_size": BLOCK, "threshold": tau, "ahead": ahead, "track": track}


@pytest.mark.parametrize("tau", [0.9, 0.3])
@pytest.mark.parametrize("batch", [1, 2])
def test_every_position_recomputed_is_the_no_cache_decode(model, tau, batch):
    ps = prompts([5, 9, 3, 12, 7])
    got = run(model, flash(tau, CAPACITY, CAPACITY), ps, batch)
    assert [r.output_ids for r in got] == no_cache_outputs(model, ps, batch, tau)
    assert all(r.extra["nfe"] > 0 for r in got)


@pytest.mark.parametrize("steps", [1, 3])
def test_fixed_steps_recomputing_every_position_are_the_no_cache_fixed_steps(model, steps):
    """With `steps` (Fast-dLLM's fixed-step mode, threshold unused) and every position recomputed: threshold's rule
    fast_dllm with the same `steps`, token for token, and a block of 4 costs `steps` forwards."""
    ps = prompts([5, 9, 3], seed=5)
    got = run(model, flash(0.0, CAPACITY, CAPACITY) | {"steps": steps}, ps, 2)
    assert [r.output_ids for r in got] == no_cache_outputs(model, ps, 2, 0.0, steps=steps)
    assert [r.extra["nfe"] for r in got] == [16 // BLOCK * steps] * 3


@pytest.mark.parametrize("ahead,track", [(2, 3), (0, 0), (8, 1)])
def test_small_sets_are_approximate_and_batch_invariant(model, ahead, track):
    ps = prompts([5, 9, 3, 12, 7], seed=3)
    alone = [run(model, flash(0.5, ahead, track), [p], 1)[0].output_ids for p in ps]
    batched = run(model, flash(0.5, ahead, track), ps, 3, buckets=(1, 2, 3))
    assert [r.output_ids for r in batched] == alone
    exact = [r.output_ids for r in run(model, flash(0.5, CAPACITY, CAPACITY), ps, 3)]
    assert alone != exact, "the cache changed nothing"


def test_the_logit_tracker_score_is_batch_invariant_and_tracks_other_positions(model):
    """`track_score: logits` (Flash-dLLM's raw-score ranking): batched == alone, and it tracks other positions than
    the mass does (other tokens here), while with every position recomputed the score does not matter."""
    ps = prompts([5, 9, 3, 12, 7], seed=3)
    logits = flash(0.5, 2, 3) | {"track_score": "logits"}
    alone = [run(model, logits, [p], 1)[0].output_ids for p in ps]
    assert [r.output_ids for r in run(model, logits, ps, 3, buckets=(1, 2, 3))] == alone
    assert alone != [r.output_ids for r in run(model, flash(0.5, 2, 3), ps, 3)]
    everything = flash(0.5, CAPACITY, CAPACITY)
    assert ([r.output_ids for r in run(model, everything | {"track_score": "logits"}, ps, 3)]
            == [r.output_ids for r in run(model, everything, ps, 3)])


def test_the_query_set_is_block_new_ahead_and_the_most_attended(model):
    """One row: prompt 0-5, block 8-11, working length 20; decoded 6 and 7 (7 in the last step), masked 8-19 but 9;
    ahead 3, track 2: the block, 7, the next three masked past the block (12, 13, 14) and the two decoded positions
    outside those with the largest mass (2 and 6), in position order, padding last."""
    policy = make_policy(policy_config(flash(0.9, 3, 2)), model.mask_token_id, bidirectional=True)
    T, M = 24, model.mask_token_id
    seq = torch.tensor([[5] * 8 + [M] * 16])
    seq[0, 9] = 7
    mass = torch.zeros(1, T)
    mass[0, [2, 6, 3, 9, 13]] = torch.tensor([0.5, 0.4, 0.1, 9.0, 9.0])  # 9: in the block; 13: masked
    new = torch.zeros(1, T, dtype=torch.bool)
    new[0, [7, 9]] = True
    st = SimpleNamespace(seq=seq, prompt_len=torch.tensor([6]), work_len=torch.tensor([20]),
                         block_start=torch.tensor([8]), policy={"mass": mass, "new": new})
    masked = (seq == M) & (torch.arange(T) >= 6) & (torch.arange(T) < 20)
    q_pos, live, counted, logits_at = policy.query_set(st, masked, torch.tensor([True]))
    n = int(live.sum())
    assert q_pos[0, :n].tolist() == [2, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert q_pos.shape[1] == policy.queries(T) and not live[0, n:].any()
    assert q_pos[0, :n][counted[0, :n]].tolist() == [8, 10, 11, 12, 13, 14]  # the masked block and window queries
    assert q_pos[0].gather(0, logits_at[0]).tolist() == [8, 9, 10, 11]


@pytest.mark.parametrize("rule", ["agree", "prefix_product"])
def test_verify_at_gamma_one_accepts_nothing_past_the_confident_set(model, rule):
    ps = prompts([5, 9, 3, 12], seed=4)
    plain = run(model, flash(0.9, 4, 6), ps, 2)
    checked = run(model, flash(0.9, 4, 6) | {"verify": True, "gamma": 1.0, "verify_rule": rule}, ps, 2)
    assert [r.output_ids for r in checked] == [r.output_ids for r in plain]
    assert all(r.extra["verified"] == 0 for r in checked)


@pytest.mark.parametrize("rule,gamma", [("agree", 0.0), ("prefix_product", 0.05)])
def test_verify_accepts_drafts_batch_invariantly_in_fewer_draft_passes(model, rule, gamma):
    """A low gamma accepts drafts the confidence rule left (more tokens a step: fewer decode forwards, counting
    the verify forwards apart); batched == alone."""
    ps = prompts([5, 9, 3, 12], seed=4)
    policy = flash(0.9, 4, 6) | {"verify": True, "gamma": gamma, "verify_rule": rule}
    alone = [run(model, policy, [p], 1)[0] for p in ps]
    batched = run(model, policy, ps, 3, buckets=(1, 2, 3))
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]
    assert all(r.extra["verified"] > 0 for r in batched)
    plain = run(model, flash(0.9, 4, 6), ps, 3)
    assert sum(r.extra["nfe"] for r in batched) < sum(r.extra["nfe"] for r in plain)


def test_the_views_see_what_flash_verify_says():
    """Draft i sees drafts j <= i and masks j > i; mask i sees drafts j < i and masks j >= i; the tracked context
    sees itself and the masks; all see the tracked context; padding sees only itself."""
    from compiledllm.policies.flash_verify import view_groups

    S = 3
    see = view_groups(S, "cpu").tolist()
    sees = lambda g, h: bool(see[g] >> h & 1)  # noqa: E731
    draft, mask = (lambda i: 1 + i), (lambda i: 1 + S + i)
    for i in range(S):
        for j in range(S):
            assert sees(draft(i), draft(j)) == (j <= i) and sees(draft(i), mask(j)) == (j > i)
            assert sees(mask(i), draft(j)) == (j < i) and sees(mask(i), mask(j)) == (j >= i)
        assert sees(draft(i), 0) and sees(mask(i), 0) and sees(0, mask(i)) and not sees(0, draft(i))
    assert see[2 * S + 1] == 1 << (2 * S + 1) and not any(sees(g, 2 * S + 1) for g in range(2 * S + 1))


def test_refuses_a_block_causal_model_and_bad_settings(tmp_path):
    model = compiledllm.load_model(write_checkpoint(tmp_path / "s", "sdar", 1))
    with pytest.raises(UserError, match="flash_dllm"):
        Engine(model, EngineConfig(flash(0.9, 4, 4), max_new_tokens=4))
    with pytest.raises(UserError, match="track: must be >= 0"):
        policy_config(flash(0.9, 4, -1))
    with pytest.raises(UserError, match="search: must be within"):
        policy_config(flash(0.9, 4, 4) | {"verify": True, "search": 15})
    with pytest.raises(UserError, match="verify_rule"):
        policy_config(flash(0.9, 4, 4) | {"verify_rule": "vote"})


@pytest.mark.parametrize("verify,fused,score", [(False, False, "mass"), (True, False, "mass"), (False, True, "mass"),
                                               (False, True, "logits")],
                         ids=["cache", "verify", "fused-cache", "logit-score"])
def test_compiled_equals_eager(model, compile_kw, verify, fused, score):
    ps = prompts([5, 2, 9, 3], seed=6)
    kw = dict(max_new_tokens=8, ignore_eos=True, **compile_kw)
    policy = (flash(0.6, 3, 2) | ({"verify": True, "gamma": 0.3} if verify else {})
              | {"fused_cache": fused, "track_score": score})
    eager = Engine(model, EngineConfig(policy, **kw)).generate(ps)
    compiled = Engine(model, EngineConfig(policy, compile=True, **kw)).generate(ps)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    assert [r.extra["nfe"] for r in compiled] == [r.extra["nfe"] for r in eager]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("dtype,verify,score", [(torch.bfloat16, False, "mass"), (torch.float32, False, "mass"),
                                               (torch.bfloat16, True, "mass"), (torch.bfloat16, False, "logits")],
                         ids=["bf16", "fp32", "bf16-verify", "bf16-logits"])
def test_cuda_graphs_equal_eager(tmp_path, dtype, verify, score):
    """The refresh on a subset of rows and the decode's query set (sorts, scatters, an indexed KV source) captured
    once per (phase, bucket); bf16 with head_dim 64 runs the packed-attention kernel (with the logit tracker score:
    the kernel's scored pass, its score equal to the reference's on the same inputs in test_packed_attention.py)."""
    ckpt = write_checkpoint(tmp_path / "l", "llada", 11, d_model=256, n_heads=4, n_kv_heads=4)
    model = compiledllm.load_model(ckpt, device="cuda", dtype=dtype, eos_token_id=0)
    ps = prompts([5, 11, 2, 8, 3, 14], seed=8)
    kw = dict(max_new_tokens=21, batch_size=4, max_seq_len=48)
    policy = flash(0.9, 6, 5) | ({"verify": True, "gamma": 0.5} if verify else {}) | {"track_score": score}
    eager = Engine(model, EngineConfig(policy, cuda_graphs=False, **kw)).generate(ps)
    graphs = Engine(model, EngineConfig(policy, cuda_graphs=True, **kw)).generate(ps)
    assert [r.output_ids for r in graphs] == [r.output_ids for r in eager]
    assert [r.extra["nfe"] for r in graphs] == [r.extra["nfe"] for r in eager]


@pytest.mark.parametrize("verify", [False, True], ids=["cache", "verify"])
@pytest.mark.parametrize("ahead,track", [(2, 3), (CAPACITY, CAPACITY)])
def test_writing_the_kv_before_the_attention_changes_no_token(model, monkeypatch, verify, ahead, track):
    """`fused_cache`: the projection writes each forward's K/V before its attention reads the cache (Flash-Cache's
    order; on the CPU the separate kernels in that order): no forward reads a position it writes, so the tokens and
    forward counts are those of the write-after order, batched and alone."""
    from compiledllm.models import qkv_kernel

    ps = prompts([5, 9, 3, 12, 7], seed=4)
    policy = flash(0.6, ahead, track) | ({"verify": True, "gamma": 0.3} if verify else {})
    after = run(model, policy | {"fused_cache": False}, ps, 3)
    calls, real = [], qkv_kernel.project_write
    monkeypatch.setattr(qkv_kernel, "project_write", lambda *a: calls.append(a[-1] is not None) or real(*a))
    first = run(model, policy | {"fused_cache": True}, ps, 3)
    assert any(calls)  # the write-first path ran, with writes
    assert [(r.output_ids, r.extra["nfe"]) for r in first] == [(r.output_ids, r.extra["nfe"]) for r in after]
    assert [r.output_ids for r in first] == [run(model, policy | {"fused_cache": True}, [p], 1)[0].output_ids
                                             for p in ps]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_cache_kernel_on_the_gpu(tmp_path, dtype):
    """The Triton kernel (models/qkv_kernel.py) against the separate projection, RoPE and write: q, k, v and the pool
    rows within the dtype's rounding; then flash_dllm with it, captured == eager, and its tokens == the separate
    path's in float32."""
    from compiledllm.kv.pooled import PooledLayout
    from compiledllm.models import qkv_kernel

    ckpt = write_checkpoint(tmp_path / "l", "llada", 11, d_model=256, n_heads=4, n_kv_heads=4)
    model = compiledllm.load_model(ckpt, device="cuda", dtype=dtype, eos_token_id=0)
    attn, rotary = model.layers[0].attn, model.rotary
    B, L, cap = 3, 37, 48
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, L, model.config.hidden_size, device="cuda", generator=g).to(dtype)
    # distinct positions in a row, as a forward's are (two writes to one row would race in either path)
    pos = torch.rand(B, cap, device="cuda", generator=g).argsort(1)[:, :L]
    write = torch.where(torch.rand(B, L, device="cuda", generator=g) < 0.8, pos, -1)
    cos, sin = rotary.cos_sin(pos)
    pools = [PooledLayout.for_model(model, B, cap).allocate().layer(0) for _ in range(2)]
    assert qkv_kernel.supports(attn, rotary, x, pools[0])
    want = qkv_kernel.project_write(attn, rotary, x.cpu().cuda(), cos, sin, None, None)
    pools[0].write(write, want[1], want[2])
    got = qkv_kernel.project_write(attn, rotary, x, cos, sin, pools[1], write)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    kept = torch.arange(B * (cap + 1), device="cuda") % (cap + 1) < cap  # spare rows: every -1 write, any order
    for a, b in zip((*got, pools[1].k[kept], pools[1].v[kept]), (*want, pools[0].k[kept], pools[0].v[kept])):
        torch.testing.assert_close(a, b, **tol)
    ps = prompts([5, 11, 2, 8, 3, 14], seed=8)
    kw = dict(max_new_tokens=21, batch_size=4, max_seq_len=48)
    policy = flash(0.9, 6, 5) | {"fused_cache": True}
    eager = Engine(model, EngineConfig(policy, cuda_graphs=False, **kw)).generate(ps)
    graphs = Engine(model, EngineConfig(policy, cuda_graphs=True, **kw)).generate(ps)
    assert [r.output_ids for r in graphs] == [r.output_ids for r in eager]
    if dtype == torch.float32:
        separate = Engine(model, EngineConfig(flash(0.9, 6, 5), cuda_graphs=False, **kw)).generate(ps)
        assert [r.output_ids for r in eager] == [r.output_ids for r in separate]
