#!/usr/bin/env python3
"""(Re)build the held-out task files for a trained tiny checkpoint and (re)evaluate it, updating its model card.

Uses the checkpoint's tokenizer and the same deterministic split as tools/train/train_tiny.py (sha1 of the relative
path), over the stdlib of the interpreter that runs this tool: a file held out in training is held out here
whatever the Python version, so tasks built from this interpreter's copies of held-out files are still unseen
text. The bigram baseline is counted on this interpreter's copies of the training files.

    python tools/train/build_tasks.py --checkpoint compiledllm/assets/tiny-llada2 --results docs/results/tiny_model.json \
        --tasks-out compiledllm/assets/tasks --eval

With --synthetic it writes the generated-task files instead (tools/train/synth_tasks.py, from their fixed seed): arithmetic,
lists, retrieval at 1K / 2K / 4K / 8K tokens of context and variable binding, text prompts and references sized with
the tokenizer of --checkpoint (or, without one, the tokenizer train_tiny's new kinds train: byte-level BPE of
--vocab tokens, digits split, on this interpreter's training files), filler from the held-out files:

    python tools/train/build_tasks.py --synthetic --tasks-out compiledllm/assets/tasks [--checkpoint OUT/checkpoint]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import tiny_data as D
import train_kinds as K
import train_tiny as T


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="required without --synthetic")
    ap.add_argument("--results", type=Path, default=None,
                    help="the training run's results.json (updated in place; required without --synthetic)")
    ap.add_argument("--synthetic", action="store_true", help="write the generated-task files (see above)")
    ap.add_argument("--kind", default="tiny-llada2.1", help="--synthetic: whose file plan (tiny-llada2.1: all files)")
    ap.add_argument("--vocab", type=int, default=4096, help="--synthetic without --checkpoint: tokenizer size")
    ap.add_argument("--tasks-out", type=Path, required=True)
    ap.add_argument("--holdout", type=float, default=None, help="default: the training run's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval", action="store_true", help="evaluate the checkpoint on the tasks and update the card")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--card", type=Path, default=None, help="also write the metrics tables here (markdown)")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    if args.synthetic:
        return synthetic(args)
    if args.checkpoint is None or args.results is None:
        ap.error("--checkpoint and --results are required (or give --synthetic)")

    results = json.loads(args.results.read_text())
    holdout = args.holdout if args.holdout is not None else results["data"]["holdout"]
    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    files = D.read_corpus(D.stdlib_root())
    train_files, held_files = D.split(files, holdout)
    short, long_ = D.build_tasks(tok, held_files, seed=args.seed, **T.PRESETS["full"]["tasks"])
    task_files = {"code_short.jsonl": args.tasks_out / "code_short.jsonl",
                  "code_long.jsonl": args.tasks_out / "code_long.jsonl"}
    D.write_jsonl(task_files["code_short.jsonl"], short)
    D.write_jsonl(task_files["code_long.jsonl"], long_)
    print(f"tasks: {len(short)} short, {len(long_)} long from {sum(not f.is_test for f in held_files)} held-out "
          f"files of {D.stdlib_root()}", flush=True)
    results["task_source"] = {
        "python": sys.version.split()[0], "root": str(D.stdlib_root()), "held_files": len(held_files),
        "held_files_in_training_run": len({f.rel for f in held_files} & set(results["data"]["held_file_list"])),
        "built_by": "tools/train/build_tasks.py"}
    if args.eval:
        t0 = time.time()
        table = D.bigram_table(D.token_stream(D.encode_files(tok, train_files)), tok.get_vocab_size())
        results["bigram_source"] = f"{len(train_files)} training-split files of {D.stdlib_root()}"

        class _Log:
            def __call__(self, msg, **_):
                print(msg, flush=True)

        model = T.load_model(args.checkpoint, device=args.device, dtype=torch.float32)
        results["eval_device"] = f"{args.device} (engine, eager)"
        results["tasks"] = T.eval_tasks(model, task_files, table, args.batch_size, _Log(), time.time() + 1e9)
        results["task_eval_s"] = time.time() - t0
        (args.checkpoint / "README.md").write_text(T.model_card(results))
        if args.card is not None:
            args.card.write_text(T.metrics_tables(results) + "\n")
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    return results


def synthetic(args) -> dict:
    from tokenizers import Tokenizer

    files = D.read_corpus(D.stdlib_root())
    train_files, held_files = D.split(files, 0.10 if args.holdout is None else args.holdout)
    if args.checkpoint is not None:
        tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    else:
        tok = D.train_tokenizer([f.text for f in train_files], args.vocab, digits=True)
    plan = K.synth_plan(args.kind, "full")
    written = K.write_synthetic(plan, tok, [f.text for f in held_files if not f.is_test], args.tasks_out)
    summary = {}
    for name, path in written.items():
        recs = [json.loads(ln) for ln in path.read_text().splitlines()]
        sizes = [r["meta"]["prompt_tokens"] for r in recs if "prompt_tokens" in r["meta"]]
        summary[name] = {"tasks": len(recs), **({"prompt_tokens": [min(sizes), max(sizes)]} if sizes else {})}
        print(f"{path}: {json.dumps(summary[name])}", flush=True)
    return summary


if __name__ == "__main__":
    main()
