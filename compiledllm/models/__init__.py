"""Architecture registry: config.json's `architectures` / `model_type` -> (parser, model class, defaults)."""
from __future__ import annotations

from types import ModuleType

from compiledllm.models import llada, llada2_moe, sdar
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.config import ModelConfig, MoEConfig

_MODULES: dict[str, ModuleType] = {"llada2_moe": llada2_moe, "sdar": sdar, "llada": llada}
_CLASSES: dict[str, type[BlockDiffusionLM]] = {
    "llada2_moe": llada2_moe.LLaDA2MoE, "sdar": sdar.SDAR, "llada": llada.LLaDA,
}


def resolve_architecture(hf_config: dict) -> str | None:
    """Registry name for a config.json, from `architectures` first, then `model_type`."""
    for name, mod in _MODULES.items():
        if any(a in mod.ARCHITECTURES for a in hf_config.get("architectures") or []):
            return name
    for name, mod in _MODULES.items():
        if hf_config.get("model_type") in mod.MODEL_TYPES:
            return name
    return None


def architecture_module(name: str) -> ModuleType:
    return _MODULES[name]


def build_model(config: ModelConfig) -> BlockDiffusionLM:
    return _CLASSES[config.architecture](config)


KNOWN_ARCHITECTURES = tuple(a for m in _MODULES.values() for a in m.ARCHITECTURES)
__all__ = ["BlockDiffusionLM", "ModelConfig", "MoEConfig", "build_model", "resolve_architecture",
           "architecture_module", "KNOWN_ARCHITECTURES"]
