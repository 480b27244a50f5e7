"""Several phases per step, each captured on its own (docs/design.md §2): a HERALD-shaped 2B-token draft forward
(QueryGroups: block and copy see the prefix, not each other; no KV written) before threshold's forward."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from checkpoints import write_checkpoint
from draft_decode import DraftDecodeConfig, DraftDecodePolicy

import compiledllm
from compiledllm.engine import Engine, EngineConfig, generate
from compiledllm.policies import register_policy
from compiledllm.policies.plan import COPY_STRIDE

register_policy("draft_decode", DraftDecodeConfig, DraftDecodePolicy)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("m"), "llada2", 41), eos_token_id=0)


def test_draft_phase_changes_nothing_and_predicts_the_decode(model):
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 2, 12)]
    kw = dict(max_new_tokens=14, batch_size=3, max_seq_len=40)
    plain = generate(model, ps, {"name": "threshold", "block_size": 4, "threshold": 0.6}, **kw)
    engine = Engine(model, EngineConfig({"name": "draft_decode", "block_size": 4, "threshold": 0.6}, **kw))
    both = engine.generate(ps)
    assert [r.output_ids for r in both] == [r.output_ids for r in plain]
    assert [r.steps for r in both] == [2 * r.steps for r in plain]  # each step: the draft forward and the decode
    assert engine.policy.mismatches and max(engine.policy.mismatches) == 0


def test_block_routed_draft_group_routes_apart(tmp_path):
    """A block-routed MoE (capacity 3 of 8): the draft copy is a route group of its own (Forward.route_groups copy 1),
    the tokens are still threshold's and every draft is the decode's argmax."""
    model = compiledllm.load_model(write_checkpoint(tmp_path, "llada2", 41, expert_capacity=3, block_size=4),
                                   eos_token_id=0)
    ps = [[5, 9, 17, 33, 2], [40, 41], [7, 7, 8, 90, 12, 3, 60, 61, 62]]
    kw = dict(max_new_tokens=10, batch_size=3, max_seq_len=40)
    plain = generate(model, ps, {"name": "threshold", "block_size": 4, "threshold": 0.6}, **kw)
    engine = Engine(model, EngineConfig({"name": "draft_decode", "block_size": 4, "threshold": 0.6}, **kw))
    assert [r.output_ids for r in engine.generate(ps)] == [r.output_ids for r in plain]
    assert engine.policy.mismatches and max(engine.policy.mismatches) == 0
    st = SimpleNamespace(seq=torch.full((2, 12), 1), block_start=torch.tensor([4, 8]), prompt_len=torch.tensor([3, 9]),
                         active=torch.tensor([True, False]), policy=engine.policy.init_state(2, "cpu"))
    groups = engine.policy.plan("draft", st).route_groups
    assert groups[0, :4].tolist() == [1] * 4 and groups[0, 4:].tolist() == [1 + COPY_STRIDE] * 4  # the copy apart
    assert groups[1].tolist() == [-1] * 8  # a finished row routes nowhere


def test_two_phase_step_compiled_equals_eager_within_the_recompile_budget(model, compile_kw):
    """Regional compile of a two-phase step: each layer kind compiles once per (bucket, phase shape), 2B and B
    tokens here; the recompile budget makes room for both (from a limit of 1, as a long process would reach).
    The decode phase has the shapes of the other compile tests (conftest.compile_kw): their compiled layers serve."""
    ps = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15]]
    pol = {"name": "draft_decode", "block_size": 4, "threshold": 0.6}
    kw = dict(max_new_tokens=8, buckets=[4], **compile_kw)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, accumulated_recompile_limit=1):
        runs = [Engine(model, EngineConfig(pol, compile=c, **kw)).generate(ps) for c in (True, False)]
    assert [r.output_ids for r in runs[0]] == [r.output_ids for r in runs[1]]
