"""Checkpoint-name maps for the shared layers; architecture files compose them with their own prefixes."""
from __future__ import annotations

import torch

from compiledllm.models.layers import Attention, GatedMLP, MoE


def split_rows(weight: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Row-slices of a fused weight, as views (loading into them fills the fused parameter)."""
    return list(weight.detach().split(sizes, dim=0))


def fused_qkv(prefix: str, attn: Attention, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    sizes = [attn.h * attn.hd, attn.kvh * attn.hd, attn.kvh * attn.hd]
    return {f"{prefix}.{n}.weight": w for n, w in zip(names, split_rows(attn.qkv.weight, sizes))}


def gated_mlp(prefix: str, mlp: GatedMLP, names=("gate_proj", "up_proj", "down_proj")) -> dict[str, torch.Tensor]:
    gate, up = split_rows(mlp.gate_up.weight, [mlp.inner, mlp.inner])
    return {f"{prefix}.{names[0]}.weight": gate, f"{prefix}.{names[1]}.weight": up,
            f"{prefix}.{names[2]}.weight": mlp.down.weight.detach()}


def moe(prefix: str, m: MoE) -> dict[str, torch.Tensor]:
    """DeepSeek/LLaDA2 names: gate.weight, gate.expert_bias, experts.{e}.*, shared_experts.*."""
    F_ = m.cfg.expert_dim
    out = {f"{prefix}.gate.weight": m.gate.detach(), f"{prefix}.gate.expert_bias": m.expert_bias}
    for e in range(m.cfg.num_experts):
        gate, up = split_rows(m.w_gate_up[e], [F_, F_])
        out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate
        out[f"{prefix}.experts.{e}.up_proj.weight"] = up
        out[f"{prefix}.experts.{e}.down_proj.weight"] = m.w_down.detach()[e]
    if m.shared is not None:
        out.update(gated_mlp(f"{prefix}.shared_experts", m.shared))
    return out


def hf_decoder_frame(model, embed_name: str) -> dict[str, torch.Tensor]:
    """Embedding, final norm, untied head and each layer's two norms under the usual Hugging Face names
    (`model.layers.{i}.*`); architecture files add their attention and MLP entries."""
    out = {embed_name: model.embed.weight, "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        out[f"model.layers.{i}.input_layernorm.weight"] = layer.input_norm.weight
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = layer.post_norm.weight
    return out
