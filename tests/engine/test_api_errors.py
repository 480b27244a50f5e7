"""The Python API answers mistakes with one UserError naming the argument (not a raw exception, not a guess)."""
from __future__ import annotations

import pytest
import torch

import compiledllm
from compiledllm.engine import Engine, EngineConfig, generate
from compiledllm.errors import UserError

POL = {"name": "threshold", "block_size": 8}


@pytest.fixture(scope="module")
def model():
    return compiledllm.load_model("tiny-llada2-random")


@pytest.mark.parametrize("prompts,needle", [
    ([1, 2, 3], "not [1, 2, 3]"),
    ([], "empty"),
    ("hello", "a list of token-id lists"),
    (["hello"], "prompt 0: text"),
    (torch.tensor([[1, 2]]), ".tolist()"),
    ([[1.5, 2]], "1.5 is not an integer"),
    ([[True, 2]], "True is not an integer"),
    ([[3], []], "prompt 1: empty"),
    ([[-1]], "outside the vocabulary"),
])
def test_bad_prompts(model, prompts, needle):
    with pytest.raises(UserError, match=None) as e:
        generate(model, prompts, POL, max_new_tokens=4)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("settings,needle", [
    ({"batch_size": 0}, "batch_size: an integer >= 1"),
    ({"batch_size": -2}, "batch_size"),
    ({"batch_size": 2.5}, "batch_size"),
    ({"max_new_tokens": 4.5}, "max_new_tokens: an integer >= 1, got 4.5"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_seq_len": 0}, "max_seq_len"),
    ({"compile": "yes"}, "compile: true or false"),
])
def test_bad_settings(model, settings, needle):
    with pytest.raises(UserError) as e:
        generate(model, [[3, 4]], POL, **{"max_new_tokens": 4, **settings})
    assert needle in str(e.value)


def test_bad_policy_buckets_and_overrides(model):
    with pytest.raises(UserError, match="policy: a mapping"):
        EngineConfig("threshold", max_new_tokens=4)
    with pytest.raises(UserError, match="buckets"):
        EngineConfig(POL, max_new_tokens=4, buckets="1,2")
    with pytest.raises(UserError, match="overrides: a list"):
        compiledllm.run({"model": {"path": "tiny-llada2-random"}, "prompts": [{"ids": [3]}]}, "batch_size=2")


def test_numpy_and_tuple_ids_are_ints(model):
    import numpy as np

    want = generate(model, [[3, 4, 5]], POL, max_new_tokens=4)[0].output_ids
    got = Engine(model, EngineConfig(POL, max_new_tokens=4)).generate([tuple(np.array([3, 4, 5]))])[0]
    assert got.output_ids == want and got.prompt_ids == [3, 4, 5]


def test_request_ids_key_a_share_of_a_run_as_the_run_would():
    """Sampled decoding: prompts 1 and 3 of a run, given alone with their run ids, decode the run's tokens."""
    model = compiledllm.load_model("tiny-llada2-random")
    pol = {**POL, "temperature": 10.0, "seed": 5}  # hot enough that a request's key shows in its tokens
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
    run = Engine(model, EngineConfig(pol, max_new_tokens=8, max_seq_len=32)).generate(prompts)
    eng = Engine(model, EngineConfig(pol, max_new_tokens=8, max_seq_len=32))
    share = eng.generate([prompts[1], prompts[3]], request_ids=[1, 3])
    assert [r.index for r in share] == [1, 3]
    assert [r.output_ids for r in share] == [run[1].output_ids, run[3].output_ids]
    assert eng.generate([prompts[1]])[0].output_ids != run[1].output_ids  # without its id: request 0's noise
    with pytest.raises(UserError, match="request_ids: 1 ids for 2 prompts"):
        eng.generate([prompts[1], prompts[3]], request_ids=[1])
