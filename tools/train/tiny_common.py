"""What both kinds of tools/train/train_tiny.py share: the run log, the model's build and optimizer, the held-out
evaluation (masked-token accuracy, task files through the engine), the metrics tables and the packaging of a run.

Imports go one way: train_tiny (the CLI and the legacy tiny-llada2 kind) -> train_kinds (tiny-llada2.1, tiny-llada)
-> tiny_card (their model card) -> tiny_common (this file) -> tiny_data; nothing here imports those above it.
"""
from __future__ import annotations

import json
import shutil
import tarfile
import time
from pathlib import Path

import torch

import tiny_data as D
from compiledllm.attention.spec import AttentionSpec, BlockCausal, ExplicitMask
from compiledllm.builtin import init_random
from compiledllm.loader import materialize, parse_model_config
from compiledllm.policies.plan import Forward

RATIOS = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
EVAL_POLICIES = [
    {"label": "threshold-0.95", "name": "threshold", "block_size": 32, "threshold": 0.95},
    {"label": "threshold-0.9", "name": "threshold", "block_size": 32, "threshold": 0.9},
    {"label": "t2t", "name": "t2t", "block_size": 32, "threshold": 0.7, "edit_threshold": 0.5, "max_post_steps": 16},
]

# Sizes of the code task files (code_short / code_long, tiny_data.build_tasks) of each preset, both kinds.
CODE_TASKS = {
    "full": {"n_short": 64, "n_long": 64, "max_ref": 16},
    "tiny": {"n_short": 4, "n_long": 4, "max_ref": 8, "short_max_prompt": 48, "long_min_prompt": 64,
             "long_max_prompt": 96, "far": 24, "quiet": 8, "short_pre": 8},
}


class Log:
    """Progress lines to stdout and to train_log.txt beside `path`; records (keyword arguments) to `path` (JSONL)."""

    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a" if append else "w")
        self.text = path.with_suffix(".txt").open("a" if append else "w")
        self.t0 = time.time()

    def __call__(self, msg: str, **rec) -> None:
        line = f"[{time.time() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.text.write(line + "\n")
        self.text.flush()
        if rec:
            self.file.write(json.dumps({"t": round(time.time() - self.t0, 2), **rec}) + "\n")
            self.file.flush()


# -------------------------------------------------------------------------------------- model

def bd_mask(bid: torch.Tensor) -> torch.Tensor:
    """[B, 2L, 2L] bool for [x_t ; x0]: noisy i sees noisy block(i) and clean blocks < block(i);
    clean i sees clean blocks <= block(i); clean never sees noisy."""
    q, k = bid[:, :, None], bid[:, None, :]
    top = torch.cat([q == k, k < q], dim=2)
    bottom = torch.cat([torch.zeros_like(k <= q), k <= q], dim=2)
    return torch.cat([top, bottom], dim=1)


