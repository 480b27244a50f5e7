"""What admitting requests costs on the host: EngineSession.add of N prompts of L random tokens (their checks and
copies, before any forward), and Engine.validate of the same prompts, timed around the loop. No device work.

    python tools/bench/bench_admission.py --requests 32 --prompt-len 32000 --out docs/results/bench_admission_cpu.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import compiledllm
from compiledllm.engine import Engine, EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llada2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = compiledllm.load_model(a.model)
    eng = Engine(model, EngineConfig({"name": "threshold"}, max_new_tokens=32, batch_size=a.requests))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.requests)]
    add_s, validate_s = [], []
    for _ in range(a.repeats):
        session = eng.session(a.requests, a.prompt_len + 64)
        t = time.perf_counter()
        for i, p in enumerate(prompts):
            session.add(i, p)
        add_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.validate(prompts)
        validate_s.append(time.perf_counter() - t)
    out = {"model": a.model, "requests": a.requests, "prompt_len": a.prompt_len, "add_s": add_s,
           "validate_s": validate_s, "add_s_min": min(add_s), "validate_s_min": min(validate_s),
           "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}
    print(f"add {a.requests} x {a.prompt_len}: {min(add_s):.3f} s; validate: {min(validate_s):.3f} s (min of "
          f"{a.repeats})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
