"""A session's overlap (EngineSession.step): the next step launched before the last one's events are collected,
whenever nothing needs the host in between. On the CPU a launch runs the step at once, so `overlap: true` there
changes only the order of the host's work; the tokens, events and counts must not change at all."""
from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint
from serve_loop import serve

import compiledllm
from compiledllm.engine import Engine, EngineConfig, RequestParams
from compiledllm.errors import UserError

CAPACITY = 96


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("m"), "sdar", 23))


def prompts_of(lengths, vocab, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def served(model, policy, overlap, arrivals, cancels=None, slots=3, max_new=8):
    eng = Engine(model, EngineConfig(policy, max_new_tokens=max_new, batch_size=slots, max_seq_len=CAPACITY,
                                     overlap=overlap))
    session = eng.session(slots, CAPACITY)
    out = serve(session, arrivals, cancels)
    return out, session.stats()


def outcome(out, cancelled=()):
    """Every result and every request's streamed tokens (of a cancelled one only its finish reason: how far it got
    depends on when it was admitted)."""
    return ({i: (r.finish_reason,) if i in cancelled else (r.output_ids, r.finish_reason, r.steps, r.blocks)
             for i, r in out.results.items()}, {i: t for i, t in out.streamed.items() if i not in cancelled})


@pytest.mark.parametrize("policy", [{"name": "threshold", "block_size": 4, "threshold": 0.6},
                                    {"name": "threshold", "block_size": 4, "threshold": 1.0, "steps": 2},
                                    {"name": "threshold", "block_size": 4, "threshold": 0.6, "commit": "fused"},
                                    {"name": "t2t", "block_size": 4}])
def test_overlap_changes_no_token_event_or_count(sdar, policy):
    """Requests join mid-run (one waits for a slot) and one is cancelled while steps run ahead: every result,
    block event and forward count equals the session without overlap, and steps did run ahead. (A request that
    arrives while a step runs ahead is admitted after it: a step later than without overlap.)"""
    prompts = prompts_of([5, 9, 3, 12, 7], sdar.config.vocab_size)
    lengths = [28, 6, 40, 30, 16]
    arrivals = {0: [(i, prompts[i], RequestParams(lengths[i])) for i in (0, 1)],
                6: [(2, prompts[2], RequestParams(lengths[2]))],
                9: [(i, prompts[i], RequestParams(lengths[i])) for i in (3, 4)]}  # 4 waits for a slot
    cancels = {14: [3]}
    plain, plain_stats = served(sdar, policy, False, arrivals, cancels)
    ahead, stats = served(sdar, policy, True, arrivals, cancels)
    assert outcome(ahead, (3,)) == outcome(plain, (3,))
    for out in (plain, ahead):  # what was final when the cancel landed
        assert out.results[3].finish_reason == "cancelled" and out.results[3].output_ids == out.streamed[3]
    short, long = sorted((plain.results[3].output_ids, ahead.results[3].output_ids), key=len)
    assert long[: len(short)] == short
    assert ahead.finished_at[3] == plain.finished_at[3]  # within the step it was asked before, as without overlap
    assert plain_stats.ahead_steps == 0 and stats.ahead_steps >= 10


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("l"), "llada", 6))


@pytest.mark.parametrize("policy", [{"name": "flash_dllm", "block_size": 4, "threshold": 0.5, "ahead": 8, "track": 8},
                                    {"name": "flash_dllm", "block_size": 4, "threshold": 0.5, "verify": True},
                                    {"name": "fast_dllm_cache", "block_size": 4, "threshold": 0.5, "dual": True}])
def test_the_bidirectional_caches_run_ahead_with_the_same_tokens(llada, policy):
    """The caches whose refresh rows are the step's admitted rows (StepView.admitted) run ahead too; the prefix
    cache does not (its window follows each row's suffix, read from the device)."""
    prompts = prompts_of([5, 9, 3, 12, 7], llada.config.vocab_size)
    arrivals = {0: [(i, prompts[i], RequestParams(n)) for i, n in ((0, 20), (1, 6))],
                5: [(2, prompts[2], RequestParams(24))], 8: [(i, prompts[i], RequestParams(n)) for i, n in ((3, 9),
                                                                                                      (4, 12))]}
    plain, plain_stats = served(llada, policy, False, arrivals)
    ahead, stats = served(llada, policy, True, arrivals)
    assert outcome(ahead) == outcome(plain) and plain_stats.ahead_steps == 0 and stats.ahead_steps >= 5
    prefix = Engine(llada, EngineConfig({"name": "fast_dllm_cache", "block_size": 4}, max_new_tokens=4, overlap=True))
    assert prefix.session(1, 32).overlap is False


