"""A policy-owned KV store from outside the package (sparse_pool.py, HERALD-shaped): layers from 2 on attend to a
per-layer sparse pool filled by the captured post-forward hook and the admission host hook. With the whole prefix
selected (budget 1.0) its tokens are dense threshold's."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint
from sparse_pool import SparsePoolConfig, SparsePoolPolicy

import compiledllm
from compiledllm.engine import Engine, EngineConfig
from compiledllm.policies import register_policy

register_policy("sparse_pool", SparsePoolConfig, SparsePoolPolicy)
DENSE = {"name": "threshold", "block_size": 8, "threshold": 0.6}
LENGTHS = [3, 21, 40, 9, 17]  # prompts up to 40 tokens: several prefill chunks of 16


class UnfilledConfig(SparsePoolConfig):
    pass


class UnfilledPolicy(SparsePoolPolicy):
    """The pool never filled: if the sparse layers really read it, the tokens must change."""

    def after_forward(self, phase, st, fwd, upd, kv):
        pass

    def on_blocks(self, host, rows):
        pass


register_policy("unfilled_pool", UnfilledConfig, UnfilledPolicy)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def run(model, policy, batch, **kw):
    cfg = EngineConfig(policy, max_new_tokens=20, batch_size=batch, max_seq_len=64, prefill_chunk=16, **kw)
    return Engine(model, cfg).generate(prompts(model.config.vocab_size))


@pytest.fixture(scope="module", params=["llada2", "sdar"])
def model(request, tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, 21,
                                                   num_hidden_layers=4))


def test_whole_prefix_pool_equals_dense_threshold(model):
    dense = run(model, DENSE, 3)
    for batch in (1, 3):  # batch 3 of 5 requests: slots freed, refilled and compacted (buckets 1, 2, 3)
        pooled = run(model, DENSE | {"name": "sparse_pool", "budget": 1.0}, batch)
        assert [(r.output_ids, r.steps) for r in pooled] == [(r.output_ids, r.steps) for r in dense]


def test_a_pool_keeps_the_separate_commit(model):
    """A policy that fills its own KV after a block's retiring forward (kv_hook) needs that forward to write the
    block: commit auto stays separate for it on CUDA too, and fused is a one-line error."""
    from compiledllm.errors import UserError

    auto = SparsePoolConfig(block_size=8)
    assert auto.for_engine(SparsePoolPolicy.kv_hook, torch.device("cuda"), False).commit == "separate"
    with pytest.raises(UserError, match=r"^policy\.commit: fused: sparse_pool fills its own KV"):
        Engine(model, EngineConfig(DENSE | {"name": "sparse_pool", "commit": "fused"}, max_new_tokens=4))


def test_the_sparse_layers_read_the_pool(model):
    dense = [r.output_ids for r in run(model, DENSE, 3)]
    assert [r.output_ids for r in run(model, DENSE | {"name": "unfilled_pool"}, 3)] != dense


def test_a_partial_budget_decodes_alike_alone_and_batched(model):
    policy = DENSE | {"name": "sparse_pool", "budget": 0.4, "sink": 2}
    batched = [r.output_ids for r in run(model, policy, 3)]
    alone = [Engine(model, EngineConfig(policy, max_new_tokens=20, batch_size=1, max_seq_len=64, prefill_chunk=16))
             .generate([p], request_ids=[i])[0].output_ids for i, p in enumerate(prompts(model.config.vocab_size))]
    assert batched == alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("budget", [1.0, 0.4])
def test_captured_pool_hooks_equal_eager_on_the_gpu(tmp_path, budget):
    """The post-forward hook is captured with the step: CUDA graphs == eager (bf16, Triton paged attention), and
    with the whole prefix (float32) == dense threshold."""
    ckpt = write_checkpoint(tmp_path / "m", "llada2", 22, head_dim=64, num_hidden_layers=4)
    policy = DENSE | {"name": "sparse_pool", "budget": budget}
    for dtype in (torch.bfloat16, torch.float32):
        m = compiledllm.load_model(ckpt, device="cuda", dtype=dtype)
        eager, graphs = run(m, policy, 3, cuda_graphs=False), run(m, policy, 3, cuda_graphs=True)
        assert [(r.output_ids, r.steps) for r in graphs] == [(r.output_ids, r.steps) for r in eager]
        if budget == 1.0 and dtype == torch.float32:
            assert [r.output_ids for r in graphs] == [r.output_ids for r in run(m, DENSE, 3, cuda_graphs=True)]
