"""Load test of `compiledllm serve` (issue 30): N concurrent clients send R completions in all, bounded in count
and time, over loopback only; then the checks that no request was lost or duplicated, and latency, throughput
and memory.

    python tools/bench/load_test.py --serve tiny-llada2 --set generation.max_seq_len=256 --set batch_size=8 \
        --clients 8 --requests 200 --max-tokens 32 --prompt-tokens 64 [--stream] --out load.json
    python tools/bench/load_test.py --url http://127.0.0.1:8000 --pid 1234 --soak --clients 16 --out soak.json

--serve TARGET starts `python -m compiledllm serve TARGET --port 0 --set ...` itself, reads the URL it prints and
stops it with SIGTERM at the end (which must exit 0); --url uses a running server (a loopback address only; --pid
its process, for its memory). Before the timed part two warm-up requests (8 prompts each, not counted) measure the
server's prompt tokens per character, so the prompts are about --prompt-tokens long (each different: Python snippets
in a per-request order from --seed, headed by the request's number; the report gives the tokens the server counted).
--time-limit stops sending after S seconds (the requests in flight finish; the report says how many were sent).

Checks (each PASS / FAIL in the report; the exit status is 1 when one fails): every request got exactly one
response (a stream: one finish and [DONE], one id throughout); response ids are unique; every response is a 200;
usage.completion_tokens == len(token_ids); the server's compiledllm_finished_requests_total (summed over reasons)
and compiledllm_output_tokens_total grew by the requests sent and the tokens received; with --serve, the server
exits 0 on SIGTERM; with --soak, the server's resident memory (VmRSS, sampled every second) grew by at most
--rss-growth-mib under load, from the first sample after the warm-up (the first --warmup-frac of the requests) to the
last one under load, and at rest, from before the run to after it (likewise the GPU's allocated memory, from
/metrics' compiledllm_gpu_memory_bytes, when the server reports it). Every mode records the samples.

Latency is client side, end to end per request; with --stream also the time to the first chunk and to the first
chunk with text. Server-side figures (time to first block, step time, engine latency) come from the /metrics
histograms scraped before and after: the mean (sum / count) and quantiles interpolated in the buckets.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import platform
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
CALIBRATION = 8  # prompts in each warm-up request

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n",
    "import os\n\n\ndef walk(root):\n    for dirpath, _, files in os.walk(root):\n        yield dirpath, files\n",
    "def read(path):\n    with open(path) as f:\n        return f.read()\n",
    "x = [i * i for i in range(10)]\nprint(x)\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(3):\n    print(i, i ** 2)\n",
    "import sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "def f(x):\n    \"\"\"Return x doubled.\"\"\"\n    return 2 * x\n",
    "try:\n    import json\nexcept ImportError:\n    json = None\n",
    "with open('a.txt', 'w') as f:\n    f.write('hello')\n",
    "def g(*args, **kwargs):\n    return args, kwargs\n",
    "total = 0\nfor value in values:\n    if value > 0:\n        total += value\n",
    "def merge(a, b):\n    out = dict(a)\n    out.update(b)\n    return out\n",
]


# --- prompts ------------------------------------------------------------------------------------------------------
def prompt_text(seed: int, index: int, chars: int) -> str:
    """Request `index`'s prompt, about `chars` characters: its number, then the snippets in an order of its own."""
    rng = random.Random(f"{seed}:{index}")
    text = f"# request {index}\n"
    while len(text) < chars:
        order = SNIPPETS[:]
        rng.shuffle(order)
        text += "\n".join(order)
    return text[:max(chars, 1)]


