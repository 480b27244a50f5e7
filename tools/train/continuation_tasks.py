#!/usr/bin/env python3
"""Code-continuation tasks whose reference spans several blocks, cut from a shipped code task file.

The shipped code tasks (code_long.jsonl: 1,500-1,920 tokens of one held-out stdlib file, then the rest of a line)
have references of a few tokens, inside the first decoded block. A policy that works across blocks (FlowBlock's
window) needs references that fill several: each task here is the same held-out text (prompt + reference, which
are contiguous in the file), tokenized with the checkpoint's tokenizer, its last `--tokens` tokens the reference and
at most `--max-prompt` tokens before them the prompt (a shorter prompt keeps the CPU's prefill cheap). The text was
held out from training by construction (tools/train/tiny_data.py), so the references are unseen code.

    python tools/train/continuation_tasks.py --checkpoint compiledllm/assets/tiny-llada2.1 \\
        --source compiledllm/assets/tasks/code_long.jsonl --tokens 256 --max-prompt 768 --n 32 \\
        --out compiledllm/assets/tasks/code_continue_256.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from synth_tasks import tokenizer_fingerprint


def continuation_tasks(source: list[dict], tokenizer, tokens: int, n: int, min_prompt: int, max_prompt: int
                       ) -> list[dict]:
    """Up to n tasks: each source task's prompt + reference text, re-tokenized, split `tokens` from its end; a task
    whose text has fewer than min_prompt + tokens tokens is left out; the prompt is the last max_prompt tokens
    before the reference."""
    out = []
    fingerprint = tokenizer_fingerprint(tokenizer)
    for task in source:
        ids = tokenizer.encode(task["prompt"] + task["reference"], add_special_tokens=False).ids
        if len(ids) < min_prompt + tokens:
            continue
        prompt, ref = ids[-tokens - max_prompt:-tokens], ids[-tokens:]
        meta = {k: task.get("meta", {}).get(k) for k in ("file", "line")}
        out.append({"id": f"code_continue_{tokens}/{len(out):03d}", "prompt_ids": prompt, "reference_ids": ref,
                    "reference": tokenizer.decode(ref, skip_special_tokens=False),
                    "meta": meta | {"kind": "code_continue", "from": task.get("id"), "prompt_tokens": len(prompt),
                                    "tokenizer": fingerprint}})
        if len(out) == n:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="whose tokenizer.json encodes the tasks")
    ap.add_argument("--source", type=Path, required=True, help="a code task file with prompt and reference text")
    ap.add_argument("--tokens", type=int, default=256, help="reference length in tokens")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=768, help="fewest tokens of text before the reference")
    ap.add_argument("--max-prompt", type=int, default=768, help="most prompt tokens (the text's last before it)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    if args.out.exists():
        sys.exit(f"error: {args.out} exists; remove it first (nothing is overwritten)")
    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    source = [json.loads(line) for line in args.source.read_text().splitlines() if line.strip()]
    tasks = continuation_tasks(source, tok, args.tokens, args.n, args.min_prompt, args.max_prompt)
    if not tasks:
        sys.exit(f"error: {args.source}: no task has {args.min_prompt} + {args.tokens} tokens")
    args.out.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    print(f"{args.out}: {len(tasks)} tasks, references of {args.tokens} tokens, prompts "
          f"{min(len(t['prompt_ids']) for t in tasks)}-{max(len(t['prompt_ids']) for t in tasks)} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
