"""Policy details beyond docs/design.md §4's defaults: the fixed-step schedule of `threshold`."""
from __future__ import annotations

import torch
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.engine import generate
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy


def test_min_accept_schedule_sums_to_block():
    pol = ThresholdPolicy(ThresholdConfig(block_size=32, threshold=1.0, steps=20), mask_id=0)
    k = pol.min_accept(torch.arange(20)).tolist()
    assert sum(k) == 32 and k[:12] == [2] * 12 and k[12:] == [1] * 8


def test_fixed_steps_give_exactly_steps_accepting_forwards_per_block(tmp_path):
    # tau = 1.0 accepts nothing by confidence, so every block takes exactly `steps` accepting forwards, plus the
    # forward that sees the finished block (its KV goes to the cache) = steps + 1 forwards per block.
    model = compiledllm.load_model(write_checkpoint(tmp_path / "m", "llada2", 5), eos_token_id=95)
    out = generate(model, [list(range(2, 10))], {"name": "threshold", "block_size": 8, "threshold": 1.0, "steps": 5},
                   max_new_tokens=24)[0]
    assert len(out.output_ids) == 24 and out.blocks == 3
    assert out.steps == 3 * (5 + 1)


def test_a_config_class_belongs_to_one_policy():
    """make_policy finds the policy by its config's class: registering that class again under another name would
    silently run the first policy, so it is refused."""
    import pytest

    from compiledllm.policies import register_policy
    from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy

    class Other(ThresholdPolicy):
        pass

    with pytest.raises(ValueError, match="config class ThresholdConfig already belongs to policy 'threshold'"):
        register_policy("other_threshold", ThresholdConfig, Other)
