"""Flash-Cache's fused projection + RoPE + cache write (models/qkv_kernel.py) against the separate path (F.linear,
Rotary.apply on q and k, PoolView.write), one attention layer of the LLaDA-8B shape (hidden 4096, 32 heads of 128,
bf16), same run: CUDA-graph replay time of each, the HBM bytes each must move at least, and the ceilings.

Token counts: flash_dllm's decode query set (block 32 + ahead 64 + track 64 = 160 per row) at batch 1, 8 and 32, and
the refresh of a 1,024-token working sequence at batch 1 and 8.

    python tools/bench/bench_qkv_cache.py [--shapes 1x160,8x160,32x160,1x1024,8x1024] [--out bench_qkv_cache.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gpu_timing import ceilings, graph_ms  # noqa: E402

from compiledllm.kv.pooled import PoolView, pool_index  # noqa: E402
from compiledllm.models.layers import Rotary  # noqa: E402
from compiledllm.models.qkv_kernel import qkv_rope_write_op  # noqa: E402

HIDDEN, H, KVH, D = 4096, 32, 32, 128


def bytes_moved(T: int, fused: bool) -> int:
    """HBM bytes at least (bf16): x and W read; fused: q, k, v out and k, v into the pool. Separate: the projection
    writes qkv, RoPE reads q, k and writes them back (float32 math in registers at best), the write reads k, v."""
    n, e = (H + 2 * KVH) * D, 2
    base = T * HIDDEN * e + n * HIDDEN * e + T * n * e + 2 * T * KVH * D * e
    return base if fused else base + T * n * e + 2 * T * (H + KVH) * D * e + 2 * T * KVH * D * e


def point(B: int, L: int) -> dict:
    """B rows of L query tokens each."""
    T = B * L
    g = torch.Generator(device="cuda").manual_seed(T)
    cap = L + 64
    x = torch.randn(B, L, HIDDEN, device="cuda", generator=g).bfloat16()
    w = (torch.randn((H + 2 * KVH) * D, HIDDEN, device="cuda", generator=g) * HIDDEN ** -0.5).bfloat16()
    rotary = Rotary(D, 500000.0).cuda()
    pos = torch.arange(L, device="cuda").expand(B, L)
    cos, sin = rotary.cos_sin(pos)
    pool = lambda: torch.zeros(B * (cap + 1), KVH, D, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    view = PoolView(pool(), pool(), cap)
    rows_ = pool_index(pos, cap)

    def separate():
        q, k, v = F.linear(x, w).view(B, L, H + 2 * KVH, D).split([H, KVH, KVH], dim=2)
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        view.write(pos, k, v)
        return q

    def fused():
        return qkv_rope_write_op(x, w, cos, sin, H, KVH, rows_, view.k, view.v)[0]

    ms = {name: graph_ms(fn) for name, fn in (("separate", separate), ("fused", fused))}
    return {"tokens": T, "rows": B, "separate_ms": ms["separate"], "fused_ms": ms["fused"],
            "speedup": ms["separate"] / ms["fused"], "separate_bytes": bytes_moved(T, False),
            "fused_bytes": bytes_moved(T, True), "bytes_ratio": bytes_moved(T, False) / bytes_moved(T, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x160,8x160,32x160,1x1024,8x1024", help="rows x query tokens per row")
    ap.add_argument("--out", default="bench_qkv_cache.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_qkv_cache: needs a CUDA device")
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "shape": {"hidden": HIDDEN, "heads": H, "kv_heads": KVH, "head_dim": D, "dtype": "bfloat16"},
           "ceilings": ceilings(), "points": []}
    hbm = rec["ceilings"]["hbm_bytes_per_s"]
    print(f"{'rows x L':>9} {'separate ms':>12} {'fused ms':>9} {'x':>5} {'bytes sep/fused MB':>19} "
          f"{'HBM floor ms':>13}")
    for shape in args.shapes.split(","):
        B, L = (int(n) for n in shape.split("x"))
        p = point(B, L)
        rec["points"].append(p)
        print(f"{shape:>9} {p['separate_ms']:>12.3f} {p['fused_ms']:>9.3f} {p['speedup']:>5.2f} "
              f"{p['separate_bytes'] / 1e6:>9.1f} / {p['fused_bytes'] / 1e6:>7.1f} "
              f"{p['fused_bytes'] / hbm * 1e3:>13.3f}")
    Path(args.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