def bd_logits(model, xt: torch.Tensor, x0: torch.Tensor, bid: torch.Tensor) -> torch.Tensor:
    """Float32 logits [B, L, V] of the noisy copy under the block-diffusion mask."""
    B, L = x0.shape
    pos = torch.arange(L, device=x0.device).repeat(2)[None].expand(B, 2 * L)
    idx = torch.arange(L, device=x0.device)[None].expand(B, L)
    block, clean = route_block(model), torch.arange(2 * L, device=x0.device)[None] >= L  # [x_t ; x0]
    groups = None if block is None else bd_route_groups(pos, torch.ones_like(clean), clean, block, -(-L // block))
    return model(Forward(torch.cat([xt, x0], 1), pos, AttentionSpec(ExplicitMask(bd_mask(bid))), logits_at=idx,
                         float_logits=True, route_groups=groups))


def route_block(model) -> int | None:
    """The routing block of a block-routed model (models/block_routing.py), else None."""
    moe = getattr(model.config, "moe", None)
    return None if moe is None else moe.route_block


def bd_route_groups(positions: torch.Tensor, live: torch.Tensor, clean: torch.Tensor, block: int, n_blocks: int
                    ) -> torch.Tensor:
    """Forward.route_groups [B, N] of a training forward over both copies, for a block-routed model: each token's
    block (position // block), the clean copy's offset by n_blocks (the window's block count), -1 where not `live`
    (dummy slots). A clean block and the noisy copy of it are two groups because at inference they are two
    forwards: the clean block was routed alone when it was prefilled or committed, the noisy one is the block
    being decoded."""
    return torch.where(live, positions // block + clean * n_blocks, -1)


def build_model(cfg: dict, device, seed: int):
    model = materialize(parse_model_config(cfg, "train_tiny"), device, torch.float32)
    init_random(model, seed, std=0.02, embed_std=0.02)
    with torch.no_grad():  # GPT-2 style: residual output projections scaled by 1/sqrt(2 * layers)
        scale = (2 * model.config.num_layers) ** -0.5
        for name, p in model.named_parameters():
            if name.endswith(("attn.o.weight", "down.weight", "w_down")):
                p.mul_(scale)
    return model.requires_grad_(True).train()


def make_optimizer(model, args):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and not name.startswith("embed") else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = args.device.type == "cuda"
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


# ---------------------------------------------------------------------------- evaluation

@torch.no_grad()
def masked_accuracy(model, held_stream: torch.Tensor, L: int, n_windows: int, seed: int, batch: int = 8,
                    modes: tuple[str, ...] = ("block_32", "bidirectional")) -> dict:
    """Masked-token accuracy of held-out windows by masking ratio: block diffusion with block 32 (clean earlier
    blocks, every block masked at the ratio) and fully bidirectional (the whole window masked at the ratio)."""
    dev = model.device
    n = min(n_windows, max(1, (held_stream.numel() - 1) // L))
    gen = torch.Generator(device=dev).manual_seed(seed)
    starts = torch.arange(n, device=dev) * L
    out = {"windows": n, "window_tokens": L, **{m: {} for m in modes}}
    for r in RATIOS:
        hit = {m: 0.0 for m in modes}
        cnt = 0.0
        for b0 in range(0, n, batch):
            x0 = held_stream[starts[b0 : b0 + batch, None] + torch.arange(L, device=dev)]
            masked = torch.rand(x0.shape, generator=gen, device=dev) < r
            masked[:, 0] |= ~masked.any(1)
            xt = torch.where(masked, D.MASK, x0)
            bid = (torch.arange(L, device=dev) // 32)[None].expand_as(x0)
            preds = {}
            if "block_32" in modes:
                preds["block_32"] = bd_logits(model, xt, x0, bid)
            if "bidirectional" in modes:
                preds["bidirectional"] = model(Forward(xt, torch.arange(L, device=dev)[None].expand_as(x0),
                                                       AttentionSpec(BlockCausal(L)), float_logits=True))
            for k, lg in preds.items():
                lg[..., D.MASK] = float("-inf")
                hit[k] += ((lg.argmax(-1) == x0) & masked).sum().item()
            cnt += masked.sum().item()
        for k in hit:
            out[k][str(r)] = hit[k] / max(cnt, 1)
    return out


def eval_tasks(model, task_files: dict[str, Path], table, batch_size: int, log: Log, deadline_at: float,
               limit: int | None = None, tokenizer=None, policies: list[dict] | None = None) -> dict:
    """Every task file through the engine with `policies` (EVAL_POLICIES); text tasks are encoded with `tokenizer`."""
    from compiledllm.evaluate import continuation_scores, evaluate, load_tasks

    res = {}
    for name, file in task_files.items():
        if not file.read_text().strip():
            res[name] = {"skipped": "no tasks"}
            continue
        tasks = load_tasks(file, tokenizer, limit=limit)
        if time.time() > deadline_at:
            log(f"skipping {name}: past the deadline")
            res[name] = {"skipped": "deadline"}
            continue
        try:
            r = evaluate(model, tasks, policies or EVAL_POLICIES, batch_size=batch_size, cuda_graphs=False)
        except Exception as e:  # keep the run's other results; say what failed
            log(f"engine eval of {name} on {model.device} failed: {e!r}")
            res[name] = {"error": repr(e)}
            continue
        outs = [D.bigram_generate(table, t.prompt_ids, len(t.reference_ids)) for t in tasks]
        r["baseline_bigram"] = continuation_scores(outs, [t.reference_ids for t in tasks])
        r["samples"] = [{"id": t.id, "reference_ids": t.reference_ids,
                         **{lb: r["outputs"][lb][i] for lb in r["outputs"]}} for i, t in enumerate(tasks[:3])]
        del r["outputs"]
        res[name] = r
        log(f"{name}: " + ", ".join(f"{lb} EM {m['exact_match']:.3f} acc {m['token_accuracy']:.3f} "
                                    f"tpf {m['tokens_per_forward']:.2f}" for lb, m in r["policies"].items())
            + f"; bigram EM {r['baseline_bigram']['exact_match']:.3f} acc {r['baseline_bigram']['token_accuracy']:.3f}")
    return res


# -------------------------------------------------------------------------------- report

def metrics_tables(results: dict) -> str:
    lines = []
    ma = results.get("masked_accuracy")
    if ma:
        lines += [f"Masked-token accuracy on {ma['windows']} held-out windows of {ma['window_tokens']} tokens "
                  "(argmax over the vocabulary without MASK):", "",
                  "| masking ratio | " + " | ".join(str(r) for r in RATIOS) + " |",
                  "|---|" + "---:|" * len(RATIOS)]
        for mode, name in (("block_32", "block diffusion, block 32"), ("bidirectional", "bidirectional")):
            if mode not in ma:
                continue
            lines.append(f"| {name} | " + " | ".join(f"{ma[mode][str(r)]:.3f}" for r in RATIOS) + " |")
        lines.append("")
    lines += synthetic_summary(results)
    for fname, r in results.get("tasks", {}).items():
        if "policies" not in r:
            lines += [f"{fname}: not evaluated ({r})", ""]
            continue
        lines += [f"`{fname}` ({r['tasks']} tasks, {r['max_new_tokens']} new tokens, engine on {results.get('eval_device')}, "
                  f"float32; agreement is with `{r['reference']}`):", "",
                  "| policy | exact match | token acc | prefix tokens | agreement | forwards | tokens/forward |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for lb, m in r["policies"].items():
            lines.append(f"| `{lb}` | {m['exact_match']:.3f} | {m['token_accuracy']:.3f} | {m['prefix_tokens']:.2f} "
                         f"| {m['agreement']:.3f} | {m['forwards']} | {m['tokens_per_forward']:.2f} |")
        b = r["baseline_bigram"]
        lines += [f"| bigram baseline (greedy) | {b['exact_match']:.3f} | {b['token_accuracy']:.3f} | "
                  f"{b['prefix_tokens']:.2f} | - | - | - |", ""]
    ab = results.get("long_context_ablation")
    if ab:
        lines += [f"Long-context ablation ({ab['note']}; `{ab['policy']}`):", "",
                  "| prompt | exact match | token acc | prefix tokens |", "|---|---:|---:|---:|"]
        for key, m in ab.items():
            if isinstance(m, dict):
                name = "full (1,500-1,920 tokens)" if key == "full" else key.replace("_", " ") + " tokens"
                lines.append(f"| {name} | {m['exact_match']:.3f} | {m['token_accuracy']:.3f} | {m['prefix_tokens']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def synthetic_summary(results: dict) -> list[str]:
    """One row per evaluated task file: exact match and tokens per forward of each policy, and the needle ablation."""
    tasks = {k: v for k, v in results.get("tasks", {}).items() if "policies" in v}
    if not tasks or "kind" not in results:
        return []
    labels = list(next(iter(tasks.values()))["policies"])
    lines = ["Summary (exact match / tokens per forward; the engine on the saved bf16 weights in float32):", "",
             "| task file | tasks | " + " | ".join(f"`{lb}`" for lb in labels) + " |", "|---|---:|" + "---:|" * len(labels)]
    for name, r in tasks.items():
        cells = [f"{r['policies'][lb]['exact_match']:.3f} / {r['policies'][lb]['tokens_per_forward']:.2f}"
                 if lb in r["policies"] else "-" for lb in labels]
        lines.append(f"| `{name}` | {r['tasks']} | " + " | ".join(cells) + " |")
    lines.append("")
    ab = results.get("needle_ablation")
    if ab:
        lines += [("Needle ablation (one forward: the prompt, then as many masks as the reference has tokens; argmax "
                   "exact match with every query seeing the needle, and with the needle's tokens hidden from every "
                   "query; chance is ~0, the answers are 5-digit values):"), "",
                  "| task file | tasks | exact match | needle hidden |", "|---|---:|---:|---:|"]
        for name, a in ab.items():
            lines.append(f"| `{name}` | {a['tasks']} | {a['exact_match_full']:.3f} | {a['exact_match_needle_hidden']:.3f} |")
        lines.append("")
    return lines


def task_note(results: dict) -> str:
    src = results.get("task_source")
    if not src:
        return ""
    return (f" The shipped task files were built after training by `tools/train/build_tasks.py` from Python {src['python']}'s "
            f"copies of the held-out files (`{src['root']}`; the split goes by relative path, so none of these files "
            f"was in the training data); the bigram baseline counts {results.get('bigram_source', 'the training files')}.")


def package(out: Path, dest: Path | None, state: bool = False) -> None:
    """Copy the weights (state: and the state's shards) and a tarball of every other output file to `dest`
    (the device run's $OUT: files of at most 16 MiB, all in one folder)."""
    if dest is None:
        return
    dest.mkdir(parents=True, exist_ok=True)
    for f in [*(out / "checkpoint").glob("*.safetensors"), *((out / "state").glob("*.safetensors") if state else ())]:
        shutil.copy2(f, dest / f.name)
    tmp = dest / "bundle.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(out.rglob("*")):
            if f.is_file() and f.suffix != ".safetensors":
                tar.add(f, arcname=str(f.relative_to(out)))
    tmp.replace(dest / "bundle.tar.gz")
