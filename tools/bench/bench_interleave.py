"""Chunked prefill between decode steps under a request rate: what each (chunk, per-forward token budget) costs the
rows already decoding and what it gives the arriving requests (issue 19 item 2, "the choice measured").

One model is built once; each configuration serves the same seeded Poisson stream of requests through
`compiledllm.bench.run_point` (the engine's own clocks: RunStats and per-request arrival -> first retired block /
finish). Reported per configuration: the decode step (mean), how many steps waited for a prefill forward of another
request and for how long (mean, max: the bound is one forward), time to the first retired block (p50) and
latency (p50 / p99), output tokens/s. The engine's rule: with rows decoding, one prefill forward (<= `tokens`
positions, chunks of `chunk` positions per row) runs before each decode step.

    python tools/bench/bench_interleave.py --prompt-len 32000 --rate 2 --requests 24 --batch 8 \
        --configs 1024:16384,2048:16384,4096:16384,4096:65536 --out docs/results/bench_interleave_h200.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from compiledllm.bench import _warm_up, load_bench_recipe, poisson_arrivals, run_point, synthetic_prompts
from compiledllm.engine import Engine, EngineConfig
from compiledllm.runner import load_from_spec

KEYS = ("decode_step_ms", "stalled_steps", "decode_steps", "stall_mean_ms", "stall_max_ms", "first_block_p50_s",
        "latency_p50_s", "latency_p99_s", "output_tokens_per_s", "prefill_tokens_per_s", "prefill_forwards", "wall_s")


def parse_configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        chunk, _, tokens = item.partition(":")
        out.append((int(chunk), int(tokens or chunk)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/profile_llada2_mini.yaml")
    ap.add_argument("--set", action="append", default=[], help="recipe override key.path=value")
    ap.add_argument("--prompt-len", type=int, default=32000)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson, seeded)")
    ap.add_argument("--configs", default="1024:16384,2048:16384,4096:16384,4096:65536", help="chunk:tokens,...")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    recipe = load_bench_recipe(Path(args.recipe), args.set)
    model = load_from_spec(recipe.model)
    base = replace(EngineConfig.from_recipe(recipe), ignore_eos=True, batch_size=args.batch,
                   max_new_tokens=args.output_len)
    block = Engine(model, base).block
    if model.device.type == "cuda":
        _warm_up(model, base, block, args.prompt_len, args.seed)
    prompts = synthetic_prompts(model, args.requests, args.prompt_len, args.seed)
    arrivals = poisson_arrivals(args.requests, args.rate, args.seed)
    report = {"recipe": args.recipe, "overrides": args.set, "model": recipe.model.name,
              "device": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len,
              "output_len": args.output_len, "batch": args.batch, "requests": args.requests, "rate": args.rate,
              "seed": args.seed, "points": []}
    print(f"{'chunk':>6} {'tokens':>6} {'step ms':>8} {'waited':>9} {'mean ms':>8} {'max ms':>7} {'1st blk':>8} "
          f"{'p50 s':>6} {'p99 s':>6} {'out tok/s':>9}")
    for chunk, tokens in parse_configs(args.configs):
        rec = run_point(model, replace(base, prefill_chunk=chunk, prefill_tokens=tokens), prompts, arrivals)
        rec = {"chunk": chunk, "tokens": tokens} | {k: rec[k] for k in KEYS}
        report["points"].append(rec)
        print(f"{chunk:>6} {tokens:>6} {rec['decode_step_ms']:>8.2f} {rec['stalled_steps']:>4}/{rec['decode_steps']:<4}"
              f" {rec['stall_mean_ms']:>8.1f} {rec['stall_max_ms']:>7.1f} {rec['first_block_p50_s']:>8.2f} "
              f"{rec['latency_p50_s']:>6.2f} {rec['latency_p99_s']:>6.2f} {rec['output_tokens_per_s']:>9.0f}",
              flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
