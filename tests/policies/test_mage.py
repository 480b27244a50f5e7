"""`mage` (compiledllm/policies/mage.py, kv/sparse.py): exact selection once per block, reused for its later steps.

Its tokens are those of a literal float64 loop written from the description (literal_selection.py). Also: budget 1.0
== dense `threshold`, batched == alone with admissions and compaction, compiled == eager, captured == eager on a
GPU."""
from __future__ import annotations

import literal_selection
import pytest
import selection_cases
import torch
from checkpoints import write_checkpoint
from selection_cases import BLOCK, DENSE, ckpt, model, prompts, run  # noqa: F401  (fixtures)

import compiledllm
from compiledllm.engine import generate
from compiledllm.errors import UserError

def literal(ckpt, prompt, budget, dense_layers=2, new=12):
    return literal_selection.literal(ckpt, prompt, block=BLOCK, threshold=DENSE["threshold"], new=new, budget=budget,
                                     dense_layers=dense_layers)


@pytest.mark.parametrize("budget,dense_layers", [(0.3, 2), (0.5, 1)])
def test_mage_equals_a_literal_selection_loop(ckpt, model, budget, dense_layers):
    ps = prompts(model.config.vocab_size)
    got = run(model, DENSE | {"name": "mage", "budget": budget, "dense_layers": dense_layers}, 3, ps)
    dense = run(model, DENSE, 3, ps)
    for p, r in zip(ps, got):
        assert r.output_ids == literal(ckpt, p, budget, dense_layers), p
    assert [r.output_ids for r in got] != [r.output_ids for r in dense], "the selection changed nothing"


def test_whole_budget_is_dense_threshold(model):
    ps = prompts(model.config.vocab_size)
    dense = [(r.output_ids, r.steps) for r in run(model, DENSE, 3, ps)]
    for batch in (1, 3):  # batch 3 of 5 requests: slots freed, refilled and compacted
        got = run(model, DENSE | {"name": "mage", "budget": 1.0}, batch, ps)
        assert [(r.output_ids, r.steps) for r in got] == dense


def test_batched_equals_alone(model):
    ps = prompts(model.config.vocab_size)
    policy = DENSE | {"name": "mage", "budget": 0.3}
    batched = [r.output_ids for r in run(model, policy, 2, ps)]
    alone = [run(model, policy, 1, [p])[0].output_ids for p in ps]
    assert batched == alone


@pytest.mark.parametrize("params,message", [
    ({"budget": 0.0}, "budget: must be within (0, 1]"),
    ({"budget": 1.5}, "budget: must be within (0, 1]"),
    ({"dense_layers": -1}, "dense_layers: must be >= 0"),
    ({"commit": "fused"}, "commit: mage commits a block in its own forward"),
])
def test_bad_settings_are_one_line_errors(params, message):
    from compiledllm.policies import policy_config

    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        policy_config({"name": "mage"} | params)


def test_too_many_dense_layers_and_bidirectional_models_are_refused(model, tmp_path):
    with pytest.raises(UserError, match="dense_layers: 4 leaves none of the model's 4 layers"):
        run(model, DENSE | {"name": "mage", "dense_layers": 4}, 1, prompts(model.config.vocab_size)[:1])
    llada = compiledllm.load_model(write_checkpoint(tmp_path / "llada", "llada", 3))
    with pytest.raises(UserError, match="mage selects from a block-causal model's KV cache"):
        generate(llada, [[5, 6, 7]], {"name": "mage", "block_size": BLOCK}, max_new_tokens=4)


@pytest.mark.slow
def test_compiled_equals_eager(model, compile_kw):
    selection_cases.compiled_equals_eager(model, DENSE | {"name": "mage", "budget": 0.3}, compile_kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_captured_equals_eager_on_the_gpu(tmp_path, budget):
    """The selection (stats in the Triton kernel, the captured post-forward gather) replayed as CUDA graphs."""
    selection_cases.captured_equals_eager(tmp_path, DENSE | {"name": "mage", "budget": budget})
