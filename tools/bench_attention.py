"""Benchmark the packed-attention kernels (CuPy/CUDA "ours" and Triton) against FlexAttention and SDPA (dense
mask) on one GPU.

Per config (heads, batch B, mean prefix with +-25% per-row variation, q_len, slot) it times them all
in the same run, measures the two ceilings (HBM copy bandwidth, bf16 8192^3 matmul rate) and reports
the ratio to FlexAttention and the fraction of the roofline
    max(visible K/V (+ q/out) bytes / HBM bandwidth, visible FLOPs / matmul rate).
The K/V live once per config in FlexAttention's layout [B, KVH, S + Lq, D] (prefix at [0, o_b), the
window at the tail [S, S + Lq)); the kernel reads the same memory through transposed views.
triton.testing.do_bench flushes L2 before every timed call, so small configs are not timed from cache.

    PYTHONPATH=. python tools/bench_attention.py --out bench.json [--sweep] [--quick] [--no-baselines]
"""
import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from compiledllm.attention.cupy_packed import TILES, default_tile, packed_attention_cuda
from compiledllm.attention.launch import PackedArgs
from compiledllm.attention.spec import BlockCausal
from compiledllm.attention.triton_packed import TRITON_TILES, default_triton_tile, packed_attention_triton_launch

HEADS = [(16, 4), (32, 8)]  # LLaDA2.0-mini, SDAR-8B
BATCHES = [1, 8, 32, 64]
PREFIXES = [1024, 4096, 16384, 32768]
QLENS = [32, 64]
D = 128
SWEEP_CASES = [(32, 4096, 32), (32, 32768, 32), (64, 4096, 32), (8, 32768, 32), (64, 16384, 64)]  # B, prefix, Lq
SDPA_BYTES_LIMIT = 24 << 30  # skip SDPA-dense where its math path would need more than this


def ceilings() -> dict:
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t_copy = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median") * 1e-3
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t_mm = do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median") * 1e-3
    return {"hbm_bytes_per_s": 2 * (1 << 31) * 2 / t_copy, "bf16_flops_per_s": 2 * 8192**3 / t_mm}


