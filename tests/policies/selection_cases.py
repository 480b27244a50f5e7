"""What the selection policies' tests share (test_mage, test_herald, test_infinigen): tiny LLaDA2 and SDAR checkpoints,
prompts of 0 to 3 prompt blocks before the first decoded one, and the engine run (no EOS stops a request)."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.engine import Engine, EngineConfig

BLOCK = 4
DENSE = {"name": "threshold", "block_size": BLOCK, "threshold": 0.5}
LENGTHS = [3, 9, 14, 6, 11]


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
    cfg = EngineConfig(policy, max_new_tokens=new, batch_size=batch, prefill_chunk=8, ignore_eos=True,
                       **{"max_seq_len": 32} | kw)
    return Engine(model, cfg).generate(ps)


def compiled_equals_eager(model, policy: dict, compile_kw: dict) -> None:
    ps = prompts(model.config.vocab_size)[:4]
    kw = dict(max_new_tokens=8, ignore_eos=True, **compile_kw)
    eager = [r.output_ids for r in Engine(model, EngineConfig(policy, compile=False, **kw)).generate(ps)]
    assert [r.output_ids for r in Engine(model, EngineConfig(policy, compile=True, **kw)).generate(ps)] == eager


def captured_equals_eager(tmp_path, policy: dict) -> None:
    """On a GPU: replayed CUDA graphs == eager (bf16); with the whole budget (float32) also == dense threshold."""
    ckpt = write_checkpoint(tmp_path / "m", "llada2", 32, head_dim=64, num_hidden_layers=4)
    whole = policy["budget"] == 1.0
    m = compiledllm.load_model(ckpt, device="cuda", dtype=torch.float32 if whole else torch.bfloat16)
    ps = prompts(m.config.vocab_size, [5, 19, 30, 12, 40])
    kw = dict(max_new_tokens=16, batch_size=4, max_seq_len=64, prefill_chunk=16, ignore_eos=True)

    def out(pol, graphs):
        return [r.output_ids for r in Engine(m, EngineConfig(pol, cuda_graphs=graphs, **kw)).generate(ps)]

    eager = out(policy, False)
    assert out(policy, True) == eager
    if whole:
        assert out(DENSE, True) == eager
