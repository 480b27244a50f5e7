"""The ceilings HERALD's speed table is read against, measured in the same device call as the bench: HBM and bf16
matmul rate (gpu_timing.ceilings), PCIe with pinned memory both ways, the host's DRAM read rate, and ext/'s scan and
value gather alone at the bench's shape (LLaDA2.0-mini: 18 selecting layers of 4 KV heads x 4 query heads x 128, a
5 % budget; every layer in one call, as the host pool's scan; pageable and pinned) on the cores the host worker uses,
and again while a thread streams pinned memory to the GPU (as the pool's uploads do); then what one block of one
request costs on each.

    python tools/bench/herald_ceilings.py --prefix 32000 [--rows 1,8] [--out herald_ceilings.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_selection import read_bandwidth, timeit  # noqa: E402
from gpu_timing import ceilings, time_ms  # noqa: E402

from compiledllm.kv import cpu_select as cs  # noqa: E402

LAYERS, KVH, G, D, BUDGET = 18, 4, 4, 128, 0.05


def pcie(gib: float = 1.0) -> dict:
    n = int(gib * (1 << 30)) // 2
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    h2d = time_ms(lambda: dev.copy_(host, non_blocking=True), 5)
    d2h = time_ms(lambda: host.copy_(dev, non_blocking=True), 5)
    return {"h2d_bytes_per_s": 2 * n / (h2d / 1e3), "d2h_bytes_per_s": 2 * n / (d2h / 1e3)}


def _filled(n: int, S: int, pinned: bool, g: torch.Generator, tile: int = 4096) -> torch.Tensor:
    """[n, KVH, S, D] bf16 of one random tile repeated along S: a one-thread normal_ over the 32K pools (~6G values)
    alone outlasted the stage's 120 s; the timings read bytes, not values."""
    out = torch.empty(n, KVH, S, D, dtype=torch.bfloat16, pin_memory=pinned)
    src = torch.randn(KVH, min(tile, S), D, generator=g).to(torch.bfloat16)
    for s0 in range(0, S, src.shape[1]):
        w = min(src.shape[1], S - s0)
        out[:, :, s0:s0 + w].copy_(src[:, :w].expand(n, -1, -1, -1))
    return out


def scan_and_gather(S: int, rows: int, threads: int, pinned: bool) -> dict:
    """ext/'s fused scan (one query of G heads per KV head, keys only, top 5 %) and K+V gather over `rows` requests of
    every selecting layer in one call each, as the host pool's scan makes them (a stacked pool's entries read in place
    through `rows`); the pool pinned (as the host pool is on CUDA: page-locked, 4 KiB pages) or pageable. Seconds per
    call, GB/s of the keys read (scan) or the rows written (gather)."""
    g = torch.Generator().manual_seed(S)
    n = LAYERS * rows
    k, v = (_filled(n, S, pinned, g) for _ in range(2))
    q = torch.randn(n, KVH * G, 1, D, generator=g).to(torch.bfloat16)
    lengths, keep, entries = torch.full((n,), S, dtype=torch.int64), max(1, round(BUDGET * S)), torch.arange(n)
    scan = timeit(lambda i: cs.select(q, k, None, lengths, keep, want_output=False, want_lse=False, threads=threads,
                                      rows=entries), 3, 20, 0.5)["median_s"]
    idx = cs.select(q, k, None, lengths, keep, want_output=False, want_lse=False, threads=threads).topk_idx
    out = cs.gather(k, v, idx, threads=threads, rows=entries)  # the staging reused: no page faults in the timing
    gather = timeit(lambda i: cs.gather(k, v, idx, out=out, threads=threads, rows=entries), 3, 20, 0.5)["median_s"]
    return {"rows": rows, "pinned": pinned, "scan_s": scan, "scan_gbs": n * KVH * S * D * 2 / scan / 1e9,
            "gather_s": gather, "gather_gbs": 2 * n * KVH * keep * D * 2 / gather / 1e9}