def prompt_ids(seed: int, index: int, tokens: int) -> list[int]:
    """--ids: request `index`'s prompt as token ids (a model without a tokenizer, e.g. random weights): `tokens`
    ids +- 1/8, drawn from [100, 1000): inside any vocabulary, away from the shipped configs' special tokens."""
    rng = random.Random(f"{seed}:{index}:ids")
    n = max(1, tokens + rng.randint(-(tokens // 8), tokens // 8))
    return [rng.randrange(100, 1000) for _ in range(n)]


# --- Prometheus text ----------------------------------------------------------------------------------------------
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(name, sorted labels): value}."""
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        labels = tuple(sorted(LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def series(metrics: dict, name: str) -> dict[tuple, float]:
    return {labels: v for (n, labels), v in metrics.items() if n == name}


def by_label(metrics: dict, name: str, label: str) -> dict[str, float]:
    return {dict(labels).get(label, ""): v for labels, v in series(metrics, name).items()}


def delta(before: dict, after: dict, name: str, label: str | None = None, zeros: bool = False):
    """after - before of a counter (by one label, or its single series); a series absent before counts 0; by label,
    the labels that did not grow are left out unless `zeros`."""
    if label is None:
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)
    a, b = by_label(after, name, label), by_label(before, name, label)
    return {k: v - b.get(k, 0.0) for k, v in a.items() if zeros or v - b.get(k, 0.0)}


def histogram(before: dict, after: dict, name: str) -> dict | None:
    """The histogram's observations between the scrapes: count, mean and quantiles interpolated in its buckets
    (Prometheus' histogram_quantile)."""
    count = delta(before, after, f"{name}_count")
    if (f"{name}_count", ()) not in after:
        return None
    out = {"count": int(count), "mean": delta(before, after, f"{name}_sum") / count if count else None}
    buckets = sorted((float(le), v) for le, v in delta(before, after, f"{name}_bucket", "le", True).items())
    for q in (0.5, 0.9, 0.99):
        out[f"p{round(q * 100)}"] = bucket_quantile(buckets, q) if count else None
    return out


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lo, below = q * buckets[-1][1], 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * ((rank - below) / (cum - below) if cum > below else 1.0)
        lo, below = le, cum
    return lo


# --- statistics ---------------------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def summary(xs: list[float]) -> dict | None:
    if not xs:
        return None
    return {"p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9), "p99": percentile(xs, 0.99),
            "mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs."""
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else None


# --- the server ---------------------------------------------------------------------------------------------------
def loopback_url(url: str) -> str:
    """The server's base URL (no /v1), or a ValueError: only http(s) on a loopback address."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url {url}: give http://127.0.0.1:PORT")
    host = parts.hostname
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise ValueError(f"--url {url}: {host} is not a loopback address; this tool only loads a server on this "
                         "machine (127.0.0.1, ::1 or localhost)")
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Served:
    """`python -m compiledllm serve TARGET --port 0 ...` as a child process; its output goes to files (a pipe nobody
    reads could fill and stall the server)."""

    def __init__(self, target: str, sets: list[str], extra: list[str], start_timeout: float):
        self.cmd = [sys.executable, "-m", "compiledllm", "serve", target, "--port", "0", "--host", "127.0.0.1"]
        for s in sets:
            self.cmd += ["--set", s]
        self.cmd += extra
        self.dir = tempfile.TemporaryDirectory(prefix="load_test_")
        self.out_path, self.err_path = Path(self.dir.name, "stdout"), Path(self.dir.name, "stderr")
        t0 = time.monotonic()
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT)
        self.pid = self.proc.pid
        self.exit_code: int | None = None
        while True:
            line = self.out_path.read_text().split("\n", 1)
            if len(line) > 1:  # a whole first line
                m = re.search(r" on (\S+)/v1 ", line[0] + " ")
                if m is None:
                    self.kill()
                    raise RuntimeError(f"the server printed {line[0]!r}, not 'serving NAME on URL/v1 ...'")
                self.start_line, self.url = line[0], loopback_url(m.group(1))
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode} before serving: {self.stderr_tail(3)}")
            if time.monotonic() - t0 > start_timeout:
                self.kill()
                raise RuntimeError(f"the server did not start in {start_timeout:g} s: {self.stderr_tail(3)}")
            time.sleep(0.05)
        self.startup_s = time.monotonic() - t0

    def stderr_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.err_path.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM, then wait for the drain; its exit status (None: it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        self.exit_code = self.proc.returncode
        return self.exit_code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# --- the clients --------------------------------------------------------------------------------------------------
@dataclass
class Record:
    index: int
    status: int | str = "none"          # HTTP status, or "transport:<error>" when none came back
    latency_s: float | None = None
    first_chunk_s: float | None = None  # streaming: the first data chunk
    first_text_s: float | None = None   # streaming: the first chunk with text
    id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    token_ids: int | None = None        # len(token_ids) over the choice (all chunks of a stream)
    finish_reason: str | None = None
    problems: list[str] = field(default_factory=list)  # a malformed response (no id, two finishes, ...)
    error: str | None = None


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    sent: int = 0
    done: int = 0
    ok: int = 0
    stopped_by_time_limit: bool = False
    t_start: float = 0.0
    t_end: float = 0.0


def body_of(a, index: int, chars: int, model: str | None, max_tokens: int) -> dict:
    prompt = prompt_ids(a.seed, index, a.prompt_tokens) if a.ids else prompt_text(a.seed, index, chars)
    body = {"prompt": prompt, "max_tokens": max_tokens}
    if model is not None:
        body["model"] = model
    if a.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def one(client: httpx.AsyncClient, url: str, body: dict, rec: Record, stream: bool) -> None:
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await client.post(url, json=body)
            rec.status = r.status_code
            rec.latency_s = time.perf_counter() - t0
            if r.status_code != 200:
                rec.error = r.text[:300]
                return
            data = r.json()
            rec.id = data.get("id")
            choices = data.get("choices") or []
            if len(choices) != 1:
                rec.problems.append(f"{len(choices)} choices")
            if choices:
                rec.token_ids = len(choices[0].get("token_ids") or [])
                rec.finish_reason = choices[0].get("finish_reason")
            usage = data.get("usage") or {}
            rec.prompt_tokens, rec.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if rec.id is None:
                rec.problems.append("no id")
            return
        async with client.stream("POST", url, json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = (await r.aread()).decode(errors="replace")[:300]
                rec.latency_s = time.perf_counter() - t0
                return
            ids, finishes, done, tokens, usage = set(), 0, 0, 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                now = time.perf_counter() - t0
                if rec.first_chunk_s is None:
                    rec.first_chunk_s = now
                if payload == "[DONE]":
                    done += 1
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    rec.problems.append(f"error in the stream: {chunk['error'].get('message', '')[:200]}")
                    continue
                ids.add(chunk.get("id"))
                for c in chunk.get("choices") or []:
                    tokens += len(c.get("token_ids") or [])
                    if c.get("text") and rec.first_text_s is None:
                        rec.first_text_s = now
                    if c.get("finish_reason") is not None:
                        finishes += 1
                        rec.finish_reason = c["finish_reason"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
            rec.latency_s = time.perf_counter() - t0
            rec.token_ids = tokens
            rec.id = next(iter(ids)) if len(ids) == 1 else None
            if len(ids) != 1:
                rec.problems.append(f"{len(ids)} ids in one stream")
            if finishes != 1:
                rec.problems.append(f"{finishes} finish chunks")
            if done != 1:
                rec.problems.append(f"{done} [DONE] lines")
            if usage is None:
                rec.problems.append("no usage chunk")
            else:
                rec.prompt_tokens, rec.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    except httpx.HTTPError as e:
        rec.status = f"transport:{type(e).__name__}"
        rec.error = str(e)[:300]
        rec.latency_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a response this client cannot read (not JSON, not the API's shape)
        rec.problems.append(f"unreadable response: {type(e).__name__}: {str(e)[:200]}")
        rec.latency_s = time.perf_counter() - t0


async def sampler(base: str, pid: int | None, run: Run, samples: list[dict], stop: asyncio.Event, headers: dict,
                  every_s: float = 1.0) -> None:
    """Every second: the server's RSS, its queue, running requests and GPU memory (when /metrics gives it)."""
    async with httpx.AsyncClient(timeout=10, headers=headers) as client:
        while True:
            s = {"t": round(time.perf_counter() - run.t_start, 3), "done": run.done, "sent": run.sent}
            if pid is not None:
                s["rss_mib"] = rss_mib(pid)
            try:
                m = parse_metrics((await client.get(base + "/metrics")).text)
                s["queue"] = m.get(("compiledllm_queue_length", ()))
                s["running"] = m.get(("compiledllm_running_requests", ()))
                for kind, v in by_label(m, "compiledllm_gpu_memory_bytes", "kind").items():
                    s[f"gpu_{kind}_mib"] = v / MIB
            except (httpx.HTTPError, ValueError):
                pass
            samples.append(s)
            try:
                await asyncio.wait_for(stop.wait(), every_s)
                return
            except asyncio.TimeoutError:
                pass


async def load(a, base: str, pid: int | None, model: str | None, chars: int, headers: dict) -> tuple[Run, list]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    run, samples, stop = Run(), [], asyncio.Event()
    url = base + "/v1/completions"
    next_index = 0
    timeout = httpx.Timeout(a.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=a.clients, max_keepalive_connections=a.clients)
    progress = Progress(TextColumn("[bold]load[/]"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=Console(stderr=True),
                        disable=a.no_progress)
    task = progress.add_task("load", total=a.requests, info="")

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < a.requests:
            if a.time_limit is not None and time.perf_counter() - run.t_start >= a.time_limit:
                run.stopped_by_time_limit = True
                return
            i = next_index
            next_index += 1
            rec = Record(i)
            run.records.append(rec)
            run.sent += 1
            await one(client, url, body_of(a, i, chars, model, a.max_tokens), rec, a.stream)
            run.done += 1
            run.ok += rec.status == 200 and not rec.problems
            rss = samples[-1].get("rss_mib") if samples else None
            progress.update(task, advance=1, info=f"ok {run.ok}  failed {run.done - run.ok}"
                            + (f"  rss {rss:.0f} MiB" if rss else ""))

    with progress:
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
            run.t_start = time.perf_counter()
            sampling = asyncio.create_task(sampler(base, pid, run, samples, stop, headers))
            await asyncio.gather(*(client_loop(client) for _ in range(a.clients)))
            run.t_end = time.perf_counter()
            stop.set()
            await sampling
    return run, samples


async def warm_up(base: str, model: str | None, a, headers: dict, capacity: int | None) -> tuple[float, float]:
    """Two requests (not counted) of CALIBRATION prompts each, of L / 2 and L characters, cut like the real ones: the
    server's prompt tokens as intercept + chars / chars_per_token on average, so prompts of about --prompt-tokens can
    be cut. L is at most half the server's positions (a token is a character or more of such text)."""
    long = max(32, min(4 * a.prompt_tokens, (capacity or 4096) // 2))
    counts = []
    async with httpx.AsyncClient(timeout=a.timeout, headers=headers) as client:
        for chars in (long // 2, long):
            texts = [prompt_text(a.seed, -1 - i, chars) for i in range(CALIBRATION)]
            body = {"prompt": texts, "max_tokens": 1} | ({"model": model} if model else {})
            r = await client.post(base + "/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"the warm-up request got {r.status_code}: {r.text[:300]}")
            counts.append(r.json()["usage"]["prompt_tokens"] / CALIBRATION)
    per_char = (counts[1] - counts[0]) / (long - long // 2)
    if per_char <= 0:
        return long / max(counts[1], 1), 0.0
    return 1 / per_char, counts[0] - per_char * (long // 2)


def scrape(base: str, headers: dict) -> dict:
    r = httpx.get(base + "/metrics", timeout=30, headers=headers)
    r.raise_for_status()
    return parse_metrics(r.text)


def settle(base: str, headers: dict, timeout: float = 30.0) -> dict:
    """/metrics once nothing runs or waits (a cancelled request frees its slot at the next step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base, headers)
        idle = not m.get(("compiledllm_running_requests", ()), 0) and not m.get(("compiledllm_queue_length", ()), 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# --- the report ---------------------------------------------------------------------------------------------------
def memory_report(samples: list[dict], key: str, sent: int, warmup_frac: float, bound: float | None) -> dict | None:
    """Growth under load: the last sample taken while requests ran minus the first after the warm-up (the first
    `warmup_frac` of the requests), and its least-squares slope over the requests; growth at rest: the sample after
    the run (nothing running) minus the one before it (after the warm-up requests)."""
    pts = [(s["done"], s[key]) for s in samples if s.get(key) is not None and not s.get("final")]
    rest = [s[key] for s in samples if s.get(key) is not None and s.get("final")]
    if not pts:
        return None
    vals = [v for _, v in pts] + rest
    warm_at = warmup_frac * sent
    after = [(d, v) for d, v in pts if d >= warm_at] or pts[-1:]
    out = {"samples": len(vals), "start": pts[0][1], "end": vals[-1], "min": min(vals), "max": max(vals),
           "warmup_requests": int(math.ceil(warm_at)), "after_warmup": after[0][1], "end_under_load": pts[-1][1],
           "growth_after_warmup": pts[-1][1] - after[0][1],
           "peak_growth_after_warmup": max(v for _, v in after) - after[0][1],
           "end_at_rest": rest[-1] if rest else None, "growth_at_rest": rest[-1] - pts[0][1] if rest else None}
    s = slope([d for d, _ in after], [v for _, v in after])
    out["slope_mib_per_1k_requests"] = None if s is None else s * 1000
    if bound is not None:
        out["bound_mib"] = bound
    return out


def build_report(a, base: str, served: Served | None, pid: int | None, model: str | None, chars_per_token: float,
                 chars: int, run: Run, samples: list[dict], before: dict, after: dict, load_start: list, load_end: list,
                 exit_code: int | None, cpu_s: float) -> dict:
    recs = sorted(run.records, key=lambda r: r.index)
    ok = [r for r in recs if r.status == 200 and not r.problems]
    by_status: dict[str, int] = {}
    for r in recs:
        if r.status != 200:
            by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    malformed = [r for r in recs if r.status == 200 and r.problems]
    wall = run.t_end - run.t_start
    out_tokens = sum(r.completion_tokens or 0 for r in ok)

    finished = delta(before, after, "compiledllm_finished_requests_total", "reason")
    finished_total = sum(finished.values())
    server_tokens = delta(before, after, "compiledllm_output_tokens_total")
    responses = delta(before, after, "compiledllm_requests_total", "status")
    have_metrics = any(n == "compiledllm_output_tokens_total" for n, _ in after)

    checks: dict[str, dict] = {}

    def check(name: str, passed: bool, detail: str) -> None:
        checks[name] = {"pass": bool(passed), "detail": detail}

    indices = [r.index for r in recs]
    answered = [r for r in recs if r.status != "none"]
    check("one_response_each", len(set(indices)) == len(indices) == run.sent and len(answered) == run.sent
          and not malformed, f"{run.sent} sent, {len(answered)} answered, {len(set(indices))} distinct requests, "
          f"{len(malformed)} malformed responses" + (f" (first: request {malformed[0].index}: "
                                                    f"{'; '.join(malformed[0].problems)})" if malformed else ""))
    ids = [r.id for r in recs if r.id is not None]
    check("unique_ids", len(ids) == len(set(ids)), f"{len(ids)} ids, {len(set(ids))} distinct")
    check("no_errors", not by_status, "every response a 200" if not by_status else
          f"non-200: {by_status}; first: {next(r.error for r in recs if r.status != 200)}")
    mismatched = [r for r in ok if r.completion_tokens != r.token_ids]
    check("completion_tokens_match_token_ids", not mismatched, f"{len(ok) - len(mismatched)} of {len(ok)} match"
          + (f"; request {mismatched[0].index}: usage {mismatched[0].completion_tokens}, token_ids "
             f"{mismatched[0].token_ids}" if mismatched else ""))
    check("server_finished_equals_sent", have_metrics and finished_total == run.sent,
          f"compiledllm_finished_requests_total grew by {finished_total:g} {finished}; {run.sent} sent"
          if have_metrics else "no compiledllm metrics at /metrics")
    check("server_output_tokens_equal_received", have_metrics and server_tokens == out_tokens,
          f"compiledllm_output_tokens_total grew by {server_tokens:g}; {out_tokens} received")
    if served is not None:
        check("server_exit_0", exit_code == 0, f"the server exited {exit_code} on SIGTERM" if exit_code is not None
              else "the server did not exit on SIGTERM (killed)")

    rss = memory_report(samples, "rss_mib", run.sent, a.warmup_frac, a.rss_growth_mib if a.soak else None)
    gpu = {k[4:-4]: memory_report(samples, k, run.sent, a.warmup_frac, a.gpu_growth_mib if a.soak else None)
           for k in sorted({k for s in samples for k in s if k.startswith("gpu_")})}
    if a.soak:
        if rss is None:
            check("rss_growth", False, "no RSS samples (the server's /proc/PID/status was not readable)")
        else:
            rest = rss["growth_at_rest"]
            check("rss_growth", rss["growth_after_warmup"] <= a.rss_growth_mib and (rest is None or
                                                                                  rest <= a.rss_growth_mib),
                  f"VmRSS {rss['after_warmup']:.1f} MiB after {rss['warmup_requests']} requests -> "
                  f"{rss['end_under_load']:.1f} MiB at the last sample under load: "
                  f"{rss['growth_after_warmup']:+.1f} MiB"
                  + (f"; at rest {rss['start']:.1f} before -> {rss['end_at_rest']:.1f} MiB after: {rest:+.1f} MiB"
                     if rest is not None else "") + f" (bound {a.rss_growth_mib:g} MiB each)")
        if "allocated" in gpu and gpu["allocated"] is not None:
            g = gpu["allocated"]
            rest = g["growth_at_rest"]
            check("gpu_allocated_growth", g["growth_after_warmup"] <= a.gpu_growth_mib and (rest is None or
                                                                                          rest <= a.gpu_growth_mib),
                  f"GPU allocated {g['after_warmup']:.1f} -> {g['end_under_load']:.1f} MiB under load: "
                  f"{g['growth_after_warmup']:+.1f} MiB" + (f"; at rest {rest:+.1f} MiB" if rest is not None else "")
                  + f" (bound {a.gpu_growth_mib:g} MiB each)")

    queue = [s["queue"] for s in samples if s.get("queue") is not None]
    running = [s["running"] for s in samples if s.get("running") is not None]
    loadavg_uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    report = {
        "tool": "tools/bench/load_test.py", "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]], "git_commit": commit,
        "machine": {"nproc": os.cpu_count(), "sched_cpus": len(os.sched_getaffinity(0)), "loadavg_start": load_start,
                    "loadavg_end": load_end, "uptime_end": loadavg_uptime, "platform": platform.platform(),
                    "python": platform.python_version()},
        "server": {"url": base, "mode": "serve" if served else "url", "model": model, "pid": pid,
                   **({"command": served.cmd[1:], "start_line": served.start_line, "startup_s": served.startup_s,
                       "exit_code": exit_code, "stderr_tail": served.stderr_tail()} if served else {})},
        "settings": {"clients": a.clients, "requests": a.requests, "max_tokens": a.max_tokens,
                     "prompt_tokens": a.prompt_tokens, "prompt_chars": chars,
                     "chars_per_token": chars_per_token, "stream": a.stream, "time_limit_s": a.time_limit,
                     "soak": a.soak, "seed": a.seed, "timeout_s": a.timeout, "warmup_frac": a.warmup_frac},
        "counts": {"planned": a.requests, "sent": run.sent, "answered": len(answered), "ok": len(ok),
                   "errors_by_status": by_status, "malformed": len(malformed),
                   "stopped_by_time_limit": run.stopped_by_time_limit},
        "prompt_tokens": summary([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "completion_tokens": summary([r.completion_tokens for r in ok if r.completion_tokens is not None]),
        "finish_reasons": {k: sum((r.finish_reason or "") == k for r in ok)
                           for k in sorted({r.finish_reason or "" for r in ok})},
        "latency_s": summary([r.latency_s for r in ok]),
        "first_chunk_s": summary([r.first_chunk_s for r in ok if r.first_chunk_s is not None]) if a.stream else None,
        "first_text_chunk_s": summary([r.first_text_s for r in ok if r.first_text_s is not None]) if a.stream else None,
        "throughput": {"wall_s": wall, "requests_per_s": len(ok) / wall if wall > 0 else None,
                       "output_tokens_per_s": out_tokens / wall if wall > 0 else None, "output_tokens": out_tokens},
        "server_metrics": {"finished_by_reason": finished, "finished_total": finished_total,
                           "output_tokens": server_tokens, "responses_by_status": responses,
                           "time_to_first_block_s": histogram(before, after, "compiledllm_time_to_first_block_seconds"),
                           "step_s": histogram(before, after, "compiledllm_step_seconds"),
                           "request_latency_s": histogram(before, after, "compiledllm_request_latency_seconds"),
                           "queue_length_max": max(queue, default=None), "running_max": max(running, default=None)},
        "memory": {"rss_mib": rss, "gpu_mib": gpu or None, "samples": samples},
        "client_cpu_s": cpu_s,
        "checks": checks, "passed": all(c["pass"] for c in checks.values()),
    }
    if a.save_requests:
        report["requests"] = [r.__dict__ for r in recs]
    return report


def print_table(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def ms(s: dict | None, key: str) -> str:
        return "-" if not s or s.get(key) is None else f"{s[key] * 1000:.0f}"

    t = Table(title=f"load test: {rep['server']['model']} at {rep['server']['url']}", show_header=True)
    t.add_column("figure")
    t.add_column("value", justify="right")
    st, c = rep["settings"], rep["counts"]
    t.add_row("clients x requests", f"{st['clients']} x {st['requests']}" + (" (stream)" if st["stream"] else "")
              + (" soak" if st["soak"] else ""))
    t.add_row("sent / ok / server finished", f"{c['sent']} / {c['ok']} / "
              f"{rep['server_metrics']['finished_total']:g}" + (" (time limit)" if c["stopped_by_time_limit"] else ""))
    t.add_row("errors by status", json.dumps(c["errors_by_status"]) if c["errors_by_status"] else "none")
    p = rep["prompt_tokens"]
    t.add_row("prompt / output tokens (mean)", "-" if not p else
              f"{p['mean']:.1f} / {rep['completion_tokens']['mean']:.1f}")
    for name, key in (("latency ms", "latency_s"), ("first chunk ms", "first_chunk_s"),
                      ("first text chunk ms", "first_text_chunk_s")):
        if rep[key]:
            t.add_row(f"{name} p50 / p90 / p99", " / ".join(ms(rep[key], q) for q in ("p50", "p90", "p99")))
    th = rep["throughput"]
    if th["requests_per_s"] is not None:
        t.add_row("requests/s, output tokens/s", f"{th['requests_per_s']:.2f}, {th['output_tokens_per_s']:.1f}")
    sm = rep["server_metrics"]
    for name, key in (("server first block ms mean / p50", "time_to_first_block_s"),
                      ("server step ms mean / p50", "step_s")):
        if sm[key] and sm[key]["mean"] is not None:
            t.add_row(name, f"{sm[key]['mean'] * 1000:.1f} / {ms(sm[key], 'p50')}")
    rss = rep["memory"]["rss_mib"]
    if rss:
        t.add_row("RSS MiB start / end / min / max", f"{rss['start']:.0f} / {rss['end']:.0f} / {rss['min']:.0f} / "
                  f"{rss['max']:.0f}")
        t.add_row("RSS growth after warm-up / at rest", f"{rss['growth_after_warmup']:+.1f} / "
                  + ("-" if rss["growth_at_rest"] is None else f"{rss['growth_at_rest']:+.1f}") + " MiB"
                  + (f" (bound {rss['bound_mib']:g})" if "bound_mib" in rss else ""))
    for kind, g in (rep["memory"]["gpu_mib"] or {}).items():
        if g:
            t.add_row(f"GPU {kind} MiB start / end", f"{g['start']:.0f} / {g['end']:.0f} "
                      f"({g['growth_after_warmup']:+.1f} after warm-up)")
    m = rep["machine"]
    t.add_row("machine", f"nproc {m['nproc']}, load {m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f}")
    for name, ch in rep["checks"].items():
        t.add_row(f"check {name}", "[green]PASS[/]" if ch["pass"] else "[red]FAIL[/]")
    console = Console(width=max(100, Console().width))
    console.print(t)
    for name, ch in rep["checks"].items():
        if not ch["pass"]:
            console.print(f"FAIL {name}: {ch['detail']}", highlight=False, soft_wrap=True)


# --- main ---------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, http://127.0.0.1:PORT (loopback only)")
    where.add_argument("--serve", metavar="TARGET", help="start `compiledllm serve TARGET --port 0` and stop it after")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="--serve: a recipe override")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="--serve: one more argument of `compiledllm serve` (e.g. --server-arg=--threads=2)")
    ap.add_argument("--pid", type=int, help="--url: the server's process id (for its resident memory)")
    ap.add_argument("--api-key", default=os.environ.get("COMPILEDLLM_API_KEY"), help="--url: the server's key")
    ap.add_argument("--model", help="the model name to send (default: none; the server's own)")
    ap.add_argument("--clients", type=int, default=None, help="concurrent clients (default 8; --soak 16)")
    ap.add_argument("--requests", type=int, default=None, help="requests in all (default 200; --soak 10000)")
    ap.add_argument("--max-tokens", type=int, default=None, help="max_tokens of each (default 32; --soak 8)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="about this many prompt tokens (default 64; "
                    "--soak 16)")
    ap.add_argument("--ids", action="store_true", help="prompts of random token ids (a model without a tokenizer; "
                    "no calibration: --prompt-tokens ids +- 1/8)")
    ap.add_argument("--stream", action="store_true", help="stream (SSE): also the time to the first chunk")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S", help="stop sending after S seconds")
    ap.add_argument("--soak", action="store_true", help="many short requests; checks the server's memory growth")
    ap.add_argument("--rss-growth-mib", type=float, default=64.0, help="--soak: the bound on VmRSS growth after "
                    "warm-up (default 64)")
    ap.add_argument("--gpu-growth-mib", type=float, default=64.0, help="--soak: the bound on GPU allocated growth")
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="the share of requests that warms up (0.1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="--serve: seconds the server may take to start")
    ap.add_argument("--out", help="write the JSON report here (default: print only)")
    ap.add_argument("--save-requests", action="store_true", help="put every request's record in the report")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    defaults = {"clients": (8, 16), "requests": (200, 10000), "max_tokens": (32, 8), "prompt_tokens": (64, 16)}
    for k, (plain, soak) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, soak if a.soak else plain)
    return a


def fail(msg: str, code: int = 2):
    print(f"load_test: error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def main(argv=None) -> int:
    a = parse_args(argv)
    for k in ("clients", "requests", "max_tokens", "prompt_tokens"):
        if getattr(a, k) < 1:
            fail(f"--{k.replace('_', '-')} {getattr(a, k)}: give at least 1")
    if a.time_limit is not None and a.time_limit <= 0:
        fail(f"--time-limit {a.time_limit:g}: give a positive number of seconds")
    if not 0 <= a.warmup_frac < 1:
        fail(f"--warmup-frac {a.warmup_frac:g}: give a share in [0, 1)")
    if a.serve is None and (a.set or a.server_arg):
        fail("--set and --server-arg go with --serve (a server started here)")
    if a.serve is not None and a.pid is not None:
        fail("--pid goes with --url (with --serve the tool knows its server's process)")
    if a.url is not None:
        try:
            base = loopback_url(a.url)
        except ValueError as e:
            fail(str(e))
        if a.soak and a.pid is None:
            fail("--soak samples the server's resident memory: give --pid PID with --url, or use --serve")
        if a.pid is not None and rss_mib(a.pid) is None:
            fail(f"--pid {a.pid}: no readable /proc/{a.pid}/status")
    if a.out is not None and Path(a.out).is_dir():
        fail(f"--out {a.out}: a directory; give a file")

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM, like Ctrl-C, still stops the server
    served = None
    load_start = list(os.getloadavg())
    uptime_start = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    try:
        if a.serve is not None:
            try:
                served = Served(a.serve, a.set, a.server_arg, a.start_timeout)
            except RuntimeError as e:
                fail(str(e).replace("\n", " | "))
            base, pid = served.url, served.pid
        else:
            pid = a.pid
        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key and served is None else {}
        try:
            health = httpx.get(base + "/health", timeout=30, headers=headers)
            if health.status_code != 200:
                fail(f"{base}/health: {health.status_code} {health.text[:200]}")
            listed = httpx.get(base + "/v1/models", timeout=30, headers=headers).json().get("data") or [{}]
            served_name = listed[0].get("id")
            chars_per_token, intercept = (1.0, 0.0) if a.ids else asyncio.run(
                warm_up(base, a.model, a, headers, listed[0].get("max_model_len")))
            before = settle(base, headers)
        except httpx.HTTPError as e:
            fail(f"{base}: {type(e).__name__}: {e}")
        except RuntimeError as e:
            fail(str(e))
        chars = max(1, int(round((a.prompt_tokens - intercept) * chars_per_token)))
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        run, samples = asyncio.run(load(a, base, pid, a.model, chars, headers))
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        after = settle(base, headers)
        final = {"t": round(time.perf_counter() - run.t_start, 3), "done": run.done, "sent": run.sent,
                 "final": True}  # the last sample: the server at rest
        if pid is not None:
            final["rss_mib"] = rss_mib(pid)
        final |= {f"gpu_{kind}_mib": v / MIB for kind, v in by_label(after, "compiledllm_gpu_memory_bytes",
                                                                      "kind").items()}
        samples.append(final)
        exit_code = served.stop() if served is not None else None
    except KeyboardInterrupt:
        if served is not None:
            served.stop(30)
        print("load_test: interrupted; nothing was written", file=sys.stderr)
        return 130
    finally:
        if served is not None:
            served.kill()
    cpu_s = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    report = build_report(a, base, served, pid, a.model or served_name, chars_per_token, chars, run, samples,
                          before, after, load_start, list(os.getloadavg()), exit_code, cpu_s)
    report["machine"]["uptime_start"] = uptime_start
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out)
    print_table(report)
    if a.out:
        print(f"report: {a.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
