"""Prefill through the engine against its compute roofline, the old one-row path in the same run (issue 19).

For each model, prompt length and batch, `batch` random prompts of `prompt` tokens go through `Engine.generate`
with one block of output (`threshold` tau 1.0, 20 steps, block 32, ignore_eos) and the engine's own prefill clock
(RunStats.prefill_s, synchronised) is read. Variants, in the same process:

* `rows1-1024`: the path before issue 19 (one row at a time, eager 1024-position chunks: prefill_tokens 1024);
* `eager-C`: batched chunks of C positions per row, up to --tokens per forward, the layers run eagerly;
* `compiled-C`: the same forwards through compiled regions, static shapes per (rows, C) bucket (`prefill.compile`,
  issue 31 item 5; what the engine runs on CUDA by default). Run twice: the first engine's start-up compiles (or
  loads) the compiled shapes (first_startup_s; its prefill: first_prefill_s), the second run is the figure.

(The run of record, docs/results/bench_prefill_h200.json, also has `compiled-2048`: a shape-generic compile of the
layers for prefill that this tool measured and the engine then dropped: faster at 4K x 8, 3.8x slower at 32K x 8.)

Roofline: FLOPs of the prompt's full blocks (2 x active parameters per token, plus attention: 4 x heads x
head_dim x layers per visible (query, key) pair, block-causal) / the bf16 matmul rate measured in this run.

    python tools/bench/bench_prefill.py --out docs/results/bench_prefill_h200.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from gpu_timing import ceilings

from compiledllm.engine import Engine, EngineConfig
from compiledllm.loader import build_random

BLOCK = 32
POLICY = {"name": "threshold", "block_size": BLOCK, "threshold": 1.0, "steps": 20}


def active_params(cfg) -> int:
    d, L, H, KVH, hd = cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = d * (H + 2 * KVH) * hd + H * hd * d
    if cfg.moe is None:
        return L * (attn + 3 * d * cfg.intermediate_size)
    m = cfg.moe
    moe = d * m.num_experts + 3 * d * m.expert_dim * (m.num_shared + m.top_k)
    return L * attn + m.first_dense_layers * 3 * d * cfg.intermediate_size + (L - m.first_dense_layers) * moe


def prefill_flops(cfg, prompt: int, batch: int) -> float:
    n = prompt // BLOCK * BLOCK
    pairs = sum((b + 1) * BLOCK * BLOCK for b in range(n // BLOCK))  # block-causal (query, key) pairs
    return batch * (2 * active_params(cfg) * n + 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * pairs)


def run_variant(model, prompts, chunk: int, tokens: int, compiled: bool = False) -> dict:
    cfg = EngineConfig(POLICY, max_new_tokens=BLOCK, batch_size=len(prompts), ignore_eos=True, compile=False,
                       prefill_chunk=chunk, prefill_tokens=tokens, prefill_compile=compiled,
                       buckets=(len(prompts),))  # one decode graph
    eng = Engine(model, cfg)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    eng.generate(prompts)
    s = eng.stats
    return {"prefill_s": s.prefill_s, "prefill_tokens": s.prefill_tokens, "prefill_forwards": s.prefill_forwards,
            "decode_s": s.decode_s, "wall_s": s.wall_s, "startup_s": s.startup_s,
            "command_s": time.perf_counter() - t0, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default="llada2.0-mini:4000x1,4000x8,16000x8,32000x8,32000x32;sdar-8b:4000x8,16000x8")
    ap.add_argument("--chunks", default="1024,2048,4096", help="chunk sizes of the batched eager variants")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per prefill forward (batched variants)")
    ap.add_argument("--variants", default="rows1-1024,eager,compiled")
    ap.add_argument("--baseline-max-tokens", type=int, default=300_000,
                    help="skip the one-row baseline above this many prompt tokens (it is the slow one)")
    ap.add_argument("--out", default="docs/results/bench_prefill.json")
    args = ap.parse_args()
    ceil = ceilings()
    rate = ceil["bf16_flops_per_s"]
    print(f"ceilings: HBM {ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {rate / 1e12:.0f} TFLOP/s", flush=True)
    records = []
    for item in args.plan.split(";"):
        preset, points = item.split(":")
        model = build_random(preset, device="cuda", dtype=torch.bfloat16)
        vocab = model.config.vocab_size
        warm = torch.randint(3, vocab - 3, (2, 4096), generator=torch.Generator().manual_seed(0)).tolist()
        for chunk, tokens in ((1024, 1024), *((int(c), args.tokens) for c in args.chunks.split(","))):  # kernels' first-call JIT
            run_variant(model, warm, chunk, tokens)
        for point in points.split(","):
            prompt, batch = map(int, point.split("x"))
            g = torch.Generator().manual_seed(prompt + batch)
            prompts = torch.randint(3, vocab - 3, (batch, prompt), generator=g).tolist()
            flops = prefill_flops(model.config, prompt, batch)
            rec = {"model": preset, "prompt": prompt, "batch": batch, "flops": flops, "roofline_s": flops / rate,
                   "variants": {}}
            names = []
            for v in args.variants.split(","):
                if v == "rows1-1024":
                    if batch * prompt <= args.baseline_max_tokens:
                        names.append((v, 1024, 1024))
                elif v in ("eager", "compiled"):
                    names += [(f"{v}-{c}", int(c), args.tokens) for c in args.chunks.split(",")]
            for name, chunk, tokens in names:
                try:
                    compiled = name.startswith("compiled")
                    first = run_variant(model, prompts, chunk, tokens, compiled) if compiled else None
                    r = run_variant(model, prompts, chunk, tokens, compiled)
                    if first is not None:
                        r["first_prefill_s"], r["first_startup_s"] = first["prefill_s"], first["startup_s"]
                    r["tokens_per_s"] = r["prefill_tokens"] / r["prefill_s"]
                    r["of_roofline"] = rec["roofline_s"] / r["prefill_s"]
                except torch.OutOfMemoryError as e:
                    r = {"error": f"OOM: {str(e).splitlines()[0]}"}
                    torch.cuda.empty_cache()
                except Exception as e:  # keep going; the JSON says what failed
                    r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                rec["variants"][name] = r
                print(json.dumps({"model": preset, "prompt": prompt, "batch": batch, "variant": name,
                                  **{k: round(x, 4) if isinstance(x, float) else x for k, x in r.items()}}), flush=True)
            records.append(rec)
            with open(args.out, "w") as f:
                json.dump({"ceilings": ceil, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                           "tokens_per_forward": args.tokens, "records": records}, f, indent=2)
        del model
        torch.cuda.empty_cache()
    print(f"{'model':13} {'prompt':>6} {'B':>3} {'roof s':>7}  variant: prefill s (share of roofline)")
    for r in records:
        cells = "  ".join(f"{n}: {v['prefill_s']:.2f} ({v['of_roofline']:.0%})" if "prefill_s" in v else f"{n}: {v['error'][:30]}"
                          for n, v in r["variants"].items())
        print(f"{r['model']:13} {r['prompt']:>6} {r['batch']:>3} {r['roofline_s']:7.2f}  {cells}")


if __name__ == "__main__":
    main()
