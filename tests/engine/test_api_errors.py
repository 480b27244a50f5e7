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
