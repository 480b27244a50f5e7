"""tools/bench/load_test.py (issue 30) against the tiny built-in model, served by `compiledllm serve` in a child
process the tool starts and stops itself. The server decodes at threshold 0.05 (two forwards a request instead of
~23), so a run of dozens of requests takes seconds on two cores; the checks and the report are what is tested."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench" / "load_test.py"
SERVE = ["--serve", "tiny-llada2", "--set", "generation.max_seq_len=256", "--set", "batch_size=4",
         "--set", "policy.threshold=0.05"]


def tool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "--no-progress", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def ordered(s: dict) -> bool:
    return s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]


def test_a_run_counts_every_request_once(tmp_path):
    out = tmp_path / "load.json"
    p = tool(*SERVE, "--clients", "4", "--requests", "12", "--max-tokens", "8", "--prompt-tokens", "24",
             "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    c = rep["counts"]
    assert c["planned"] == c["sent"] == c["answered"] == c["ok"] == 12 and not c["errors_by_status"]
    assert rep["server_metrics"]["finished_total"] == 12
    assert rep["server_metrics"]["responses_by_status"] == {"200": 12}
    assert rep["passed"] and all(ch["pass"] for ch in rep["checks"].values())
    assert {"one_response_each", "unique_ids", "no_errors", "completion_tokens_match_token_ids",
            "server_finished_equals_sent", "server_output_tokens_equal_received", "server_exit_0"} <= set(rep["checks"])
    assert rep["server"]["exit_code"] == 0 and rep["server"]["model"] == "tiny-llada2"
    assert ordered(rep["latency_s"]) and rep["first_chunk_s"] is None
    assert 1 <= rep["completion_tokens"]["max"] <= 8
    assert 12 <= rep["prompt_tokens"]["mean"] <= 48  # about --prompt-tokens
    assert rep["throughput"]["requests_per_s"] > 0 and rep["server_metrics"]["step_s"]["count"] > 0
    assert rep["machine"]["nproc"] >= 1 and len(rep["machine"]["loadavg_start"]) == 3
    assert "check server_finished_equals_sent" in p.stdout and "FAIL" not in p.stdout


def test_token_id_prompts_for_a_model_without_a_tokenizer():
    lt = load_tool()
    a, b = lt.prompt_ids(0, 1, 64), lt.prompt_ids(0, 2, 64)
    assert a != b and a == lt.prompt_ids(0, 1, 64) and all(56 <= len(x) <= 72 for x in (a, b))
    assert all(100 <= t < 1000 for t in a + b)
    p = tool(*SERVE, "--ids", "--clients", "2", "--requests", "4", "--max-tokens", "4", "--prompt-tokens", "20")
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_streamed_soak_samples_the_servers_memory(tmp_path):
    out = tmp_path / "soak.json"
    p = tool(*SERVE, "--soak", "--stream", "--clients", "4", "--requests", "60", "--max-tokens", "4",
             "--prompt-tokens", "12", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    assert rep["counts"]["sent"] == rep["counts"]["ok"] == rep["server_metrics"]["finished_total"] == 60
    assert ordered(rep["first_chunk_s"]) and ordered(rep["latency_s"])
    assert rep["first_chunk_s"]["p50"] <= rep["latency_s"]["p50"]
    rss = rep["memory"]["rss_mib"]
    assert rss["samples"] >= 2 and rss["bound_mib"] == 64
    assert rss["min"] <= rss["start"] <= rss["max"] and rss["min"] <= rss["end"] <= rss["max"] and rss["min"] > 50
    assert rep["checks"]["rss_growth"]["pass"]
    assert all("rss_mib" in s for s in rep["memory"]["samples"])


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://example.com:80/v1", "http://0.0.0.0:8000"])
def test_a_non_loopback_url_is_refused_in_one_line(url):
    p = tool("--url", url, timeout=30)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "not a loopback address" in p.stderr, p.stderr


def test_option_errors_are_one_line():
    for args in (["--url", "http://127.0.0.1:1", "--soak"], ["--url", "http://127.0.0.1:1", "--set", "a=1"],
                 ["--serve", "tiny-llada2", "--clients", "0"]):
        p = tool(*args, timeout=30)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)


def load_tool():
    spec = importlib.util.spec_from_file_location("load_test", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_urls_quantiles_and_metrics_parsing():
    lt = load_tool()
    assert lt.loopback_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert lt.loopback_url("http://[::1]:8000") == "http://[::1]:8000"
    assert lt.loopback_url("http://localhost:9") == "http://localhost:9"
    for bad in ("http://192.168.0.1:80", "ftp://127.0.0.1", "127.0.0.1:8000"):
        with pytest.raises(ValueError):
            lt.loopback_url(bad)
    assert lt.percentile([3, 1, 2], 0.5) == 2 and lt.percentile([1, 2], 0.99) == pytest.approx(1.99)
    before = lt.parse_metrics('x_total{reason="eos"} 2.0\nh_bucket{le="0.1"} 1\nh_bucket{le="1.0"} 1\n'
                              'h_bucket{le="+Inf"} 1\nh_count 1\nh_sum 0.05\n')
    after = lt.parse_metrics('# HELP x\nx_total{reason="eos"} 5.0\nx_total{reason="length"} 4.0\n'
                             'h_bucket{le="0.1"} 1\nh_bucket{le="1.0"} 11\nh_bucket{le="+Inf"} 11\nh_count 11\n'
                             'h_sum 5.05\n')
    assert lt.delta(before, after, "x_total", "reason") == {"eos": 3.0, "length": 4.0}
    h = lt.histogram(before, after, "h")
    assert h["count"] == 10 and h["mean"] == pytest.approx(0.5) and h["p50"] == pytest.approx(0.55)


def test_memory_growth_under_load_and_at_rest():
    lt = load_tool()
    samples = [{"done": 0, "rss_mib": 100.0, "gpu_allocated_mib": 10.0}]
    samples += [{"done": d, "rss_mib": 110.0 + d / 100, "gpu_allocated_mib": 20.0} for d in range(10, 101, 10)]
    samples += [{"done": 100, "rss_mib": 105.0, "gpu_allocated_mib": 12.0, "final": True}]
    rss = lt.memory_report(samples, "rss_mib", 100, 0.1, 64)
    assert rss["after_warmup"] == 110.1 and rss["end_under_load"] == 111.0 and rss["end_at_rest"] == 105.0
    assert rss["growth_after_warmup"] == pytest.approx(0.9) and rss["growth_at_rest"] == pytest.approx(5.0)
    assert rss["slope_mib_per_1k_requests"] == pytest.approx(10.0) and rss["min"] == 100 and rss["max"] == 111
    gpu = lt.memory_report(samples, "gpu_allocated_mib", 100, 0.1, None)
    assert gpu["growth_after_warmup"] == 0 and gpu["growth_at_rest"] == 2.0 and "bound_mib" not in gpu
    m = lt.parse_metrics('compiledllm_gpu_memory_bytes{kind="allocated"} 1048576.0\n'
                         'compiledllm_gpu_memory_bytes{kind="reserved"} 2097152.0\n')
    assert lt.by_label(m, "compiledllm_gpu_memory_bytes", "kind") == {"allocated": 1048576.0, "reserved": 2097152.0}
