"""FlowBlock's speed on the GPU (issue 16), two parts in one process, every baseline in the same run.

(a) end to end, as `compiledllm run` decodes: a shipped tiny model on a task file's prompts (default: tiny-llada2
    on code_short, max_new_tokens 64, issue 16's run; issue 31 item 7: --model tiny-llada2.1 --tasks
    code_continue_256 --new-tokens 256 --ignore-eos, every request decoding all 256), CUDA graphs, batch 1 / 4 / 8 /
    16 / 32: tokens/s (prefill included, start-up excluded), forwards and tokens per forward of `t2t`, `flowblock` and
    `flowblock_sync` (the lock-step form: HWP against lock-step is flowblock against flowblock_sync).
(b) the per-forward cost of a W x block window against a block window on the LLaDA2.1-mini shape (random weights:
    a random router, not a trained balanced one), batch 1-32, short context: one captured step of `flowblock`
    (ungated, so every window slot is live) vs one of `t2t`; with the tokens per forward of (a) this gives a
    projected tokens/s, labelled as a projection (a trained LLaDA2.1's TPF differs from the tiny model's).

    python tools/bench/bench_flowblock.py --out docs/results/bench_flowblock_h200.json
    python tools/bench/bench_flowblock.py --model tiny-llada2.1 --tasks code_continue_256 --new-tokens 256 \
        --ignore-eos --batches 1,16 --window 2 --out ...
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench_decode import cycle_ms, synthetic_state
from gpu_timing import ceilings

from compiledllm.engine.stepper import Stepper
from compiledllm.loader import build_random
from compiledllm.policies.flowblock import FlowBlockConfig, FlowBlockPolicy
from compiledllm.policies.t2t import T2TConfig, T2TPolicy
from compiledllm.recipe import load_recipe
from compiledllm.runner import execute

TASKS = Path(__file__).resolve().parents[2] / "compiledllm/assets/tasks"
T2T = {"threshold": 0.7, "edit_threshold": 0.5, "max_post_steps": 16, "block_size": 32}


def policies(window: int) -> dict[str, dict]:
    """t2t, and FlowBlock's two forms (HWP, lock-step) at the default gate and ungated."""
    return {"t2t": {"name": "t2t", **T2T}} | {
        f"{name} W{window} s{spawn}": {"name": name, "window": window, "spawn": spawn, **T2T}
        for spawn in (0.6, 0.0) for name in ("flowblock", "flowblock_sync")}


def end_to_end(batches: list[int], dtype: str, device: str, model: str, tasks: str, new_tokens: int,
               ignore_eos: bool, window: int, limit: int | None = None) -> list[dict]:
    path = TASKS / f"{tasks}.jsonl"
    prompts = [{"ids": json.loads(line)["prompt_ids"]} for line in path.read_text().splitlines() if line.strip()]
    prompts = prompts[:limit]
    out = []
    for batch in batches:
        for label, pol in policies(window).items():
            recipe = load_recipe({"model": {"path": model, "device": device, "dtype": dtype}, "policy": pol,
                                  "generation": {"max_new_tokens": new_tokens, "ignore_eos": ignore_eos},
                                  "prompts": prompts, "batch_size": batch, "output": None})
            results, s = execute(recipe)
            rec = {"batch": batch, "policy": label, "tokens": s.tokens, "forwards": s.forwards,
                   "tokens_per_forward": s.tokens_per_forward, "wall_s": s.wall_s, "tokens_per_s": s.tokens_per_s,
                   "startup_s": s.startup_s, "prompts": len(results)}
            out.append(rec)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
    return out


def forward_cost(batches: list[int], context: int, window: int) -> list[dict]:
    model = build_random("llada2.0-mini", device="cuda", dtype=torch.bfloat16)
    block = T2T["block_size"]
    fb = FlowBlockPolicy(FlowBlockConfig(window=window, spawn=0.0, **T2T), model.mask_token_id)
    serial = T2TPolicy(T2TConfig(**T2T), model.mask_token_id)
    out = []
    with torch.no_grad():
        for batch in batches:
            rec = {"batch": batch, "context": context, "window": window}
            for name, pol in (("t2t", serial), ("flowblock", fb)):
                torch.manual_seed(context * 1009 + batch)
                st, kv = synthetic_state(model, pol, batch, context)
                if name == "flowblock":
                    st.policy["more"].fill_(window - 1)  # a full window: every slot live (ungated keeps it full)
                stepper = Stepper(model, pol, st, kv, [batch], compile=False, cuda_graphs=True)
                rec[f"{name}_ms"] = cycle_ms(lambda: stepper.run(batch))
                del stepper, st, kv
                torch.cuda.empty_cache()
            rec["cost_ratio"] = rec["flowblock_ms"] / rec["t2t_ms"]
            rec["query_tokens"] = {"t2t": batch * block, "flowblock": batch * block * window}
            out.append(rec)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--dtype", default="float32", help="tiny model dtype in (a) (float32: as its quality figures)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--model", default="tiny-llada2", help="(a): a built-in model")
    ap.add_argument("--tasks", default="code_short", help="(a): a task file of compiledllm/assets/tasks")
    ap.add_argument("--new-tokens", type=int, default=64, help="(a): max_new_tokens")
    ap.add_argument("--ignore-eos", action="store_true", help="(a): every request decodes all --new-tokens")
    ap.add_argument("--prompts", type=int, default=None, help="(a): the first N of the task file (default: all)")
    ap.add_argument("--parts", default="a,b")
    ap.add_argument("--device", default="cuda", help="(a) only: cpu runs it without a GPU (a check of the tool)")
    ap.add_argument("--out", default="docs/results/bench_flowblock.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cuda = args.device.startswith("cuda")
    report = {"device": torch.cuda.get_device_name() if cuda else args.device, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "ceilings": ceilings() if cuda else None,
              "model": args.model, "tasks": args.tasks, "new_tokens": args.new_tokens,
              "ignore_eos": args.ignore_eos}
    if "a" in args.parts:
        report["end_to_end"] = end_to_end(batches, args.dtype, args.device, args.model, args.tasks, args.new_tokens,
                                          args.ignore_eos, args.window, args.prompts)
        Path(args.out).write_text(json.dumps(report, indent=1))
    if "b" in args.parts:
        report["forward_cost"] = forward_cost(batches, args.context, args.window)
    Path(args.out).write_text(json.dumps(report, indent=1))
    e2e = {(r["batch"], r["policy"]): r for r in report.get("end_to_end", [])}
    print(f"\n{'batch':>5} {'policy':24} {'tok/s':>8} {'TPF':>6} {'x t2t':>6}")
    for (b, label), r in e2e.items():
        print(f"{b:5} {label:24} {r['tokens_per_s']:8.1f} {r['tokens_per_forward']:6.2f} "
              f"{r['tokens_per_s'] / e2e[b, 't2t']['tokens_per_s']:6.2f}")
    for r in report.get("forward_cost", []):
        print(f"B{r['batch']:<3} ctx {r['context']}: t2t step {r['t2t_ms']:.2f} ms, W{r['window']} window step "
              f"{r['flowblock_ms']:.2f} ms ({r['cost_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
