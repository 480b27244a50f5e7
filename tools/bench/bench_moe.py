"""Routed experts alone on the GPU: the Triton kernels (default tiles and a sweep) against the grouped-GEMM
path, as a share of the HBM bandwidth (decode sizes) or of the bf16 matmul rate (prefill sizes) measured in the
same run.

LLaDA2.0-mini's expert shape (256 experts, top 8, dim 2048, expert width 512), random bf16 weights and a
random router; tokens = batch x 32 (one block per row). Two routings: `uniform` (every token its own random
vector) and `blocks` (a row's 32 tokens share one vector plus 10 % noise, as a block of MASK tokens routes
alike: fewer experts, many pairs each). Bytes = the weights of the experts the routing
really touched (counted) + activations in and out; every time is a replayed CUDA graph (median).

Prefill sizes (--prefill-tokens, uniform routing: a prompt's tokens are distinct): each backend ("triton",
"grouped_mm", "auto" as moe_triton's constants set it) against the dense bf16 GEMMs of the same shapes and FLOPs
([T*k, D] x [D, 2F] then [T*k, F] x [F, D], one expert's weights, no routing), timed in the same run: "% dense"
is the share of that rate, "% peak" the share of the 8192^3 matmul ceiling. --prefill-sweep times candidate
prefill tiles for each kernel (the other at its default), then the best pair, and prints the values for
moe_triton.PREFILL_TILE_SPECS / PREFILL_PAIRS_PER_EXPERT / GROUPED_MM_FROM_PAIRS_PER_EXPERT that the table
supports ("prefill_decision" in the JSON).

    python tools/bench/bench_moe.py --out docs/results/bench_moe_h200.json
    python tools/bench/bench_moe.py --batches "" --prefill-tokens 2048,8192,9792,16384,32768 --prefill-sweep --out x.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from gpu_timing import ceilings, graph_ms
from compiledllm.models import moe_triton
from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE

E, K, D, F = 256, 8, 2048, 512


def build() -> MoE:
    cfg = MoEConfig(num_experts=E, expert_dim=F, top_k=K, num_shared=0, n_group=8, topk_group=4,
                    routed_scaling=2.5, norm_topk_prob=True)
    moe = MoE(D, cfg).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in (moe.gate, moe.w_gate_up, moe.w_down):
            p.normal_(std=D ** -0.5)
    return moe


def sweep_tiles() -> list[tuple[moe_triton.MoETile, moe_triton.MoETile]]:
    """The same tile for both kernels: rows 16/32/64/128, N 64/128, K 64/128, 3 or 4 stages, 4 warps."""
    grid = itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (3, 4))
    return [(t, t) for t in (moe_triton.MoETile(bm, bn, bk, 4, st) for bm, bn, bk, st in grid)]


def split_tiles() -> list[moe_triton.MoETile]:
    """Candidates for one kernel while the other keeps its default: rows 32-128, N 64-256, K 64/128, warps x stages
    (128-row tiles for the large batches, where experts see 100+ pairs and the MMA rate starts to matter)."""
    grid = itertools.product((32, 64, 128), (64, 128, 256), (64, 128), ((4, 3), (8, 3)))
    return [moe_triton.MoETile(bm, bn, bk, w, st) for bm, bn, bk, (w, st) in grid]


def sweep_split(moe, x, ids, w) -> dict:
    """Each kernel's best tile with the other kernel at its default (the op timed whole, as a graph)."""
    T = x.shape[0]
    defaults = moe_triton.default_tiles(T * K, E, D, F)
    out = {"default_ms": graph_ms(lambda: moe_triton.launch(x, moe.w_gate_up, moe.w_down, ids, w, defaults))}
    for which in (0, 1):
        best = None
        for t in split_tiles():
            tiles = (t, defaults[1]) if which == 0 else (defaults[0], t)
            try:
                ms = graph_ms(lambda: moe_triton.launch(x, moe.w_gate_up, moe.w_down, ids, w, tiles))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a large tile
                print(f"  {['gate_up', 'down'][which]} tile {t}: {type(e).__name__}", flush=True)
                continue
            if best is None or ms < best[0]:
                best = (ms, t)
        name = ["gate_up", "down"][which]
        out[f"{name}_best_ms"], out[f"{name}_best_tile"] = best[0], best[1].__dict__
        print(f"  {name}: default {out['default_ms']:.3f} ms, best {best[0]:.3f} ms with {best[1]}", flush=True)
    return out


