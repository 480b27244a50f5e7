"""Which share of each weight a rank holds (SPLITS: one description per parameter name pattern), and shard_model,
which keeps that share of a model already in memory. The loader reads the same shares straight from a checkpoint
(loader.load_checkpoint with a mesh), so both paths follow this one description.

Tensor parallel: each rank holds num_heads / T query heads and num_kv_heads / T KV heads (column slices of the
fused qkv projection, the matching input columns of o), and 1 / T of every gated MLP's inner dim (gate_up column
parallel, down row parallel); o and down give partial sums, added by one all-reduce per attention and per MLP.
The rank's config says the local head counts and widths, so the engine allocates a KV cache of the local KV heads.
Expert parallel: each rank holds E / X routed experts (each split over the T tensor ranks too) and 1 / (T x X) of
the shared expert's inner dim; routed and shared partials sum in one all-reduce per MoE layer (layers.MoE).
Embedding, norms, router (gate, expert_bias) and head are replicated."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch
from torch import nn

from compiledllm.errors import UserError
from compiledllm.models import BlockDiffusionLM, architecture_module
from compiledllm.models.config import ModelConfig
from compiledllm.models.layers import MoE
from compiledllm.parallel.collectives import Shard
from compiledllm.parallel.group import Mesh, check_sizes

# MoEConfig fields as LLaDA2's config.json spells them (the architecture KEYS name ModelConfig's)
MOE_KEYS = {"expert_dim": "moe_intermediate_size", "num_shared": "num_shared_experts"}

Ranges = tuple[tuple[range, ...], ...]  # per dim of a full weight: the index ranges a rank holds, in its order


def _whole(config: ModelConfig, n: int) -> tuple[int, ...]:
    return (n,)


def _halves(config: ModelConfig, n: int) -> tuple[int, ...]:
    return (n // 2, n // 2)  # a fused gate_up: the gate rows, then the up rows


def _qkv(config: ModelConfig, n: int) -> tuple[int, ...]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return (q, kv, kv)  # heads are consecutive row blocks of each


@dataclasses.dataclass(frozen=True)
class Cut:
    """One split of a weight along `dim` over the ranks `over` names ("tensor", "expert", or "model": all tensor x
    expert ranks of a replica): each of its fused sections (their sizes along dim, from the full config and the
    dim's size) is cut into equal consecutive parts, and a rank keeps its part of every section."""

    dim: int
    over: str
    sections: Callable[[ModelConfig, int], tuple[int, ...]] = _whole


_LAYER = r"layers\.\d+\."
# full parameter name -> its cuts; every weight not named here is replicated (embedding, norms, router, head)
SPLITS: tuple[tuple[re.Pattern, tuple[Cut, ...]], ...] = tuple((re.compile(_LAYER + p), cuts) for p, cuts in (
    (r"attn\.qkv\.weight", (Cut(0, "tensor", _qkv),)),               # column parallel: the rank's heads
    (r"attn\.o\.weight", (Cut(1, "tensor"),)),                        # row parallel: their input columns
    (r"mlp\.gate_up\.weight", (Cut(0, "tensor", _halves),)),         # a dense layer's MLP
    (r"mlp\.down\.weight", (Cut(1, "tensor"),)),
    (r"mlp\.w_gate_up", (Cut(0, "expert"), Cut(1, "tensor", _halves))),  # routed experts [E, 2F, H]
    (r"mlp\.w_down", (Cut(0, "expert"), Cut(2, "tensor"))),               # [E, H, F]
    (r"mlp\.shared\.gate_up\.weight", (Cut(0, "model", _halves),)),  # the shared expert over every rank
    (r"mlp\.shared\.down\.weight", (Cut(1, "model"),)),
))


def cuts_of(name: str) -> tuple[Cut, ...]:
    """The cuts of the parameter `name` (a model's own parameter name); () when it is replicated."""
    return next((cuts for pattern, cuts in SPLITS if pattern.fullmatch(name)), ())


def held(name: str, shape: tuple[int, ...], config: ModelConfig, mesh: Mesh) -> Ranges:
    """What this rank holds of the full weight `name` of `shape` (model `config`, the full one): per dim, the index
    ranges, concatenated in this order in the rank's weight. check_divisible has passed."""
    ranges = [(range(n),) for n in shape]
    for cut in cuts_of(name):
        parts, index = {"tensor": (mesh.tensor, mesh.tensor_rank), "expert": (mesh.expert, mesh.expert_rank),
                        "model": (mesh.world, mesh.rank)}[cut.over]
        kept, start = [], 0
        for size in cut.sections(config, shape[cut.dim]):
            part = size // parts
            kept.append(range(start + index * part, start + (index + 1) * part))
            start += size
        assert start == shape[cut.dim], (name, shape, cut)
        ranges[cut.dim] = tuple(kept)
    return tuple(ranges)


def take(w: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """The share `ranges` (held's) of the full weight `w`."""
    for dim, kept in enumerate(ranges):
        if kept != (range(w.shape[dim]),):
            w = torch.cat([w.narrow(dim, r.start, len(r)) for r in kept], dim)
    return w


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


def local_config(config: ModelConfig, tensor: int) -> ModelConfig:
    """What one rank holds: its heads, its share of the dense MLP and of each expert (num_experts stays global)."""
    moe = config.moe
    dense = moe is None or moe.first_dense_layers > 0
    return dataclasses.replace(
        config, num_heads=config.num_heads // tensor, num_kv_heads=config.num_kv_heads // tensor,
        intermediate_size=config.intermediate_size // tensor if dense else config.intermediate_size,
        moe=None if moe is None else dataclasses.replace(moe, expert_dim=moe.expert_dim // tensor))


def _fit(linear: nn.Linear) -> None:
    linear.out_features, linear.in_features = linear.weight.shape


def _localize(model: BlockDiffusionLM, mesh: Mesh) -> None:
    """The modules' sizes after their weights were cut (held's shares), and the `parallel` hooks of their sums."""
    T = mesh.tensor
    for i, layer in enumerate(model.layers):
        a, mlp = layer.attn, layer.mlp
        a.h, a.kvh = a.h // T, a.kvh // T
        _fit(a.qkv), _fit(a.o)
        if T > 1:
            a.parallel = Shard(mesh.tensor_group)
        if isinstance(mlp, MoE):
            full = (mlp.cfg.num_experts, 2 * mlp.cfg.expert_dim, model.config.hidden_size)  # before the cut
            experts = held(f"layers.{i}.mlp.w_gate_up", full, model.config, mesh)[0][0]
            if mlp.shared is not None:  # its partial joins the routed one before the all-reduce
                mlp.shared.inner //= mesh.world
                _fit(mlp.shared.gate_up), _fit(mlp.shared.down)
            mlp.cfg = dataclasses.replace(mlp.cfg, expert_dim=mlp.cfg.expert_dim // T)  # the router sees all E
            mlp.parallel = Shard(mesh.model_group, experts.start, None if mesh.expert == 1 else len(experts))
        else:
            mlp.inner //= T
            _fit(mlp.gate_up), _fit(mlp.down)
            if T > 1:
                mlp.parallel = Shard(mesh.tensor_group)


@torch.no_grad()
def shard_model(model: BlockDiffusionLM, mesh: Mesh) -> BlockDiffusionLM:
    """Keep this rank's share (SPLITS) of `model`'s weights (the full model, the same on every rank; on the meta
    device: only the shapes, as the loader uses it) and set the modules' `parallel` hooks; returns the model. A
    mesh of one process leaves it as it is."""
    if not hasattr(model, "layers"):
        raise UserError("parallel: an exported engine cannot be split across ranks; load the checkpoint")
    if getattr(model, "mesh", None) is not None:
        raise UserError("parallel: the model is already split across ranks")
    check_divisible(model.config, mesh.tensor, mesh.expert)
    if mesh.world == 1:
        return model
    for name, w in list(model.named_parameters()):
        if cuts_of(name):
            owner, attr = name.rpartition(".")[::2]
            # a copy: the full weight is freed with the module's reference to it
            setattr(model.get_submodule(owner), attr,
                    nn.Parameter(take(w, held(name, tuple(w.shape), model.config, mesh)).contiguous(),
                                 requires_grad=False))
    _localize(model, mesh)
    model.config = local_config(model.config, mesh.tensor)
    model.mesh = mesh
    return model
