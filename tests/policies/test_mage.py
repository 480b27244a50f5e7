"""`mage` (compiledllm/policies/mage.py, kv/sparse.py): exact selection once per block, reused for its later steps.

Its tokens are those of a literal float64 loop written from the description (literal_selection.py). Also: budget 1.0
== dense `threshold`, batched == alone with admissions and compaction, compiled == eager, captured == eager on a
GPU."""
from __future__ import annotations

import literal_selection
import pytest
import torch
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.engine import Engine, EngineConfig, generate
from compiledllm.errors import UserError

BLOCK = 4
DENSE = {"name": "threshold", "block_size": BLOCK, "threshold": 0.5}
LENGTHS = [3, 9, 14, 6, 11]  # 0 to 3 prompt blocks before the first one decoded; no EOS stops a request


def prompts(vocab: int, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["llada2", "sdar"])
def ckpt(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, 31, num_hidden_layers=4)


@pytest.fixture(scope="module")
def model(ckpt):
    return compiledllm.load_model(ckpt)


def run(model, policy, batch, ps, new=12, **kw):
    cfg = EngineConfig(policy, max_new_tokens=new, batch_size=batch, max_seq_len=32, prefill_chunk=8, ignore_eos=True,
                       **kw)
    return Engine(model, cfg).generate(ps)


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
    ps = prompts(model.config.vocab_size)[:4]
    policy = DENSE | {"name": "mage", "budget": 0.3}
    kw = dict(max_new_tokens=8, ignore_eos=True, **compile_kw)
    eager = [r.output_ids for r in Engine(model, EngineConfig(policy, compile=False, **kw)).generate(ps)]
    assert [r.output_ids for r in Engine(model, EngineConfig(policy, compile=True, **kw)).generate(ps)] == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_captured_equals_eager_on_the_gpu(tmp_path, budget):
    """The selection (stats in the Triton kernel, the captured post-forward gather) replayed as CUDA graphs ==
    eager (bf16); with the whole budget (float32) == dense threshold."""
    ckpt = write_checkpoint(tmp_path / "m", "llada2", 32, head_dim=64, num_hidden_layers=4)
    dtype = torch.float32 if budget == 1.0 else torch.bfloat16
    m = compiledllm.load_model(ckpt, device="cuda", dtype=dtype)
    ps = prompts(m.config.vocab_size, [5, 19, 30, 12, 40])
    policy = DENSE | {"name": "mage", "budget": budget}
    kw = dict(max_new_tokens=16, batch_size=4, max_seq_len=64, prefill_chunk=16, ignore_eos=True)
    out = lambda pol, graphs: [r.output_ids for r in Engine(m, EngineConfig(pol, cuda_graphs=graphs, **kw))  # noqa: E731
                               .generate(ps)]
    eager = out(policy, False)
    assert out(policy, True) == eager
    if budget == 1.0:
        assert out(DENSE, True) == eager
