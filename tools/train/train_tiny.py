#!/usr/bin/env python3
"""Train the shipped tiny LLaDA2-layout block-diffusion model on the Python standard library, then evaluate it.

One run does everything (so one GPU call produces the checkpoint and its numbers):
  1. corpus: the running interpreter's stdlib *.py files, split train / held out by sha1(relative path)
     (tools/train/tiny_data.py says exactly which files);
  2. tokenizer: byte-level BPE trained on the training files (<|endoftext|> EOS, <|pad|>, <|mask|>);
  3. line-completion task files from held-out files (tools/train/tiny_data.build_tasks): code_short.jsonl (finish a
     line of a function body, the function as context) and code_long.jsonl (1,500-1,920 tokens of the same file
     as context, cut right before a use of a name defined >= 1,000 tokens above);
  4. training with the project's own model class (LLaDA2 MoE layout: dense first layer, 8 experts top-2 with
     a shared expert, group-limited routing, q/k norm, partial RoPE), objective below, AdamW + cosine, bf16
     autocast on CUDA, stopped by step count or wall clock;
  5. checkpoint in HF layout (compiledllm.save.save_model) + model card;
  6. held-out evaluation of the saved checkpoint: masked-token accuracy by masking ratio, `threshold`
     (tau 0.95, 0.9) and `t2t` on both task files through the engine, and a bigram baseline.

Objective (BD3-LM / LLaDA2 block diffusion + LLaDA2.1 token-to-token editing), per sequence x0 of L tokens:
  * block size drawn per sequence from {4, 8, 16, 32, 64}, or the whole sequence (plain bidirectional
    masked diffusion) with probability --p-bidir;
  * per block a masking ratio t ~ U(0, 1); each token masked with probability t;
  * with probability --p-t2t a sequence also gets a share r ~ U(0, --max-corrupt) of its visible tokens
    replaced by random tokens;
  * the model sees [x_t ; x0] (2L tokens, both with positions 0..L-1) under the block-diffusion mask: noisy
    block i sees noisy block i and clean blocks < i; clean block i sees clean blocks <= i;
  * loss: cross entropy on the noisy copy against x0, weight 1 on masked and on replaced tokens, --keep-weight
    on the other visible tokens (so the model also learns when a visible token is right), normalised by the
    total weight.
MoE routers are balanced without an auxiliary loss (DeepSeek-V3 style): after each step every layer's
expert_bias moves by --bias-rate towards equal expert load.

Usage (the shipped checkpoint): python tools/train/train_tiny.py --out /tmp/tiny --time-budget 420
Smoke test: python tools/train/train_tiny.py --preset tiny --steps 3 --max-files 40 --out /tmp/t

Everything above is the legacy kind, `--kind tiny-llada2` (the default, kept as it was so that the shipped model's
command reproduces it). `--kind tiny-llada2.1` (LLaDA2 MoE, 16 experts, context 8192, block diffusion + T2T) and
`--kind tiny-llada` (LLaDA, bidirectional MHA, context 2048, masked diffusion) train on the stdlib mixed with
generated tasks (tools/train/train_kinds.py, tools/train/tiny_mix.py, tools/train/synth_tasks.py), resume with `--resume DIR/state`
(or a --package-state folder), and by default end by --deadline 560 s:
  python tools/train/train_tiny.py --kind tiny-llada2.1 --out /tmp/l21
  python tools/train/train_tiny.py --kind tiny-llada2.1 --resume /tmp/l21/state --out /tmp/l21b
  python tools/train/train_tiny.py --kind tiny-llada2.1 --out /tmp/l21 --state-dtype bfloat16 --package $OUT --package-state
  python tools/train/train_tiny.py --kind tiny-llada2.1 --resume $OUT_FOLDER --out /tmp/l21c
Fine-tune the shipped tiny-llada2.1 with LLaDA2.2 block routing, 8 of its 16 experts per 32-token block
(tools/train/train_kinds.py's docstring):
  python tools/train/train_tiny.py --kind tiny-llada2.1 --init-from compiledllm/assets/tiny-llada2.1 \
      --expert-capacity 8 --lr 5e-4 --warmup 50 --time-budget 200 --deadline 420 --out /tmp/l21b8
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tiny_card
import tiny_data as D
import train_kinds
from compiledllm.loader import load_model
from compiledllm.save import save_model
from compiledllm.tokenizer import TextTokenizer
from tiny_common import (CODE_TASKS, Log, bd_logits, build_model, eval_tasks, make_optimizer, masked_accuracy,
                         metrics_tables, package, task_note)
from tiny_fast import attach_load_counters, balance_experts, detach_load_counters

BLOCK_SIZES = (4, 8, 16, 32, 64)

# Architecture of each preset (vocab_size and max_position_embeddings are filled in from the run).
PRESETS = {
    "full": {"hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 96, "num_hidden_layers": 6,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8,
             "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
             "run": {"vocab": 4096, "seq_len": 2048, "batch": 16},
             "tasks": CODE_TASKS["full"]},
    "tiny": {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
             "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
             "run": {"vocab": 384, "seq_len": 128, "batch": 2},
             "tasks": CODE_TASKS["tiny"]},
}


def hf_config(preset: str, vocab: int, seq_len: int) -> dict:
    arch = {k: v for k, v in PRESETS[preset].items() if k not in ("run", "tasks")}
    return {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": vocab, **arch,
            "num_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "max_position_embeddings": seq_len, "tie_word_embeddings": False, "use_qk_norm": True,
            "use_qkv_bias": False, "use_bias": False, "mask_token_id": D.MASK, "eos_token_id": D.EOS,
            "pad_token_id": D.PAD, "block_size": 32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output dir: checkpoint/, tasks/, results.json, ...")
    ap.add_argument("--kind", choices=("tiny-llada2", "tiny-llada2.1", "tiny-llada"), default="tiny-llada2",
                    help="model kind (tiny-llada2: the legacy shipped model)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full", help="size: full, or tiny (smoke tests)")
    ap.add_argument("--corpus", type=Path, default=None, help="source root (default: this interpreter's stdlib)")
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N files (smoke tests)")
    ap.add_argument("--holdout", type=float, default=0.10)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="fixed step count (default: fill --time-budget); with --resume, counted from step 0")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="training wall-clock seconds (tiny-llada2: 420; new kinds: up to the deadline)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="whole-script seconds; the in-run eval is scaled to fit (new kinds: 560)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--p-bidir", type=float, default=None, help="default 0.2 (0 with --expert-capacity)")
    ap.add_argument("--p-t2t", type=float, default=0.5)
    ap.add_argument("--max-corrupt", type=float, default=0.2)
    ap.add_argument("--keep-weight", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--eval", choices=("full", "quick", "none"), default="full")
    ap.add_argument("--package", type=Path, default=None,
                    help="also copy the weights and a bundle.tar.gz of everything else here, after saving and at the end")
    new = ap.add_argument_group("tiny-llada2.1 / tiny-llada (--seq-len and --batch set the short steps)")
    new.add_argument("--resume", type=Path, default=None, help="continue from a state dir (OUT/state of a run)")
    new.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32",
                     help="saved state: float32 (parameters and both AdamW moments: exact resume, ~12 B a "
                          "parameter) or bfloat16 (parameters and second moments in bf16, first moments dropped "
                          "and rebuilt after the resume: not exact, 4 B a parameter, ~41 MB for tiny-llada2.1)")
    new.add_argument("--state-weights-only", action="store_true",
                     help="save no optimizer moments (AdamW starts afresh on resume; with bfloat16 2 B a parameter)")
    new.add_argument("--package-state", action="store_true",
                     help="with --package: the state's shards too (needs --state-dtype bfloat16); `--resume` takes "
                          "that folder as it comes back (--steps 0: no more training, only the checkpoint and eval)")
    new.add_argument("--workers", type=int, default=None,
                     help="batch-building processes (default: 0 on the CPU, min(6, cores / 2 - 1) on CUDA)")
    new.add_argument("--long-len", type=int, default=None, help="long-step window (0: none)")
    new.add_argument("--long-batch", type=int, default=None)
    new.add_argument("--long-from", type=int, default=None, help="first long step")
    new.add_argument("--long-every", type=int, default=None, help="then every N-th step is long")
    new.add_argument("--noisy-cap", type=int, default=None, help="noisy tokens per long window")
    new.add_argument("--mix", type=float, nargs=3, default=None, metavar=("CODE", "TASKS", "LOOKUP"),
                     help="window shares of the short steps")
    new.add_argument("--decay-frac", type=float, default=0.2, help="lr decays linearly over this last share of steps")
    new.add_argument("--rewarm", type=int, default=20, help="steps of lr ramp after --resume")
    new.add_argument("--log-every", type=float, default=30.0, help="seconds between progress lines")
    new.add_argument("--no-flex", dest="flex", action="store_false", help="SDPA with dense masks on CUDA too")
    new.add_argument("--init-from", type=Path, default=None, metavar="CHECKPOINT_DIR",
                     help="fine-tune: start from this checkpoint's weights (e.g. compiledllm/assets/tiny-llada2.1) "
                          "with its tokenizer and the original run's split (--holdout), a fresh optimizer and schedule, "
                          "no data curriculum")
    new.add_argument("--expert-capacity", type=int, default=None, metavar="C",
                     help="tiny-llada2.1: block routing (LLaDA2.2): each 32-position block admits C experts and its "
                          "tokens pick their top-k among them; blocks of 32 only, no bidirectional windows")
    args = ap.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.kind != "tiny-llada2":
        train_kinds.check_finetune(args)
        train_kinds.fill_defaults(args)
        if args.package_state and (args.package is None or args.state_dtype != "bfloat16"):
            raise SystemExit("--package-state: needs --package DIR and --state-dtype bfloat16 (a float32 state is "
                             "over what a device call brings back)")
        return args
    if args.resume is not None:
        raise SystemExit("--resume: only the tiny-llada2.1 and tiny-llada kinds resume")
    if args.init_from is not None or args.expert_capacity is not None:
        raise SystemExit("--init-from / --expert-capacity: only the tiny-llada2.1 kind (tiny-llada: --init-from)")
    args.p_bidir = 0.2 if args.p_bidir is None else args.p_bidir
    args.time_budget = 420.0 if args.time_budget is None else args.time_budget
    run = PRESETS[args.preset]["run"]
    args.vocab = args.vocab or run["vocab"]
    args.seq_len = args.seq_len or run["seq_len"]
    args.batch = args.batch or run["batch"]
    return args


# --------------------------------------------------------------------------------------------- objective

def block_ids(batch: int, length: int, gen, device, p_bidir: float) -> torch.Tensor:
    """[B, L] block index of every position; one block size per sequence (L = bidirectional)."""
    choice = torch.randint(0, len(BLOCK_SIZES), (batch,), generator=gen, device=device)
    blk = torch.tensor(BLOCK_SIZES, device=device)[choice]
    blk = torch.where(torch.rand(batch, generator=gen, device=device) < p_bidir, length, blk)
    return torch.arange(length, device=device)[None] // blk[:, None]


def noise(x0: torch.Tensor, bid: torch.Tensor, gen, vocab: int, p_t2t: float, max_corrupt: float):
    """x_t with per-block masking ratios and (for a share of sequences) random-token replacements."""
    B, L = x0.shape
    dev = x0.device
    t = torch.rand(B, L, generator=gen, device=dev).gather(1, bid)  # one ratio per block
    masked = torch.rand(B, L, generator=gen, device=dev) < t
    rate = torch.rand(B, 1, generator=gen, device=dev) * max_corrupt
    rate = rate * (torch.rand(B, 1, generator=gen, device=dev) < p_t2t)
    rand_tok = torch.randint(len(D.SPECIALS), vocab, (B, L), generator=gen, device=dev)
    corrupt = ~masked & (torch.rand(B, L, generator=gen, device=dev) < rate) & (rand_tok != x0)
    xt = torch.where(masked, D.MASK, torch.where(corrupt, rand_tok, x0))
    return xt, masked, corrupt


def loss_terms(logits, x0, masked, corrupt, keep_weight):
    V = logits.shape[-1]
    ce = F.cross_entropy(logits.reshape(-1, V), x0.reshape(-1), reduction="none").view_as(x0)
    w = masked.float() + corrupt.float() + keep_weight * (~masked & ~corrupt).float()
    loss = (ce * w).sum() / w.sum()
    with torch.no_grad():
        m = masked.float()
        masked_loss = (ce * m).sum() / m.sum().clamp(min=1)
        acc = ((logits.argmax(-1) == x0).float() * m).sum() / m.sum().clamp(min=1)
    return loss, masked_loss, acc


def lr_at(step: int, total: int | None, args) -> float:
    warm = args.warmup if total is None else min(args.warmup, max(1, total // 10))
    if step < warm:
        return args.lr * (step + 1) / warm
    if total is None:
        return args.lr
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


# ---------------------------------------------------------------------------------------------- training

def train(model, stream: torch.Tensor, held_stream: torch.Tensor, args, log: Log, deadline_at: float) -> dict:
    dev, B, L, V = args.device, args.batch, args.seq_len, model.config.vocab_size
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    eval_gen = torch.Generator(device=dev).manual_seed(args.seed + 1)
    hb = min(8, max(1, (held_stream.numel() - 1) // L))
    h_off = torch.randint(0, max(1, held_stream.numel() - L), (hb,), generator=eval_gen, device=dev)
    h_x0 = held_stream[h_off[:, None] + torch.arange(L, device=dev)]
    h_bid = block_ids(hb, L, eval_gen, dev, args.p_bidir)
    h_xt, h_m, h_c = noise(h_x0, h_bid, eval_gen, V, args.p_t2t, args.max_corrupt)

    opt = make_optimizer(model, args)
    moes = attach_load_counters(model)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    accum = 1
    total = args.steps
    t_start = time.time()
    budget_end = min(t_start + args.time_budget, deadline_at) if args.steps is None else deadline_at
    timing_from = None
    step = 0
    stop = "steps"
    history = []
    while total is None or step < total:
        if time.time() >= budget_end:
            stop = "wall clock"
            break
        lr = lr_at(step, total, args)
        for g in opt.param_groups:
            g["lr"] = lr
        off = torch.randint(0, stream.numel() - L, (B,), generator=gen, device=dev)
        x0 = stream[off[:, None] + torch.arange(L, device=dev)]
        bid = block_ids(B, L, gen, dev, args.p_bidir)
        xt, masked, corrupt = noise(x0, bid, gen, V, args.p_t2t, args.max_corrupt)
        while True:
            try:
                opt.zero_grad(set_to_none=True)
                stats = torch.zeros(3, device=dev)
                mb = B // accum
                for i in range(accum):
                    s = slice(i * mb, (i + 1) * mb)
                    with autocast:
                        logits = bd_logits(model, xt[s], x0[s], bid[s])
                    loss, mloss, acc = loss_terms(logits, x0[s], masked[s], corrupt[s], args.keep_weight)
                    (loss / accum).backward()
                    stats += torch.stack([loss.detach(), mloss, acc]) / accum
                    del logits, loss
                break
            except torch.OutOfMemoryError:
                if accum >= B:
                    raise
                accum *= 2
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                log(f"out of memory: gradient accumulation {accum} x {B // accum} sequences")
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance_experts(moes, args.bias_rate)
        step += 1
        if step == 3:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            timing_from = (step, time.time())
        if args.steps is None and step in (15, 60) and timing_from is not None:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - timing_from[1]) / (step - timing_from[0])
            total = step + int((budget_end - time.time()) / per_step * 0.98)
            log(f"step time {per_step * 1e3:.1f} ms -> {total} steps in the budget", step=step, per_step_s=per_step,
                planned_steps=total)
        if step % 50 == 0 or step == 1 or step == total:
            loss_v, mloss_v, acc_v = stats.tolist()
            rec = {"step": step, "lr": lr, "loss": loss_v, "masked_loss": mloss_v, "masked_acc": acc_v,
                   "grad_norm": float(gnorm), "elapsed_s": time.time() - t_start,
                   "tokens_per_s": step * B * L / (time.time() - t_start)}
            if step % 250 == 0 or step == total:
                model.eval()
                with torch.no_grad(), autocast:
                    hl = bd_logits(model, h_xt, h_x0, h_bid)
                _, h_mloss, h_acc = loss_terms(hl, h_x0, h_m, h_c, args.keep_weight)
                model.train()
                rec |= {"held_masked_loss": h_mloss.item(), "held_masked_acc": h_acc.item()}
                del hl
            load = torch.stack([m._load.float() for m in moes])
            rec["expert_load_max_over_mean"] = (load.max(1).values / load.mean(1)).mean().item()
            history.append(rec)
            log("step {step} lr {lr:.2e} loss {loss:.3f} masked {masked_loss:.3f} acc {masked_acc:.3f} "
                "gnorm {grad_norm:.2f} {tokens_per_s:.0f} tok/s".format(**rec)
                + (" held {held_masked_loss:.3f}/{held_masked_acc:.3f}".format(**rec) if "held_masked_loss" in rec else ""),
                **rec)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - t_start
    detach_load_counters(moes)
    model.eval().requires_grad_(False)
    return {"steps": step, "stopped_by": stop, "wall_s": wall, "batch": B, "seq_len": L,
            "tokens_seen": step * B * L, "tokens_forwarded": step * B * 2 * L, "grad_accum": accum,
            "final": history[-1] if history else {}, "history": history}


# ------------------------------------------------------------------------------------------------ report

def model_card(results: dict) -> str:
    if results.get("kind", "tiny-llada2") != "tiny-llada2":
        return tiny_card.model_card(results)
    c, d, t = results["config"], results["data"], results["training"]
    params = results["parameters"]
    return f"""# tiny-llada2