@contextmanager
def copy_traffic(gib: float = 0.5):
    """A thread copying a pinned host buffer to the GPU over and over (on the CPU: host to host), as the host pool's
    uploads do while the selection scans: whether the scan keeps its rate with DMA reading the same DRAM (issue 27:
    the bench's worker scanned at about half this script's rate). Yields a dict that gets the traffic's GB/s."""
    n = int(gib * (1 << 30)) // 2
    cuda = torch.cuda.is_available()
    src = torch.empty(n, dtype=torch.bfloat16, pin_memory=cuda).fill_(1)
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda" if cuda else "cpu")
    stream, stop, copies, stats = torch.cuda.Stream() if cuda else None, threading.Event(), [0], {}

    def loop() -> None:
        while not stop.is_set():
            if cuda:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                stream.synchronize()
            else:
                dst.copy_(src)
            copies[0] += 1

    worker, t0 = threading.Thread(target=loop, daemon=True), time.perf_counter()
    worker.start()
    try:
        yield stats
    finally:
        stop.set()
        worker.join()
        stats["traffic"] = "host to GPU, pinned" if cuda else "host to host"
        stats["traffic_gbs"] = copies[0] * 2 * n / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=32000)
    ap.add_argument("--rows", default="1,4", help="requests per scan call")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 4),
                    help="ext/'s threads (default: herald's host_threads default, all cores but four)")
    ap.add_argument("--dram-gib", type=float, default=4.0, help="buffer the DRAM read rate is measured on")
    ap.add_argument("--out", default="herald_ceilings.json")
    args = ap.parse_args()
    threads = args.threads
    S, keep = args.prefix, max(1, round(BUDGET * args.prefix))
    rec: dict = {"prefix": S, "threads": threads,
                 "shape": {"layers": LAYERS, "kv_heads": KVH, "group": G, "head_dim": D},
                 "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        rec["gpu"] = ceilings() | pcie()
    rec["dram"] = read_bandwidth(0, args.dram_gib)
    gpu = rec.get("gpu", {})
    print(f"HBM {gpu.get('hbm_bytes_per_s', 0) / 1e9:.0f} GB/s, bf16 {gpu.get('bf16_flops_per_s', 0) / 1e12:.0f} "
          f"TFLOP/s, PCIe H2D {gpu.get('h2d_bytes_per_s', 0) / 1e9:.1f} / D2H {gpu.get('d2h_bytes_per_s', 0) / 1e9:.1f}"
          f" GB/s, DRAM read {rec['dram']['ext_read_probe_gbs']:.0f} GB/s ({os.cpu_count()} cores)", flush=True)
    pins = (False, True) if torch.cuda.is_available() else (False,)
    rec["ext"] = []
    for r in args.rows.split(",") if cs.extension_available() else []:
        for pin in pins:
            m = scan_and_gather(S, int(r), threads, pin)
            rec["ext"].append(m)
            print(f"ext/ at {S} keys, {r} rows x {LAYERS} layers a call, {threads} threads, "
                  f"{'pinned' if pin else 'pageable'}: scan {m['scan_gbs']:.1f} GB/s "
                  f"({m['scan_s'] / int(r) * 1e3:.1f} ms a request-block), K+V gather {m['gather_gbs']:.1f} GB/s",
                  flush=True)
    if rec["ext"]:  # the widest call again, pinned where the pool is, while copies read the same DRAM
        r = max(int(x) for x in args.rows.split(","))
        with copy_traffic() as traffic:
            busy = scan_and_gather(S, r, threads, torch.cuda.is_available())
        rec["ext_under_copies"] = busy | traffic
        print(f"ext/ at {S} keys, {r} rows, under {traffic['traffic']} copies at {traffic['traffic_gbs']:.1f} GB/s: "
              f"scan {busy['scan_gbs']:.1f} GB/s, K+V gather {busy['gather_gbs']:.1f} GB/s", flush=True)
    # one block of one request: its keys scanned in every selecting layer, its selection (K and V, or V) over PCIe
    row_keys = LAYERS * KVH * S * D * 2
    per_block = {"keys_bytes": row_keys, "selection_kv_bytes": 2 * LAYERS * KVH * keep * D * 2}
    if rec["ext"]:
        best = max([r for r in rec["ext"] if r["pinned"]] or rec["ext"], key=lambda r: r["scan_gbs"])  # the pool's
        per_block["cpu_scan_s"] = row_keys / (best["scan_gbs"] * 1e9)
        per_block["cpu_gather_kv_s"] = per_block["selection_kv_bytes"] / (best["gather_gbs"] * 1e9)
    if "gpu" in rec:
        per_block["pcie_kv_s"] = per_block["selection_kv_bytes"] / rec["gpu"]["h2d_bytes_per_s"]
        per_block["hbm_key_scan_s"] = row_keys / rec["gpu"]["hbm_bytes_per_s"]
    rec["per_request_block"] = per_block
    Path(args.out).write_text(json.dumps(rec, indent=1))
    print("per request and block: " + ", ".join(f"{k} {v * 1e3:.2f} ms" if k.endswith("_s") else f"{k} {v / 1e6:.0f} MB"
                                                for k, v in per_block.items()))


if __name__ == "__main__":
    main()
