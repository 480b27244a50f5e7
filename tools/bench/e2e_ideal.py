"""`compiledllm bench` points against their ideal: the same requests with prefill at the compute roofline and every
decode step at its roofline (issue 19 item 5), beside the kernel-level step of tools/bench/bench_decode.py where one was
measured for that (model, batch, context).

Ideal time of a point = prefill FLOPs / matmul rate (bench_prefill.prefill_flops) + the engine's decode steps x
the step roofline (bench_decode.step_costs at the mean decode context, prompt + half the output, with the point's
touched experts per layer) — with the ceilings measured in the bench's own device call.

    python tools/bench/e2e_ideal.py --ceilings ceilings.json --decode bench_decode_*.json -- e2e_*.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_decode import roofline_ms, step_costs
from bench_prefill import prefill_flops

from compiledllm.loader import parse_model_config
from compiledllm.models.presets import PRESETS


def kernel_steps(paths: list[Path]) -> dict:
    """(model, batch, context) -> graphs step ms from bench_decode reports."""
    out = {}
    for path in paths:
        for p in json.loads(path.read_text())["records"]:
            if p.get("graphs_ms") is not None:
                out[(p["model"], p["batch"], p["context"])] = p["graphs_ms"]
    return out


def context_key(prompt: int) -> int:
    """bench_decode's context for a bench prompt length (32,000-token prompts against a 32,768 context, ...)."""
    return next((c for c in (4096, 16384, 32768) if prompt <= c), prompt)


def point_row(model: str, p: dict, ceil: dict, kernels: dict, block: int = 32, steps: int = 20) -> dict:
    cfg = parse_model_config(PRESETS[model], f"preset {model}")
    prefill_ideal = prefill_flops(cfg, p["prompt_len"], p["requests"]) / ceil["bf16_flops_per_s"]
    context = p["prompt_len"] + p["output_len"] // 2
    costs = step_costs(cfg, p["batch"], context, p.get("touched_experts") or None, block, steps)
    roof, _ = roofline_ms(costs, ceil)
    ideal = prefill_ideal + p["decode_steps"] * roof / 1e3
    return {"model": model, "prompt": p["prompt_len"], "out": p["output_len"], "batch": p["batch"],
            "kernel_step_ms": kernels.get((model, p["batch"], context_key(p["prompt_len"]))),
            "step_roofline_ms": roof, "engine_step_ms": p["decode_s"] / p["decode_steps"] * 1e3,
            "prefill_s": p["prefill_s"], "prefill_roofline_s": prefill_ideal,
            "decode_tokens_per_s": p["decode_tokens_per_s"], "output_tokens_per_s": p["output_tokens_per_s"],
            "ideal_tokens_per_s": p["generated_tokens"] / ideal, "wall_s": p["wall_s"], "ideal_s": ideal,
            "share": ideal / p["wall_s"], "latency_p50_s": p["latency_p50_s"],
            "peak_gib": (p["peak_memory_bytes"] or 0) / 2**30}


def markdown(rows: list[dict]) -> str:
    head = ("| model | prompt | out | B | kernel step ms (roofline) | engine step ms | prefill s (roofline) | "
            "decode tok/s | **output tok/s e2e** | ideal | share | p50 latency s | peak GiB |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        k = "-" if r["kernel_step_ms"] is None else f"{r['kernel_step_ms']:.2f}"
        lines.append(f"| {r['model']} | {r['prompt']:,} | {r['out']} | {r['batch']} | {k} ({r['step_roofline_ms']:.2f}) "
                     f"| {r['engine_step_ms']:.2f} | {r['prefill_s']:.2f} ({r['prefill_roofline_s']:.2f}) | "
                     f"{r['decode_tokens_per_s']:,.0f} | **{r['output_tokens_per_s']:,.0f}** | "
                     f"{r['ideal_tokens_per_s']:,.0f} | {100 * r['share']:.0f} % | {r['latency_p50_s']:.2f} | "
                     f"{r['peak_gib']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ceilings", type=Path, required=True, help="gpu_timing.ceilings() of the bench's device call")
    ap.add_argument("--decode", type=Path, nargs="*", default=[], help="bench_decode reports (kernel-level steps)")
    ap.add_argument("--out", type=Path, help="rows as JSON")
    ap.add_argument("bench", type=Path, nargs="+", help="compiledllm bench --out reports")
    args = ap.parse_args(argv)
    ceil, kernels = json.loads(args.ceilings.read_text()), kernel_steps(args.decode)
    rows = []
    for path in args.bench:
        report = json.loads(path.read_text())
        model = report["model"].removeprefix("random:")
        block, steps = report.get("block", 32), report.get("policy", {}).get("steps") or 20  # the fixed schedule
        rows += [point_row(model, p, ceil, kernels, block, steps) for p in report["points"] if "error" not in p]
    print(markdown(rows))
    if args.out is not None:
        args.out.write_text(json.dumps({"ceilings": ceil, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
