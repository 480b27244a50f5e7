"""The tiny-llada2.1 and tiny-llada kinds of tools/train/train_tiny.py (`--kind`): presets, the resumable training
loop, the synthetic-task evaluation and the model card. The legacy kind (tiny-llada2) stays in train_tiny.py.

tiny-llada2.1: LLaDA2 MoE layout (LLaDA2MoeModelLM): 16 experts of width 64, top-4 from 2 of 4 groups, a shared
  expert, sigmoid router with expert bias balanced without an auxiliary loss; context 8192. Block diffusion with
  block sizes 8-64 and LLaDA2.1 token-to-token corruption. Length curriculum: steps < long_from are short (1,024-
  token windows, every position noisy); from then on every long_every-th step is long (8,192-token windows whose
  noisy copy holds only the answer blocks plus random other blocks, noisy_cap tokens: tiny_mix.py), so retrieval
  and binding are first learnt at <= 1K distance, cheaply, then at 0.5-8K.
tiny-llada: LLaDA layout (LLaDAModelLM, bidirectional MHA, model.transformer.*), context 2048, masked diffusion over
  whole 2,048-token windows (one ratio per window; no clean copy, no block mask: SDPA's flash kernel).
Data (both): tiny_mix.py's windows over the stdlib training files and synth_tasks.py's generators; the mix is
MixConfig (code / tasks / lookup window shares, with a curriculum over the first steps). Each step's batch is a pure
function of (seed, step), built by forked worker processes (`loader`, --workers) a few steps ahead.
Fine-tune (--init-from CHECKPOINT_DIR): the checkpoint's weights and tokenizer, a fresh AdamW and lr schedule, the
original run's split (check_finetune), and no curriculum (the final window mix, long steps from step 0: the
checkpoint went through it). Block routing (--expert-capacity C, tiny-llada2.1, LLaDA2.2's: compiledllm/models/
block_routing.py): every MoE layer routes per route group, which every training forward passes (forward_loss:
the noisy copy's tokens by their 32-position block, the clean copy's blocks as groups of their own, dummy slots
nowhere), over windows of block 32 only, the block the inference policies must decode such a model with. The
"one bidirectional block" code windows are off in this mode: routing them per 32-position block would train a
routing the decode never sees (it decodes only 32-blocks), and one L-token route group would admit C experts for
the whole window, which no forward at inference does either. The expert-bias balancing counts the block-routed
assignment's loads (tiny_fast.attach_load_counters), so the bias still moves towards equal load, now acting on
which experts a block admits as well as on each token's pick among them.
Run layout: the task files are written by a forked child while the model trains (TaskWriter); after training, the
state and the checkpoint are saved (and packaged), then the in-run evaluation (eval_plan / run_eval_plan) fits every
task file into the time left before --deadline, scaling each file's task count by the seconds measured so far, and
the run ends with a compact table (tiny_card.summary_table; the full tables go to tiny_model.md and the card).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import synth_tasks as S
import tiny_card
import tiny_common as C
import tiny_data as D
import tiny_fast
import tiny_mix as M
import tiny_state
from compiledllm.attention.spec import AttentionSpec, BlockCausal, ExplicitMask
from compiledllm.loader import load_model
from compiledllm.policies.plan import Forward, route_groups
from compiledllm.save import save_model
from compiledllm.tokenizer import TextTokenizer

KINDS = ("tiny-llada2.1", "tiny-llada")
ARCH = {
    ("tiny-llada2.1", "full"): {
        "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 64, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "rope_theta": 100000.0,
        "max_position_embeddings": 8192},
    ("tiny-llada2.1", "tiny"): {
        "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 16,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "rope_theta": 10000.0,
        "max_position_embeddings": 128},
    ("tiny-llada", "full"): {"d_model": 256, "n_layers": 8, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 768,
                             "rope_theta": 10000.0, "max_sequence_length": 2048},
    ("tiny-llada", "tiny"): {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "mlp_hidden_size": 64,
                             "rope_theta": 10000.0, "max_sequence_length": 128},
}
# Per (kind, preset): vocabulary, step shapes, data mix (defaults for two such runs side by side on one H200).
# Full presets: few code windows (the targets are the generated tasks; code stays for the code task files and as
# filler), arithmetic weighted up, EOS padding after answers (the decode's trailing masks become EOS, not guesses),
# several questions per retrieval sample (the answer tokens are the only retrieval signal), and a curriculum: more
# short tasks and short lookups first (MixConfig.schedule), long 8K windows from step long_from.
SHORT_KINDS = (("add", 0.25), ("mul", 0.25), ("sort", 0.2), ("reverse", 0.15), ("copy", 0.15))
RUN = {
    ("tiny-llada2.1", "full"): {"vocab": 4096, "shapes": M.Shapes(1024, 16, 8192, 3, long_from=700, long_every=2),
                                "noisy_cap": 1024, "other_weight": 0.3,
                                "mix": M.MixConfig(shares=(0.2, 0.45, 0.35), early_shares=(0.1, 0.6, 0.3),
                                                   short_kinds=SHORT_KINDS, lookup_len=(96, 1024), lookup_start=320,
                                                   grow_steps=1200, long_len=(1024, 8192), questions=(1, 6),
                                                   long_questions=(2, 8), entries=(8, 20), eos_pad=(2, 32))},
    ("tiny-llada2.1", "tiny"): {"vocab": 384, "shapes": M.Shapes(64, 2, 128, 2, long_from=1, long_every=2),
                                "noisy_cap": 32, "mix": M.MixConfig(lookup_len=(40, 64), long_len=(64, 128),
                                                                    questions=(1, 2), entries=(2, 3), variables=(2, 3),
                                                                    eos_pad=(1, 4), early_shares=(0.2, 0.6, 0.2),
                                                                    grow_steps=2)},
    ("tiny-llada", "full"): {"vocab": 4096, "shapes": M.Shapes(2048, 24), "noisy_cap": 0,
                             "mix": M.MixConfig(shares=(0.15, 0.45, 0.40), early_shares=(0.1, 0.6, 0.3),
                                                short_kinds=SHORT_KINDS, lookup_len=(96, 2048), lookup_start=512,
                                                grow_steps=1500, questions=(1, 6), entries=(8, 20), eos_pad=(4, 32))},
    ("tiny-llada", "tiny"): {"vocab": 384, "shapes": M.Shapes(128, 2), "noisy_cap": 0,
                             "mix": M.MixConfig(shares=(0.35, 0.40, 0.25), lookup_len=(40, 128), questions=(1, 2),
                                                entries=(2, 3), variables=(2, 3), eos_pad=(2, 6))},
}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str | None          # None: a short-task file (synth_tasks.SHORT_FILES)
    n: int
    context: int = 0
    reserve: int = 128         # prompt tokens <= context - reserve: room for the answer, block rounding and another
                               # tokenizer (a model trained on another stdlib) that spends ~1 % more tokens
    entries: int | None = None


def synth_plan(kind: str, preset: str) -> list[TaskSpec]:
    if preset == "tiny":
        return [TaskSpec("arithmetic", None, 4), TaskSpec("lists", None, 4),
                TaskSpec("retrieval_128", "retrieval", 3, 128, 48, 2), TaskSpec("var_binding", "binding", 3, 128, 48, 2)]
    plan = [TaskSpec("arithmetic", None, 64), TaskSpec("lists", None, 64), TaskSpec("retrieval_1k", "retrieval", 64, 1024),
            TaskSpec("retrieval_2k", "retrieval", 64, 2048)]
    if kind == "tiny-llada2.1":
        plan += [TaskSpec("retrieval_4k", "retrieval", 64, 4096), TaskSpec("retrieval_8k", "retrieval", 32, 8192)]
    return plan + [TaskSpec("var_binding", "binding", 64, 2048)]


def write_synthetic(plan: list[TaskSpec], tokenizer, filler_texts: list[str], out_dir: Path,
                    seed: int = S.EVAL_SEED) -> dict[str, Path]:
    """The plan's task files (text prompts and references) into out_dir; returns name.jsonl -> path."""
    filler = S.FillerLines(filler_texts)
    files = {}
    for t in plan:
        if t.kind is None:
            recs = S.short_task_file(t.name, t.n, seed)
        else:
            kw = {"n_entries" if t.kind == "retrieval" else "n_vars": t.entries} if t.entries else {}
            recs = S.long_task_file(t.kind, t.n, t.context, tokenizer, filler, reserve=t.reserve, seed=seed,
                                    name=t.name, **kw)
        files[f"{t.name}.jsonl"] = out_dir / f"{t.name}.jsonl"
        D.write_jsonl(files[f"{t.name}.jsonl"], recs)
    return files


