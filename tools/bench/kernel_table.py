"""The CUDA kernels of one decode step, by total time: eager vs torch.compile, on a real-size random model.

Where `compiledllm profile` attributes time to the model's phases (eager only), this lists kernels, so that
what torch.compile generated can be compared with the eager step kernel by kernel. Each mode's kernels are also
summed by group (routed experts, attention, GEMMs, Inductor's fused elementwise, ...), and the step is set against
its roofline: its bytes (weights of the experts the step's routing touches, KV) and FLOPs at this process's own
HBM copy rate and matmul rate (gpu_timing.ceilings).

    python tools/bench/kernel_table.py --preset llada2.0-mini --context 4096 --batch 32 --out kernels.json
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from bench_decode import BLOCK, STEPS, cycle_ms, roofline_ms, step_costs, synthetic_state, touched_experts
from gpu_timing import ceilings
from compiledllm.engine.stepper import Stepper
from compiledllm.loader import build_random
from compiledllm.models.routing import moe_layers
from compiledllm.profiler import top_ops
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy


# a kernel's group: the first whose name fragments its name contains (Triton kernels of this package by their names,
# cuBLAS by its kernel families); "other" for the rest (ATen's small kernels)
GROUPS = (("attention", ("attn",)),
          ("routed experts (gate-up, down)", ("gate_up", "down_")),
          ("routing, sort, combine", ("route", "sort_", "combine")),
          ("head + confidence", ("head_rows", "confidence")),
          ("GEMMs (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma")),
          ("Inductor's fused elementwise", ("triton_",)))


def kernel_groups(rows: list[dict]) -> dict[str, dict]:
    """ms and launches a step per group of GROUPS (and "other"), in GROUPS' order."""
    out = {name: {"ms": 0.0, "launches": 0.0} for name, _ in GROUPS} | {"other": {"ms": 0.0, "launches": 0.0}}
    for r in rows:
        name = next((g for g, parts in GROUPS if any(p in r["kernel"] for p in parts)), "other")
        out[name]["ms"] += r["ms_per_step"]
        out[name]["launches"] += r["calls_per_step"]
    return out


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
        ceil = ceilings()
        torch.manual_seed(args.context * 1009 + args.batch)
        st, kv = synthetic_state(model, policy, args.batch, args.context)  # the routing the profiled steps see
        touched = touched_experts(model, policy, st, kv) if moe_layers(model) else None
        del st, kv
        costs = step_costs(model.config, args.batch, args.context, touched, args.block, args.block_steps)
        roof, bound = roofline_ms(costs, ceil)
        print(f"roofline {roof:.2f} ms ({bound}-bound: {costs['weight_bytes'] / 1e9:.1f} GB of weights, "
              f"{costs['kv_bytes'] / 1e9:.1f} GB of KV, {costs['flops'] / 1e12:.2f} TFLOP at "
              f"{ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s, {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s)")
        for mode in args.modes.split(","):
            torch.manual_seed(args.context * 1009 + args.batch)  # the state bench_decode measures at this point
            st, kv = synthetic_state(model, policy, args.batch, args.context)
            stepper = Stepper(model, policy, st, kv, [args.batch], compile=mode.startswith("compiled"),
                              cuda_graphs=mode.endswith("graphs"))
            rows = kernel_table(stepper, args.batch, args.steps)
            total = sum(r["ms_per_step"] for r in rows)
            # the step's wall time beside its kernels' sum: the difference is the GPU idle between kernels
            step = cycle_ms(lambda: stepper.run(args.batch))
            groups = kernel_groups(rows)
            result[mode] = {"kernel_ms_per_step": total, "step_ms": step, "step_over_roofline": step / roof,
                            "groups": groups, "kernels": rows}
            print(f"\n{mode}: {total:.2f} ms of kernels per step in {step:.2f} ms ({step / roof:.2f}x the roofline), "
                  f"{sum(r['calls_per_step'] for r in rows):.0f} launches")
            for name, g in groups.items():
                print(f"  {g['ms']:7.3f} ms {g['launches']:6.0f}x  [{name}]")
            for r in rows[: args.top]:
                print(f"  {r['ms_per_step']:7.3f} ms {r['calls_per_step']:6.0f}x  {r['kernel'][:110]}")
            del stepper, st, kv
    with open(args.out, "w") as f:
        json.dump({"preset": args.preset, "context": args.context, "batch": args.batch, "block": args.block,
                   "block_steps": args.block_steps, "ceilings": ceil, "touched_experts": touched, "costs": costs,
                   "roofline_ms": roof, "bound": bound} | result, f, indent=1)


if __name__ == "__main__":
    main()
