"""What sampling costs (issue 20): one captured decode step of `threshold` on the LLaDA2.0-mini shape (random
weights, bf16, a vocabulary of 157K: the draw hashes noise for every vocabulary entry of every needed row), greedy
against temperature 1 and against temperature 1 with top-k 50 + top-p 0.9, eager-captured and compiled-captured,
all in one process; and end to end on the tiny model (`compiledllm run`'s execute, prefill included).

    python tools/bench/bench_sampling.py --out docs/results/bench_sampling_h200.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench_decode import cycle_ms, synthetic_state

from compiledllm.engine.stepper import Stepper
from compiledllm.loader import build_random
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy
from compiledllm.recipe import load_recipe
from compiledllm.runner import execute

TASKS = Path(__file__).resolve().parents[2] / "compiledllm/assets/tasks/code_short.jsonl"
BASE = ThresholdConfig(block_size=32, threshold=1.0, steps=20)
SETTINGS = {"greedy": {}, "T=1": {"temperature": 1.0, "seed": 1},
            "T=1 top-k 50 top-p 0.9": {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 1}}


def step_costs(batches: list[int], context: int, modes: list[str]) -> list[dict]:
    model = build_random("llada2.0-mini", device="cuda", dtype=torch.bfloat16)
    out = []
    with torch.no_grad():
        for batch in batches:
            for mode in modes:
                rec = {"batch": batch, "context": context, "mode": mode}
                for label, s in SETTINGS.items():
                    pol = ThresholdPolicy(replace(BASE, **s), model.mask_token_id)
                    torch.manual_seed(batch * 7 + context)
                    st, kv = synthetic_state(model, pol, batch, context)
                    stepper = Stepper(model, pol, st, kv, [batch], compile=mode == "compiled", cuda_graphs=True)
                    rec[f"{label} ms"] = cycle_ms(lambda: stepper.run(batch))
                    del stepper, st, kv
                    torch.cuda.empty_cache()
                out.append(rec)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
    return out


def end_to_end(batches: list[int], device: str) -> list[dict]:
    prompts = [{"ids": json.loads(line)["prompt_ids"]} for line in TASKS.read_text().splitlines() if line.strip()]
    out = []
    for batch in batches:
        for label, s in SETTINGS.items():
            pol = {"name": "threshold", "block_size": 32, "threshold": 0.9, **s}
            recipe = load_recipe({"model": {"path": "tiny-llada2", "device": device}, "policy": pol,
                                  "generation": {"max_new_tokens": 64}, "prompts": prompts, "batch_size": batch,
                                  "output": None})
            _, summ = execute(recipe)
            out.append({"batch": batch, "setting": label, "tokens_per_s": summ.tokens_per_s, "wall_s": summ.wall_s,
                        "tokens_per_forward": summ.tokens_per_forward, "prompts": summ.prompts})
            print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--modes", default="graphs,compiled")
    ap.add_argument("--e2e-batches", default="1,16")
    ap.add_argument("--out", default="docs/results/bench_sampling.json")
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "policy": "threshold 1.0, 20 steps, block 32 (step); threshold 0.9 (end to end)"}
    report["step"] = step_costs([int(b) for b in args.batches.split(",")], args.context, args.modes.split(","))
    report["end_to_end"] = end_to_end([int(b) for b in args.e2e_batches.split(",")], "cuda")
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\n{'batch':>5} {'mode':9} " + " ".join(f"{k:>24}" for k in SETTINGS))
    for r in report["step"]:
        print(f"{r['batch']:5} {r['mode']:9} " + " ".join(f"{r[k + ' ms']:21.2f} ms" for k in SETTINGS))
    for r in report["end_to_end"]:
        print(f"e2e tiny-llada2 B{r['batch']:<3} {r['setting']:24} {r['tokens_per_s']:8.1f} tok/s  "
              f"TPF {r['tokens_per_forward']:.2f}")


if __name__ == "__main__":
    main()
