"""The CUDA kernels of one decode step, by total time: eager vs torch.compile, on a real-size random model.

Where `compiledllm profile` attributes time to the model's phases (eager only), this lists kernels, so that
what torch.compile generated can be compared with the eager step kernel by kernel.

    python tools/bench/kernel_table.py --preset llada2.0-mini --context 4096 --batch 32 --out kernels.json
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from bench_decode import BLOCK, STEPS, cycle_ms, synthetic_state
from compiledllm.engine.stepper import Stepper
from compiledllm.loader import build_random
from compiledllm.profiler import top_ops
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy


def kernel_table(stepper: Stepper, batch: int, steps: int) -> list[dict]:
    for _ in range(3):
        stepper.run(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            stepper.run(batch)
        torch.cuda.synchronize()
    return [{"kernel": r["name"], "calls_per_step": r["calls"] / steps, "ms_per_step": r["total_ms"] / steps}
            for r in top_ops(prof, cuda=True, limit=None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llada2.0-mini")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--modes", default="eager,compiled",
                    help="eager, compiled, graphs, compiled+graphs (kernels inside a replayed graph are listed too)")
    ap.add_argument("--steps", type=int, default=STEPS, help="steps profiled (default: one block's, every phase once)")
    ap.add_argument("--block", type=int, default=BLOCK, help="block size (the SDAR-4B workload: 4)")
    ap.add_argument("--block-steps", type=int, default=STEPS, help="policy steps a block (tau 1.0: exactly these)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="kernels.json")
    args = ap.parse_args()
    model = build_random(args.preset, device="cuda", dtype=torch.bfloat16)
    policy = ThresholdPolicy(ThresholdConfig(block_size=args.block, threshold=1.0, steps=args.block_steps),
                             model.mask_token_id)  # commit separate: run(batch) runs its one phase every step
    result = {}
    with torch.no_grad():
        for mode in args.modes.split(","):
            torch.manual_seed(args.context * 1009 + args.batch)  # the state bench_decode measures at this point
            st, kv = synthetic_state(model, policy, args.batch, args.context)
            stepper = Stepper(model, policy, st, kv, [args.batch], compile=mode.startswith("compiled"),
                              cuda_graphs=mode.endswith("graphs"))
            rows = kernel_table(stepper, args.batch, args.steps)
            total = sum(r["ms_per_step"] for r in rows)
            # the step's wall time beside its kernels' sum: the difference is the GPU idle between kernels
            step = cycle_ms(lambda: stepper.run(args.batch))
            result[mode] = {"kernel_ms_per_step": total, "step_ms": step, "kernels": rows}
            print(f"\n{mode}: {total:.2f} ms of kernels per step in {step:.2f} ms, "
                  f"{sum(r['calls_per_step'] for r in rows):.0f} launches")
            for r in rows[: args.top]:
                print(f"  {r['ms_per_step']:7.3f} ms {r['calls_per_step']:6.0f}x  {r['kernel'][:110]}")
            del stepper, st, kv
    with open(args.out, "w") as f:
        json.dump({"preset": args.preset, "context": args.context, "batch": args.batch, "block": args.block,
                   "block_steps": args.block_steps} | result, f, indent=1)


if __name__ == "__main__":
    main()
