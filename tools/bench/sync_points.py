"""Where a session's host waits for the GPU: every synchronising CUDA call of the decode loop, by source line.

HERALD's host form spends ~21 % of its decode time on the host between replays (docs/results.md, fourteenth and
twenty-second sessions), and its host hooks read device state (`.tolist()`, pageable copies), each of which waits
for the queued forwards. This runs a recipe's session with torch's CUDA sync debug mode on ("warn": each
synchronising call warns, with the line that made it) from the first step to the last, start-up excluded, and
counts the warnings by the compiledllm line they came from, per decode step.

    python tools/bench/sync_points.py recipes/bench_block48_standard.yaml --set compile=false \
        --set policy.name=herald --set policy.pool=host --set policy.retrieval=scan --set policy.budget=0.05 \
        --prompt-len 8000 --batch 8 --output-len 64 --out sync_points.json

On the CPU there is nothing to synchronise with: the table is empty (a check of the tool).
"""
from __future__ import annotations

import argparse
import json
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from compiledllm.bench import synthetic_prompts
from compiledllm.engine import Engine
from compiledllm.engine.request import working_length
from compiledllm.recipe import check_policy, load_recipe
from compiledllm.runner import load_from_spec

ROOT = Path(__file__).resolve().parents[2]


def count_sync_points(records: list[warnings.WarningMessage]) -> Counter:
    """The sync debug mode's warnings by the line that made them (`path:line`, relative to the repository where it
    is in it); other warnings are left out."""
    counts: Counter = Counter()
    for w in records:
        if "synchronizing" not in str(w.message):
            continue
        path = Path(w.filename)
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        counts[f"{where}:{w.lineno}"] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default="sync_points.json")
    args = ap.parse_args()
    recipe = load_recipe(args.recipe, args.sets + [f"generation.max_new_tokens={args.output_len}",
                                                   f"batch_size={args.batch}", "generation.ignore_eos=true"])
    check_policy(recipe)
    model = load_from_spec(recipe.model)
    engine = Engine.from_recipe(model, recipe)
    need = working_length(args.prompt_len, args.output_len, engine.block, engine.policy.first_block(args.prompt_len))
    session = engine.session(args.batch, need)  # its start-up (compile, capture) is not counted
    for i, prompt in enumerate(synthetic_prompts(model, args.batch, args.prompt_len, 0)):
        session.add(i, prompt)
    cuda = model.device.type == "cuda"
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            while session.has_work():
                session.step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    wall = time.perf_counter() - t
    stats = session.stats()
    counts = count_sync_points(records)
    steps = max(1, stats.decode_steps)
    report = {"recipe": args.recipe, "sets": args.sets, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "batch": args.batch, "device": torch.cuda.get_device_name() if cuda else "cpu", "wall_s": wall,
              "decode_steps": stats.decode_steps, "prefill_forwards": stats.prefill_forwards,
              "hooks_s": stats.hooks_s, "sync_points": [{"where": k, "count": n, "per_step": n / steps}
                                                        for k, n in counts.most_common()]}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{sum(counts.values())} synchronising calls in {stats.decode_steps} decode steps, "
          f"{stats.prefill_forwards} prefill forwards, {wall:.2f} s (host hooks {stats.hooks_s:.2f} s)")
    for k, n in counts.most_common(args.top):
        print(f"  {n:7d}  {n / steps:6.2f} a step  {k}")
    session.close()


if __name__ == "__main__":
    main()