def hf_config(kind: str, preset: str, vocab: int) -> dict:
    a = ARCH[(kind, preset)]
    special = {"mask_token_id": D.MASK, "eos_token_id": D.EOS, "pad_token_id": D.PAD, "block_size": 32}
    if kind == "tiny-llada2.1":
        return {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": vocab, **a,
                "num_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.5,
                "tie_word_embeddings": False, "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False, **special}
    return {"architectures": ["LLaDAModelLM"], "model_type": "llada", "vocab_size": vocab, "embedding_size": vocab,
            **a, "rms_norm_eps": 1e-5, "weight_tying": False, "include_bias": False, **special}


# Block routing's block (--expert-capacity): the inference policies must decode a block-routed model with blocks of
# its routing block (the engine refuses others), so training windows use exactly that block too: other sizes would
# route other token sets than the decode does.
ROUTE_BLOCK = 32


def check_finetune(args) -> None:
    """--init-from / --expert-capacity: read the checkpoint's config.json, refuse the options that contradict them.
    A fine-tune keeps the checkpoint's tokenizer and the original run's file split (--holdout: the shipped
    tiny-llada2.1's 0.10 by default; a run's own from its results.json beside the checkpoint), so its held-out
    files and the task files (held-out code; generated items of the evaluation share only) stay unseen."""
    args.init_config = None
    if args.init_from is not None:
        for name in ("config.json", "tokenizer.json"):
            if not (args.init_from / name).is_file():
                raise SystemExit(f"--init-from {args.init_from}: no {name} (a checkpoint directory with its tokenizer, "
                                 "e.g. compiledllm/assets/tiny-llada2.1)")
        args.init_config = json.loads((args.init_from / "config.json").read_text())
        want = "llada2_moe" if args.kind == "tiny-llada2.1" else "llada"
        if args.init_config.get("model_type") != want:
            raise SystemExit(f"--init-from {args.init_from}: a {args.init_config.get('model_type')} checkpoint; "
                             f"--kind {args.kind} trains {want}")
        for flag, value in (("--resume", args.resume), ("--vocab", args.vocab)):
            if value is not None:
                raise SystemExit(f"{flag}: not with --init-from (a fresh optimizer and schedule from the checkpoint's "
                                 "weights, with its tokenizer)")
        original = args.init_from.parent / "results.json"  # a train_tiny run's OUT/checkpoint
        if original.is_file():
            held = json.loads(original.read_text()).get("data", {}).get("holdout", args.holdout)
            if held != args.holdout:
                raise SystemExit(f"--holdout {args.holdout}: {args.init_from} was trained with --holdout {held} "
                                 f"({original}); another split would train on its held-out files")
        if args.expert_capacity is None:  # a block-routed checkpoint stays block-routed
            args.expert_capacity = args.init_config.get("expert_capacity")
    if args.expert_capacity is None:
        return
    if args.kind != "tiny-llada2.1":
        raise SystemExit(f"--expert-capacity: {args.kind} has no MoE layers")
    if args.resume is not None:
        raise SystemExit("--resume: not with --expert-capacity (start a block-routed run with --init-from)")
    if args.p_bidir:
        raise SystemExit("--p-bidir: block routing trains no bidirectional windows (the model decodes 32-token "
                         "blocks only: tools/train/train_kinds.py)")
    args.p_bidir = 0.0
    c = args.init_config or hf_config(args.kind, args.preset, 0)
    if not c["num_experts_per_tok"] <= args.expert_capacity <= c["num_experts"]:  # a block admits >= a token's top_k
        raise SystemExit(f"--expert-capacity {args.expert_capacity}: between the experts a token takes "
                         f"({c['num_experts_per_tok']}) and the experts there are ({c['num_experts']})")


def start_model(args, vocab: int, log) -> tuple[dict, torch.nn.Module]:
    """(config.json dict, model in training mode): a fresh one, or --init-from's weights; with --expert-capacity
    block-routed over ROUTE_BLOCK-position blocks (config.json then says expert_capacity and block_size, which is
    how a loader turns block routing on)."""
    if args.init_from is None:
        cfg = hf_config(args.kind, args.preset, vocab)
        model = C.build_model(cfg, args.device, args.seed)
    else:
        cfg = {k: v for k, v in args.init_config.items() if k != "torch_dtype"}  # save_model writes its own
        model = load_model(args.init_from, device=args.device, dtype=torch.float32)  # the bf16 weights, exactly
        log(f"weights of {args.init_from} ({checkpoint_name(args.init_from)}); fresh optimizer and schedule")
    if args.expert_capacity is not None:  # its range: check_finetune
        from compiledllm.models.block_routing import use_block_routing

        model = use_block_routing(model, args.expert_capacity, ROUTE_BLOCK)
        cfg |= {"expert_capacity": args.expert_capacity, "block_size": ROUTE_BLOCK}
        log(f"block routing: each {ROUTE_BLOCK}-position block admits {args.expert_capacity} of "
            f"{cfg['num_experts']} experts")
    return cfg, model.requires_grad_(True).train()


def checkpoint_name(path: Path) -> str:
    """A checkpoint's name: its model card's title (`# tiny-llada2.1`), else its directory's name."""
    card = path / "README.md"
    first = card.read_text().split("\n", 1)[0] if card.is_file() else ""
    return first.removeprefix("# ").strip() if first.startswith("# ") else path.resolve().name


def finetune_flags(args) -> str:
    """The reproduce command's fine-tune options (and the schedule's, which a fine-tune usually sets)."""
    if args.init_from is None and args.expert_capacity is None:
        return ""
    flags = "" if args.init_from is None else f" --init-from {args.init_from}"
    flags += "" if args.expert_capacity is None else f" --expert-capacity {args.expert_capacity}"
    for name, default in (("lr", 2e-3), ("warmup", 100), ("holdout", 0.10)):
        if getattr(args, name) != default:
            flags += f" --{name} {getattr(args, name):g}"
    return flags


def fill_defaults(args) -> None:
    run = RUN[(args.kind, args.preset)]
    args.vocab = args.vocab or run["vocab"]
    sh = run["shapes"]
    long_from = 0 if args.init_from is not None else sh.long_from  # a fine-tune has been through the curriculum
    args.shapes = M.Shapes(args.seq_len or sh.short_len, args.batch or sh.short_batch,
                           sh.long_len if args.long_len is None else args.long_len,
                           args.long_batch or sh.long_batch,
                           long_from if args.long_from is None else args.long_from,
                           args.long_every or sh.long_every)
    args.seq_len = args.shapes.long_len or args.shapes.short_len  # the context trained (max_position_embeddings)
    args.batch = args.shapes.short_batch
    routed = {"block_sizes": (ROUTE_BLOCK,)} if args.expert_capacity is not None else {}
    args.objective = M.Objective("bd" if args.kind == "tiny-llada2.1" else "mdm",
                                 p_bidir=0.2 if args.p_bidir is None else args.p_bidir,
                                 p_t2t=args.p_t2t, max_corrupt=args.max_corrupt, keep_weight=args.keep_weight,
                                 noisy_cap=args.noisy_cap or run["noisy_cap"],
                                 other_weight=run.get("other_weight", 1.0), **routed)
    args.p_bidir = args.objective.p_bidir
    args.mix = run["mix"] if args.mix is None else M.MixConfig(**{**asdict(run["mix"]), "shares": tuple(args.mix)})
    if args.init_from is not None:  # no window-share / lookup-length curriculum either: the final mix from step 0
        args.mix = replace(args.mix, grow_steps=0)
    if args.kind == "tiny-llada" and args.shapes.long_len:
        raise SystemExit("--long-len: tiny-llada trains one window length (--seq-len)")
    if routed and args.shapes.long_len and args.objective.noisy_cap < ROUTE_BLOCK:
        raise SystemExit(f"--noisy-cap {args.objective.noisy_cap}: block routing's long windows need room for a "
                         f"{ROUTE_BLOCK}-token block")
    context = (args.init_config or {}).get("max_position_embeddings") or (args.init_config or {}).get(
        "max_sequence_length")
    if context is not None and args.seq_len > context:
        raise SystemExit(f"--seq-len / --long-len: {args.seq_len}-token windows exceed {args.init_from}'s context "
                         f"of {context} tokens")
    if args.deadline is None:
        args.deadline = 560.0
    if args.time_budget is None:
        args.time_budget = 1e9  # train until the deadline less the evaluation's share


# ---------------------------------------------------------------------------------------------- training

def to_torch(batch: dict, pin: bool = False) -> dict:
    out = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(v))
            out[k] = t.pin_memory() if pin else t
        else:
            out[k] = v
    return out


