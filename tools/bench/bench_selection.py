"""Benchmark of the fused CPU selection kernel (compiledllm._cpu_select) against the same run's
sequential read bandwidth and a torch baseline, for LLaDA2.0-mini's shape (4 KV heads, G=4,
head_dim 128) at 8K / 32K / 128K prefixes, 1 and 32 query tokens, selection only and with output.

    python tools/bench/bench_selection.py [--out docs/results/bench_selection_<host>.json] [--quick]
                                    [--forms auto,amx,fma]

Each prefix runs B = 128K / S requests (one layer = 128 MiB of K), rotating over --layers copies so
that the scan reads DRAM, not the last-level cache. Budget k = 5 % of the prefix (HERALD's).
GB/s counts K (+V with output) bytes of the valid prefixes once per call; gather GB/s counts the
bytes written to the destination (the selected K and V rows). Prints a short table last.
Each run records the dot-product form that scored it (amx / vdpbf16ps / fma); --forms repeats the
32-query runs with each listed form (same bits, so only the time differs). The AMX self-check
outcome is in the JSON's info.amx and printed first.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from compiledllm.kv import cpu_select as cs  # noqa: E402

KVH, G, D = 4, 4, 128
TARGET_SCAN, TARGET_SPEEDUP, TARGET_GATHER = 0.70, 5.0, 0.40


def timeit(fn: Callable[[int], object], min_reps: int, max_reps: int, min_s: float,
           setup: Callable[[], object] | None = None) -> dict:
    fn(0)  # warm-up (scratch allocation, page faults)
    times: list[float] = []
    start = time.perf_counter()
    i = 1
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < min_s):
        if setup is not None:
            setup()  # not timed
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
        i += 1
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": len(times)}


def read_bandwidth(threads: int, gib: float) -> dict:
    n = int(gib * (1 << 30)) // 4
    buf = torch.empty(n, dtype=torch.float32)
    buf.fill_(1.0)
    nbytes = n * 4
    t_sum = timeit(lambda i: buf.sum(), 5, 20, 1.0)
    t_probe = timeit(lambda i: cs.read_probe(buf, threads), 5, 20, 1.0)
    t_copy = timeit(lambda i: buf[: n // 2].copy_(buf[n // 2:]), 3, 10, 0.5)
    cores = os.cpu_count() or 1
    by_threads = {}
    for th in sorted({1, max(1, cores // 4), max(1, cores // 2), cores}):
        by_threads[th] = nbytes / timeit(lambda i: cs.read_probe(buf, th), 2, 5, 0.3)["median_s"] / 1e9
    del buf
    return {
        "buffer_gib": gib,
        "torch_sum_gbs": nbytes / t_sum["median_s"] / 1e9,
        "ext_read_probe_gbs": nbytes / t_probe["median_s"] / 1e9,
        "torch_copy_rw_gbs": nbytes / t_copy["median_s"] / 1e9,  # bytes read + written
        "ext_read_probe_gbs_by_threads": by_threads,
    }


def compute_rates(threads: int) -> dict:
    """Peak VDPBF16PS and FMA rates (512-bit instructions per second), one core and all cores."""
    from compiledllm import _cpu_select as ext
    if cs.isa() != "avx512bf16":
        return {}
    out = {}
    cores = threads or os.cpu_count() or 1
    kinds = [(0, "vdpbf16ps", 200_000), (1, "fma", 2_000_000)]
    if cs.amx_status()["active"]:
        kinds.append((2, "tdpbf16ps", 20_000))  # one TDPBF16PS = 16 x 16 x 32 multiply-adds
    for kind, name, iters in kinds:
        for th in (1, cores):
            t = min(ext.compute_probe(kind, iters, th) for _ in range(3))
            out[f"{name}_ginstr_per_s_{th}t"] = 12 * iters * th / t / 1e9
    f = cs.cpu_features()
    out["dot_form_chosen"] = f.get("dot")
    out["dot_form_chosen_many_rows"] = f.get("dot_many_rows")
    return out


def form_used(rows: int, form: str = "auto") -> str:
    """The dot-product form select(..., dot_form=form) uses for `rows` query rows per KV head."""
    if cs.isa() != "avx512bf16":
        return "portable"
    return cs.cpu_features(dot_form=form)["dot_many_rows" if rows >= 16 else "dot"]


def torch_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, budget: int, scale: float):
    """What one writes in torch: bf16 -> float32 keys, q @ K^T, softmax, aggregate, topk (and p @ V)."""
    B, Hq, n_q, _ = q.shape
    qf = q.float().reshape(B, KVH, G * n_q, D)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # [B, KVH, R, S]
    p = torch.softmax(scores, dim=-1)
    idx = p.sum(dim=2).topk(budget, dim=-1).indices
    out = torch.matmul(p, v.float()) if v is not None else None
    return idx, out


def run_prefix(S: int, n_layers: int, threads: int, quick: bool, prefetch_grid: list[tuple[int, bool]],
               fixed: dict[bool, tuple[int, bool]] | None, evict_bytes: int, log, forms: list[str]) -> dict:
    B = max(1, 131072 // S)
    budget = max(1, round(0.05 * S))
    g = torch.Generator().manual_seed(S)
    k0 = torch.randn(B, KVH, S, D, generator=g).to(torch.bfloat16)
    v0 = torch.randn(B, KVH, S, D, generator=g).to(torch.bfloat16)
    ks = [k0] + [k0.clone() for _ in range(n_layers - 1)]  # distinct memory, same values
    vs = [v0] + [v0.clone() for _ in range(n_layers - 1)]
    lengths = torch.full((B,), S, dtype=torch.int64)
    scale = D ** -0.5
    key_bytes = B * KVH * S * D * 2
    rec: dict = {"prefix": S, "requests": B, "topk": budget, "layers_rotated": n_layers, "runs": []}
    min_s = 0.2 if quick else 0.6

    def ours(q, want_out, pf, form="auto"):
        return lambda i: cs.select(q, ks[i % n_layers], vs[i % n_layers], lengths, budget, want_output=want_out,
                                   threads=threads, prefetch=pf[0], prefetch_l2=pf[1], dot_form=form)

    chosen = dict(fixed) if fixed else {False: prefetch_grid[0], True: prefetch_grid[0]}  # per mode (output?)
    if not fixed and len(prefetch_grid) > 1:  # pick the software prefetch (distance in tiles, L2 or L1) on this machine
        q1 = torch.randn(B, KVH * G, 1, D, generator=g).to(torch.bfloat16)
        sweep: dict = {}
        for pf in prefetch_grid:
            t = [timeit(ours(q1, wo, pf), 5, 30, min_s / 2)["median_s"] for wo in (False, True)]
            sweep[f"{pf[0]}{'-l2' if pf[1] else ''}"] = {"select_gbs": key_bytes / t[0] / 1e9,
                                                       "select+out_gbs": 2 * key_bytes / t[1] / 1e9}
            for wo, tt in zip((False, True), t):
                best = sweep.get(f"_best_{wo}")
                if best is None or tt < best:
                    sweep[f"_best_{wo}"] = tt
                    chosen[wo] = pf
            log(f"  S={S} prefetch={pf}: select {key_bytes / t[0] / 1e9:.1f} GB/s, "
                f"with output {2 * key_bytes / t[1] / 1e9:.1f} GB/s")
        rec["prefetch_sweep"] = {k: v for k, v in sweep.items() if not k.startswith("_")}
        prefetch = chosen[False]
        cores = os.cpu_count() or 1
        if threads == 0 and cores >= 4:  # does the 1-query scan saturate memory before all cores?
            scaling = {}
            for th in sorted({max(1, cores // 4), max(1, cores // 2), cores}):
                t = timeit(lambda i: cs.select(q1, ks[i % n_layers], None, lengths, budget, want_output=False,
                                               threads=th, prefetch=prefetch[0], prefetch_l2=prefetch[1]),
                           5, 30, min_s / 2)["median_s"]
                scaling[th] = key_bytes / t / 1e9
            rec["thread_scaling_select_1q_gbs"] = scaling
            log(f"  S={S} select 1q GB/s by threads: " + ", ".join(f"{k}: {v:.1f}" for k, v in scaling.items()))
    rec["prefetch"] = {"select": list(chosen[False]), "select+out": list(chosen[True])}

    for n_q in (1, 32):
        q = torch.randn(B, KVH * G, n_q, D, generator=g).to(torch.bfloat16)
        for want_out in (False, True):
            mode = "select+out" if want_out else "select"
            scanned = key_bytes * (2 if want_out else 1)
            tb = None  # the torch baseline once per (n_q, mode), shared by the forms
            for form in forms if n_q > 1 else ["auto"]:
                t = timeit(ours(q, want_out, chosen[want_out], form), 3 if n_q > 1 else 5, 40, min_s)
                used = form_used(G * n_q, form)
                if tb is None:
                    tb_reps = 2 if (quick or S * n_q >= 131072 * 32) else 3
                    tb = timeit(lambda i: torch_baseline(q, ks[i % n_layers], vs[i % n_layers] if want_out else None,
                                                         budget, scale), tb_reps, tb_reps, 0.0)
                run = {
                    "n_q": n_q, "mode": mode, "form": used, "form_requested": form, "bytes_scanned": scanned,
                    "prefetch": list(chosen[want_out]),
                    "ms_per_layer": t["median_s"] * 1e3, "ms_per_layer_per_request": t["median_s"] * 1e3 / B,
                    "gbs": scanned / t["median_s"] / 1e9, "min_ms": t["min_s"] * 1e3, "reps": t["reps"],
                    "torch_ms_per_layer": tb["median_s"] * 1e3, "torch_gbs": scanned / tb["median_s"] / 1e9,
                    "speedup_vs_torch": tb["median_s"] / t["median_s"],
                }
                rec["runs"].append(run)
                log(f"  S={S} n_q={n_q} {mode} [{used}]: {run['gbs']:.1f} GB/s, {run['ms_per_layer_per_request']:.3f} "
                    f"ms/layer/request; torch {run['torch_ms_per_layer']:.1f} ms ({run['speedup_vs_torch']:.1f}x)")

    # gather of the 1-query selection into a (pinned when CUDA exists) buffer, then one H2D copy
    q1 = torch.randn(B, KVH * G, 1, D, generator=g).to(torch.bfloat16)
    idxs = [cs.select(q1, ks[i], None, lengths, budget, want_output=False, threads=threads).topk_idx
            for i in range(n_layers)]
    dst = torch.empty((2, B, KVH, budget, D), dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
    gbytes = dst.numel() * 2

    def do_gather(i):
        cs.gather(ks[i % n_layers], vs[i % n_layers], idxs[i % n_layers], out=dst, threads=threads)

    warm = timeit(do_gather, 10, 200, min_s / 2)  # rows possibly still in the last-level cache
    evict = torch.empty(evict_bytes, dtype=torch.uint8).fill_(1)
    cold = timeit(do_gather, 5, 30, min_s / 2, setup=lambda: cs.read_probe(evict, threads))  # from DRAM
    del evict
    rec["gather"] = {"bytes": gbytes, "ms": cold["median_s"] * 1e3, "gbs": gbytes / cold["median_s"] / 1e9,
                     "warm_ms": warm["median_s"] * 1e3, "warm_gbs": gbytes / warm["median_s"] / 1e9,
                     "pinned": dst.is_pinned(), "evict_bytes": evict_bytes}
    if torch.cuda.is_available():
        dev = torch.empty(dst.shape, dtype=dst.dtype, device="cuda")
        def h2d(i):
            dev.copy_(dst, non_blocking=True)
            torch.cuda.synchronize()
        th = timeit(h2d, 10, 200, 0.2)
        rec["gather"]["h2d_ms"] = th["median_s"] * 1e3
        rec["gather"]["h2d_gbs"] = gbytes / th["median_s"] / 1e9
    log(f"  S={S} gather: {rec['gather']['gbs']:.1f} GB/s cold, {rec['gather']['warm_gbs']:.1f} GB/s warm "
        f"({gbytes / 2**20:.1f} MiB in {rec['gather']['ms']:.3f} ms)")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default docs/results/bench_selection_<host>.json)")
    ap.add_argument("--threads", type=int, default=0, help="0: all (OpenMP default)")
    ap.add_argument("--prefixes", default="8192,32768,131072")
    ap.add_argument("--layers", type=int, default=4, help="layer copies rotated between calls")
    ap.add_argument("--prefetch", default="0,1,2,1-l2,4-l2",
                    help="software prefetch settings to try: distance in 16-key tiles, -l2 for prefetcht1")
    ap.add_argument("--evict-mib", type=int, default=1024, help="buffer read between cold gathers")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--forms", default="auto",
                    help="dot-product forms for the 32-query runs, comma-separated: auto, amx, vdpbf16ps, fma, "
                         "amx_inexact (AMX where its bits differ from the contract: a speed probe)")
    args = ap.parse_args()
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if bad := [f for f in forms if f not in ("auto", "amx", "vdpbf16ps", "fma", "amx_inexact")]:
        ap.error(f"unknown --forms {bad}")
    if args.threads:
        torch.set_num_threads(args.threads)  # the torch baseline gets the same cores
    host = socket.gethostname()
    out = Path(args.out or f"docs/results/bench_selection_{host}.json")

    def log(msg: str) -> None:
        print(msg, flush=True)

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    info = {
        "host": host, "cpu": cpu, "cores": os.cpu_count(), "threads": args.threads or torch.get_num_threads(),
        "isa": cs.isa(), "cpu_features": cs.cpu_features(), "torch": torch.__version__,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    amx = cs.amx_status()
    info["amx"] = amx
    info["dot_forms"] = {"few_rows": form_used(1), "many_rows": form_used(16)}
    if cs.isa() != "avx512bf16":
        forms = ["auto"]
    elif "amx" in forms and not amx["active"]:
        forms = [f for f in forms if f != "amx"] or ["auto"]
        print(f"--forms: amx dropped (AMX not active: {amx['reason']})", flush=True)
    if "amx_inexact" in forms and not amx["os"]:
        forms = [f for f in forms if f != "amx_inexact"] or ["auto"]
        print(f"--forms: amx_inexact dropped (no AMX tiles: {amx['reason']})", flush=True)
    log(f"# {info['cpu']} ({info['cores']} cores), isa {info['isa']}, torch {info['torch']}")
    log(f"# scoring forms: {info['dot_forms']['few_rows']} for 1..15 rows, {info['dot_forms']['many_rows']} for "
        f"16+ rows; AMX {'active' if amx['active'] else 'off: ' + amx['reason']}; self-check: {amx['selfcheck']}")
    bw = read_bandwidth(args.threads, 0.5 if args.quick else 2.0)
    read_bw = max(bw["torch_sum_gbs"], bw["ext_read_probe_gbs"])
    log(f"read bandwidth: torch sum {bw['torch_sum_gbs']:.1f} GB/s, ext probe {bw['ext_read_probe_gbs']:.1f} GB/s; "
        f"copy (r+w) {bw['torch_copy_rw_gbs']:.1f} GB/s; probe by threads {bw['ext_read_probe_gbs_by_threads']}")
    rates = compute_rates(args.threads)
    log(f"compute: {rates}")
    prefixes = [int(x) for x in args.prefixes.split(",")]
    grid = [(int(x.split("-")[0]), x.endswith("-l2")) for x in args.prefetch.split(",")]
    results: list[dict] = []
    report = {"info": info, "read_bandwidth": bw, "read_bw_ref_gbs": read_bw, "compute": rates, "targets": {
        "scan_1q_fraction_of_read_bw": TARGET_SCAN, "speedup_32q_vs_torch": TARGET_SPEEDUP,
        "gather_fraction_of_read_bw": TARGET_GATHER}, "prefixes": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    chosen = None
    for S in sorted(prefixes, reverse=True):  # the longest first: it picks the prefetch distance
        try:
            rec = run_prefix(S, args.layers, args.threads, args.quick, grid, chosen, args.evict_mib << 20, log, forms)
            chosen = {False: tuple(rec["prefetch"]["select"]), True: tuple(rec["prefetch"]["select+out"])}
        except Exception as e:  # keep the other prefixes' figures
            rec = {"prefix": S, "error": repr(e)}
            log(f"  S={S} failed: {e!r}")
        results.append(rec)
        results.sort(key=lambda r: r["prefix"])
        out.write_text(json.dumps(report, indent=1))  # after every prefix: a cut-short run keeps its figures

    print(f"\nread bandwidth (reference) {read_bw:.1f} GB/s; targets: 1-query scans >= {TARGET_SCAN:.0%} of it, "
          f"32 queries >= {TARGET_SPEEDUP:.0f}x torch, gather >= {TARGET_GATHER:.0%} of it")
    print(f"scoring forms: {info['dot_forms']['few_rows']} (1..15 rows), {info['dot_forms']['many_rows']} (16+ rows); "
          f"AMX self-check: {amx['selfcheck']}")
    print(f"{'prefix':>7} {'B':>3} {'n_q':>3} {'mode':<10} {'form':<9} {'GB/s':>6} {'%read':>6} {'ms/layer/req':>12} "
          f"{'torch ms':>9} {'speedup':>7} target")
    for rec in results:
        if "error" in rec:
            print(f"{rec['prefix']:>7} error: {rec['error']}")
            continue
        for r in rec["runs"]:
            frac = r["gbs"] / read_bw
            ok = frac >= TARGET_SCAN if r["n_q"] == 1 else r["speedup_vs_torch"] >= TARGET_SPEEDUP
            print(f"{rec['prefix']:>7} {rec['requests']:>3} {r['n_q']:>3} {r['mode']:<10} {r['form']:<9} "
                  f"{r['gbs']:>6.1f} "
                  f"{frac:>6.0%} {r['ms_per_layer_per_request']:>12.3f} {r['torch_ms_per_layer']:>9.1f} "
                  f"{r['speedup_vs_torch']:>6.1f}x {'ok' if ok else 'MISS'}")
        gth = rec["gather"]
        frac = gth["gbs"] / read_bw
        h2d = f"; H2D {gth['h2d_gbs']:.1f} GB/s" if "h2d_gbs" in gth else ""
        print(f"{rec['prefix']:>7} {rec['requests']:>3}   - gather     {'':<9} {gth['gbs']:>6.1f} {frac:>6.0%} "
              f"{gth['ms']:>12.3f} (cold, batch; warm {gth['warm_gbs']:.0f} GB/s{h2d}) "
              f"{'ok' if frac >= TARGET_GATHER else 'MISS'}")
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
