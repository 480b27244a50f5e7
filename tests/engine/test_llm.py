"""compiledllm.LLM, the text-level API: the engine's tokens on encoded prompts, prompt order with fewer slots than
prompts, text / id / chat prompts, recipes, the engine kept between calls, one-line errors; and the chat-template
helpers real templates use (raise_exception, strftime_now, break / continue) in the sandboxed renderer."""
from __future__ import annotations

import re
from datetime import datetime

import pytest
import torch
import yaml
from tokenizers import Tokenizer

import compiledllm
from compiledllm import LLM, SamplingParams
from compiledllm.builtin import ASSETS
from compiledllm.engine import Engine, EngineConfig
from compiledllm.errors import UserError
from compiledllm.policies.t2t import T2TConfig
from compiledllm.recipe import load_recipe
from compiledllm.tokenizer import TextTokenizer

POLICY = {"name": "threshold", "block_size": 4, "threshold": 0.3}
PARAMS = SamplingParams(max_new_tokens=8)
TEXTS = ["def add(a, b):\n    return", "import os\n\nfor", "class Stack:\n    def __init__(self):\n        self"]
CHAT = "<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>{}<|role_end|><role>ASSISTANT</role>"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two intra-op threads on a shared 2-core machine spin against other processes (~50x slower forwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llada2", policy=POLICY, batch_size=2)


def one_line_error(fn, *needles: str) -> str:
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_text_prompts_give_the_engines_tokens_in_prompt_order(llm):
    outs = llm.generate(TEXTS, PARAMS)  # 3 prompts on 2 slots: the third is admitted when one ends
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    want = Engine(llm.model, EngineConfig(POLICY, max_new_tokens=8, batch_size=2)).generate(ids)
    assert [o.prompt for o in outs] == TEXTS
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.token_ids for o in outs] == [r.output_ids for r in want]
    assert [o.steps for o in outs] == [r.steps for r in want]
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.token_ids) and 1 <= len(o.token_ids) <= 8
        assert o.finish_reason == ("eos" if o.token_ids[-1] == llm.model.eos_token_id else "length")


def test_ids_and_text_mix_and_the_engine_is_kept(llm):
    ids = llm.tokenizer.encode(TEXTS[0])
    text_out, ids_out = llm.generate([TEXTS[0], ids], PARAMS)
    engine = llm.engine
    assert ids_out.prompt is None and ids_out.prompt_token_ids == ids and ids_out.token_ids == text_out.token_ids
    assert llm.generate(TEXTS[0], SamplingParams(max_new_tokens=8))[0].token_ids == text_out.token_ids
    assert llm.engine is engine  # same settings: same engine
    short = llm.generate(TEXTS[0], SamplingParams(max_new_tokens=2))[0]
    assert llm.engine is engine and len(short.token_ids) <= 2  # the length is the requests' own: same engine
    llm.generate(TEXTS[0], SamplingParams(max_new_tokens=2, seed=1))
    assert llm.engine is not engine and llm.engine.config.policy.seed == 1  # other sampling: another engine


def test_sampling_reaches_the_policy(llm):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=50, seed=3)
    outs = llm.generate(TEXTS[:2], params)
    assert llm.engine.policy.sampling.temperature == 1.0 and llm.engine.config.policy.seed == 3
    sampled = {**POLICY, "temperature": 1.0, "top_k": 50, "seed": 3}
    want = Engine(llm.model, EngineConfig(sampled, max_new_tokens=8, batch_size=2)).generate(
        [o.prompt_token_ids for o in outs])
    assert [o.token_ids for o in outs] == [r.output_ids for r in want]


def test_chat_renders_the_builtin_template(llm):
    outs = llm.chat([[{"role": "user", "content": "def f"}],
                     [{"role": "system", "content": "S"}, {"role": "user", "content": "x"}]], PARAMS)
    assert outs[0].prompt == CHAT.format("def f")
    assert outs[1].prompt.startswith("<role>SYSTEM</role>S\ndetailed thinking off<|role_end|>")
    assert outs[0].prompt_token_ids == llm.tokenizer.encode(outs[0].prompt)
    assert all(o.text == llm.tokenizer.decode(o.token_ids) for o in outs)
    one_line_error(lambda: llm.chat([{"role": "tool", "content": "x"}]), "conversation 0", "tokenizer_config.json",
                   "refused the messages", "roles are system, user and assistant, got tool")


def test_recipe_file_and_recipe_object(tmp_path, llm):
    policy = {**POLICY, "temperature": 0.5, "seed": 7}
    recipe = {"model": {"path": "tiny-llada2"}, "policy": policy, "generation": {"max_new_tokens": 6},
              "batch_size": 3, "prompts": [{"text": TEXTS[1]}]}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    from_file = LLM(str(path))
    assert from_file.default_params == SamplingParams(max_new_tokens=6, temperature=0.5, seed=7)
    assert from_file.config.batch_size == 3
    out = from_file.generate(TEXTS[1])[0]  # the recipe's length, policy and sampling
    assert out.token_ids == compiledllm.generate(llm.model, [out.prompt_token_ids], policy, max_new_tokens=6,
                                                 batch_size=3)[0].output_ids
    from_object = LLM(load_recipe(path), batch_size=1, policy="t2t", dtype="bfloat16")
    assert from_object.config.batch_size == 1 and isinstance(from_object.config.policy, T2TConfig)
    assert from_object.model.dtype == torch.bfloat16


