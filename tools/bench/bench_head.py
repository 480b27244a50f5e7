"""The output head on the GPU: the row-selective Triton head (models/head.py) against cuBLAS over every row, in
the same run, with the bf16 matmul rate measured in the same run as the ceiling.

LLaDA2.0-mini's head (dim 2048, vocabulary 157184), tokens = batch x 32. A decode step under `threshold` wants
the still-masked rows: all at a block's first step, about half on average over a block. Times are replayed
CUDA graphs (median); TFLOP/s counts only the wanted rows.

    python tools/bench/bench_head.py --out docs/results/bench_head_h200.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from gpu_timing import ceilings, graph_ms
from compiledllm.models import head

D, V = 2048, 157184


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--fractions", default="1.0,0.5,0.25")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tiles at every point")
    ap.add_argument("--out", default="docs/results/bench_head.json")
    args = ap.parse_args()
    ceil = ceilings()
    w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * D ** -0.5
    tiles = {"default": None}
    if args.sweep:
        for bm, bn, bk, warps, stages in [(64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 64, 4, 4),
                                          (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4)]:
            tiles[f"{bm}x{bn}x{bk}/w{warps}s{stages}"] = head.HeadTile(bm, bn, bk, warps, stages)
    records = []
    for batch in map(int, args.batches.split(",")):
        T = batch * 32
        h = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        rec = {"batch": batch, "rows": T, "cublas_all_rows_ms": graph_ms(lambda: h @ w.t())}
        for frac in map(float, args.fractions.split(",")):
            rows = torch.arange(T, device="cuda") % round(1 / frac) == 0 if frac < 1 else torch.ones(T, dtype=torch.bool,
                                                                                                      device="cuda")
            n = int(rows.sum())
            for name, tile in tiles.items():
                ms = graph_ms(lambda: head.launch(h, w, rows, tile))
                rec[f"triton_{frac}_{name}_ms"] = ms
            ms = rec[f"triton_{frac}_default_ms"]
            rec[f"triton_{frac}_rows"] = n
            rec[f"triton_{frac}_share_of_matmul_rate"] = 2 * n * D * V / (ms / 1e3) / ceil["bf16_flops_per_s"]
            rec[f"triton_{frac}_vs_cublas_all_rows"] = rec["cublas_all_rows_ms"] / ms
        records.append(rec)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil, "dim": D,
                   "vocab": V, "records": records, "date": time.strftime("%Y-%m-%d")}, f, indent=2)
    print(f"\n{'batch':>5} {'rows':>5} {'cuBLAS all':>10} " + " ".join(f"{'tri ' + f:>10}" for f in args.fractions.split(",")))
    for r in records:
        print(f"{r['batch']:>5} {r['rows']:>5} {r['cublas_all_rows_ms']:10.3f} " + " ".join(
            f"{r[f'triton_{float(f)}_default_ms']:10.3f}" for f in args.fractions.split(",")))


if __name__ == "__main__":
    main()
