"""Routed experts alone on the GPU: the Triton kernels (default tiles and a sweep) against the grouped-GEMM
path, as a share of the HBM bandwidth measured in the same run.

LLaDA2.0-mini's expert shape (256 experts, top 8, dim 2048, expert width 512), random bf16 weights and a
random router; tokens = batch x 32 (one block per row). Two routings: `uniform` (every token its own random
vector) and `blocks` (a row's 32 tokens share one vector plus 10 % noise, as a block of MASK tokens routes
alike: fewer experts, many pairs each). Bytes = the weights of the experts the routing
really touched (counted) + activations in and out; every time is a replayed CUDA graph (median).

    python tools/bench_moe.py --out docs/results/bench_moe_h200.json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--sweep", default="8,32", help="batches at which to sweep tiles, uniform routing ('' for none)")
    ap.add_argument("--sweep-split", default="", help="batches at which to sweep each kernel's tile alone, both routings")
    ap.add_argument("--out", default="docs/results/bench_moe.json")
    args = ap.parse_args()
    torch.manual_seed(0)  # weights, router and tokens: the same experts touched in every run
    ceil = ceilings()
    hbm = ceil["hbm_bytes_per_s"]
    moe = build()
    records = []
    for batch, routing in itertools.product(map(int, args.batches.split(",")), ("uniform", "blocks")):
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
    print(f"\n{'B':>4} {'routing':>8} {'tokens':>6} {'experts':>7} {'floor ms':>8} {'grouped ms':>10} {'triton ms':>9} "
          f"{'best ms':>8} {'triton/HBM':>10}")
    for r in records:
        print(f"{r['batch']:>4} {r['routing']:>8} {r['tokens']:>6} {r['touched_experts']:>7} {r['floor_ms']:8.3f} "
              f"{r['grouped_mm_ms']:10.3f} "
              f"{r['triton_ms']:9.3f} {r.get('sweep_best_ms', float('nan')):8.3f} {r['triton_hbm_share']:10.0%}")


if __name__ == "__main__":
    main()