class Pool:
    """One big random K and V buffer; each config views its prefix (no per-config allocation)."""

    def __init__(self, numel: int) -> None:
        self.k = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()
        self.v = torch.empty(numel, dtype=torch.bfloat16, device="cuda").normal_()

    def view(self, B: int, KVH: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = B * KVH * N * D
        return self.k[:n].view(B, KVH, N, D), self.v[:n].view(B, KVH, N, D)


def make_case(pool: Pool, H: int, KVH: int, B: int, prefix: int, Lq: int, slot: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ob = (prefix * (0.75 + 0.5 * torch.rand(B, generator=g))).round().long()
    S = int(-(-int(ob.max()) // 128) * 128)
    N = S + Lq
    k_all, v_all = pool.view(B, KVH, N)
    q = torch.randn(B, H, Lq, D, dtype=torch.bfloat16, device="cuda")
    kt, vt = k_all.transpose(1, 2), v_all.transpose(1, 2)  # [B, N, KVH, D] views
    ob_dev = ob.to("cuda")
    vis_win = sum(min(Lq, (i // slot + 1) * slot) for i in range(Lq))
    vis_keys = int(ob.sum()) * Lq + B * vis_win
    return dict(
        H=H, KVH=KVH, B=B, prefix=prefix, Lq=Lq, slot=slot, S=S, N=N, ob=ob_dev, q=q, k_all=k_all, v_all=v_all,
        ours_args=PackedArgs(q.transpose(1, 2), kt[:, :S], vt[:, :S], ob_dev, kt[:, S:], vt[:, S:], BlockCausal(slot),
                             scale=D**-0.5),
        bytes=(int(ob.sum()) + B * Lq) * KVH * D * 2 * 2 + 2 * B * Lq * H * D * 2,
        flops=4 * D * H * vis_keys,
    )


def block_mask_for(c: dict):
    from torch.nn.attention.flex_attention import create_block_mask

    ob, S, slot = c["ob"], c["S"], c["slot"]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < ob[b]) | ((kv_idx >= S) & ((kv_idx - S) // slot <= q_idx // slot))

    return create_block_mask(mask_mod, c["B"], None, c["Lq"], c["N"], device="cuda")


def dense_mask(c: dict) -> torch.Tensor:
    kv = torch.arange(c["N"], device="cuda")
    qi = torch.arange(c["Lq"], device="cuda")
    S, slot = c["S"], c["slot"]
    win = (kv[None, :] >= S) & ((kv[None, :] - S) // slot <= (qi[:, None] // slot))
    return (kv[None, None, :] < c["ob"][:, None, None]) | win[None]  # [B, Lq, N]


class Flex:
    """torch.compile'd flex_attention; kernel options that compile for small q_len with GQA on torch 2.11."""

    OPTIONS = [{"BLOCK_M": 64, "BLOCK_N": 64}, None]

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 512
        self.fn = torch.compile(flex_attention, dynamic=True)
        self.working: dict = {}  # (H, KVH, Lq) -> index into OPTIONS that compiled

    def __call__(self, c: dict, bm):
        key = (c["H"], c["KVH"], c["Lq"])
        run = lambda opts: self.fn(c["q"], c["k_all"], c["v_all"], block_mask=bm, enable_gqa=True,  # noqa: E731
                                   kernel_options=opts)
        if key not in self.working:
            for i, opts in enumerate(self.OPTIONS):
                try:
                    run(opts)
                    torch.cuda.synchronize()
                    self.working[key] = i
                    break
                except Exception as e:  # noqa: BLE001 - record and try the next option set
                    print(f"flex {key} options {opts} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            else:
                self.working[key] = None
        i = self.working[key]
        return None if i is None else (lambda: run(self.OPTIONS[i]))


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3


def bench_graph(fn, label: str) -> float | None:
    """Median time of a CUDA-graph replay of fn (no host launch overhead), or None if capture fails."""
    try:
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - fall back to eager timing
        print(f"{label}: graph capture failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        torch.cuda.synchronize()
        return None
    t = bench(graph.replay)
    del graph
    return t


def run_config(c: dict, ceil: dict, flex: Flex, tile=None, with_baselines=True, triton_tile=None) -> dict:
    """Times are CUDA-graph replays (what the engine runs); *_eager_s adds the host launch path."""
    roof = max(c["bytes"] / ceil["hbm_bytes_per_s"], c["flops"] / ceil["bf16_flops_per_s"])
    scale = D**-0.5
    ours = lambda: packed_attention_cuda(c["ours_args"], False, tile=tile)  # noqa: E731
    out = ours()[0]
    r = {k: c[k] for k in ("H", "KVH", "B", "prefix", "Lq", "slot", "S", "bytes", "flops")}
    r.update(tile=[k for k, v in TILES.items() if v == (tile or default_tile(D, c["H"] // c["KVH"] * c["Lq"]))][0],
             roofline_s=roof, bound="memory" if c["bytes"] / ceil["hbm_bytes_per_s"] >= roof else "compute")
    r["ours_eager_s"] = bench(ours)
    r["ours_s"] = bench_graph(ours, "ours") or r["ours_eager_s"]
    r["frac_roofline"] = roof / r["ours_s"]
    r["frac_roofline_eager"] = roof / r["ours_eager_s"]
    rows = c["H"] // c["KVH"] * c["Lq"]
    tt = triton_tile or default_triton_tile(rows)
    tri = lambda: packed_attention_triton_launch(c["ours_args"], False, tile=tt)  # noqa: E731
    r["triton_tile"] = [k for k, v in TRITON_TILES.items() if v == tt][0]
    r["err_triton_vs_ours"] = ((tri()[0].float() - out.float()).norm() / out.float().norm()).item()
    r["triton_s"] = bench_graph(tri, "triton") or bench(tri)
    r["triton_frac_roofline"] = roof / r["triton_s"]
    r["triton_speedup_vs_ours"] = r["ours_s"] / r["triton_s"]
    if not with_baselines:
        return r
    bm = block_mask_for(c)
    f = flex(c, bm)
    if f is not None:
        ref = f().transpose(1, 2)
        r["err_vs_flex"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        r["flex_eager_s"] = bench(f)
        r["flex_s"] = bench_graph(f, "flex") or r["flex_eager_s"]
        r["speedup_vs_flex"] = r["flex_s"] / r["ours_s"]
        r["speedup_vs_flex_eager"] = r["flex_eager_s"] / r["ours_eager_s"]
    del bm
    G = c["H"] // c["KVH"]
    sdpa_bytes = c["B"] * c["H"] * c["Lq"] * c["N"] * 4 * 3 + 2 * G * c["B"] * c["KVH"] * c["N"] * D * 2
    if sdpa_bytes <= SDPA_BYTES_LIMIT:
        mask = dense_mask(c)[:, None]
        s = lambda: F.scaled_dot_product_attention(c["q"], c["k_all"], c["v_all"], attn_mask=mask,  # noqa: E731
                                                   scale=scale, enable_gqa=True)
        r["sdpa_s"] = bench_graph(s, "sdpa") or bench(s)
        del mask
    else:
        r["sdpa_skipped"] = f"dense path would need ~{sdpa_bytes / 2**30:.0f} GiB"
    return r


def grid(quick: bool, batches=BATCHES, prefixes=PREFIXES, qlens=QLENS, w2=True):
    for H, KVH in HEADS:
        for B in batches[:2] if quick else batches:
            for prefix in prefixes[:2] if quick else prefixes:
                for Lq in qlens:
                    yield H, KVH, B, prefix, Lq, Lq  # W = 1: slot = q_len
    if w2:
        for B, prefix in [(8, 4096), (32, 16384)]:  # a few W = 2 points (FlowBlock's default)
            yield 16, 4, B, prefix, 64, 32


def summarize(rows: list[dict]) -> dict:
    sp = [r["speedup_vs_flex"] for r in rows if "speedup_vs_flex" in r]
    sp_e = [r["speedup_vs_flex_eager"] for r in rows if "speedup_vs_flex_eager" in r]
    big = [r for r in rows if r["B"] >= 8 and r["prefix"] >= 4096]
    fr = [r["frac_roofline"] for r in big]
    return {
        "median_speedup_vs_flex": statistics.median(sp) if sp else None,
        "min_speedup_vs_flex": min(sp) if sp else None,
        "median_speedup_vs_flex_eager": statistics.median(sp_e) if sp_e else None,
        "median_frac_roofline": statistics.median(r["frac_roofline"] for r in rows),
        "big_min_frac_roofline": min(fr) if fr else None,
        "big_median_frac_roofline": statistics.median(fr) if fr else None,
        "big_configs_at_40pct": f"{sum(f >= 0.4 for f in fr)}/{len(fr)}",
        "big_memory_bound_at_40pct": f"{sum(r['frac_roofline'] >= 0.4 for r in big if r['bound'] == 'memory')}/"
                                     f"{sum(r['bound'] == 'memory' for r in big)}",
        "max_err_vs_flex": max((r["err_vs_flex"] for r in rows if "err_vs_flex" in r), default=None),
        "triton_median_frac_roofline": statistics.median(r["triton_frac_roofline"] for r in rows),
        "triton_big_median_frac_roofline": statistics.median(r["triton_frac_roofline"] for r in big) if big else None,
        "triton_median_speedup_vs_ours": statistics.median(r["triton_speedup_vs_ours"] for r in rows),
        "triton_max_err_vs_ours": max(r["err_triton_vs_ours"] for r in rows),
    }


def print_table(rows: list[dict]) -> None:
    print(f"\n{'H/KVH':6s} {'B':>3s} {'pref':>6s} {'Lq':>3s} {'bl':>3s} {'ours us':>8s} {'eager':>8s} {'flex us':>8s} "
          f"{'sdpa us':>8s} {'xFlex':>6s} {'roof%':>6s} {'bound':>5s} {'triton':>8s} {'roof%':>6s}")
    for r in rows:
        fmt = lambda k: f"{r[k] * 1e6:8.1f}" if k in r else f"{'-':>8s}"  # noqa: E731
        sp = f"{r['speedup_vs_flex']:6.2f}" if "speedup_vs_flex" in r else f"{'-':>6s}"
        print(f"{r['H']:>2d}/{r['KVH']:<3d} {r['B']:3d} {r['prefix']:6d} {r['Lq']:3d} {r['slot']:3d} "
              f"{fmt('ours_s')} {fmt('ours_eager_s')} {fmt('flex_s')} {fmt('sdpa_s')} {sp} "
              f"{100 * r['frac_roofline']:6.1f} {r['bound'][:3]:>5s} {fmt('triton_s')} "
              f"{100 * r['triton_frac_roofline']:6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="a quarter of the grid")
    ap.add_argument("--sweep", action="store_true", help="also time every Triton tile on a sub-grid (CUDA default tile beside)")
    ap.add_argument("--tile", choices=list(TILES), help="force one tile instead of the default choice")
    ap.add_argument("--triton-tile", choices=list(TRITON_TILES), help="force one Triton tile")
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    ap.add_argument("--batches", type=ints, help="override the grid's batch sizes, e.g. 8,32,64")
    ap.add_argument("--prefixes", type=ints, help="override the grid's mean prefixes, e.g. 4096,32768")
    ap.add_argument("--qlens", type=ints, help="override the grid's q_len values (W = 2 points dropped)")
    ap.add_argument("--no-baselines", action="store_true", help="skip FlexAttention and SDPA (kernels only)")
    ap.add_argument("--budget-s", type=float, default=230.0, help="start no new config after this many seconds")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.cuda.get_device_properties(0)
    ceil = ceilings()
    print(f"{dev.name}: HBM copy {ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    max_n = int(max(PREFIXES) * 1.25) + 256
    pool = Pool(max(BATCHES) * max(kvh for _, kvh in HEADS) * max_n * D)
    flex = Flex()
    tile = TILES[args.tile] if args.tile else None
    result = {
        "device": dev.name, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv), "ceilings": ceil, "summary": {}, "configs": [], "tile_sweep": [],
        "skipped_for_time": [],
    }
    rows, sweep = result["configs"], result["tile_sweep"]

    def save() -> None:
        result["summary"] = summarize(rows) if rows else {}
        result["seconds"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.sweep:
        for H, KVH in HEADS:
            for B, prefix, Lq in SWEEP_CASES:
                c = make_case(pool, H, KVH, B, prefix, Lq, Lq, seed=B * prefix + Lq)
                for name, t in TRITON_TILES.items():  # each Triton tile, with the default CUDA tile beside it
                    try:
                        sweep.append(run_config(c, ceil, flex, with_baselines=False, triton_tile=t))  # graph replays
                    except Exception as e:  # noqa: BLE001 - a tile this Triton cannot compile is reported, not fatal
                        print(f"tile {name} H{H} B{B} prefix {prefix}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        result["skipped_for_time"].append(f"tile {name} failed: {type(e).__name__}")
        print("Triton tile sweep (fraction of roofline; CUDA default tile in the same configs):", flush=True)
        for name in TRITON_TILES:
            sel = [r for r in sweep if r["triton_tile"] == name]
            if not sel:
                continue
            fr = [r["triton_frac_roofline"] for r in sel]
            print(f"  {name:9s} median {statistics.median(fr):.3f}  min {min(fr):.3f}  max {max(fr):.3f}  "
                  f"(cuda {statistics.median(r['frac_roofline'] for r in sel):.3f})", flush=True)
        save()
    custom = args.batches or args.prefixes or args.qlens
    for H, KVH, B, prefix, Lq, slot in grid(args.quick, args.batches or BATCHES, args.prefixes or PREFIXES,
                                           args.qlens or QLENS, w2=not custom):
        if time.time() - t0 > args.budget_s:
            result["skipped_for_time"].append([H, KVH, B, prefix, Lq, slot])
            continue
        c = make_case(pool, H, KVH, B, prefix, Lq, slot, seed=B * prefix + Lq + slot)
        t1 = time.time()
        try:
            rows.append(run_config(c, ceil, flex, tile=tile, with_baselines=not args.no_baselines,
                                   triton_tile=TRITON_TILES[args.triton_tile] if args.triton_tile else None))
            r = rows[-1]
            print(f"H{H} B{B} P{prefix} L{Lq} bl{slot}: ours {r['ours_s'] * 1e6:.1f} us, "
                  f"x{r.get('speedup_vs_flex', float('nan')):.2f} vs flex, {100 * r['frac_roofline']:.1f}% roof; "
                  f"triton {r['triton_s'] * 1e6:.1f} us {100 * r['triton_frac_roofline']:.1f}% roof "
                  f"({time.time() - t1:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - keep the rest of the grid
            print(f"config H{H} B{B} P{prefix} L{Lq} failed: {type(e).__name__}: {e}", flush=True)
        del c
        save()
    save()
    print_table(rows)
    ceil_s = f"HBM {ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
    print(f"\nceilings: {ceil_s}; skipped for time: {len(result['skipped_for_time'])}")
    print("summary:", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in result["summary"].items()}))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
