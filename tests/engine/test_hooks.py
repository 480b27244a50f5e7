"""Host hooks around a step (engine/hooks.py): the order the session calls them in, host work on the session's
worker thread overlapping the step, host state kept per session, and still one host sync per step."""
from __future__ import annotations

import threading

import pytest
import torch
from checkpoints import write_checkpoint

import compiledllm
import compiledllm.engine.state as state_module
from compiledllm.engine import Engine, EngineConfig
from compiledllm.policies import register_policy
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy


class HookedConfig(ThresholdConfig):
    pass


class HookedPolicy(ThresholdPolicy):
    """threshold, recording every host hook in host.state and handing a host job to the worker before each step
    (collected after the step's sync): the job runs on another thread while the step is launched."""

    def _log(self, host, *entry):
        host.state.setdefault("calls", []).append(entry)

    def on_blocks(self, host, rows):
        self._log(host, "blocks", tuple(rows))

    def before_step(self, host, step):
        self._log(host, "before", step.rows, step.begun)
        started = threading.Event()
        host.state["job"] = (host.worker.submit(self._job, host, step.rows, started), started)

    def _job(self, host, rows, started):
        started.set()
        return threading.get_ident(), sorted(rows)

    def after_step(self, host, report):
        future, started = host.state.pop("job")
        thread, rows = future.result()
        self._log(host, "after", tuple(rows), thread != threading.get_ident(), started.is_set())


register_policy("hooked", HookedConfig, HookedPolicy)


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("m"), "sdar", 17))


def test_hooks_run_in_step_order_with_host_work_on_the_worker(sdar, monkeypatch):
    syncs = []
    host_view = state_module.SlotState.host_view
    monkeypatch.setattr(state_module.SlotState, "host_view",
                        lambda st, done=None: syncs.append(done) or host_view(st, done))
    policy = {"name": "hooked", "block_size": 4, "threshold": 0.6}
    eng = Engine(sdar, EngineConfig(policy, max_new_tokens=10, batch_size=2, max_seq_len=48))
    session = eng.session(2, 48)
    session.add(0, [5, 6, 7, 8, 9])
    session.add(1, [10, 11])
    steps = 0
    while session.has_work():
        session.step()
        steps += 1
    calls = session.host.state["calls"]
    assert session.host.wait_for() is None and not any(syncs)  # the CPU: no event to sleep on
    session.close()
    befores = [c for c in calls if c[0] == "before"]
    afters = [c for c in calls if c[0] == "after"]
    assert calls[0] == ("blocks", (0, 1))  # both begin decoding after admission (prefill of slot 0's block)
    assert len(befores) == len(afters) == len(syncs) == steps  # one sync per step, hooks around it
    for i, c in enumerate(calls):
        if c[0] == "before":
            assert calls[i + 1][0] == "after" and calls[i + 1][1] == c[1]  # after_step follows its step
    assert all(thread_was_other and ran for _, _, thread_was_other, ran in afters)
    assert any(c[0] == "blocks" and c is not calls[0] for c in calls)  # rows that began a block later
    want = Engine(sdar, EngineConfig(policy | {"name": "threshold"}, max_new_tokens=10, batch_size=2,
                                     max_seq_len=48)).generate([[5, 6, 7, 8, 9], [10, 11]])
    other = Engine(sdar, EngineConfig(policy, max_new_tokens=10, batch_size=2, max_seq_len=48))
    assert [r.output_ids for r in other.generate([[5, 6, 7, 8, 9], [10, 11]])] == [r.output_ids for r in want]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_with_the_worker_busy_the_step_sync_sleeps_on_the_gpu(tmp_path, monkeypatch):
    """Once the worker runs host work beside the steps, each step's sync first waits on a blocking event (the engine
    thread sleeps instead of spinning a core the worker needs): the same tokens as threshold."""
    syncs = []
    host_view = state_module.SlotState.host_view
    monkeypatch.setattr(state_module.SlotState, "host_view",
                        lambda st, done=None: syncs.append(done) or host_view(st, done))
    model = compiledllm.load_model(write_checkpoint(tmp_path / "m", "sdar", 17), device="cuda")
    policy = {"name": "hooked", "block_size": 4, "threshold": 0.6}
    ps = [[5, 6, 7, 8, 9], [10, 11]]
    got = Engine(model, EngineConfig(policy, max_new_tokens=10, batch_size=2, max_seq_len=48)).generate(ps)
    assert syncs and all(isinstance(e, torch.cuda.Event) for e in syncs[1:])  # the worker exists after step 1
    want = Engine(model, EngineConfig(policy | {"name": "threshold"}, max_new_tokens=10, batch_size=2,
                                      max_seq_len=48)).generate(ps)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