def test_a_loaded_model(llm):
    again = LLM(llm.model, policy=POLICY, batch_size=2)
    assert again.model is llm.model and again.tokenizer is llm.tokenizer
    one_line_error(lambda: LLM(llm.model, device="cpu"), "device", "already loaded")


@pytest.mark.parametrize("call,needles", [
    (lambda m: m.generate(42), ("prompts: a string, a list of strings or a list of token-id lists, got int",)),
    (lambda m: m.generate(torch.tensor([[1, 2]])), (".tolist()",)),
    (lambda m: m.generate([1, 2, 3]), ("prompt 0", "not [1, 2, 3]")),
    (lambda m: m.generate([]), ("empty",)),
    (lambda m: m.generate([""]), ("prompt 0: empty",)),
    (lambda m: m.generate([[1.5]]), ("1.5 is not an integer",)),
    (lambda m: m.generate(["x"], {"max_new_tokens": 4}), ("params: a compiledllm.SamplingParams, got dict",
                                                           "SamplingParams(**params)")),
    (lambda m: m.chat("hello"), ("messages: a conversation",)),
    (lambda m: m.chat([]), ("messages: a conversation",)),
    (lambda m: m.chat([[{"content": "no role"}]]), ("conversation 0",)),
    (lambda m: m.generate([[5] * 3000]), ("a prompt of 3000 tokens", "the model's context is 2048")),
])
def test_bad_calls(llm, call, needles):
    one_line_error(lambda: call(llm), *needles)


@pytest.mark.parametrize("make,needles", [
    (lambda: SamplingParams(max_new_tokens=0), ("SamplingParams.max_new_tokens: an integer >= 1, got 0",)),
    (lambda: SamplingParams(max_new_tokens=True), ("max_new_tokens",)),
    (lambda: SamplingParams(temperature=-1.0), ("SamplingParams.temperature",)),
    (lambda: SamplingParams(temperature=float("nan")), ("SamplingParams.temperature",)),
    (lambda: SamplingParams(top_k=0), ("SamplingParams.top_k",)),
    (lambda: SamplingParams(top_p=1.5), ("SamplingParams.top_p",)),
    (lambda: SamplingParams(seed=-1), ("SamplingParams.seed",)),
    (lambda: LLM(123), ("LLM: model is a built-in name", "got int")),
    (lambda: LLM("tiny-llada2", batch_size=0), ("batch_size: an integer >= 1",)),
    (lambda: LLM("tiny-llada2", policy="greedy"), ("policy.name: 'greedy' is not one of",)),
    (lambda: LLM("tiny-llada2", policy={"name": "threshold", "tau": 1}), ("policy.tau: unknown parameter",)),
    (lambda: LLM("no/such/dir/x"), ("no/such/dir/x",)),
])
def test_bad_settings(make, needles):
    one_line_error(make, *needles)


def test_text_needs_a_tokenizer():
    bare = LLM("tiny-llada2-random", policy=POLICY)
    assert bare.tokenizer is None
    one_line_error(lambda: bare.generate(["hello"]), "prompt 0: text", "no tokenizer.json", "token ids")
    one_line_error(lambda: bare.chat([{"role": "user", "content": "hi"}]), "no tokenizer.json")


# ---- the chat-template renderer: the helpers Hugging Face gives templates ------------------------------------

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] == 'ipython' %}{%- continue %}{%- endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Unknown role '" + message['role'] + "':\\nonly user and assistant") }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
    {%- if message.get('last') %}{%- break %}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def llama3():
    tok = Tokenizer.from_file(str(ASSETS / "tiny-llada2" / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "chat_template": LLAMA3}
    return TextTokenizer(tok, config, "llama3/tokenizer_config.json")


def test_llama3_template_helpers(llama3):
    out = llama3.apply_chat_template([
        {"role": "system", "content": " be brief "},
        {"role": "user", "content": "hi"},
        {"role": "ipython", "content": "skipped by continue"},
        {"role": "assistant", "content": "hello", "last": True},
        {"role": "user", "content": "after break"},
    ])
    date = re.search(r"Today Date: (\d\d \w{3} \d{4})", out).group(1)
    assert abs((datetime.strptime(date, "%d %b %Y") - datetime.now()).days) <= 1
    assert out == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                   f"Today Date: {date}\n\nbe brief<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_raise_exception_is_one_line(llama3):
    one_line_error(lambda: llama3.apply_chat_template([{"role": "narrator", "content": "x"}]),
                   "llama3/tokenizer_config.json: the chat template refused the messages",
                   "Unknown role 'narrator': only user and assistant")