A small block-diffusion language model of the LLaDA2.0/2.1 MoE layout (`LLaDA2MoeModelLM`), trained from
scratch by `tools/train/train_tiny.py` on the Python standard library so that compiledllm has a real checkpoint:
confident where code is predictable, unsure where it is not. It writes plausible Python; it knows nothing else.

## Architecture
{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads / {c['num_key_value_heads']} KV heads
of {c['head_dim']} (q/k RMSNorm before RoPE, partial rotary {c['partial_rotary_factor']}, theta {c['rope_theta']:g}); layer 0 dense MLP
({c['intermediate_size']}), layers 1-{c['num_hidden_layers'] - 1} MoE: {c['num_experts']} experts of width {c['moe_intermediate_size']}, top-{c['num_experts_per_tok']}
with group-limited routing ({c['n_group']} groups, keep {c['topk_group']}), 1 shared expert, sigmoid router with
expert bias, routed scaling {c['routed_scaling_factor']}; untied head; vocabulary {c['vocab_size']} (byte-level BPE);
context {c['max_position_embeddings']} tokens. {params:,} parameters, stored in bfloat16 ({results['weights_bytes'] / 1e6:.1f} MB).
Special tokens: `<|endoftext|>` (EOS, id {D.EOS}), `<|pad|>` ({D.PAD}), `<|mask|>` ({D.MASK}).
`tokenizer_config.json` carries LLaDA2.0's chat template (`<role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>`)
so that messages prompts and `LLM.chat` take the shape they have on the real models; the model was never chat-tuned
and answers a chat prompt with Python-like text.

## Data and split
`*.py` files under the training interpreter's stdlib directory (Python {d['python']}, `{d['root']}`), test
directories included as far as that installation ships them, `site-packages` and non-UTF-8 files excluded: {d['files']} files. Held out: files with
sha1(relative path)[:8] mod 1000 < {round(d['holdout'] * 1000)} ({d['held_files']} files, {d['held_tokens']:,} tokens);
training: {d['train_files']} files, {d['train_tokens']:,} tokens. The tokenizer was trained on the training files
only. Task files (`compiledllm/assets/tasks/`) come from held-out files outside test directories.{task_note(results)}

## Objective
Block diffusion as in LLaDA2 / BD3-LM: the noisy copy x_t and the clean copy x_0 of each {t['seq_len']}-token window
are forwarded together (same positions) under the block-diffusion mask (noisy block i sees noisy block i and clean
blocks < i; clean block i sees clean blocks <= i); block size drawn per sequence from {{4, 8, 16, 32, 64}}, and
{results['args']['p_bidir']:.0%} of sequences fully bidirectional (plain masked diffusion); masking ratio t ~ U(0, 1)
per block. LLaDA2.1 token-to-token editing: {results['args']['p_t2t']:.0%} of sequences also have a share
r ~ U(0, {results['args']['max_corrupt']}) of visible tokens replaced by random tokens. Cross entropy against x_0 with
weight 1 on masked and replaced tokens and {results['args']['keep_weight']} on other visible tokens. Router balancing
without auxiliary loss (expert-bias updates of {results['args']['bias_rate']} per step).

## Training
AdamW (betas 0.9/0.95, weight decay {results['args']['weight_decay']}), peak lr {results['args']['lr']}, {results['args']['warmup']}-step
warm-up, cosine to {results['args']['min_lr_frac']}x; bf16 autocast on CUDA; batch {t['batch']} x {t['seq_len']} tokens; seed {results['args']['seed']}.
{t['steps']} steps (stopped by {t['stopped_by']}), {t['tokens_seen']:,} tokens seen ({t['tokens_forwarded']:,} forwarded
with the clean copies), {t['wall_s']:.0f} s of training on {results['device_name']} (whole run {results['run_wall_s']:.0f} s
including tokenizer, tasks and evaluation). Final training loss {t['final'].get('loss', float('nan')):.3f}, masked-token loss
{t['final'].get('masked_loss', float('nan')):.3f}; held-out masked loss {t['final'].get('held_masked_loss', float('nan')):.3f}.
Reproduce: `{results['command']}`.

## Held-out metrics
{metrics_tables(results)}
## Limitations
* A 7M-parameter model trained for minutes: it writes syntactically plausible, often repetitive Python and
  knows nothing beyond the standard library. Prompts should end inside a line of code (as the task prompts do):
  a prompt ending in a bare newline is rare in its training text and often gets EOS.
* {t['tokens_seen'] / max(d['train_tokens'], 1):.0f} passes over {d['train_tokens']:,} training tokens: the model fits its training text
  better than held-out text (held-out masked loss {t['final'].get('held_masked_loss', float('nan')):.2f} at the end; last training
  batch {t['final'].get('masked_loss', float('nan')):.2f}; see `docs/results/tiny_model_training_history.json`).
* Long-context retrieval is weak: the ablation above shows whether accuracy on `code_long.jsonl` depends on the far
  context. Where it does not, a long-context approximation can only be judged by its agreement with the exact decode.
* tokens/forward counts continuation tokens (at most {results['tasks'].get('code_short.jsonl', {}).get('max_new_tokens', 16) if results.get('tasks') else 16})
  per forward, while the decode fills whole 32-token blocks, so values below 1 do not mean less than one commit per forward.
"""


def main(argv=None) -> dict:
    t0 = time.time()
    args = parse_args(argv)
    if args.kind != "tiny-llada2":
        return train_kinds.main(args, t0)
    deadline_at = t0 + (args.deadline if args.deadline is not None else 1e9)
    torch.manual_seed(args.seed)
    out = args.out
    (out / "checkpoint").mkdir(parents=True, exist_ok=True)
    log = Log(out / "train_log.jsonl")
    dev = args.device
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    root = args.corpus or D.stdlib_root()
    files, train_files, held_files = D.corpus_split(root, args.max_files, args.holdout)
    log(f"corpus {root}: {len(files)} files ({sum(len(f.text) for f in files) / 1e6:.1f} MB), "
        f"{len(train_files)} train / {len(held_files)} held out")
    tok = D.train_tokenizer([f.text for f in train_files], args.vocab)
    vocab = tok.get_vocab_size()
    tok_cfg = D.tokenizer_config(args.seq_len)
    train_stream = D.token_stream(D.encode_files(tok, train_files))
    held_stream = D.token_stream(D.encode_files(tok, [f for f in held_files if not f.is_test] or held_files))
    log(f"tokenizer: vocab {vocab}; {len(train_stream):,} training tokens "
        f"({sum(len(f.text) for f in train_files) / len(train_stream):.2f} chars/token), {len(held_stream):,} held out")

    task_kw = PRESETS[args.preset]["tasks"]
    short, long_ = D.build_tasks(tok, held_files, seed=args.seed, **task_kw)
    task_files = {"code_short.jsonl": out / "tasks" / "code_short.jsonl", "code_long.jsonl": out / "tasks" / "code_long.jsonl"}
    D.write_jsonl(task_files["code_short.jsonl"], short)
    D.write_jsonl(task_files["code_long.jsonl"], long_)
    log(f"tasks: {len(short)} short, {len(long_)} long")

    cfg = hf_config(args.preset, vocab, args.seq_len)
    model = build_model(cfg, dev, args.seed)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params:,} parameters on {dev}")
    stream = torch.tensor(train_stream, dtype=torch.long, device=dev)
    held = torch.tensor(held_stream, dtype=torch.long, device=dev)
    if held.numel() <= args.seq_len:
        held = held.repeat(args.seq_len // max(1, held.numel()) + 2)
    eval_reserve = {"full": 110, "quick": 20, "none": 10}[args.eval]
    training = train(model, stream, held, args, log, deadline_at - eval_reserve)

    model.tokenizer = TextTokenizer(tok, tok_cfg)
    ckpt = out / "checkpoint"
    weight_files = save_model(model, ckpt, cfg, dtype=torch.bfloat16)
    command = "python tools/train/train_tiny.py --out OUT" + ("" if args.preset == "full" else f" --preset {args.preset}") + \
        f" --steps {training['steps']}" + (f" --seed {args.seed}" if args.seed else "")
    results = {"command": command, "config": cfg, "parameters": params,
               "weights_bytes": sum(f.stat().st_size for f in weight_files),
               "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
               "torch": torch.__version__, "args": {k: (str(v) if isinstance(v, (Path, torch.device)) else v)
                                                   for k, v in vars(args).items()},
               "data": {"python": sys.version.split()[0], "root": str(root), "files": len(files),
                        "train_files": len(train_files), "held_files": len(held_files), "holdout": args.holdout,
                        "train_tokens": len(train_stream), "held_tokens": len(held_stream),
                        "held_file_list": sorted(f.rel for f in held_files)},
               "training": {k: v for k, v in training.items() if k != "history"}}
    (out / "training_history.json").write_text(json.dumps(training["history"], indent=1) + "\n")
    results["run_wall_s"] = time.time() - t0
    (ckpt / "README.md").write_text(model_card(results))
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    log(f"saved {ckpt} ({results['weights_bytes'] / 1e6:.2f} MB of weights)")
    package(out, args.package)

    if args.eval != "none":
        torch.backends.cuda.matmul.allow_tf32 = False
        m = load_model(ckpt, device=dev, dtype=torch.float32)  # exactly the shipped (bf16) weights
        results["eval_device"] = str(dev)
        n_win = 32 if args.eval == "full" else 2
        results["masked_accuracy"] = masked_accuracy(m, held, args.seq_len, n_win, args.seed)
        log("masked accuracy: " + json.dumps({k: v for k, v in results["masked_accuracy"].items()}))
        table = D.bigram_table(train_stream, vocab)
        limit = None if args.eval == "full" else 4
        results["tasks"] = eval_tasks(m, task_files, table, 32, log, deadline_at - 15, limit)
        if dev.type == "cuda" and any("error" in r for r in results["tasks"].values()):
            log("retrying the failed task files on the CPU")
            m = load_model(ckpt, device="cpu", dtype=torch.float32)
            failed = {k: v for k, v in task_files.items() if "error" in results["tasks"][k]}
            results["tasks"] |= eval_tasks(m, failed, table, 32, log, deadline_at - 15, limit)
            results["eval_device"] = "cuda; cpu for " + ", ".join(failed)
    results["run_wall_s"] = time.time() - t0
    (ckpt / "README.md").write_text(model_card(results))
    (out / "tiny_model.md").write_text(metrics_tables(results) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    package(out, args.package)
    log(f"done in {results['run_wall_s']:.0f} s\n\n" + metrics_tables(results))
    return results


if __name__ == "__main__":
    main()
