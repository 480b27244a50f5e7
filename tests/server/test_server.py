"""`compiledllm serve` end to end: a real uvicorn server on a loopback port (in a thread of the test process, so the
tests can look at its worker), called with the official `openai` client and with raw HTTP for what a client would
never send. The tiny built-in model on the CPU; greedy decoding, so outputs can be compared with `compiledllm run`."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from compiledllm.recipe import load_recipe  # noqa: E402
from compiledllm.server.launch import bind, build_server  # noqa: E402

CAPACITY = 256  # KV positions per request, the same in the server and in the `run` it is compared with
PROMPTS = [f"def {name}(a, b):\n    return a" for name in ("add", "sub", "mul", "div")] + [
    "class Stack:\n    def __init__(self):\n        self.items", "import os\n\n\ndef walk(root):\n    for",
    "def read(path):\n    with open(path) as f:\n        return", "x = [i * i for i in range(10)]\nprint(x",
    "def fib(n):\n    if n < 2:\n        return n\n    return", "# a comment\n\ndef main():\n    print(",
    "for i in range(3):\n    print(i", "import sys\n\nif __name__ == '__main__':\n    sys.exit(",
    "def f(x):\n    \"\"\"Return x.\"\"\"\n    return", "try:\n    import json\nexcept ImportError:\n    json",
    "with open('a.txt', 'w') as f:\n    f.write(", "def g(*args, **kwargs):\n    return args, kwargs",
]


def recipe(**over):
    data = {"model": {"path": "tiny-llada2", "dtype": "float32", "device": "cpu"},
            "policy": {"name": "threshold", "block_size": 32, "threshold": 0.9},
            "generation": {"max_new_tokens": 32, "max_seq_len": CAPACITY}, "batch_size": 4,
            "prompts": [{"text": "x"}]}
    for k, v in over.items():
        data[k] = v
    return load_recipe(data)


class Running:
    """A Server behind uvicorn in a thread, on a free loopback port."""

    def __init__(self, rec, **kw):
        self.server = build_server(rec, **kw)
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app, log_level="error"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def client(self, key: str = "none", **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=data, **{"timeout": 60, **kw})

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served():
    s = Running(recipe(), max_queue=64, timeout_s=120)
    yield s
    s.stop()


def wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.worker.running or server.worker.waiting:
        assert time.monotonic() < deadline, f"{server.worker.running} requests still running"
        time.sleep(0.01)


# --- the openai client ---------------------------------------------------------------------------------------------
def test_completion_and_stream_agree(served):
    c = served.client()
    out = c.completions.create(model="tiny-llada2", prompt=PROMPTS[0], max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert out.usage.completion_tokens == len(choice.token_ids) and out.usage.prompt_tokens > 0
    assert out.usage.forwards >= 2  # the engine's own count: at least one forward per block
    chunks = list(c.completions.create(model="tiny-llada2", prompt=PROMPTS[0], max_tokens=64, stream=True,
                                       stream_options={"include_usage": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == choice.text
    assert sum(len(ch.choices[0].token_ids) for ch in chunks if ch.choices) == len(choice.token_ids)
    assert len([t for t in texts if t]) >= 2, "64 tokens are two blocks: two chunks with text"
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == choice.finish_reason


def test_chat_and_stream_agree(served):
    c = served.client()
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    out = c.chat.completions.create(model="tiny-llada2", messages=messages, max_tokens=40)
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    prompt = served.server.tokenizer.apply_chat_template(messages, True)
    assert out.usage.prompt_tokens == len(served.server.tokenizer.encode(prompt))
    chunks = list(c.chat.completions.create(model="tiny-llada2", messages=messages, max_tokens=40, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_models_health_metrics(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["tiny-llada2"]
    h = httpx.get(served.url + "/health").json()
    assert h["status"] == "ok"
    served.client().completions.create(model="tiny-llada2", prompt="x = 1", max_tokens=8)
    text = httpx.get(served.url + "/metrics").text
    for name in ("compiledllm_queue_length", "compiledllm_running_requests", "compiledllm_output_tokens_per_second",
                 "compiledllm_time_to_first_block_seconds_count", "compiledllm_step_seconds_count"):
        assert name in text
    count = [line for line in text.splitlines() if line.startswith("compiledllm_step_seconds_count")]
    assert float(count[0].split()[-1]) > 0


def test_stop_string_cuts_text_and_stream(served):
    c = served.client()
    full = c.completions.create(model="tiny-llada2", prompt=PROMPTS[2], max_tokens=64).choices[0].text
    stop = full.strip()[len(full.strip()) // 2 :][:3]  # from the model's own output, not hard-coded
    assert stop and stop in full
    cut = c.completions.create(model="tiny-llada2", prompt=PROMPTS[2], max_tokens=64, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    streamed = c.completions.create(model="tiny-llada2", prompt=PROMPTS[2], max_tokens=64, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut.text  # nothing the stop cut away was ever sent


# --- batch invariance under traffic ----------------------------------------------------------------------------------
def test_outputs_equal_compiledllm_run_alone_and_16_at_once(served, tmp_path):
    out = tmp_path / "run.jsonl"
    cmd = [sys.executable, "-m", "compiledllm", "-q", "run", "tiny-llada2", "--set", "model.dtype=float32",
           "--set", "policy.block_size=32", "--set", "policy.threshold=0.9", "--set", "generation.max_new_tokens=32",
           "--set", f"generation.max_seq_len={CAPACITY}", "-o", str(out)]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    expected = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()]
    c = served.client()

    def ask(p: str) -> list[int]:
        return c.completions.create(model="tiny-llada2", prompt=p, max_tokens=32).choices[0].token_ids

    alone = [ask(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(ask, PROMPTS))
    assert alone == expected
    assert together == expected
    one_request = c.completions.create(model="tiny-llada2", prompt=PROMPTS[:4], max_tokens=32)  # a list of them
    assert [ch.token_ids for ch in sorted(one_request.choices, key=lambda ch: ch.index)] == expected[:4]


# --- cancellation ----------------------------------------------------------------------------------------------------
def test_stream_closed_by_client_frees_its_slot(served):
    wait_idle(served.server)
    before = served.server.worker.session.stats()
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                      content=json.dumps({"prompt": PROMPTS[1], "max_tokens": 200, "stream": True})) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first block arrived; the client goes away
    wait_idle(served.server, 5.0)
    text = httpx.get(served.url + "/metrics").text
    assert 'compiledllm_finished_requests_total{reason="cancelled"}' in text
    assert served.server.worker.session.stats().generated_tokens - before.generated_tokens < 200


def test_non_streaming_client_disconnect_frees_its_slot(served):
    wait_idle(served.server)
    with pytest.raises(httpx.ReadTimeout):
        served.post("/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 200}, timeout=0.5)
    wait_idle(served.server, 5.0)


# --- bad requests: a 4xx in OpenAI's error format, and the server goes on ---------------------------------------------
BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": "x " * 1000}, 400, "prompt"),         # longer than the context (256 positions)
    ({"prompt": "x", "max_tokens": 10_000}, 400, "prompt"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "temperature": 0.7}, 400, "temperature"),
    ({"prompt": "x", "policy": {"nonsense": 1.0}}, 400, "policy"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completion_request(served, body, status, param):
    r = served.post("/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "Traceback" not in err["message"] and "\n" not in err["message"]
    assert err["param"] == param, err


def test_bad_chat_requests_and_server_goes_on(served):
    for body, param in (({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]},
                        "messages.0.role"), ({"messages": "hi"}, "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                          "max_completion_tokens": 5}, "max_completion_tokens")):
        r = served.post("/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(served.url + "/v1/nowhere").status_code == 404
    assert httpx.get(served.url + "/v1/completions").status_code == 405
    ok = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4})
    assert ok.status_code == 200


def test_per_request_policy_setting(served):
    c = served.client()
    loose = c.completions.create(model="tiny-llada2", prompt=PROMPTS[0], max_tokens=32,
                                 extra_body={"policy": {"threshold": 0.3}})
    strict = c.completions.create(model="tiny-llada2", prompt=PROMPTS[0], max_tokens=32,
                                  extra_body={"policy": {"threshold": 1.0}})
    assert loose.usage.forwards < strict.usage.forwards  # a lower threshold commits more tokens per forward


def test_one_failing_request_fails_alone(served, monkeypatch):
    wait_idle(served.server)
    session = served.server.worker.session
    real = session.add

    def add(rid, prompt, params=None, arrival=None):
        if prompt[:1] == [served.server.tokenizer.encode("boom")[0]]:
            raise RuntimeError("injected failure")
        return real(rid, prompt, params, arrival)

    monkeypatch.setattr(session, "add", add)
    with ThreadPoolExecutor(3) as pool:
        good = [pool.submit(served.post, "/v1/completions", {"prompt": p, "max_tokens": 16}) for p in PROMPTS[:2]]
        bad = served.post("/v1/completions", {"prompt": "boom", "max_tokens": 16})
        assert [f.result().status_code for f in good] == [200, 200]
    assert bad.status_code == 500 and "injected failure" in bad.json()["error"]["message"]
    assert served.post("/v1/completions", {"prompt": "x = 1", "max_tokens": 8}).status_code == 200


# --- limits ----------------------------------------------------------------------------------------------------------
def test_queue_full_is_429_with_retry_after_and_timeout_is_408():
    s = Running(recipe(batch_size=1), max_queue=1, timeout_s=1.5)
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(s.post, "/v1/completions", {"prompt": p, "max_tokens": 200}) for p in PROMPTS[:4]]
            codes = sorted(f.result().status_code for f in futures)
            full = [f.result() for f in futures if f.result().status_code == 429]
        assert 429 in codes and full[0].headers["retry-after"] == "1", codes
        assert 408 in codes, codes  # 200 tokens on one slot take longer than 1.5 s on this machine's CPU
        wait_idle(s.server)
    finally:
        s.stop()


def test_api_key():
    s = Running(recipe(), api_key="sekrit")
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = s.post("/v1/completions", {"prompt": "x", "max_tokens": 4}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/metrics").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        out = s.client("sekrit").completions.create(model="tiny-llada2", prompt="x = 1", max_tokens=4)
        assert out.choices[0].finish_reason in ("stop", "length")
    finally:
        s.stop()


# --- the command -----------------------------------------------------------------------------------------------------
def start_cli(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "compiledllm", "serve", "tiny-llada2", "--port", "0",
                             "--set", f"generation.max_seq_len={CAPACITY}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "serving tiny-llada2 on http://127.0.0.1:" in line, line + proc.stderr.read()
    return proc, line.split(" on ")[1].split("/v1")[0]


def test_sigterm_drains_running_requests_and_exits_0():
    import signal

    proc, url = start_cli()
    try:
        got: dict = {}

        def ask():
            got["r"] = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 96},
                                  timeout=120)

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 60
        while "compiledllm_running_requests 1.0" not in httpx.get(url + "/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert got["r"].status_code == 200 and got["r"].json()["usage"]["completion_tokens"] == 96
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "stopped" in out and "Traceback" not in err
    finally:
        proc.kill()


def test_cli_errors_are_one_line(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        for args in (["tiny-llada2", "--port", str(port)], ["no-such-model"],
                     ["tiny-llada2", "--set", "policy.threshold=7"]):
            p = subprocess.run([sys.executable, "-m", "compiledllm", "serve", *args], capture_output=True, text=True,
                               timeout=120)
            assert p.returncode == 2, p.stderr
            assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    finally:
        taken.close()
