"""A request admitted while others decode waits (inactive) for its prefill chunks over several steps; the decode steps
meanwhile must leave its policy state as admitted. Threshold's `steps` schedule and its sampling keys read the
block's step counter, so a counter that moved while the row waited gave other tokens batched than alone."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.engine import Engine, EngineConfig

LENGTHS = [3, 9, 14, 6, 11, 18, 2, 15]  # prompts of up to 4 chunks of 4 positions: admissions wait 1-4 steps


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("sdar"), "sdar", 31, num_hidden_layers=2))


def run(model, policy, batch, prompts, ids=None):
    cfg = EngineConfig(policy, max_new_tokens=12, batch_size=batch, max_seq_len=32, prefill_chunk=4, ignore_eos=True)
    return [r.output_ids for r in Engine(model, cfg).generate(prompts, request_ids=ids)]


@pytest.mark.parametrize("policy", [{"steps": 2, "threshold": 0.99}, {"temperature": 0.8, "seed": 3}],
                         ids=["steps", "sampling"])
def test_rows_waiting_for_prefill_keep_their_state(model, policy):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    policy = {"name": "threshold", "block_size": 4, "threshold": 0.5} | policy
    alone = [run(model, policy, 1, [p], [i])[0] for i, p in enumerate(prompts)]
    assert run(model, policy, 2, prompts) == alone