class StepBatches(torch.utils.data.Dataset):
    """Map-style dataset whose index is the step: item s is make(s) as CPU tensors (built in a worker)."""

    def __init__(self, make):
        self.make = make

    def __getitem__(self, step: int) -> dict:
        return to_torch(self.make(step))


def default_workers(device: torch.device) -> int:
    """Batch-building processes: none on the CPU (the tests; the model needs the cores), else half the cores
    less one, at most 6 (two runs side by side on a 16-core device machine leave cores for their main processes)."""
    return 0 if device.type != "cuda" else max(1, min(6, (os.cpu_count() or 2) // 2 - 1))


def loader(make, start: int, workers: int, pin: bool):
    """Batches start, start + 1, ... in order, built by `workers` forked processes (0: in this process) a few steps
    ahead and pinned in a thread of this one. Forked workers run numpy and the tokenizer only (no CUDA), and the
    tokenizer's own thread pool is turned off first (a forked Rust pool deadlocks)."""
    from torch.utils.data import DataLoader

    if workers:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return DataLoader(StepBatches(make), batch_size=None, sampler=range(start, start + (1 << 40)), num_workers=workers,
                      pin_memory=pin, prefetch_factor=4 if workers else None, persistent_workers=False,
                      multiprocessing_context="fork" if workers else None)


def to_device(batch: dict, dev) -> dict:
    return {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def forward_loss(model, b: dict, rows: slice, use_flex: bool):
    """(loss, stats [loss, masked loss, masked acc, answer acc, answer count]) of a batch slice."""
    tokens, positions = b["tokens"][rows].long(), b["positions"][rows].long()
    n_clean = b["n_clean"]
    B, N = tokens.shape
    groups, block = None, C.route_block(model)
    if "bids" in b:
        bids = b["bids"][rows]
        rule = tiny_fast.bd_rule(bids, n_clean, use_flex)
        at = torch.arange(n_clean, N, device=tokens.device)[None].expand(B, N - n_clean)
        if block is not None:  # block routing: [x0 ; x_t] routed per block, dummy slots (bids < 0) nowhere
            clean = torch.arange(N, device=tokens.device)[None] < n_clean
            groups = C.bd_route_groups(positions, bids >= 0, clean, block, -(-n_clean // block))
    else:
        rule, at = tiny_fast.FullRule(), None
    logits = model(Forward(tokens, positions, AttentionSpec(rule), logits_at=at, float_logits=True,
                           route_groups=groups))
    tgt, w = b["targets"][rows].long(), b["weights"][rows]
    masked, answer = b["masked"][rows], b["answer"][rows] & b["masked"][rows]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none").view_as(w)
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1) == tgt).float()
        m, a = masked.float(), answer.float()
        stats = torch.stack([loss.detach(), (ce * m).sum() / m.sum().clamp(min=1), (hit * m).sum() / m.sum().clamp(min=1),
                             (hit * a).sum() / a.sum().clamp(min=1), a.sum()])
    return loss, stats


class ShapeTimer:
    """Step time per shape (short / long) from a few synchronised steps after two warm-up steps of each."""

    def __init__(self, n: int = 6):
        self.n, self.seen, self.times = n, {}, {}

    def wants(self, shape: str) -> bool:
        return 2 <= self.seen.get(shape, 0) < 2 + self.n

    def add(self, shape: str, dt: float | None) -> bool:
        """Count a step; returns True when this shape's measurement just completed."""
        self.seen[shape] = self.seen.get(shape, 0) + 1
        if dt is not None:
            self.times.setdefault(shape, []).append(dt)
        return len(self.times.get(shape, [])) == self.n and dt is not None

    def per_step(self, shape: str) -> float | None:
        t = self.times.get(shape)
        return statistics.median(t) if t and len(t) == self.n else None


def plan_steps(step: int, seconds: float, shapes: M.Shapes, t_short: float, t_long: float | None,
               long_tokens_ratio: float) -> int:
    """How many steps fit in `seconds` from `step` on, with the curriculum's mix of short and long steps."""
    t_long = t_long or t_short * long_tokens_ratio
    s, left = step, seconds
    while left > 0 and s < step + 10_000_000:
        left -= t_long if shapes.is_long(s) else t_short
        s += 1
    return max(step + 1, s - 1)


def lr_factor(step: int, first: int, total: int | None, args) -> float:
    f = min(1.0, (step + 1) / max(1, args.warmup))
    if first > 0 and args.rewarm > 0:  # a resumed call ramps back up from the last call's decayed rate
        f = min(f, (step - first + 1) / args.rewarm)
    if total is not None and args.decay_frac > 0:
        p = (step - first) / max(1, total - first)
        if p > 1 - args.decay_frac:
            f *= args.min_lr_frac + (1 - args.min_lr_frac) * max(0.0, (1 - p) / args.decay_frac)
    return f


def train(model, batches: M.Batches, held: dict, args, log, stop_at: float, resumed: tuple | None) -> dict:
    dev = args.device
    cuda = dev.type == "cuda"
    opt = C.make_optimizer(model, args)
    prior = {"step": 0, "history": [], "wall_s": 0.0, "tokens_seen": 0, "tokens_forwarded": 0, "calls": []}
    if resumed is not None:
        info, tensors = resumed
        tiny_state.restore(model, opt, tensors)
        prior = {k: info[k] for k in prior}
        log(f"resumed at step {prior['step']} ({prior['tokens_seen']:,} tokens seen, {prior['wall_s']:.0f} s trained)")
    moes = tiny_fast.attach_moe_training(model, log)
    use_flex = cuda and args.flex
    first = step = prior["step"]
    history = list(prior["history"])
    total = args.steps
    workers = default_workers(dev) if args.workers is None else args.workers
    data = iter(loader(batches.make, step, workers, pin=cuda))
    held_t = to_device(to_torch(held, False), dev)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    timer, tried = ShapeTimer(), set()
    sh = args.shapes
    long_ratio = (sh.long_batch * (sh.long_len + args.objective.noisy_cap)) / max(1, sh.short_batch * 2 * sh.short_len) * 2
    t_start = time.time()
    budget_end = min(t_start + args.time_budget, stop_at)
    last_log, n_logs, seen, fwd_tokens, accum, stop, waited = 0.0, 0, 0, 0, 1, "steps", 0.0
    stats_sum, stats_n = None, 0

    def record(with_held: bool) -> None:
        nonlocal stats_sum, stats_n
        v = (stats_sum / stats_n).tolist()
        stats_sum, stats_n = None, 0
        el = time.time() - t_start
        rec = {"step": step, "lr": lr, "loss": v[0], "masked_loss": v[1], "masked_acc": v[2],
               "answer_acc": v[3] if v[4] > 0 else None, "grad_norm": float(gnorm),
               "elapsed_s": prior["wall_s"] + el, "tokens_seen": prior["tokens_seen"] + seen,
               "tokens_per_s": seen / max(el, 1e-9), "forwarded_per_s": fwd_tokens / max(el, 1e-9),
               "data_wait_share": waited / max(el, 1e-9)}
        if with_held:
            rec |= held_loss(model, held_t, autocast)
        if moes:
            load = torch.stack([m._load.float() for m in moes])
            rec["expert_load_max_over_mean"] = (load.max(1).values / load.mean(1)).mean().item()
        if cuda:
            rec["gpu_max_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
        history.append(rec)
        log(f"step {step} ({shape}) lr {lr:.1e} loss {v[0]:.3f} masked {v[1]:.3f} acc {v[2]:.3f}"
            + (f" answer {rec['answer_acc']:.3f}" if rec["answer_acc"] is not None else "")
            + (f" held {rec['held_masked_loss']:.3f}" if "held_masked_loss" in rec else "")
            + f" | {rec['tokens_per_s'] / 1e3:.0f}k tok/s ({rec['forwarded_per_s'] / 1e3:.0f}k forwarded, "
              f"data wait {rec['data_wait_share']:.0%})"
            + (f" | {rec['gpu_max_gb']:.1f} GB" if cuda else ""), **rec)

    try:
        with tiny_fast.training_attention():
            while total is None or step < total:
                if time.time() >= budget_end:
                    stop = "wall clock"
                    break
                t_get = time.time()
                b = to_device(next(data), dev)
                waited += time.time() - t_get
                shape = "long" if b["long"] else "short"
                lr = args.lr * lr_factor(step, first, total, args)
                for g in opt.param_groups:
                    g["lr"] = lr
                measure = cuda and timer.wants(shape)
                if measure:
                    torch.cuda.synchronize()
                t_step = time.time()
                B = b["tokens"].shape[0]
                while True:
                    try:
                        opt.zero_grad(set_to_none=True)
                        stats = torch.zeros(5, device=dev)
                        mb = -(-B // accum)
                        for i in range(0, B, mb):
                            with autocast:
                                loss, st = forward_loss(model, b, slice(i, i + mb), use_flex)
                            (loss * min(mb, B - i) / B).backward()
                            stats += st * min(mb, B - i) / B
                        if use_flex and shape not in tried and cuda:
                            torch.cuda.synchronize()  # a FlexAttention failure surfaces here, once per shape
                        tried.add(shape)
                        break
                    except torch.OutOfMemoryError:
                        if accum >= B:
                            raise
                        accum *= 2
                        opt.zero_grad(set_to_none=True)
                        torch.cuda.empty_cache()
                        log(f"out of memory: gradient accumulation {accum} x {-(-B // accum)} windows")
                    except Exception as e:  # noqa: BLE001  FlexAttention failed to compile or run: dense masks
                        if not use_flex or shape in tried:
                            raise
                        use_flex = False
                        log(f"FlexAttention failed ({type(e).__name__}: {str(e)[:160]}); SDPA with dense masks")
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                tiny_fast.balance_experts(moes, args.bias_rate)
                step += 1
                seen += B * b["n_clean"] if b["n_clean"] else b["tokens"].numel()
                fwd_tokens += b["tokens"].numel()
                stats_sum = stats if stats_sum is None else stats_sum + stats
                stats_n += 1
                if measure:
                    torch.cuda.synchronize()
                done = timer.add(shape, time.time() - t_step if measure else None)
                if done and args.steps is None:
                    t_s, t_l = timer.per_step("short"), timer.per_step("long")
                    if t_s is not None:
                        total = plan_steps(step, budget_end - time.time(), sh, t_s, t_l, long_ratio)
                        log(f"step time short {t_s * 1e3:.0f} ms" + (f", long {t_l * 1e3:.0f} ms" if t_l else "")
                            + f" -> {total} steps in the budget", step=step, planned_steps=total)
                now = time.time()
                if step == first + 1 or now - last_log >= args.log_every or step == total:
                    last_log, n_logs = now, n_logs + 1
                    record(n_logs % 4 == 1 or step == total)
            if stats_n:  # stopped by the wall clock: the last steps' line, with the held-out loss
                record(True)
    finally:
        del data  # stops the workers
    if cuda:
        torch.cuda.synchronize()
    wall = time.time() - t_start
    tiny_fast.detach_load_counters(moes)
    model.eval().requires_grad_(False)
    final = history[-1] if history else {}
    call = {"first_step": first, "steps": step - first, "wall_s": wall, "stopped_by": stop, "attention":
            "flex" if use_flex else ("sdpa-dense" if cuda else "sdpa-cpu"), "grad_accum": accum, "workers": workers,
            "data_wait_s": waited}
    return {"steps": step, "stopped_by": stop, "wall_s": prior["wall_s"] + wall, "tokens_seen": prior["tokens_seen"] + seen,
            "tokens_forwarded": prior["tokens_forwarded"] + fwd_tokens, "calls": prior["calls"] + [call],
            "final": final, "history": history, "opt": opt, "attention": call["attention"]}


@torch.no_grad()
def held_loss(model, held: dict, autocast) -> dict:
    """Masked loss and accuracy of the held-out code windows (dense masks: no FlexAttention compile for its shape)."""
    model.eval()
    with autocast:
        _, st = forward_loss(model, held, slice(None), use_flex=False)
    model.train()
    return {"held_masked_loss": st[1].item(), "held_masked_acc": st[2].item()}


# -------------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def needle_ablation(model, file: Path, limit: int | None, block: int = 32) -> dict:
    """One-forward exact match of retrieval tasks, with and without the needle's tokens hidden from every query.

    The prompt is followed by len(reference) masks and forwarded once (block-causal blocks of `block` from 0, as
    the engine's prefill and decode see it; fully bidirectional for bidirectional models); the answer is the argmax
    at the masks. Hidden: no query attends to the needle tokens (meta.needle_chars mapped through this tokenizer),
    so no later token carries what they say."""
    tok = model.tokenizer.tokenizer
    rows = [json.loads(ln) for ln in file.read_text().splitlines() if ln.strip()][:limit]
    out = {"tasks": len(rows), "full": 0, "hidden": 0}
    mask_id = model.mask_token_id
    for r in rows:
        enc = tok.encode(r["prompt"], add_special_tokens=False)
        ref = tok.encode(r["reference"], add_special_tokens=False).ids
        x = torch.tensor(enc.ids + [mask_id] * len(ref), device=model.device)[None]
        L = x.shape[1]
        base = (torch.ones(L, L, dtype=torch.bool, device=x.device) if model.bidirectional
                else BlockCausal(block).window_mask(L, x.device)[0])
        hide = torch.zeros(L, dtype=torch.bool, device=x.device)
        for a, b in r["meta"]["needle_chars"]:
            i, j = S.char_span_to_tokens(enc.offsets, a, b)
            hide[i:j] = True
        eye = torch.eye(L, dtype=torch.bool, device=x.device)
        at = torch.arange(L - len(ref), L, device=x.device)[None]
        pos = torch.arange(L, device=x.device)[None]
        rb = C.route_block(model)  # block routing: the blocks of `block` are the route groups too (block == rb)
        groups = None if rb is None else route_groups(pos, rb)
        for key, mask in (("full", base), ("hidden", (base & ~hide[None, :]) | eye)):
            lg = model(Forward(x, pos, AttentionSpec(ExplicitMask(mask[None])), logits_at=at, float_logits=True,
                               route_groups=groups))
            lg[..., mask_id] = float("-inf")
            out[key] += lg.argmax(-1)[0].tolist() == ref
    n = max(1, len(rows))
    return {"tasks": len(rows), "exact_match_full": out["full"] / n, "exact_match_needle_hidden": out["hidden"] / n}


EVAL_ORDER = ("arithmetic", "lists", "retrieval_4k", "retrieval_8k", "var_binding", "retrieval_1k", "retrieval_2k",
              "retrieval_128", "code_short", "code_long")


def ordered(files: dict[str, Path]) -> dict[str, Path]:
    rank = {n: i for i, n in enumerate(EVAL_ORDER)}
    return dict(sorted(files.items(), key=lambda kv: rank.get(kv[0].removesuffix(".jsonl"), len(rank))))


@dataclass(frozen=True)
class EvalItem:
    """One task file of the in-run evaluation: which policies (labels of tiny_common.EVAL_POLICIES), at most how many
    tasks, and its prompts' length in tokens (about), which weighs its cost."""
    name: str
    policies: tuple[str, ...]
    cap: int
    context: int

    def units(self, n: int | None = None) -> float:
        return (self.cap if n is None else n) * len(self.policies) * (1 + self.context / 1024)


ALL_POLICIES = ("threshold-0.95", "threshold-0.9", "t2t")


def prompt_tokens(file: Path, n: int = 8) -> int:
    """Mean prompt length of a task file's first n tasks: prompt_ids, else about 3 characters a token."""
    rows = [json.loads(ln) for ln in file.read_text().splitlines()[:n] if ln.strip()]
    if not rows:
        return 0
    return int(statistics.mean(len(r["prompt_ids"]) if "prompt_ids" in r else len(r["prompt"]) / 3 for r in rows))


def eval_plan(task_files: dict[str, Path], quick: bool = False) -> list[EvalItem]:
    """Every task file, the issue's targets first. arithmetic and lists (the exact-match, tokens-per-forward and t2t
    targets) with all three policies, 64 tasks; every other file with the exact decode (`threshold-0.95`) only
    (code_short also at 0.9), 32 tasks; `compiledllm eval` runs the full grid later. quick: 2 tasks, one policy."""
    items = []
    for name, file in ordered(task_files).items():
        stem, ctx = name.removesuffix(".jsonl"), prompt_tokens(file)
        if quick:
            items.append(EvalItem(name, ALL_POLICIES[:1], 2, ctx))
        elif stem in ("arithmetic", "lists"):
            items.append(EvalItem(name, ALL_POLICIES, 64, ctx))
        else:
            items.append(EvalItem(name, ALL_POLICIES[:2] if stem == "code_short" else ALL_POLICIES[:1], 32, ctx))
    return items


def eval_limit(item: EvalItem, rest_units: float, seconds_left: float, rate: float) -> int:
    """Tasks of `item` to run: its cap, or the same share of every remaining file's cap that fits the time left at
    `rate` seconds a unit (EvalItem.units), but at least 4 while those fit (the plan's order is its priority);
    else 0."""
    floor = min(4, item.cap)
    n = int(item.cap * min(1.0, seconds_left / max(rest_units * rate, 1e-9)))
    return max(n, floor) if item.units(floor) * rate <= seconds_left else 0


def run_eval_plan(model, task_files: dict[str, Path], plan: list[EvalItem], table, log, end_at: float,
                  rate: float = 0.06) -> tuple[dict, dict]:
    """(task results, needle ablation) of the plan, every file finished by end_at: each file's task count comes from
    eval_limit with the seconds a unit measured so far (`rate` until then: run 1 on the H200 spent 0.035-0.055)."""
    by_label = {p["label"]: p for p in C.EVAL_POLICIES}
    tasks, ablation, spent, units = {}, {}, 0.0, 0.0
    for i, item in enumerate(plan):
        start = time.time()
        n = eval_limit(item, sum(it.units() for it in plan[i:]), end_at - start, spent / units if units else rate)
        if n == 0:
            log(f"skipping {item.name}: no time left")
            tasks[item.name] = {"skipped": "deadline"}
            continue
        tasks |= C.eval_tasks(model, {item.name: task_files[item.name]}, table, 32, log, end_at, n,
                              tokenizer=model.tokenizer, policies=[by_label[lb] for lb in item.policies])
        if item.name.startswith("retrieval") and "policies" in tasks[item.name]:
            ablation[item.name] = needle_ablation(model, task_files[item.name], n)
            log(f"needle ablation {item.name}: " + json.dumps(ablation[item.name]))
        spent, units = spent + time.time() - start, units + item.units(n)
    return tasks, ablation


# ------------------------------------------------------------------------------------------------- main

def write_task_files(tok, held_files, held_code, args, tasks_dir: Path, log) -> None:
    """The run's task files (code from held-out files, then the synthetic plan). Runs in a forked process beside the
    training: the 4K / 8K files size their prompts by tokenizing, ~30 s on the device machine."""
    short, long_ = D.build_tasks(tok, held_files, seed=args.seed, **C.CODE_TASKS[args.preset])
    D.write_jsonl(tasks_dir / "code_short.jsonl", short)
    D.write_jsonl(tasks_dir / "code_long.jsonl", long_)
    plan = synth_plan(args.kind, args.preset)
    write_synthetic(plan, tok, [f.text for f in held_code], tasks_dir)
    log(f"tasks: {len(short)} code_short, {len(long_)} code_long, " + ", ".join(f"{t.n} {t.name}" for t in plan))


class TaskWriter:
    """write_task_files in a forked child (before any CUDA work in this process), joined before the files are read."""

    def __init__(self, *a):
        import multiprocessing as mp

        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no Rust thread pool across the fork (it would deadlock)
        self.proc = mp.get_context("fork").Process(target=write_task_files, args=a, daemon=True)
        self.proc.start()

    def join(self, log) -> bool:
        if self.proc.exitcode is None:
            self.proc.join()
        if self.proc.exitcode != 0:
            log(f"writing the task files failed (exit code {self.proc.exitcode}): no task evaluation")
        return self.proc.exitcode == 0


def main(args, t0: float) -> dict:
    deadline_at = t0 + args.deadline
    out = args.out
    ckpt, state_dir = out / "checkpoint", out / "state"
    ckpt.mkdir(parents=True, exist_ok=True)
    resumed = tiny_state.read_state(args.resume) if args.resume else None
    if resumed is not None:
        info = resumed[0]
        if (info["kind"], info["preset"]) != (args.kind, args.preset):
            raise SystemExit(f"--resume {args.resume}: a {info['kind']} / {info['preset']} state, not "
                             f"{args.kind} / {args.preset}")
        if "expert_capacity" in info["config"]:  # the state's model would be rebuilt without block routing
            raise SystemExit(f"--resume {args.resume}: a block-routed run's state does not resume (fine-tune its "
                             "checkpoint again with --init-from)")
        args.seed, args.vocab, args.holdout = info["seed"], info["vocab"], info["holdout"]
    log = C.Log(out / "train_log.jsonl", append=resumed is not None)
    dev = args.device
    torch.manual_seed(args.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    root = args.corpus or D.stdlib_root()
    files, train_files, held_files = D.corpus_split(root, args.max_files, args.holdout)
    log(f"{args.kind} ({args.preset}): corpus {root}: {len(files)} files, {len(train_files)} train / "
        f"{len(held_files)} held out")
    if resumed is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(resumed[2])
    elif args.init_from is not None:  # the checkpoint's own: its embeddings are of these ids
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
    else:
        tok = D.train_tokenizer([f.text for f in train_files], args.vocab, digits=True)
    vocab = tok.get_vocab_size()
    if args.init_from is not None:
        args.vocab = vocab
    train_stream = np.asarray(D.token_stream(D.encode_files(tok, train_files)), dtype=np.int32)
    held_code = [f for f in held_files if not f.is_test] or held_files
    held_stream = np.asarray(D.token_stream(D.encode_files(tok, held_code)), dtype=np.int32)
    if len(held_stream) <= args.shapes.short_len + 1:
        held_stream = np.tile(held_stream, args.shapes.short_len // max(1, len(held_stream)) + 2)
    log(f"tokenizer: vocab {vocab} (digits split); {len(train_stream):,} training tokens, {len(held_stream):,} held out")

    tasks_dir = out / "tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    task_files = {f"{n}.jsonl": tasks_dir / f"{n}.jsonl"
                  for n in ["code_short", "code_long"] + [t.name for t in synth_plan(args.kind, args.preset)]}
    writer = TaskWriter(tok, held_files, held_code, args, tasks_dir, log)

    cfg, model = start_model(args, vocab, log)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params:,} parameters ({params * 2 / 1e6:.1f} MB in bf16) on {dev}")
    windows = M.Windows(tok, train_stream, args.mix, D.EOS)
    batches = M.Batches(windows, args.shapes, args.objective, args.seed, vocab, len(D.SPECIALS), D.MASK, D.PAD)
    held = batches.held_out(held_stream, 8 if args.preset == "full" else 2, args.seed)
    eval_reserve = {"full": 90 if args.kind == "tiny-llada2.1" else 75, "quick": 25, "none": 5}[args.eval]
    training = train(model, batches, held, args, log, deadline_at - eval_reserve, resumed and resumed[:2])

    run = {"kind": args.kind, "preset": args.preset, "seed": args.seed, "vocab": args.vocab, "holdout": args.holdout,
           "shapes": asdict(args.shapes), "objective": asdict(args.objective), "mix": asdict(args.mix)}
    info = run | {"config": cfg, "step": training["steps"], "history": training["history"], "wall_s": training["wall_s"],
                  "tokens_seen": training["tokens_seen"], "tokens_forwarded": training["tokens_forwarded"],
                  "calls": training["calls"], "state_dtype": args.state_dtype,
                  "state_moments": not args.state_weights_only}
    tiny_state.save_state(state_dir, model, training.pop("opt"), info, tok, dtype=getattr(torch, args.state_dtype),
                          moments=not args.state_weights_only)
    if args.init_from is None:  # a fine-tune keeps the checkpoint's (its tokenizer_config.json too)
        model.tokenizer = TextTokenizer(tok, D.tokenizer_config(cfg.get("max_position_embeddings")
                                                               or cfg["max_sequence_length"]))
    weight_files = save_model(model, ckpt, cfg, dtype=torch.bfloat16)
    steps = training["steps"]
    command = (f"python tools/train/train_tiny.py --kind {args.kind} --out OUT --steps {steps}"
               + ("" if args.preset == "full" else f" --preset {args.preset}") + (f" --seed {args.seed}" if args.seed else "")
               + finetune_flags(args))
    results = {"kind": args.kind, "command": command, "config": cfg, "parameters": params,
               "init_from": None if args.init_from is None else {"path": str(args.init_from),
                                                                 "name": checkpoint_name(args.init_from)},
               "weights_bytes": sum(f.stat().st_size for f in weight_files),
               "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
               "torch": torch.__version__,
               "args": {k: (str(v) if isinstance(v, (Path, torch.device, torch.dtype)) else
                            asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in vars(args).items()},
               "data": {"python": sys.version.split()[0], "root": str(root), "files": len(files),
                        "train_files": len(train_files), "held_files": len(held_files), "holdout": args.holdout,
                        "train_tokens": len(train_stream), "held_tokens": len(held_stream), "mix": asdict(args.mix),
                        "eval_permille": S.EVAL_PERMILLE, "held_file_list": sorted(f.rel for f in held_files)},
               "training": {k: v for k, v in training.items() if k != "history"} | {
                   "batch": args.shapes.short_batch, "seq_len": args.seq_len, "shapes": asdict(args.shapes)}}
    (out / "training_history.json").write_text(json.dumps(training["history"], indent=1) + "\n")
    tiny_state.plot_history(training["history"], out / "loss_curve.png", f"{args.kind}: {steps} steps, "
                            f"{training['tokens_seen'] / 1e6:.1f}M tokens, {training['wall_s']:.0f} s")
    results["run_wall_s"] = time.time() - t0
    tasks_ok = writer.join(log)
    write_reports(out, ckpt, results)
    log(f"saved {ckpt} ({results['weights_bytes'] / 1e6:.2f} MB of weights) and {state_dir} ({args.state_dtype})")
    C.package(out, args.package, state=args.package_state)

    if args.eval != "none" and tasks_ok:
        torch.backends.cuda.matmul.allow_tf32 = False
        m = load_model(ckpt, device=dev, dtype=torch.float32)  # exactly the saved (bf16) weights
        results["eval_device"] = str(dev)
        n_win = 32 if args.eval == "full" else 2
        modes = ("bidirectional",) if args.kind == "tiny-llada" else ("block_32", "bidirectional")
        modes = ("block_32",) if C.route_block(m) is not None else modes  # block routing: no bidirectional windows
        results["masked_accuracy"] = C.masked_accuracy(m, torch.tensor(held_stream, dtype=torch.long, device=dev),
                                                       args.shapes.short_len, n_win, args.seed, modes=modes)
        table = D.bigram_table(train_stream.tolist(), vocab)
        plan = eval_plan(task_files, quick=args.eval == "quick")
        results["tasks"], results["needle_ablation"] = run_eval_plan(m, task_files, plan, table, log, deadline_at - 12)
    results["run_wall_s"] = time.time() - t0
    write_reports(out, ckpt, results)
    C.package(out, args.package, state=args.package_state)
    log(f"done in {results['run_wall_s']:.0f} s (full tables: {out / 'tiny_model.md'})\n" + results["summary"])
    return results


def write_reports(out: Path, ckpt: Path, results: dict) -> None:
    results["summary"] = tiny_card.summary_table(results)
    (ckpt / "README.md").write_text(tiny_card.model_card(results))
    (out / "tiny_model.md").write_text(C.metrics_tables(results) + "\n")
    (out / "summary.txt").write_text(results["summary"])
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
