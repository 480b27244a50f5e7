"""The CPU thread policy (compiledllm/threads.py) on the Python API's paths: the decision from faked load readings,
the re-check between steps, the user's choice winning (threads=, OMP_NUM_THREADS, torch.set_num_threads, before and
during a run), LLM / compiledllm.generate / load_model + Engine applying the CLI's default, CUDA untouched."""
from __future__ import annotations

import os

import pytest
import torch

import compiledllm
from compiledllm import LLM, SamplingParams, threads
from compiledllm.engine import Engine, EngineConfig
from compiledllm.errors import UserError
from compiledllm.loader import load_model

POLICY = {"name": "threshold", "block_size": 4, "threshold": 0.3}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(autouse=True)
def machine(monkeypatch):
    """A 2-core machine whose torch default is 2, nothing chosen yet; the policy's record restored after."""
    before = torch.get_num_threads()
    for k in threads.ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_baseline", 2)
    monkeypatch.setattr(threads, "_mine", None)
    monkeypatch.setattr(threads, "_pinned", None)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class Load:
    """Faked readings: `others` cores busy with other processes and `own` cores of this process, 1 s apart."""

    def __init__(self, others: float, own: float = 1.0):
        self.others, self.own, self.t, self.busy, self.cpu = others, own, 0.0, 0.0, 0.0

    def __call__(self):
        self.t += 1.0
        self.busy += self.others + self.own
        self.cpu += self.own
        return self.t, self.busy, self.cpu


def follower(load: Load) -> threads.ThreadFollower:
    return threads.ThreadFollower(read=load, interval_s=0.0)


def test_decide_wants_k_minus_a_margin_free_cores_for_k_threads():
    assert [threads.decide(f, 2) for f in (2.0, 1.75, 1.6, 1.33, 1.0, 0.2, -1.0)] == [2, 2, 1, 1, 1, 1, 1]
    assert threads.decide(8.0, 4) == 4 and threads.decide(3.8, 8) == 4  # never above the cap


def test_a_job_that_starts_during_the_run_lowers_the_count_at_the_next_check_and_more_comes_back_slowly():
    load = Load(others=0.0, own=2.0)
    f = follower(load)
    threads._mine = 2
    assert f.check() is None and torch.get_num_threads() == 2          # idle: stays
    load.others, load.own = 0.67, 1.33                                  # a busy process takes its fair share
    assert f.check() == 1 and torch.get_num_threads() == 1              # at once
    load.others, load.own = 1.0, 1.0
    assert f.check() is None and torch.get_num_threads() == 1           # 1 free core: 1 thread
    load.others, load.own = 0.0, 1.0                                    # it ends
    assert f.check() is None and torch.get_num_threads() == 1           # one check is not enough to rise
    assert f.check() == 2 and torch.get_num_threads() == 2              # two in a row are
    assert [n for _, n in f.changes] == [1, 2]


def test_checks_are_rate_limited_and_cost_no_reading_in_between():
    calls = []
    load = Load(others=1.0)
    f = threads.ThreadFollower(read=lambda: calls.append(1) or load(), interval_s=3600.0)
    threads._mine = 2
    for _ in range(100):
        assert f.check() is None
    assert len(calls) == 1 and torch.get_num_threads() == 2  # the reading at the start only


def test_set_num_threads_in_the_middle_of_a_run_stops_the_rechecks():
    load = Load(others=1.5)
    f = follower(load)
    threads._mine = 2
    torch.set_num_threads(1)  # the user's (differs from the policy's 2)
    assert f.check() is None and not f.active
    torch.set_num_threads(2)
    assert f.check() is None and torch.get_num_threads() == 2


def test_the_users_choice_wins(monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)  # the default would be 1
    torch.set_num_threads(1)  # before the policy set any: differs from torch's default 2
    monkeypatch.setattr(threads, "_baseline", 2)
    assert threads.user_chose() and threads.follow(torch.device("cpu")) is None
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.user_chose() and threads.follow(torch.device("cpu")) is None and torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.set_threads(2) == 2 and threads.user_chose()  # --threads 2 / the recipe key: pinned
    assert threads.follow(torch.device("cpu")) is None and torch.get_num_threads() == 2


def test_cuda_runs_are_untouched(monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    assert threads.follow(torch.device("cuda", 0)) is None and torch.get_num_threads() == 2
    assert threads._mine is None


def test_the_default_is_measured_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(threads, "busy_cores", lambda: calls.append(1) or 1.0)
    assert threads.follow(torch.device("cpu")) is not None and torch.get_num_threads() == 1
    assert threads.follow(torch.device("cpu")) is not None and len(calls) == 1  # the next starts from 1


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llada2")


def test_load_model_engine_and_generate_get_the_clis_default(model, monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    monkeypatch.setattr(threads, "CHECK_S", 1e9)
    Engine(model, EngineConfig(POLICY, max_new_tokens=4, batch_size=2)).generate(PROMPTS)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "_mine", None)
    compiledllm.generate(model, PROMPTS, POLICY, max_new_tokens=4)
    assert torch.get_num_threads() == 1


def test_a_session_rechecks_between_steps(model, monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)  # idle at the start: 2 threads
    monkeypatch.setattr(threads, "CHECK_S", 0.0)
    monkeypatch.setattr(threads, "machine_reading", Load(others=1.0))  # then a job beside the run
    session = Engine(model, EngineConfig(POLICY, max_new_tokens=16, batch_size=2)).session(2, 64)
    assert torch.get_num_threads() == 2
    session.add(0, PROMPTS[0])
    seen = []
    while session.has_work():
        session.step()
        seen.append(torch.get_num_threads())
    session.close()
    assert seen[0] == 1 and set(seen) == {1} and session.threads.changes[0][1] == 1


def test_a_compiled_session_keeps_the_thread_count_it_compiled_with(model, monkeypatch):
    """Dynamo guards on torch's thread count: a change between steps would recompile every graph. The default is
    still applied at the start; the compile itself is not what this checks (Stepper stubbed)."""
    import compiledllm.engine.session as session_module

    class Uncompiled:
        def __init__(self, *args, **kwargs):
            self.startup_s, self.cache = 0.0, None

    monkeypatch.setattr(session_module, "Stepper", Uncompiled)
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    compiled = Engine(model, EngineConfig(POLICY, max_new_tokens=4, batch_size=2, compile=True)).session(2, 32)
    assert compiled.threads is None and torch.get_num_threads() == 1
    assert Engine(model, EngineConfig(POLICY, max_new_tokens=4, batch_size=2)).session(2, 32).threads is not None


def test_llm_applies_the_default_and_threads_pins_its_calls(model, monkeypatch):
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    monkeypatch.setattr(threads, "CHECK_S", 1e9)
    params = SamplingParams(max_new_tokens=4)
    LLM(model, policy=POLICY).generate("def f(x):\n    return", params)
    assert torch.get_num_threads() == 1  # the CLI's default: 1 of 2 cores busy
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "_mine", None)
    seen = []
    monkeypatch.setattr(threads, "ThreadFollower", lambda: seen.append(torch.get_num_threads()))
    LLM(model, policy=POLICY, threads=2).generate("def f(x):\n    return", params)
    assert seen == [] and torch.get_num_threads() == 2 and threads.user_chose()  # pinned: no follower
    with pytest.raises(UserError, match="threads"):
        LLM(model, threads=0)
