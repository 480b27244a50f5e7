"""Split a loaded model's weights to this rank's share, in place (gpt-fast's tp.py, for this package's layers).

Tensor parallel: each rank holds num_heads / T query heads and num_kv_heads / T KV heads (column slices of the
fused qkv projection, the matching input columns of o), and 1 / T of every gated MLP's inner dim (gate_up column
parallel, down row parallel); o and down give partial sums, added by one all-reduce per attention and per MLP.
The rank's config says the local head counts and widths, so the engine allocates a KV cache of the local KV heads.
Expert parallel: each rank holds E / X routed experts (each split over the T tensor ranks too) and 1 / (T x X) of
the shared expert's inner dim; routed and shared partials sum in one all-reduce per MoE layer (layers.MoE).
Embedding, norms, router (gate, expert_bias) and head are replicated."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from compiledllm.errors import UserError
from compiledllm.models import BlockDiffusionLM, architecture_module
from compiledllm.models.config import ModelConfig
from compiledllm.models.layers import Attention, GatedMLP, MoE
from compiledllm.parallel.collectives import Shard
from compiledllm.parallel.group import Mesh, check_sizes

# MoEConfig fields as LLaDA2's config.json spells them (the architecture KEYS name ModelConfig's)
MOE_KEYS = {"expert_dim": "moe_intermediate_size", "num_shared": "num_shared_experts"}


def check_divisible(config: ModelConfig, tensor: int, expert: int) -> None:
    """Every split size divides what it splits; else a one-line UserError naming the parallel key and the
    config.json key with both values."""
    check_sizes(tensor, expert)
    keys = {**MOE_KEYS, **architecture_module(config.architecture).KEYS}
    moe = config.moe
    dense = moe is None or moe.first_dense_layers > 0
    splits = [("tensor", tensor, "num_heads", config.num_heads),
              ("tensor", tensor, "num_kv_heads", config.num_kv_heads)]
    if dense:
        splits.append(("tensor", tensor, "intermediate_size", config.intermediate_size))
    if moe is not None:
        splits += [("tensor", tensor, "expert_dim", moe.expert_dim), ("expert", expert, "num_experts", moe.num_experts)]
    for key, n, field, value in splits:
        if value % n:
            raise UserError(f"parallel.{key}={n} does not divide {keys.get(field, field)}={value} of the model "
                            "(each rank holds an equal share)")
    if moe is not None and moe.num_shared and (moe.expert_dim * moe.num_shared) % (tensor * expert):
        raise UserError(f"parallel.tensor={tensor} x parallel.expert={expert} does not divide the shared expert's "
                        f"width {keys['expert_dim']} x {keys['num_shared']}={moe.expert_dim * moe.num_shared}")


def _part(w: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    return w.chunk(parts, dim=dim)[index]


def _param(w: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(w.contiguous(), requires_grad=False)  # a copy: the full weight is freed with its module


def _shard_attention(a: Attention, parts: int, index: int) -> None:
    q, k, v = a.qkv.weight.split([a.h * a.hd, a.kvh * a.hd, a.kvh * a.hd])  # heads are consecutive row blocks
    a.qkv.weight = _param(torch.cat([_part(t, parts, index, 0) for t in (q, k, v)]))
    a.o.weight = _param(_part(a.o.weight, parts, index, 1))
    a.h, a.kvh = a.h // parts, a.kvh // parts
    a.qkv.out_features, a.o.in_features = a.qkv.weight.shape[0], a.o.weight.shape[1]


def _shard_mlp(m: GatedMLP, parts: int, index: int) -> None:
    gate, up = m.gate_up.weight.split(m.inner)
    m.gate_up.weight = _param(torch.cat([_part(gate, parts, index, 0), _part(up, parts, index, 0)]))
    m.down.weight = _param(_part(m.down.weight, parts, index, 1))
    m.inner //= parts
    m.gate_up.out_features, m.down.in_features = m.gate_up.weight.shape[0], m.down.weight.shape[1]


def _shard_moe(m: MoE, mesh: Mesh) -> None:
    T, X = mesh.tensor, mesh.expert
    F_ = m.cfg.expert_dim
    held = slice(mesh.expert_rank * (m.cfg.num_experts // X), (mesh.expert_rank + 1) * (m.cfg.num_experts // X))
    gate, up = m.w_gate_up[held].split(F_, dim=1)
    m.w_gate_up = _param(torch.cat([_part(gate, T, mesh.tensor_rank, 1), _part(up, T, mesh.tensor_rank, 1)], 1))
    m.w_down = _param(_part(m.w_down[held], T, mesh.tensor_rank, 2))
    if m.shared is not None:
        _shard_mlp(m.shared, mesh.world, mesh.rank)  # its partial joins the routed one before the all-reduce
    m.cfg = dataclasses.replace(m.cfg, expert_dim=F_ // T)  # num_experts stays global: the router sees them all
    m.parallel = Shard(mesh.model_group, held.start, None if X == 1 else held.stop - held.start)


def local_config(config: ModelConfig, tensor: int) -> ModelConfig:
    """What one rank holds: its heads, its share of the dense MLP and of each expert (num_experts stays global)."""
    moe = config.moe
    dense = moe is None or moe.first_dense_layers > 0
    return dataclasses.replace(
        config, num_heads=config.num_heads // tensor, num_kv_heads=config.num_kv_heads // tensor,
        intermediate_size=config.intermediate_size // tensor if dense else config.intermediate_size,
        moe=None if moe is None else dataclasses.replace(moe, expert_dim=moe.expert_dim // tensor))


@torch.no_grad()
def shard_model(model: BlockDiffusionLM, mesh: Mesh) -> BlockDiffusionLM:
    """Keep this rank's share of `model`'s weights (loaded in full, the same on every rank) and set the
    modules' `parallel` hooks; returns the model. A mesh of one process leaves it as it is."""
    if not hasattr(model, "layers"):
        raise UserError("parallel: an exported engine cannot be split across ranks; load the checkpoint")
    if getattr(model, "mesh", None) is not None:
        raise UserError("parallel: the model is already split across ranks")
    check_divisible(model.config, mesh.tensor, mesh.expert)
    if mesh.world == 1:
        return model
    for layer in model.layers:
        if mesh.tensor > 1:
            _shard_attention(layer.attn, mesh.tensor, mesh.tensor_rank)
            layer.attn.parallel = Shard(mesh.tensor_group)
        if isinstance(layer.mlp, MoE):
            _shard_moe(layer.mlp, mesh)
        elif mesh.tensor > 1:
            _shard_mlp(layer.mlp, mesh.tensor, mesh.tensor_rank)
            layer.mlp.parallel = Shard(mesh.tensor_group)
    model.config = local_config(model.config, mesh.tensor)
    model.mesh = mesh
    return model
