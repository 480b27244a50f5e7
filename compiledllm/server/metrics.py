"""GET /metrics: the server's Prometheus metrics (prometheus_client, one registry per server).

Gauges read the worker when scraped (queue length, running requests, output tokens/s over the last WINDOW_S);
counters and histograms are fed by the worker's thread (steps, finished requests) and by the handlers (responses
by status).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # the *_created series: noise for a server that restarts rarely

WINDOW_S = 10.0  # tokens/s is measured over this many seconds
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, waiting: Callable[[], int], running: Callable[[], int], device=None):
        """device: the engine's torch.device (on CUDA its memory is exported too)."""
        self.registry = r = CollectorRegistry()
        Gauge("compiledllm_queue_length", "Requests accepted and waiting for a slot", registry=r).set_function(waiting)
        Gauge("compiledllm_running_requests", "Requests in a slot (prefilling or decoding)",
              registry=r).set_function(running)
        Gauge("compiledllm_output_tokens_per_second", f"Output tokens of finished requests per second, over the "
              f"last {WINDOW_S:g} s", registry=r).set_function(self.tokens_per_s)
        self.requests = Counter("compiledllm_requests", "Responses by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.finish = Counter("compiledllm_finished_requests", "Requests the engine ended, by finish reason",
                              ["reason"], registry=r)
        self.prompt_tokens = Counter("compiledllm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.output_tokens = Counter("compiledllm_output_tokens", "Output tokens of finished requests", registry=r)
        self.forwards = Counter("compiledllm_request_forwards", "Decode forwards made for finished requests",
                                registry=r)
        self.first_block = Histogram("compiledllm_time_to_first_block_seconds", "Arrival to the first finished "
                                     "block", buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("compiledllm_request_latency_seconds", "Arrival to finish in the engine",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.step_s = Histogram("compiledllm_step_seconds", "One engine step (prefill and decode forwards)",
                                buckets=STEP_BUCKETS, registry=r)
        if device is not None and device.type == "cuda":
            import torch

            gpu = Gauge("compiledllm_gpu_memory_bytes", "GPU memory of this process (torch's allocator)", ["kind"],
                        registry=r)
            gpu.labels("allocated").set_function(lambda: torch.cuda.memory_allocated(device))
            gpu.labels("reserved").set_function(lambda: torch.cuda.memory_reserved(device))
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def step(self, seconds: float) -> None:
        self.step_s.observe(seconds)

    def finished(self, result) -> None:
        """A request's GenerationResult (the worker's thread)."""
        n = len(result.output_ids)
        self.finish.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.output_tokens.inc(n)
        self.forwards.inc(result.steps)
        if result.finish_reason != "cancelled":
            self.first_block.observe(result.first_block_s)
            self.latency.observe(result.latency_s)
        with self._lock:
            self._recent.append((time.monotonic(), n))

    def tokens_per_s(self) -> float:
        cut = time.monotonic() - WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < cut:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / WINDOW_S

    def response(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
