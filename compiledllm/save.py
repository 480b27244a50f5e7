"""save_model: write a model in the Hugging Face directory layout that `load_model` reads back.

The checkpoint names are the inverse of `model.hf_weight_map()` (HF tensor name -> parameter or view), so a
saved model loads into the same architecture with identical weights (up to the storage dtype). Weights go to
`model.safetensors`, or to `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json` when
they would pass `max_shard_bytes`. Float tensors are stored in `dtype`, except the MoE router's expert bias,
which stays float32 as in the LLaDA2 checkpoints.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from compiledllm.loader import parse_dtype

FLOAT32_SUFFIXES = ("expert_bias",)  # router state kept in float32 whatever the storage dtype
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SHARD_LIMIT = 16_000_000  # bytes of tensor data per file (just under 16 MiB with the header)


def checkpoint_tensors(model, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """HF name -> an independent, contiguous CPU tensor in the storage dtype."""
    dtype = parse_dtype(dtype)
    out = {}
    for name, t in model.hf_weight_map().items():
        t = t.detach()
        if t.is_floating_point():
            t = t.to(torch.float32 if name.endswith(FLOAT32_SUFFIXES) else dtype)
        out[name] = t.to("cpu").contiguous().clone()
    return out


def plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy, order-preserving packing of tensor names into files of at most max_bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def save_model(model, path, hf_config: dict, *, dtype=torch.bfloat16, max_shard_bytes: int = SHARD_LIMIT,
               tokenizer: bool = True) -> list[Path]:
    """Write config.json, safetensors weights (sharded with an index when needed) and, if the model has one,
    tokenizer.json + tokenizer_config.json into `path`. Returns the weight files written."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(dtype)
    for old in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        if old.exists():
            old.unlink()  # a previous save's shards would otherwise be loaded alongside the new ones
    tensors = checkpoint_tensors(model, dtype)
    shards = plan_shards(tensors, max_shard_bytes)
    meta = {"format": "pt"}
    files: list[Path] = []
    if len(shards) == 1:
        files.append(path / "model.safetensors")
        save_file(tensors, str(files[0]), metadata=meta)
    else:
        weight_map = {}
        for i, names in enumerate(shards, 1):
            file = path / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, str(file), metadata=meta)
            weight_map |= {n: file.name for n in names}
            files.append(file)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = dict(hf_config)
    config["torch_dtype"] = DTYPE_NAMES[dtype]
    for key in ("mask_token_id", "eos_token_id"):
        if config.get(key) is None and getattr(model, key, None) is not None:
            config[key] = int(getattr(model, key))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok = getattr(model, "tokenizer", None)
    if tokenizer and tok is not None:
        tok.tokenizer.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(tok.config, indent=2) + "\n")
    return files


__all__ = ["save_model", "checkpoint_tensors", "plan_shards", "SHARD_LIMIT"]
