"""The Python API in vLLM's and the OpenAI API's names (issue #30, item 5): SamplingParams(max_tokens=..., stop=...)
with max_new_tokens as max_tokens' alias, RequestOutput.outputs[0] as vLLM's CompletionOutput, stop strings per
request (the engine kept), n=1 only, and stop strings in streaming. Stop strings are taken from each test's own
no-stop output, never written down."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import compiledllm
from compiledllm import LLM, CompletionOutput, RequestOutput, SamplingParams
from compiledllm.engine import Engine, EngineConfig
from compiledllm.errors import UserError

PROMPTS = ["def fibonacci(n):\n    if n", "class Stack:\n    def push(", "import os\n\nfor"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two intra-op threads on a shared 2-core machine spin against other processes (~50x slower forwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llada2")  # a vLLM user's line: the model alone, every engine setting at its default


@pytest.fixture(scope="module")
def full(llm):
    """Each prompt's output without stop strings (64 tokens at most)."""
    return llm.generate(PROMPTS, SamplingParams(max_tokens=64))


def a_stop_string(text: str) -> str:
    """A string of `text` whose first occurrence is well inside it (not at its start): 4 characters from the middle,
    moved on until they are not all whitespace."""
    for k in range(len(text) // 2, len(text) - 4):
        s = text[k:k + 4]
        if s.strip() and text.find(s) > 0:
            return s
    raise AssertionError(f"no stop string to take from {text!r}")


def test_a_vllm_script_runs_with_the_import_changed(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0))
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    want = Engine(llm.model, EngineConfig(llm.config.policy, max_new_tokens=32)).generate(ids)
    assert len(outs) == len(PROMPTS)
    for output, prompt, w in zip(outs, PROMPTS, want):
        assert isinstance(output, RequestOutput) and output.finished is True
        assert output.prompt == prompt and output.prompt_token_ids == w.prompt_ids
        (c,) = output.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0 and c.finished()
        assert c.token_ids == w.output_ids == output.token_ids and c.text == w.text == output.text
        assert c.cumulative_logprob is None and c.logprobs is None and c.stop_reason is None
        eos = c.token_ids[-1] == llm.model.eos_token_id
        assert (output.finish_reason, c.finish_reason) == (("eos", "stop") if eos else ("length", "length"))
        assert eos or len(c.token_ids) == 32
    rids = [o.request_id for o in outs]
    assert all(isinstance(r, str) for r in rids) and len(set(rids)) == len(rids)
    again = llm.generate(PROMPTS, sampling_params=SamplingParams(max_tokens=32), use_tqdm=False)  # vLLM's keywords
    assert [o.outputs[0].token_ids for o in again] == [o.token_ids for o in outs]
    assert not set(o.request_id for o in again) & set(rids)  # counted on, as vLLM's LLM counts
    with pytest.raises(UserError, match="params or sampling_params"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=4), sampling_params=SamplingParams(max_tokens=5))