def test_steps_run_ahead_while_prompts_wait_for_the_first_blocks(sdar):
    """prefill.priority first_block: no prefill while a decoding row is in its first block, so those steps run
    ahead too, and the tokens, events and counts are those without overlap."""
    prompts = prompts_of([12, 10, 14, 9], sdar.config.vocab_size, seed=6)
    policy = {"name": "threshold", "block_size": 4, "threshold": 1.0, "steps": 4}
    outs = []
    for overlap in (False, True):
        eng = Engine(sdar, EngineConfig(policy, max_new_tokens=12, batch_size=4, max_seq_len=CAPACITY,
                                        prefill_priority="first_block", prefill_tokens=16, prefill_chunk=16,
                                        overlap=overlap))
        session = eng.session(4, CAPACITY)
        prefill, at = session._prefill, []  # the steps run ahead so far, at each prefill forward
        session._prefill = lambda *a, **k: at.append(session.stats().ahead_steps) or prefill(*a, **k)
        out = serve(session, {0: [(i, p, RequestParams()) for i, p in enumerate(prompts)]})
        outs.append((outcome(out), at))
    (plain, none), (ahead, some) = outs
    assert ahead == plain and len(none) == len(some) == 4  # one prompt a prefill forward
    assert none[-1] == 0 and some[-1] > some[0]  # steps ran ahead between them


def test_a_stop_string_ends_the_request_while_a_step_runs_ahead():
    """A stop string is found in the events collected while the next step runs: the result is cut as without
    overlap (that step ran on the request's row; nothing of it is reported)."""
    llm = compiledllm.LLM("tiny-llada2", policy={"name": "threshold", "threshold": 0.9})
    prompt = llm.tokenizer.encode("def fibonacci(n):\n    if n")
    policy = {"name": "threshold", "threshold": 0.9}
    full = Engine(llm.model, EngineConfig(policy, max_new_tokens=64, batch_size=1, max_seq_len=128)).generate(
        [prompt])[0]
    stop = full.text[40:44]
    results = []
    for overlap in (False, True):
        eng = Engine(llm.model, EngineConfig(policy, max_new_tokens=64, batch_size=2, max_seq_len=128,
                                             overlap=overlap))
        session = eng.session(2, 128)
        out = serve(session, {0: [(0, prompt, RequestParams(stop=(stop,))), (1, prompt, RequestParams())]})
        results.append((outcome(out), out.results[0].text, session.stats().ahead_steps))
    (plain, text, none), (ahead, text_ahead, some) = results
    assert (ahead, text_ahead) == (plain, text) and none == 0 and some > 0
    assert plain[0][0][1] == "stop" and text == full.text[: full.text.find(stop)]


def test_overlap_is_on_by_default_on_cuda_only_and_never_for_host_hooks(sdar):
    cfg = {"name": "threshold", "block_size": 4}
    assert Engine(sdar, EngineConfig(cfg, max_new_tokens=4)).overlap is False  # auto, on the CPU
    assert Engine(sdar, EngineConfig(cfg, max_new_tokens=4, overlap=True)).session(1, 32).overlap is True
    mage = {"name": "mage", "block_size": 4, "dense_layers": 1}
    hooked = Engine(sdar, EngineConfig(mage, max_new_tokens=4, overlap=True))
    assert hooked.session(1, 32).overlap is False  # its selection runs on the host between steps
    with pytest.raises(UserError, match="overlap: true or false, or auto"):
        EngineConfig(cfg, max_new_tokens=4, overlap="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_captured_steps_run_ahead_with_the_same_tokens_on_the_gpu(tmp_path):
    """On the GPU the step launched ahead really runs while the host collects: CUDA graphs, bf16, requests joining
    and a cancel; tokens, events and counts equal the session without overlap."""
    model = compiledllm.load_model(write_checkpoint(tmp_path / "sdar", "sdar", 13, head_dim=64), device="cuda",
                                   dtype=torch.bfloat16)
    prompts = prompts_of([5, 9, 3, 12, 7], model.config.vocab_size)
    arrivals = {0: [(i, prompts[i], RequestParams(n)) for i, n in ((0, 28), (1, 6))],
                6: [(2, prompts[2], RequestParams(40))], 9: [(i, prompts[i], RequestParams(n)) for i, n in ((3, 11),
                                                                                                      (4, 16))]}
    policy = {"name": "threshold", "block_size": 4, "threshold": 0.6}
    plain, _ = served(model, policy, False, arrivals, {14: [3]})
    ahead, stats = served(model, policy, "auto", arrivals, {14: [3]})
    assert outcome(ahead, (3,)) == outcome(plain, (3,)) and stats.ahead_steps >= 10
