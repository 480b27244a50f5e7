"""CUDA timing shared by the GPU benchmarks: CUDA-event medians, CUDA-graph replays, and the HBM / matmul
ceilings measured in the same run."""
from __future__ import annotations

import torch


def time_ms(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def graph_ms(fn, reps: int = 20) -> float:
    """Median replay time of fn captured as one CUDA graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = time_ms(graph.replay, reps)
    del graph
    return ms


def ceilings() -> dict:
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 10)
    hbm = 2 * src.numel() * 2 / (ms / 1e3)
    del src, dst
    n = 8192
    a, b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda"), torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: a @ b, 10)
    return {"hbm_bytes_per_s": hbm, "bf16_flops_per_s": 2 * n**3 / (ms / 1e3)}
