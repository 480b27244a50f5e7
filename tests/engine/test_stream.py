"""Text as it is decoded (compiledllm/stream.py): per-block deltas that never split a character and add up to the
result's text."""
from __future__ import annotations

from dataclasses import replace

import pytest

import compiledllm
from compiledllm.engine import Engine, EngineConfig, RequestParams
from compiledllm.stream import TextStream, text_deltas

POLICY = {"name": "threshold", "threshold": 0.9}


@pytest.fixture(scope="module")
def tiny():
    return compiledllm.load_model("tiny-llada2")


def test_a_character_split_over_tokens_is_held_back_until_complete(tiny):
    tok = tiny.tokenizer
    ids = tok.encode("héllo wörld ✓ 日本語 — ok")
    s = TextStream(tok)
    deltas = [s.push([t]) for t in ids]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") >= 3  # the byte-level tokens of ✓ and the CJK characters arrive one byte at a time


def test_hold_keeps_back_what_a_stop_string_could_cut(tiny):
    tok = tiny.tokenizer
    text = "def add(a, b):\n    return a + b\n"
    ids = tok.encode(text)
    s = TextStream(tok, hold=4)
    for n in range(len(ids)):
        s.push(ids[n : n + 1])
        decoded = tok.decode(ids[: n + 1])
        assert decoded.startswith(s.text) and len(decoded) - len(s.text) >= min(4, len(decoded))  # 4 kept back
        if " + b" in decoded:  # a stop string that arrived over several tokens: the session ends here
            break
    cut = text[: text.index(" + b")]
    assert cut.startswith(s.text) and s.finish(cut) == cut[len(s.text):]


def test_block_deltas_add_up_to_each_result(tiny):
    prompts = [tiny.tokenizer.encode(p) for p in ("def fibonacci(n):\n    if n", "class Stack:\n    def push(")]
    eng = Engine(tiny, EngineConfig(POLICY, max_new_tokens=96, batch_size=2))
    text: dict[int, str] = {0: "", 1: ""}
    blocks = {0: 0, 1: 0}
    results = {}
    for d in text_deltas(eng.events(prompts), tiny.tokenizer):
        text[d.request_id] += d.text
        if d.finished:
            results[d.request_id] = d.result
        else:
            blocks[d.request_id] += 1
    assert {i: r.text for i, r in results.items()} == text
    assert all(n >= 2 for n in blocks.values())  # streamed block by block, not at the end
    assert [r.output_ids for r in eng.generate(prompts)] == [results[0].output_ids, results[1].output_ids]


def test_a_stop_string_cuts_the_streamed_text_too(tiny):
    prompt = tiny.tokenizer.encode("def fibonacci(n):\n    if n")
    eng = Engine(tiny, EngineConfig(POLICY, max_new_tokens=64, batch_size=1))
    full = eng.generate([prompt])[0].text
    stop = full[40:44]
    got, result = "", None
    for d in text_deltas(eng.events([prompt], params=RequestParams(stop=(stop,))), tiny.tokenizer):
        got += d.text
        result = d.result or result
    assert result.finish_reason == "stop" and result.text == full[: full.find(stop)]
    assert got == result.text  # nothing past the stop string was ever shown


def test_llm_stream_yields_text_per_block_and_the_outputs_of_generate():
    llm = compiledllm.LLM("tiny-llada2", policy=POLICY, batch_size=2)
    prompts = ["def fibonacci(n):\n    if n", "class Stack:\n    def push("]
    params = compiledllm.SamplingParams(max_new_tokens=64)
    pieces = list(llm.generate(prompts, params, stream=True))
    outs = llm.generate(prompts, params)
    for i, want in enumerate(outs):
        mine = [p for p in pieces if p.index == i]
        assert "".join(p.text for p in mine) == want.text
        assert replace(mine[-1].output, latency_s=0) == replace(want, latency_s=0)
        assert sum(p.finished for p in mine) == 1 and mine[-1].finished and len(mine) >= 3
        assert [t for p in mine for t in p.token_ids] == want.token_ids
    with pytest.raises(compiledllm.UserError, match="params: a compiledllm.SamplingParams"):
        llm.stream(prompts, {"max_new_tokens": 4})  # checked at the call, not at the first next()
