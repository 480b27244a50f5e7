"""Resumable training state of tools/train/train_tiny.py (safetensors + JSON, never pickle) and the loss-curve PNG.

A state directory holds
  train_state.json                 step, the run's config, the history so far, the calls that made it;
  train_state-0000i.safetensors    "model.<name>" (the state_dict: parameters and the router's expert bias),
                                   "opt.<i>.<key>" (AdamW's exp_avg, exp_avg_sq, step per parameter index),
                                   "rng.cpu" / "rng.cuda" (torch's generator states), in shards of at most
                                   `shard_bytes` (the device tool brings back files of at most 16 MiB);
  tokenizer.json                   the run's tokenizer (a resumed run must not retrain it).
dtype float32 resumes exactly (12 bytes a parameter: 122 MB for tiny-llada2.1, over what a device call carries).
dtype bfloat16 keeps the parameters (the expert bias in float32) and exp_avg_sq in bf16 and drops exp_avg (4 bytes
a parameter: 41 MB, which a device call can bring back and carry in beside the repository). The resume is not exact:
the weights are rounded to bf16 once (<= 0.4 % relative), and the first moment restarts at zero and, with
beta1 = 0.9, is rebuilt within ~20 steps, which the resume's lr re-warm-up covers; exp_avg_sq keeps its scale, so no
step is oversized. Without moments (--state-weights-only: 2 bytes a parameter, 20 MB) AdamW starts afresh on
resume, which the re-warm-up also covers. The batches need no generator state: tools/train/tiny_mix.py builds each from
(seed, step).
A folder written by train_tiny.py --package --package-state (the state's shards beside bundle.tar.gz, which holds
state/train_state.json and state/tokenizer.json) reads as a state directory too.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

STATE_JSON = "train_state.json"


def save_state(path: Path, model, opt, info: dict, tokenizer=None, dtype=torch.float32,
               shard_bytes: int = 15_000_000, moments: bool = True) -> list[Path]:
    """moments=False: no optimizer state (AdamW starts afresh on resume, under the lr re-warm-up)."""
    path.mkdir(parents=True, exist_ok=True)
    keep = lambda k, v: not v.is_floating_point() or k.endswith("expert_bias")  # noqa: E731  (bias steps < bf16 ulp)
    tensors = {f"model.{k}": v.detach().to("cpu", v.dtype if keep(k, v) else dtype).contiguous()
               for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items() if moments else ():
        for key, v in st.items():
            if key == "exp_avg" and dtype != torch.float32:
                continue  # restarts at zero (module docstring)
            v = torch.as_tensor(v)
            keep = key == "step" or not v.is_floating_point()
            tensors[f"opt.{i}.{key}"] = v.detach().to("cpu", v.dtype if keep else dtype).reshape(-1).contiguous()
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    for old in path.glob("train_state-*.safetensors"):
        old.unlink()
    shards, size = [[]], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    files = []
    for i, names in enumerate(shards, 1):
        files.append(path / f"train_state-{i:05d}.safetensors")
        save_file({n: tensors[n] for n in names}, str(files[-1]), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(str(path / "tokenizer.json"))
    (path / STATE_JSON).write_text(json.dumps(info, indent=1) + "\n")
    return files


def read_state(path: Path) -> tuple[dict, dict, str]:
    """(info, tensors, tokenizer JSON) of a state directory or of a --package-state folder."""
    files = sorted(path.glob("train_state-*.safetensors"))
    if (path / STATE_JSON).exists():
        info, tok = (path / STATE_JSON).read_text(), (path / "tokenizer.json").read_text()
    elif (path / "bundle.tar.gz").exists():
        with tarfile.open(path / "bundle.tar.gz") as tar:
            try:
                info, tok = (tar.extractfile(f"state/{n}").read().decode() for n in (STATE_JSON, "tokenizer.json"))
            except KeyError:
                raise SystemExit(f"--resume {path}: bundle.tar.gz holds no state/{STATE_JSON}") from None
    else:
        raise SystemExit(f"--resume {path}: no {STATE_JSON} and no bundle.tar.gz (not a train_tiny state)")
    if not files:
        raise SystemExit(f"--resume {path}: no train_state-*.safetensors (run with --package-state to bring them back)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors |= load_file(str(f))
    return json.loads(info), tensors, tok


def restore(model, opt, tensors: dict) -> None:
    """Load the parameters, buffers, optimizer moments and torch RNG states saved by save_state."""
    sd = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    model.load_state_dict({k: v.to(model.device) for k, v in sd.items()}, strict=True)
    cur = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, p in enumerate(params):
        st = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"opt.{i}.")}
        if st:
            st = {k: (v.reshape(()) if k == "step" else v.view_as(p).to(torch.float32)) for k, v in st.items()}
            if "exp_avg_sq" in st and "exp_avg" not in st:  # a bfloat16 state
                st["exp_avg"] = torch.zeros_like(st["exp_avg_sq"])
            state[i] = st
    opt.load_state_dict({"state": state, "param_groups": cur["param_groups"]})
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])


def plot_history(history: list[dict], path: Path, title: str) -> None:
    """Training loss, masked-token loss, held-out masked loss and answer accuracy against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["loss"] for h in history], label="training loss (weighted)", lw=1.2)
    ax.plot(steps, [h["masked_loss"] for h in history], label="masked-token loss", lw=1.2)
    held = [(h["step"], h["held_masked_loss"]) for h in history if "held_masked_loss" in h]
    if held:
        ax.plot(*zip(*held), "o-", label="held-out masked loss (code)", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats)")
    ax.grid(alpha=0.3)
    acc = [(h["step"], h["answer_acc"]) for h in history if h.get("answer_acc") is not None]
    if acc:
        ax2 = ax.twinx()
        ax2.plot(*zip(*acc), color="tab:red", lw=1, alpha=0.7, label="masked answer-token accuracy")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("accuracy")
        ax2.legend(loc="upper center", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