# (BM, BN cap, BK cap, warps, stages) candidates at prefill sizes: the current large-batch tiles first, then
# 128-row tiles (twice the FLOPs per byte of streamed weight) and deeper pipelines
PREFILL_CANDIDATES = {
    "gate_up": [(64, 256, 64, 8, 3), (64, 256, 64, 8, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3),
                (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 128, 32, 8, 5), (64, 128, 128, 4, 3)],
    "down": [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3),
             (256, 128, 64, 8, 3), (64, 256, 64, 8, 4), (128, 256, 32, 8, 5), (128, 128, 128, 8, 3)],
}
GAIN_TO_SWITCH = 0.02  # a prefill tile (or grouped_mm) must beat the default by this share to be suggested


def spec_tile(spec: tuple[int, int, int, int, int], n_dim: int, k_dim: int) -> moe_triton.MoETile:
    bm, bn, bk, w, st = spec
    return moe_triton.MoETile(bm, moe_triton._block(n_dim, bn), moe_triton._block(k_dim, bk), w, st)


def try_ms(fn) -> float | None:
    try:
        return graph_ms(fn)
    except Exception as e:  # noqa: BLE001 - e.g. OutOfResources (shared memory) for a large tile
        print(f"    {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


def prefill_sweep(moe, x, ids, w) -> dict:
    """Each kernel's candidates with the other at its default tile, then the best of both together."""
    T = x.shape[0]
    defaults = moe_triton.default_tiles(T * K, E, D, F)
    run = lambda tiles: lambda: moe_triton.launch(x, moe.w_gate_up, moe.w_down, ids, w, tiles)  # noqa: E731
    out = {"default_ms": graph_ms(run(defaults)), "candidates": []}
    best = {}
    for which, (n_dim, k_dim) in (("gate_up", (F, D)), ("down", (D, F))):
        for spec in PREFILL_CANDIDATES[which]:
            t = spec_tile(spec, n_dim, k_dim)
            tiles = (t, defaults[1]) if which == "gate_up" else (defaults[0], t)
            ms = try_ms(run(tiles))
            out["candidates"].append({"kernel": which, "spec": list(spec), "ms": ms})
            if ms is not None and (which not in best or ms < best[which][0]):
                best[which] = (ms, spec, t)
    if len(best) == 2:
        out["best_gate_up"], out["best_down"] = list(best["gate_up"][1]), list(best["down"][1])
        out["best_pair_ms"] = graph_ms(run((best["gate_up"][2], best["down"][2])))
    return out


def dense_ms(moe, T: int) -> float:
    """The routed experts' GEMMs as dense bf16 GEMMs (same shapes and FLOPs, one expert's weights)."""
    a = torch.randn(T * K, D, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(T * K, F, device="cuda", dtype=torch.bfloat16)
    wgu, wd = moe.w_gate_up[0], moe.w_down[0]
    return graph_ms(lambda: (a @ wgu.t(), act @ wd.t()))


def prefill_records(moe, tokens: list[int], ceil: dict, sweep: bool, records: list[dict], save) -> None:
    """Appends one record per token count to `records`, calling save() after each (a timeout keeps the rest)."""
    peak = ceil["bf16_flops_per_s"]
    for T in tokens:
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            ids, w = moe.route(x)
        pairs = T * K
        flops = 6 * pairs * D * F  # gate_up 2 * pairs * D * 2F, down 2 * pairs * F * D
        rec = {"tokens": T, "pairs_per_expert": pairs / E, "touched_experts": int(torch.unique(ids).numel()),
               "max_pairs_per_expert": int(torch.bincount(ids.flatten(), minlength=E).max()), "flops": flops,
               "auto_picks": "triton" if moe_triton.auto_uses_triton(pairs, E) else "grouped_mm",
               "default_tiles": [t.__dict__ for t in moe_triton.default_tiles(pairs, E, D, F)]}
        rec["dense_ms"] = dense_ms(moe, T)
        with torch.no_grad():
            for backend in ("triton", "grouped_mm", "auto"):
                rec[f"{backend}_ms"] = graph_ms(lambda: moe._routed(x, ids, w, backend))
            rec["route_triton_ms"] = graph_ms(lambda: moe.route(x, "auto"))
            rec["route_torch_ms"] = graph_ms(lambda: moe.route(x, "grouped_mm"))
            if sweep:
                rec["sweep"] = prefill_sweep(moe, x, ids, w)
                if "best_pair_ms" in rec["sweep"]:
                    rec["best_tiles_ms"] = rec["sweep"]["best_pair_ms"]
        for key in ("dense", "triton", "grouped_mm", "auto", "best_tiles"):
            if f"{key}_ms" in rec:
                rec[f"{key}_tflops"] = flops / (rec[f"{key}_ms"] / 1e3) / 1e12
                rec[f"{key}_pct_of_peak"] = rec[f"{key}_tflops"] * 1e12 / peak
                rec[f"{key}_pct_of_dense"] = rec["dense_ms"] / rec[f"{key}_ms"]
        records.append(rec)
        save()
        print(json.dumps({k: v for k, v in rec.items() if k != "sweep"}), flush=True)


def prefill_decision(records: list[dict]) -> dict:
    """What the table supports for moe_triton's constants (the lead sets them; nothing is changed here)."""
    d: dict = {"current": {"PREFILL_PAIRS_PER_EXPERT": moe_triton.PREFILL_PAIRS_PER_EXPERT,
                           "PREFILL_TILE_SPECS": [list(t) for t in moe_triton.PREFILL_TILE_SPECS],
                           "GROUPED_MM_FROM_PAIRS_PER_EXPERT": moe_triton.GROUPED_MM_FROM_PAIRS_PER_EXPERT}}
    faster = [r for r in records if r["grouped_mm_ms"] < (1 - GAIN_TO_SWITCH) * r["triton_ms"]]
    # the smallest size from which grouped_mm is faster at every measured size
    from_ppe = None
    for r in sorted(records, key=lambda r: r["tokens"]):
        if r in faster:
            from_ppe = from_ppe or int(r["pairs_per_expert"])
        else:
            from_ppe = None
    d["GROUPED_MM_FROM_PAIRS_PER_EXPERT"] = from_ppe
    swept = [r for r in records if "best_tiles_ms" in r]
    gains = [r for r in swept if r["best_tiles_ms"] < (1 - GAIN_TO_SWITCH) * r["sweep"]["default_ms"]]
    if gains:
        big = max(gains, key=lambda r: r["tokens"])
        d["PREFILL_TILE_SPECS"] = [big["sweep"]["best_gate_up"], big["sweep"]["best_down"]]
        d["PREFILL_PAIRS_PER_EXPERT"] = int(min(r["pairs_per_expert"] for r in gains))
        d["note"] = ("tiles: the best pair at the largest size where it beats the default by >= "
                     f"{GAIN_TO_SWITCH:.0%}; threshold: the smallest such size (check the sizes between)")
    elif swept:
        d["PREFILL_TILE_SPECS"] = "keep: no candidate pair beat the defaults by >= " + f"{GAIN_TO_SWITCH:.0%}"
    return d


def print_prefill(records: list[dict], decision: dict) -> None:
    print(f"\n{'tokens':>6} {'pairs/exp':>9} {'dense ms':>8} {'dense TF':>8} {'triton ms':>9} {'%dense':>6} "
          f"{'%peak':>6} {'grouped ms':>10} {'%dense':>6} {'%peak':>6} {'auto':>10} {'best ms':>8} {'%dense':>6} "
          f"{'route tri/torch ms':>18}")
    for r in records:
        pct = lambda k: f"{r[k]:6.0%}" if k in r else f"{'-':>6}"  # noqa: E731
        best = f"{r['best_tiles_ms']:8.3f}" if "best_tiles_ms" in r else f"{'-':>8}"
        print(f"{r['tokens']:>6} {r['pairs_per_expert']:9.0f} {r['dense_ms']:8.3f} {r['dense_tflops']:8.0f} "
              f"{r['triton_ms']:9.3f} {pct('triton_pct_of_dense')} {pct('triton_pct_of_peak')} "
              f"{r['grouped_mm_ms']:10.3f} {pct('grouped_mm_pct_of_dense')} {pct('grouped_mm_pct_of_peak')} "
              f"{r['auto_picks']:>10} {best} {pct('best_tiles_pct_of_dense')} "
              f"{r['route_triton_ms']:8.3f}/{r['route_torch_ms']:.3f}")
    for r in records:
        sw = r.get("sweep")
        if sw and "best_gate_up" in sw:
            print(f"  T={r['tokens']}: default tiles {sw['default_ms']:.3f} ms; best gate_up {sw['best_gate_up']}, "
                  f"down {sw['best_down']}: {sw['best_pair_ms']:.3f} ms")
    print("prefill decision (moe_triton constants; target: >= 60 % of the matmul rate):", json.dumps(decision))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--sweep", default="8,32", help="batches at which to sweep tiles, uniform routing ('' for none)")
    ap.add_argument("--sweep-split", default="", help="batches at which to sweep each kernel's tile alone, both routings")
    ap.add_argument("--prefill-tokens", default="", help="prefill token counts, e.g. 2048,8192,16384,32768")
    ap.add_argument("--prefill-sweep", action="store_true", help="sweep prefill tile candidates at those sizes")
    ap.add_argument("--out", default="docs/results/bench_moe.json")
    args = ap.parse_args()
    torch.manual_seed(0)  # weights, router and tokens: the same experts touched in every run
    ceil = ceilings()
    hbm = ceil["hbm_bytes_per_s"]
    moe = build()
    records = []
    batches = [int(b) for b in args.batches.split(",") if b]
    for batch, routing in itertools.product(batches, ("uniform", "blocks")):
        T = batch * 32
        if routing == "uniform":
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        else:
            x = (torch.randn(batch, 1, D, device="cuda") + 0.1 * torch.randn(batch, 32, D, device="cuda"))
            x = x.reshape(T, D).to(torch.bfloat16)
        with torch.no_grad():
            ids, w = moe.route(x)
        touched = int(torch.unique(ids).numel())
        # touched experts + x in + the (T, k, D) partial outputs out; as before the sum moved into the op, its
        # re-read of those and the (T, D) result are not counted (records stay comparable)
        nbytes = touched * 3 * D * F * 2 + T * D * 2 * (1 + K)
        rec = {"batch": batch, "routing": routing, "tokens": T, "touched_experts": touched, "bytes": nbytes,
               "floor_ms": nbytes / hbm * 1e3,
               "max_pairs_per_expert": int(torch.bincount(ids.flatten(), minlength=E).max())}

        def routed(backend):
            return lambda: moe._routed(x, ids, w, backend)

        with torch.no_grad():
            rec["grouped_mm_ms"] = graph_ms(routed("grouped_mm"))
            rec["triton_ms"] = graph_ms(routed("triton"))
            if str(batch) in args.sweep.split(",") and routing == "uniform":
                best = None
                for tiles in sweep_tiles():
                    try:
                        ms = graph_ms(lambda: moe_triton.launch(x, moe.w_gate_up, moe.w_down, ids, w, tiles))
                    except Exception as e:  # e.g. out of shared memory for a large tile
                        print(f"  tile {tiles[0]}: {type(e).__name__}", flush=True)
                        continue
                    if best is None or ms < best[0]:
                        best = (ms, tiles[0])
                rec["sweep_best_ms"] = best[0]
                rec["sweep_best_tile"] = best[1].__dict__
            if str(batch) in args.sweep_split.split(","):
                rec["split_sweep"] = sweep_split(moe, x, ids, w)
        for key in ("grouped_mm", "triton", "sweep_best"):
            if f"{key}_ms" in rec:
                rec[f"{key}_hbm_share"] = rec["floor_ms"] / rec[f"{key}_ms"]
        records.append(rec)
        print(json.dumps(rec), flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil,
           "shape": {"experts": E, "top_k": K, "dim": D, "expert_dim": F}, "records": records,
           "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    tokens = [int(t) for t in args.prefill_tokens.split(",") if t]
    if tokens:
        out["prefill"] = []

        def save() -> None:
            out["prefill_decision"] = prefill_decision(out["prefill"])
            with open(args.out, "w") as f:
                json.dump(out, f, indent=2)

        prefill_records(moe, tokens, ceil, args.prefill_sweep, out["prefill"], save)
    if not records:
        if tokens:
            print_prefill(out["prefill"], out["prefill_decision"])
        return
    print(f"\n{'B':>4} {'routing':>8} {'tokens':>6} {'experts':>7} {'floor ms':>8} {'grouped ms':>10} {'triton ms':>9} "
          f"{'best ms':>8} {'triton/HBM':>10}")
    for r in records:
        print(f"{r['batch']:>4} {r['routing']:>8} {r['tokens']:>6} {r['touched_experts']:>7} {r['floor_ms']:8.3f} "
              f"{r['grouped_mm_ms']:10.3f} "
              f"{r['triton_ms']:9.3f} {r.get('sweep_best_ms', float('nan')):8.3f} {r['triton_hbm_share']:10.0%}")
    if tokens:
        print_prefill(out["prefill"], out["prefill_decision"])


if __name__ == "__main__":
    main()
