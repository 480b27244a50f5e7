#!/usr/bin/env python3
"""(Re)build the held-out task files for a trained tiny checkpoint and (re)evaluate it, updating its model card.

Uses the checkpoint's tokenizer and the same deterministic split as tools/train_tiny.py (sha1 of the relative
path), over the stdlib of the interpreter that runs this tool: a file held out in training is held out here
whatever the Python version, so tasks built from this interpreter's copies of held-out files are still unseen
text. The bigram baseline is counted on this interpreter's copies of the training files.

    python tools/build_tasks.py --checkpoint compiledllm/assets/tiny-llada2 --results docs/results/tiny_model.json \
        --tasks-out compiledllm/assets/tasks --eval
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_data as D  # noqa: E402
import train_tiny as T  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--results", type=Path, required=True, help="the training run's results.json (updated in place)")
    ap.add_argument("--tasks-out", type=Path, required=True)
    ap.add_argument("--holdout", type=float, default=None, help="default: the training run's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval", action="store_true", help="evaluate the checkpoint on the tasks and update the card")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--card", type=Path, default=None, help="also write the metrics tables here (markdown)")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

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
        "built_by": "tools/build_tasks.py"}
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


if __name__ == "__main__":
    main()
