"""EditRecord (policies/t2t.py): the edit statistics of t2t / flowblock against a literal log of the engine's writes,
and the decoded tokens unchanged by recording them."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint

import compiledllm
import compiledllm.engine.step as step
from compiledllm.engine import Engine
from compiledllm.policies.sampling import request_key

BK, NEW = 4, 14
# threshold 0: the first forward of a block fills it; edit_threshold 0.9: on this checkpoint some blocks get no edit,
# others several, some positions are edited twice
EDITS = {"block_size": BK, "threshold": 0.0, "edit_threshold": 0.9, "max_post_steps": 3}
POLICIES = {"t2t": {"name": "t2t", **EDITS}, "flowblock": {"name": "flowblock", **EDITS, "window": 2, "spawn": 0.0},
            "flowblock_sync": {"name": "flowblock_sync", **EDITS, "window": 3, "spawn": 0.0}}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("m") / "llada2", "llada2", 3)
    return compiledllm.load_model(ckpt, eos_token_id=95)


def decode(model, policy: dict, span: int | None, monkeypatch=None, batch: int = len(PROMPTS)):
    """Results of one batch and, with monkeypatch, the engine's writes logged literally: per request (a slot's
    request is known by its sampling key: the session moves rows between slots), the first token written at each
    position, the positions whose non-MASK token a write changed, and the count of such changes."""
    log = [{"first": {}, "edited": set(), "edits": 0} for _ in PROMPTS]
    request = {request_key(0, i): i for i in range(len(PROMPTS))}
    if monkeypatch is not None:
        apply = step.apply_update

        def logged(st, upd, block, eos_id):
            before, active = st.seq.clone(), st.active.clone()
            apply(st, upd, block, eos_id)
            for s in range(st.seq.shape[0]):  # the bucket: the first rows
                if not active[s]:
                    continue
                r = request[int(st.key[s])]
                for pos in (st.seq[s] != before[s]).nonzero().flatten().tolist():
                    old, new = int(before[s, pos]), int(st.seq[s, pos])
                    log[r]["first"].setdefault(pos, new)
                    if old != model.mask_token_id:
                        log[r]["edited"].add(pos)
                        log[r]["edits"] += 1

        monkeypatch.setattr(step, "apply_update", logged)
    engine = Engine(model, policy, max_new_tokens=NEW, batch_size=batch)
    if span is not None:
        engine.policy.track_edits(span)
    return engine.generate(PROMPTS), log


@pytest.mark.parametrize("name", list(POLICIES))
def test_record_equals_a_literal_log_and_changes_no_token(model, name, monkeypatch):
    plain, _ = decode(model, POLICIES[name], None)
    assert all(set(r.extra) <= {"front_drafts", "down_drafts", "front_edits", "down_edits"} for r in plain)
    for span in (5, NEW + BK):  # a span shorter than the output, and the whole working length
        results, log = decode(model, POLICIES[name], span, monkeypatch)
        monkeypatch.undo()
        assert [r.output_ids for r in results] == [r.output_ids for r in plain]
        assert [r.steps for r in results] == [r.steps for r in plain]
        for r, lg, prompt in zip(results, log, PROMPTS):
            P = len(prompt)
            edited = sorted(p - P for p in lg["edited"] if p - P < span)
            assert r.extra["edit_offsets"] == edited
            assert r.extra["edit_drafts"] == [lg["first"][P + off] for off in edited]
            assert r.extra["edits"] == lg["edits"]
            retired_end = P // BK * BK + r.blocks * BK  # blocks retired; a stop at EOS leaves later ones out
            assert r.extra["edit_blocks"] == len({p // BK for p in lg["edited"] if p < retired_end})
            if "front_edits" in r.extra and span > NEW:  # flowblock's own count of first edits agrees
                assert r.extra["front_edits"] + r.extra["down_edits"] == len(edited)
    one_slot, _ = decode(model, POLICIES[name], NEW + BK, batch=1)  # a slot reused: its record starts afresh
    assert [r.extra for r in one_slot] == [r.extra for r in results]
    # the case is not trivial: re-edits, and blocks without an edit
    assert sum(r.extra["edits"] for r in results) > sum(len(r.extra["edit_offsets"]) for r in results) > 0
    assert 0 < sum(r.extra["edit_blocks"] for r in results) < sum(r.blocks for r in results)


def test_track_edits_needs_a_span():
    from compiledllm.policies.t2t import T2TConfig, T2TPolicy

    with pytest.raises(ValueError, match="span"):
        T2TPolicy(T2TConfig(block_size=4), mask_id=1).track_edits(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("name", ["t2t", "flowblock"])
def test_record_in_captured_and_compiled_steps_equals_eager(tmp_path, name):
    ckpt = write_checkpoint(tmp_path / "m", "llada2", 3, head_dim=64)
    model = compiledllm.load_model(ckpt, device="cuda", dtype=torch.float32, eos_token_id=95)
    runs = []
    for kw in ({"cuda_graphs": False}, {"cuda_graphs": True}, {"compile": True, "cuda_graphs": True}):
        engine = Engine(model, POLICIES[name], max_new_tokens=NEW, batch_size=2, **kw)  # buckets 1 and 2, slots reused
        engine.policy.track_edits(NEW + BK)
        runs.append([(r.output_ids, r.steps, r.extra) for r in engine.generate(PROMPTS)])
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert sum(extra["edits"] for _, _, extra in runs[0]) > 0


@pytest.mark.parametrize("name", ["t2t", "flowblock"])
def test_a_config_built_with_edit_span_records_as_track_edits_does(model, name):
    """evaluate's way (policies.record_edits: the frozen config carries edit_span) == the track_edits shim."""
    from compiledllm.policies import record_edits

    shim, _ = decode(model, POLICIES[name], NEW + BK)
    config = record_edits(POLICIES[name], NEW + BK)
    assert config.edit_span == NEW + BK
    built = Engine(model, config, max_new_tokens=NEW, batch_size=len(PROMPTS)).generate(PROMPTS)
    assert [(r.output_ids, r.steps, r.extra) for r in built] == [(r.output_ids, r.steps, r.extra) for r in shim]


def test_edit_span_is_a_frozen_config_value_not_a_recipe_key():
    from dataclasses import FrozenInstanceError, replace

    from compiledllm.errors import UserError
    from compiledllm.policies import policy_config, record_edits
    from compiledllm.policies.t2t import T2TConfig, T2TPolicy

    config = T2TConfig(edit_span=6)
    assert replace(config, block_size=4).edit_span == 6 and config.with_block(8).edit_span == 6
    with pytest.raises(FrozenInstanceError):
        config.edit_span = 1
    with pytest.raises(ValueError, match="edit_span"):
        T2TConfig(edit_span=-1)
    with pytest.raises(UserError, match="edit_span: unknown parameter"):
        policy_config({"name": "t2t", "edit_span": 3})
    assert record_edits({"name": "threshold"}, 6) == policy_config({"name": "threshold"})  # no record to keep
    policy = T2TPolicy(T2TConfig(block_size=4), mask_id=1)
    assert policy.edit_span == 0 and "drafts" not in policy.init_state(2, "cpu")
    policy.track_edits(3)
    assert policy.config.edit_span == 3 and policy.init_state(2, "cpu")["drafts"].shape == (2, 4)
