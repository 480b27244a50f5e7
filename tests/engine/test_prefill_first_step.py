"""`prefill.first_step`: a prompt's last prefill forward also makes the request's first decode step (its block's
queries after the prompt's, engine/prefill.py). Every token, event and per-request count must be those of the
step made on its own; only the decode steps are fewer."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint
from serve_loop import serve

import compiledllm
from compiledllm.engine import Engine, EngineConfig, RequestParams

CAPACITY = 96


@pytest.fixture(scope="module", params=["sdar", "llada2"])
def model(request, tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, 19))


def prompts_of(lengths, vocab, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run(model, policy, first_step, arrivals, **settings):
    eng = Engine(model, EngineConfig(policy, max_new_tokens=12, batch_size=3, max_seq_len=CAPACITY,
                                     prefill_first_step=first_step, **settings))
    session = eng.session(3, CAPACITY)
    out = serve(session, arrivals)
    results = {i: (r.output_ids, r.finish_reason, r.steps, r.blocks) for i, r in out.results.items()}
    return results, out.streamed, session.stats(), session.prefiller.first_step is not None


@pytest.mark.parametrize("policy", [{"name": "threshold", "block_size": 4, "threshold": 0.6},
                                    {"name": "threshold", "block_size": 4, "threshold": 0.6, "commit": "fused"},
                                    {"name": "threshold", "block_size": 4, "threshold": 1.0, "steps": 2},
                                    {"name": "threshold", "block_size": 4, "threshold": 0.05, "commit": "fused"},
                                    {"name": "threshold", "block_size": 4, "rule": "sdar_dynamic"},
                                    {"name": "threshold", "block_size": 4, "threshold": 0.7, "temperature": 0.8,
                                     "top_k": 20}])
def test_the_first_step_in_prefill_changes_no_token_and_saves_a_decode_step(model, policy):
    """Prompts on and off block boundaries, one longer than a prefill chunk, requests joining while others decode,
    one with 2 new tokens (it can end in its first step), with tau 0.05 blocks that retire in it, and sampling (its
    keys count the block's steps, not forwards)."""
    prompts = prompts_of([8, 13, 37, 5, 22], model.config.vocab_size)
    arrivals = {0: [(0, prompts[0], RequestParams(20)), (1, prompts[1], RequestParams(2)),
                    (2, prompts[2], RequestParams(9))],
                4: [(3, prompts[3], RequestParams(14))], 7: [(4, prompts[4], RequestParams(11))]}
    settings = dict(prefill_chunk=16, prefill_tokens=48)
    plain, plain_streamed, plain_stats, off = run(model, policy, False, arrivals, **settings)
    merged, streamed, stats, on = run(model, policy, True, arrivals, **settings)
    assert not off and on
    assert merged == plain and streamed == plain_streamed
    assert stats.decode_steps < plain_stats.decode_steps
    assert stats.prefill_forwards == plain_stats.prefill_forwards


def test_first_block_priority_gets_its_first_block_a_step_sooner(model):
    """prefill.priority first_block, one prompt a forward: each request's first block comes one decode step sooner
    (a step fewer in all), with the same tokens."""
    policy = {"name": "threshold", "block_size": 4, "threshold": 1.0, "steps": 4}
    prompts = prompts_of([12, 12, 12], model.config.vocab_size, seed=2)
    arrivals = {0: [(i, p, RequestParams(8)) for i, p in enumerate(prompts)]}
    settings = dict(prefill_chunk=16, prefill_tokens=16, prefill_priority="first_block", ignore_eos=True)
    plain, _, plain_stats, _ = run(model, policy, False, arrivals, **settings)
    merged, _, stats, _ = run(model, policy, True, arrivals, **settings)
    assert merged == plain
    assert plain_stats.decode_steps - stats.decode_steps >= 1


def test_rows_joining_a_first_block_turn_stay_in_step_with_the_decoding_ones(model):
    """prefill.priority first_block with the fused commit: a turn comes as the decoding rows begin a block, so the
    rows it prefills join them in step; a first step made in that forward would put them a step ahead and make most
    later steps commit steps (two blocks of queries for the whole batch; without the rule, 9 against 6 on SDAR). Only
    the turn with nothing decoding makes it: same tokens, a step fewer, no more commit steps."""
    policy = {"name": "threshold", "block_size": 4, "threshold": 1.0, "steps": 4, "commit": "fused"}
    prompts = prompts_of([16] * 3, model.config.vocab_size, seed=4)
    arrivals = {0: [(i, p, RequestParams(16)) for i, p in enumerate(prompts)]}
    settings = dict(prefill_chunk=16, prefill_tokens=20, prefill_priority="first_block", ignore_eos=True)
    plain, _, plain_stats, _ = run(model, policy, False, arrivals, **settings)
    merged, _, stats, _ = run(model, policy, True, arrivals, **settings)
    assert merged == plain
    assert stats.decode_steps == plain_stats.decode_steps - 1
    assert stats.policy["commit_steps"] <= plain_stats.policy["commit_steps"]


def test_policies_with_host_hooks_or_two_forward_steps_keep_their_own_first_step(model):
    for policy in ({"name": "threshold", "block_size": 4, "verify": True},  # its first step is two forwards
                   {"name": "t2t", "block_size": 4},                          # not offered
                   {"name": "mage", "block_size": 4, "dense_layers": 1}):     # host hooks
        eng = Engine(model, EngineConfig(policy, max_new_tokens=4, batch_size=1, max_seq_len=32))
        assert eng.session(1, 32).prefiller.first_step is None, policy
    eng = Engine(model, EngineConfig({"name": "threshold", "block_size": 4}, max_new_tokens=4, batch_size=1,
                                     max_seq_len=32, prefill_first_step=False))
    assert eng.session(1, 32).prefiller.first_step is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_the_first_step_in_prefill_on_the_gpu(tmp_path):
    """CUDA graphs for the decode steps, the Triton prefill and decode kernels, float32 (no bf16 rounding between
    the two paths): the same tokens, events and counts with the first step in prefill as without."""
    model = compiledllm.load_model(write_checkpoint(tmp_path / "sdar", "sdar", 19, head_dim=64), device="cuda",
                                   dtype=torch.float32)
    prompts = prompts_of([8, 13, 37, 5, 22], model.config.vocab_size)
    arrivals = {0: [(i, prompts[i], RequestParams(n)) for i, n in ((0, 20), (1, 2), (2, 9))],
                4: [(3, prompts[3], RequestParams(14))], 7: [(4, prompts[4], RequestParams(11))]}
    policy = {"name": "threshold", "block_size": 4, "threshold": 0.6}  # commit: auto, fused on CUDA
    plain, plain_streamed, plain_stats, _ = run(model, policy, False, arrivals, prefill_chunk=16, prefill_tokens=48)
    merged, streamed, stats, on = run(model, policy, True, arrivals, prefill_chunk=16, prefill_tokens=48)
    assert on and merged == plain and streamed == plain_streamed
    assert stats.decode_steps < plain_stats.decode_steps
