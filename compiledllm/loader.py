"""load_model: config.json + safetensors (single or sharded) + tokenizer -> a ready model. Never unpickles."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from compiledllm.errors import UserError
from compiledllm.export.runtime import is_exported, load_exported
from compiledllm.models import (KNOWN_ARCHITECTURES, BlockDiffusionLM, architecture_module, build_model,
                                resolve_architecture)
from compiledllm.models.config import ModelConfig
from compiledllm.tokenizer import TextTokenizer

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters save; recomputed here


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise UserError(f"dtype {dtype!r} is not one of float32, bfloat16, float16")
    return names[dtype]


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not path.is_dir():
        raise UserError(f"{path}: not a model directory")
    if not file.exists():
        raise UserError(f"{file}: not found (a model directory needs config.json)")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{file}: malformed JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{file}: expected a JSON object")
    return cfg


def parse_model_config(hf_config: dict, source: str) -> ModelConfig:
    arch = resolve_architecture(hf_config)
    if arch is None:
        got = hf_config.get("architectures") or hf_config.get("model_type")
        raise UserError(f"{source}: unknown architecture {got!r} (supported: {', '.join(KNOWN_ARCHITECTURES)})")
    try:
        return architecture_module(arch).parse_config(hf_config)
    except KeyError as e:
        raise UserError(f"{source}: missing key {e.args[0]!r} for architecture {arch}") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{source}: invalid value ({e})") from None


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{index}: malformed index ({e!r})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise UserError(f"{index}: names shard files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UserError(f"{path}: only pickle checkpoints found ({', '.join(pickles)}); compiledllm loads safetensors "
                        "only and never unpickles (convert with safetensors first)")
    raise UserError(f"{path}: no *.safetensors weights found")


def load_weights(model: BlockDiffusionLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its parameter; every expected weight must be found, shapes must match."""
    targets = model.hf_weight_map()
    seen: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise UserError(f"{file}: not a readable safetensors file ({e})") from None
        with handle as f:
            for name in f.keys():
                target = targets.get(name)
                if target is None:
                    if not name.endswith(IGNORED_SUFFIXES):
                        unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(target.shape):
                    raise UserError(f"{file.name}: tensor {name} has shape {list(shape)}, "
                                    f"the config implies {list(target.shape)}")
                with torch.no_grad():
                    target.copy_(f.get_tensor(name))
                seen.add(name)
    if unexpected:
        more = f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise UserError(f"{files[0].parent}: checkpoint tensors the model does not use: "
                        f"{', '.join(unexpected[:3])}{more}")
    missing = [n for n in targets if n not in seen]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise UserError(f"{files[0].parent}: checkpoint lacks tensors the model needs: {', '.join(missing[:3])}{more}")


def materialize(config: ModelConfig, device, dtype: torch.dtype) -> BlockDiffusionLM:
    """Build the model without initialising weights (they are loaded or initialised next)."""
    with torch.device("meta"):
        model = build_model(config).to(dtype)
    model = model.to_empty(device=device)
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def resolve_special_ids(config: ModelConfig, tokenizer: TextTokenizer | None, mask_token_id, eos_token_id,
                        source: str) -> ModelConfig:
    """The config with its MASK / EOS ids resolved: recipe value, else config.json, else the tokenizer's special
    tokens, else the architecture's known default."""
    defaults = architecture_module(config.architecture).DEFAULTS
    from_tok = {"mask": tokenizer.mask_id() if tokenizer else None, "eos": tokenizer.special_id("eos_token") if tokenizer else None}
    ids = {}
    for kind, override, from_cfg in (("mask", mask_token_id, config.mask_token_id),
                                     ("eos", eos_token_id, config.eos_token_id)):
        if isinstance(from_cfg, list):  # some configs list several EOS ids; the first is the primary one
            from_cfg = from_cfg[0] if from_cfg else None
        value = next(v for v in (override, from_cfg, from_tok[kind], defaults[f"{kind}_token_id"]) if v is not None)
        if not 0 <= int(value) < config.vocab_size:
            raise UserError(f"{source}: {kind}_token_id {value} is outside the vocabulary [0, {config.vocab_size})")
        ids[f"{kind}_token_id"] = int(value)
    return dataclasses.replace(config, **ids)


def build_random(config: str | dict, device="cpu", dtype=torch.float32, seed: int = 0,
                 mask_token_id: int | None = None, eos_token_id: int | None = None) -> BlockDiffusionLM:
    """A model with deterministic random weights, built directly on `device`, from a preset name
    (models/presets.py) or an inline config.json mapping: real-size shapes for benchmarks without checkpoints."""
    from compiledllm.builtin import init_random
    from compiledllm.models.presets import PRESETS

    if isinstance(config, str):
        if config not in PRESETS:
            raise UserError(f"model.config: unknown preset {config!r} (presets: {', '.join(PRESETS)})")
        source, config = f"preset {config}", PRESETS[config]
    else:
        source = "model.config"
    config = resolve_special_ids(parse_model_config(config, source), None, mask_token_id, eos_token_id, source)
    model = materialize(config, device, parse_dtype(dtype))
    init_random(model, seed)
    return model


def load_model(path, device="cpu", dtype=torch.float32, mask_token_id: int | None = None,
               eos_token_id: int | None = None) -> BlockDiffusionLM:
    """Load a Hugging Face-layout checkpoint directory (or a built-in model name) onto `device`."""
    from compiledllm import builtin

    if is_exported(path):
        return load_exported(path, device)
    if builtin.is_builtin(path):
        return builtin.load(path, device=device, dtype=dtype, mask_token_id=mask_token_id, eos_token_id=eos_token_id)
    path = Path(path)
    dtype = parse_dtype(dtype)
    config = parse_model_config(read_config(path), str(path / "config.json"))
    files = checkpoint_files(path)
    tokenizer = TextTokenizer.from_dir(path)
    config = resolve_special_ids(config, tokenizer, mask_token_id, eos_token_id, str(path))
    model = materialize(config, device, dtype)
    load_weights(model, files)
    model.tokenizer = tokenizer
    return model
