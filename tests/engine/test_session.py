"""EngineSession: requests join and leave a running session one step at a time (tests/engine/serve_loop.py is the
server-shaped loop). Each request's tokens equal its decode alone with the same KV capacity, whatever joins,
leaves or is cancelled around it."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint
from serve_loop import serve

import compiledllm
from compiledllm.engine import Engine, EngineConfig, RequestParams
from compiledllm.errors import UserError

POLICY = {"name": "threshold", "block_size": 4, "threshold": 0.6}
CAPACITY = 64


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("m"), "sdar", 11))


def prompts_of(lengths, vocab, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompt, max_new, policy=POLICY, request_id=0):
    eng = Engine(model, EngineConfig(policy, max_new_tokens=max_new, batch_size=1, max_seq_len=CAPACITY))
    return eng.generate([prompt], request_ids=[request_id])[0]


def test_requests_join_mid_run_one_is_cancelled_the_others_decode_as_alone(sdar):
    prompts = prompts_of([5, 9, 3, 12, 7, 6], sdar.config.vocab_size)
    lengths = [20, 6, 33, 11, 16, 9]
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=8, batch_size=4, max_seq_len=CAPACITY))
    session = eng.session(4, CAPACITY)
    arrivals = {0: [(0, prompts[0], RequestParams(lengths[0])), (1, prompts[1], RequestParams(lengths[1]))],
                2: [(2, prompts[2], RequestParams(lengths[2]))],
                3: [(3, prompts[3], RequestParams(lengths[3])), (4, prompts[4], RequestParams(lengths[4])),
                    (5, prompts[5], RequestParams(lengths[5]))]}  # 5 waits for a free slot
    served = serve(session, arrivals, cancels={4: [2]})
    assert sorted(served.results) == list(range(6))
    cancelled = served.results[2]
    assert cancelled.finish_reason == "cancelled" and served.finished_at[2] == 4  # within the step it was asked in
    assert cancelled.output_ids == served.streamed[2]  # what was final when it was cancelled
    for i in (0, 1, 3, 4, 5):
        res = served.results[i]
        ref = alone(sdar, prompts[i], lengths[i], request_id=i)
        assert res.output_ids == ref.output_ids, i
        assert served.streamed[i] == res.output_ids  # the block events add up to the result
        assert res.finish_reason in ("eos", "length") and len(res.output_ids) <= lengths[i]
    assert max(served.running) == 4 and served.running[-1] == 0


def test_a_cancelled_slot_is_taken_by_the_next_request_in_the_same_step(sdar):
    prompts = prompts_of([6, 6, 6], sdar.config.vocab_size, seed=5)
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=24, batch_size=2, max_seq_len=CAPACITY))
    session = eng.session(2, CAPACITY)
    for i in range(3):
        session.add(i, prompts[i])
    session.step()
    assert session.running == 2 and session.queued == 1
    session.cancel(0)
    session.step()
    assert session.running == 2 and session.queued == 0 and session.slot_of(2) == 0
    while session.has_work():
        session.step()


def test_live_rows_are_compacted_so_the_bucket_follows_them(sdar):
    """Four slots (buckets 1, 2, 4): when only the request in slot 3 is left, it moves to slot 0 and keeps its
    tokens."""
    prompts = prompts_of([4, 4, 4, 5], sdar.config.vocab_size, seed=9)
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=8, batch_size=4, max_seq_len=CAPACITY, ignore_eos=True))
    session = eng.session(4, CAPACITY)
    lengths = [4, 4, 4, 40]
    for i in range(4):
        session.add(i, prompts[i], RequestParams(lengths[i]))
    results, slots = {}, []
    while session.has_work():
        for ev in session.step():
            if hasattr(ev, "result"):
                results[ev.request_id] = ev.result
        if 3 in session._live:
            slots.append(session.slot_of(3))
    assert slots[0] == 3 and slots[-1] == 0
    ref = Engine(sdar, EngineConfig(POLICY, max_new_tokens=40, batch_size=1, max_seq_len=CAPACITY, ignore_eos=True))
    assert results[3].output_ids == ref.generate([prompts[3]], request_ids=[3])[0].output_ids


def test_per_request_seed_and_sampling_keys_do_not_depend_on_the_session(sdar):
    policy = POLICY | {"temperature": 0.8, "seed": 1}
    prompts = prompts_of([5, 7], sdar.config.vocab_size, seed=2)
    eng = Engine(sdar, EngineConfig(policy, max_new_tokens=12, batch_size=2, max_seq_len=CAPACITY))
    session = eng.session(2, CAPACITY)
    session.add(10, prompts[0], RequestParams(seed=7))
    session.add(11, prompts[1])
    served = serve(session, {})
    assert served.results[10].output_ids == alone(sdar, prompts[0], 12, policy | {"seed": 7}, 10).output_ids
    assert served.results[11].output_ids == alone(sdar, prompts[1], 12, policy, 11).output_ids


def test_per_request_policy_settings_decode_as_a_session_of_that_setting(sdar):
    """`threshold` is a row parameter of the threshold policy: two requests with their own tau in one session each
    give the tokens of an engine configured with that tau."""
    prompts = prompts_of([6, 8, 5], sdar.config.vocab_size, seed=8)
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=16, batch_size=3, max_seq_len=CAPACITY))
    session = eng.session(3, CAPACITY)
    taus = [0.3, None, 0.95]
    for i, tau in enumerate(taus):
        session.add(i, prompts[i], RequestParams(policy={} if tau is None else {"threshold": tau}))
    served = serve(session, {})
    for i, tau in enumerate(taus):
        want = alone(sdar, prompts[i], 16, POLICY | ({} if tau is None else {"threshold": tau}), i)
        assert (served.results[i].output_ids, served.results[i].steps) == (want.output_ids, want.steps), i
    assert served.results[0].steps < served.results[2].steps  # the settings took effect


def test_stop_strings_end_a_request_and_cut_its_text():
    llm = compiledllm.LLM("tiny-llada2", policy={"name": "threshold", "threshold": 0.9})
    prompt = llm.tokenizer.encode("def fibonacci(n):\n    if n")
    eng = Engine(llm.model, EngineConfig({"name": "threshold", "threshold": 0.9}, max_new_tokens=64, batch_size=1,
                                         max_seq_len=128))
    full = eng.generate([prompt])[0]
    stop = full.text[40:44]
    assert stop and full.text.find(stop) >= 32  # past the first block: found at a block event
    session = eng.session(1, 128)
    session.add(0, prompt, RequestParams(stop=(stop,)))
    res = serve(session, {}).results[0]
    assert res.finish_reason == "stop" and res.text == full.text[: full.text.find(stop)]
    assert full.output_ids[: len(res.output_ids)] == res.output_ids
    assert stop in llm.tokenizer.decode(res.output_ids) and stop not in llm.tokenizer.decode(res.output_ids[:-1])


def test_session_errors_are_one_line(sdar):
    eng = Engine(sdar, EngineConfig(POLICY, max_new_tokens=8, batch_size=2, max_seq_len=CAPACITY))
    session = eng.session(2, CAPACITY)
    session.add(1, [3, 4, 5])
    with pytest.raises(UserError, match="request 1: already in this session"):
        session.add(1, [3, 4])
    with pytest.raises(UserError, match="needs 68 positions; this session's KV capacity is 64"):
        session.add(2, [3] * 4, RequestParams(max_new_tokens=64))
    with pytest.raises(UserError, match="prompt 3: empty"):
        session.add(3, [])
    with pytest.raises(UserError, match="policy.nope: not a per-request setting"):
        session.add(4, [3], RequestParams(policy={"nope": 1.0}))
    with pytest.raises(UserError, match="max_new_tokens: an integer >= 1"):
        RequestParams(max_new_tokens=0)
    with pytest.raises(UserError, match="stop strings need a tokenizer"):
        session.add(5, [3], RequestParams(stop=("x",)))
    with pytest.raises(UserError, match="request_ids: 4 appears more than once"):
        eng.generate([[3], [4]], request_ids=[4, 4])
    assert session.cancel(99) is False and session.cancel(1) is True
    assert [ev.result.finish_reason for ev in session.step()] == ["cancelled"] and not session.has_work()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("arch", ["llada2", "sdar"])
def test_captured_session_equals_eager_on_the_gpu(tmp_path, arch):
    """The server-shaped loop with CUDA graphs (bf16, buckets 1 / 2 / 4, compaction moving captured rows) gives
    the eager session's tokens, block events and forward counts, and each request's tokens alone."""
    model = compiledllm.load_model(write_checkpoint(tmp_path / arch, arch, 13, head_dim=64), device="cuda",
                                   dtype=torch.bfloat16)
    prompts = prompts_of([5, 9, 3, 12, 7, 6], model.config.vocab_size)
    lengths = [20, 6, 33, 11, 16, 9]

    def run(graphs: bool):
        eng = Engine(model, EngineConfig(POLICY, max_new_tokens=8, batch_size=4, max_seq_len=CAPACITY,
                                         cuda_graphs=graphs))
        arrivals = {0: [(i, prompts[i], RequestParams(lengths[i])) for i in (0, 1)],
                    2: [(2, prompts[2], RequestParams(lengths[2]))],
                    3: [(i, prompts[i], RequestParams(lengths[i])) for i in (3, 4, 5)]}
        return serve(eng.session(4, CAPACITY), arrivals, cancels={4: [2]})

    eager, graphs = run(False), run(True)
    assert graphs.streamed == eager.streamed
    assert {i: (r.output_ids, r.steps) for i, r in graphs.results.items()} == \
        {i: (r.output_ids, r.steps) for i, r in eager.results.items()}
    for i in (0, 1, 3, 4, 5):
        eng = Engine(model, EngineConfig(POLICY, max_new_tokens=lengths[i], batch_size=1, max_seq_len=CAPACITY))
        assert graphs.results[i].output_ids == eng.generate([prompts[i]], request_ids=[i])[0].output_ids


def test_a_compiled_session_made_outside_no_grad_compiles_nothing_after_its_start(sdar):
    """The server's worker makes its session outside torch.no_grad and steps it under no_grad (EngineSession.step):
    grad mode is part of the compiled graphs' guards, so a start-up compiled with grad enabled recompiled every
    graph at the first step. The start-up compiles under no_grad: stepping adds no graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    assert torch.is_grad_enabled()
    session = Engine(sdar, EngineConfig(POLICY, max_new_tokens=8, batch_size=2, compile=True)).session(2, CAPACITY)
    started = counters["stats"]["unique_graphs"]
    for i, p in enumerate(prompts_of([6, 9], sdar.config.vocab_size)):
        session.add(i, p)
    while session.has_work():
        session.step()
    assert started > 0 and counters["stats"]["unique_graphs"] == started
