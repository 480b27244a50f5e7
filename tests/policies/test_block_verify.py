"""Flash-Verify on block-causal models (`threshold verify: true`, compiledllm/policies/flash_verify.py BlockVerify):
at gamma 1 nothing past the confident set is accepted (threshold's tokens); lower, drafts are accepted in fewer decode
steps, batched == alone; compiled == eager; settings that cannot work are one-line errors."""
from __future__ import annotations

import pytest
import selection_cases
import torch
from checkpoints import write_checkpoint
from selection_cases import BLOCK, ckpt, model, prompts  # noqa: F401  (fixtures)

import compiledllm
from compiledllm.engine import Engine, EngineConfig
from compiledllm.errors import UserError
from compiledllm.policies import policy_config

PLAIN = {"name": "threshold", "block_size": BLOCK, "threshold": 0.9}


def run(model, policy, batch, ps, **kw):
    return selection_cases.run(model, policy, batch, ps, 16, **kw)


@pytest.mark.parametrize("rule", ["agree", "prefix_product"])
def test_gamma_one_accepts_nothing_past_the_confident_set(model, rule):
    ps = prompts(model.config.vocab_size)
    plain = run(model, PLAIN, 3, ps)
    checked = run(model, PLAIN | {"verify": True, "gamma": 1.0, "verify_rule": rule}, 3, ps)
    assert [r.output_ids for r in checked] == [r.output_ids for r in plain]
    assert all(r.extra["verified"] == 0 for r in checked)


@pytest.mark.parametrize("rule,gamma", [("agree", 0.0), ("prefix_product", 0.05)])
def test_drafts_accepted_batch_invariantly_in_fewer_steps(model, rule, gamma):
    ps = prompts(model.config.vocab_size)
    policy = PLAIN | {"verify": True, "gamma": gamma, "verify_rule": rule}
    alone = [run(model, policy, 1, [p])[0] for p in ps]
    batched = run(model, policy, 3, ps)
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]
    assert sum(r.extra["verified"] for r in batched) > 0
    plain = run(model, PLAIN, 3, ps)
    assert sum(r.steps for r in batched) < 2 * sum(r.steps for r in plain)  # a decode and a verify phase a step
    decode_steps = sum(r.steps for r in batched) / 2
    assert decode_steps < sum(r.steps for r in plain)


def test_compiled_equals_eager(model, compile_kw):
    ps = prompts(model.config.vocab_size)[:4]
    policy = PLAIN | {"verify": True, "gamma": 0.3}
    kw = dict(max_new_tokens=8, ignore_eos=True, **compile_kw)
    eager = [r.output_ids for r in Engine(model, EngineConfig(policy, **kw)).generate(ps)]
    assert [r.output_ids for r in Engine(model, EngineConfig(policy, compile=True, **kw)).generate(ps)] == eager


@pytest.mark.parametrize("params,message", [
    ({"verify": True, "commit": "fused"}, "verify: checks drafts between a block's steps"),
    ({"verify": True, "search": 0}, "search: must be within"),
    ({"verify_rule": "vote"}, "verify_rule"),
])
def test_bad_settings_are_one_line_errors(params, message):
    with pytest.raises(UserError, match=message):
        policy_config(PLAIN | params)


def test_only_threshold_verifies(model):
    with pytest.raises(UserError, match="policy.verify: a setting of threshold"):
        Engine(model, EngineConfig({"name": "mage", "block_size": BLOCK, "budget": 0.5, "verify": True},
                                   max_new_tokens=4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_captured_equals_eager_on_the_gpu(tmp_path, name):
    """The decode and verify phases captured once per bucket (bf16, head_dim 64: the packed-attention kernels)."""
    m = compiledllm.load_model(write_checkpoint(tmp_path / "m", name, 32, head_dim=64, num_hidden_layers=4),
                               device="cuda", dtype=torch.bfloat16)
    ps = prompts(m.config.vocab_size, [5, 19, 30, 12, 40])
    kw = dict(max_new_tokens=16, batch_size=4, max_seq_len=64, prefill_chunk=16, ignore_eos=True)
    policy = PLAIN | {"verify": True, "gamma": 0.5}
    eager = [r.output_ids for r in Engine(m, EngineConfig(policy, cuda_graphs=False, **kw)).generate(ps)]
    assert [r.output_ids for r in Engine(m, EngineConfig(policy, cuda_graphs=True, **kw)).generate(ps)] == eager