def test_an_eos_is_vllms_stop_with_no_stop_reason(llm, full):
    """An EOS id that the output holds (another id of the vocabulary as EOS) ends it with vLLM's "stop"."""
    ids = full[0].token_ids
    eos = ids[len(ids) // 2]
    early = LLM("tiny-llada2", eos_token_id=eos).generate(PROMPTS[0], SamplingParams(max_tokens=64))[0]
    assert early.token_ids[-1] == eos and eos not in early.token_ids[:-1] and len(early.token_ids) < len(ids)
    assert early.finish_reason == "eos"
    assert (early.outputs[0].finish_reason, early.outputs[0].stop_reason) == ("stop", None)


def test_max_new_tokens_is_an_alias_of_max_tokens(llm):
    a, b = SamplingParams(max_tokens=12), SamplingParams(max_new_tokens=12)
    assert a == b and hash(a) == hash(b) and a.max_new_tokens == b.max_tokens == 12
    assert SamplingParams(max_tokens=12, max_new_tokens=12) == a
    assert SamplingParams().max_tokens == SamplingParams().max_new_tokens == 256  # ours; vLLM's default is 16
    assert replace(a, max_tokens=5).max_new_tokens == 5 and replace(a, temperature=0.5).max_tokens == 12
    with pytest.raises(UserError, match="max_tokens=12 and max_new_tokens=13 differ"):
        SamplingParams(max_tokens=12, max_new_tokens=13)
    with pytest.raises(UserError, match="SamplingParams.max_tokens: an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)
    out_a, out_b = llm.generate(PROMPTS[:2], a), llm.generate(PROMPTS[:2], b)
    assert [o.token_ids for o in out_a] == [o.token_ids for o in out_b]
    assert [o.text for o in out_a] == [o.text for o in out_b]
    assert all(len(o.token_ids) <= 12 for o in out_a)
    want = Engine(llm.model, EngineConfig(llm.config.policy, max_new_tokens=12)).generate(
        [o.prompt_token_ids for o in out_a])  # the request's length is the engine's max_new_tokens'
    assert [o.token_ids for o in out_a] == [w.output_ids for w in want]


def test_stop_strings_cut_the_text_and_keep_the_engine(llm, full):
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=8))
    engine = llm.engine
    stop = a_stop_string(full[0].text)
    never = full[0].text + "!"  # longer than the text: never in it
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, stop=[never, stop]))
    assert llm.engine is engine  # stop strings are the requests' own: no new engine
    hits = 0
    for o, f in zip(outs, full):
        at = f.text.find(stop)
        if at < 0:  # this prompt's output never holds it: as without stop strings
            assert (o.text, o.token_ids, o.finish_reason) == (f.text, f.token_ids, f.finish_reason)
            assert o.outputs[0].stop_reason is None
            continue
        hits += 1
        c = o.outputs[0]
        assert o.text == c.text == f.text[:at]
        assert (o.finish_reason, c.finish_reason, c.stop_reason) == ("stop", "stop", stop)
        n = len(o.token_ids)
        assert o.token_ids == f.token_ids[:n] and n < len(f.token_ids)  # decoding ended there
        decode = llm.tokenizer.decode
        assert stop in decode(o.token_ids) and stop not in decode(o.token_ids[:-1])  # up to the stop string's end
    assert hits >= 1 and full[0].text.find(stop) > 0
    one = llm.generate(PROMPTS[0], SamplingParams(max_tokens=64, stop=stop))[0]  # a string, not a list
    assert one.text == outs[0].text and one.outputs[0].stop_reason == stop


def test_only_one_completion_per_prompt():
    assert SamplingParams(n=1).n == 1
    for n in (2, 0, True):
        with pytest.raises(UserError, match="SamplingParams.n: only n=1"):
            SamplingParams(n=n)
    for bad in ("", [""], ["x", 3]):
        with pytest.raises(UserError, match="SamplingParams.stop"):
            SamplingParams(stop=bad)
    with pytest.raises(TypeError):
        SamplingParams(presence_penalty=0.5)  # a vLLM setting this engine does not have


def test_stop_strings_in_streaming(llm, full):
    stop = a_stop_string(full[1].text)
    params = SamplingParams(max_tokens=64, stop=stop)
    pieces = list(llm.generate(PROMPTS[:2], params, stream=True))
    outs = llm.generate(PROMPTS[:2], params)
    for i, want in enumerate(outs):
        mine = [p for p in pieces if p.index == i]
        text = "".join(p.text for p in mine)
        assert text == want.text and stop not in text  # nothing from the stop string on is ever shown
        assert [t for p in mine for t in p.token_ids] == want.token_ids
        assert sum(p.finished for p in mine) == 1 and mine[-1].finished
        assert replace(mine[-1].output, latency_s=0) == replace(want, latency_s=0)
    assert outs[1].finish_reason == "stop" and outs[1].text == full[1].text[: full[1].text.find(stop)]
    assert outs[1].outputs[0].stop_reason == stop and len([p for p in pieces if p.index == 1]) >= 2


def test_stop_strings_need_a_tokenizer():
    bare = LLM("tiny-llada2-random", policy={"name": "threshold", "block_size": 4})
    with pytest.raises(UserError, match="stop strings need a tokenizer"):
        bare.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop="x"))
    out = bare.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0]
    assert out.outputs[0].text is None and out.outputs[0].token_ids == out.token_ids


def test_a_request_output_from_its_flat_fields_has_its_completion():
    out = RequestOutput(prompt="p", prompt_token_ids=[1], text="t", token_ids=[2, 3], finish_reason="eos", steps=1,
                        latency_s=0.0)
    assert out.outputs == [CompletionOutput(0, "t", [2, 3], finish_reason="stop")] and out.finished
    assert compiledllm.CompletionOutput is CompletionOutput
