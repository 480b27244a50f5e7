"""LLaDA2.2's block routing: each block of a forward admits `expert_capacity` experts, and each of its tokens picks
its top_k among them, so a decoded block reads at most that many experts' weights (48 of 256 on LLaDA2.2-flash
instead of the ~150 a 32-token block touches with per-token routing).

Per route group (Forward.route_groups: one row's block, positions // the routing block; -1 = a dead token):

* phase 1, admission: the router's biased scores (sigmoid + expert bias, the scores selection uses) aggregated by
  max over the group's live tokens ("token racing", LLaDA2.2 tech report eq. 1); the `expert_capacity` experts with
  the largest aggregate are admitted, ties to the lower expert id. Dead tokens take no part.
* phase 2, per token: the top_k experts by biased score among the admitted ones (ties to the lower id), weights
  from the unbiased sigmoid scores, divided by their sum + 1e-20 (norm_topk_prob) and times routed_scaling.
* the shared expert runs on every token as without block routing.

Sources: SGLang PR #31768 (config keys `expert_capacity` / `block_size`, max aggregation of the biased scores) and
its review, which quotes the released LLaDA2.2-flash modeling code: capacity and token selection are exact top-k
over the unmodified biased scores with non-admitted experts at -inf, and the weights are the chosen experts'
unbiased scores over their sum + 1e-20. Neither describes a group-limited step inside the pool, so `n_group` /
`topk_group` do not apply under block routing (with capacity = every expert this is the ungrouped top-k: equal to
the standard routing exactly when n_group is 1).

Both phases run in the Triton router on CUDA (moe_triton.moe_block_route, captured with the step) and in torch
here elsewhere; the routed experts are the MoE's own, and they read only experts some pair chose: a subset of
the experts the live blocks admitted.
"""
from __future__ import annotations

import dataclasses

import torch

from compiledllm.models import moe_triton
from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE, router_logits


class BlockRoutedMoE(MoE):
    """An MoE whose tokens route per block (module docstring); its weights and checkpoint names are MoE's."""

    def __init__(self, dim: int, cfg: MoEConfig):
        if cfg.expert_capacity is None:
            raise ValueError("BlockRoutedMoE needs an MoEConfig with expert_capacity")
        super().__init__(dim, cfg)

    @classmethod
    def adopt(cls, moe: MoE, cfg: MoEConfig) -> BlockRoutedMoE:
        """A block-routed MoE holding `moe`'s own weights (shared, not copied), configured by `cfg`."""
        with torch.device("meta"):
            new = cls(moe.gate.shape[1], cfg)
        for name, tensor in [*moe.named_parameters(recurse=False), *moe.named_buffers(recurse=False)]:
            setattr(new, name, tensor)  # Module.__setattr__ replaces the registered parameter / buffer
        new.shared, new.parallel = moe.shared, moe.parallel
        return new

    def route(self, x: torch.Tensor, backend: str = "auto", groups: torch.Tensor | None = None,
              index: torch.Tensor | None = None):
        if groups is None:
            raise ValueError("a block-routed MoE needs the forward's route groups (Forward.route_groups)")
        c = self.cfg
        logits = router_logits(x, self.gate)
        index = route_index(groups) if index is None else index
        if backend != "grouped_mm" and moe_triton.block_route_supported(x, c.num_experts):
            return torch.ops.compiledllm.moe_block_route(logits, self.expert_bias, index, groups.shape[1],
                                                         c.expert_capacity, c.top_k, c.norm_topk_prob,
                                                         c.routed_scaling)
        return block_route(logits, self.expert_bias, groups, c, index)


def group_index(groups: torch.Tensor) -> torch.Tensor:
    """groups [R, Q] -> [R * Q] long: a dense index in [0, R * Q) of each token's (row, group), equal exactly for
    the tokens of one row's one group. Dead tokens (-1) get their rows' dead groups (never read). Static shapes, no
    host sync: a stable sort makes the index dense."""
    R = groups.shape[0]
    key = (groups * R + torch.arange(R, device=groups.device)[:, None]).reshape(-1)  # dead: r - R < 0, per row
    order = key.argsort(stable=True)
    sorted_key = key[order]
    new = torch.ones_like(sorted_key)
    new[1:] = sorted_key[1:] != sorted_key[:-1]
    return torch.empty_like(key).scatter_(0, order, new.cumsum(0) - 1)


def route_index(groups: torch.Tensor) -> torch.Tensor:
    """groups [R, Q] -> [R * Q] long: group_index, -1 for a dead token. What both routers key the groups by; the
    model makes it once per forward (Forward.route_index) rather than once per MoE layer (a sort: ~8 kernels)."""
    return torch.where(groups.reshape(-1) >= 0, group_index(groups), -1)


def block_route(logits: torch.Tensor, bias: torch.Tensor, groups: torch.Tensor, c: MoEConfig,
                index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both phases in torch: router logits [T, E] float32 -> (expert ids [T, k], weights [T, k] float32), a dead
    token's pairs id E and weight 0 (no expert); index: route_index(groups) where the caller has it."""
    scores = torch.sigmoid(logits)
    biased = scores + bias
    T, E = biased.shape
    index = (route_index(groups) if index is None else index).clamp(min=0)  # a dead token reads row 0: replaced
    live = (groups.reshape(-1) >= 0)[:, None]
    agg = torch.full((T, E), float("-inf"), device=biased.device).scatter_reduce_(
        0, index[:, None].expand(-1, E), biased.masked_fill(~live, float("-inf")), "amax")
    best = agg.sort(dim=-1, descending=True, stable=True).indices[:, : c.expert_capacity]  # ties: the lower id
    admitted = torch.zeros(T, E, dtype=torch.bool, device=biased.device).scatter_(1, best, True)[index]
    pool = biased.masked_fill(~admitted, float("-inf"))
    ids = pool.sort(dim=-1, descending=True, stable=True).indices[:, : c.top_k]
    w = scores.gather(1, ids)
    if c.norm_topk_prob and c.top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids.masked_fill(~live, E), (w * c.routed_scaling).masked_fill(~live, 0.0)


def use_block_routing(model, capacity: int, block: int | None = None):
    """Turn block routing on for a built LLaDA2-layout model (a recipe's model.expert_capacity): every MoE layer
    becomes a BlockRoutedMoE sharing its weights, over blocks of `block` positions (default: the model's default
    block). Returns the model; its config says what it routes by."""
    from compiledllm.errors import UserError
    from compiledllm.models.config import InvalidConfig

    moe_cfg = getattr(model.config, "moe", None)
    if moe_cfg is None or not hasattr(model, "layers"):
        raise UserError(f"model.expert_capacity: {model.config.architecture} has no MoE layers to block-route")
    try:
        cfg = dataclasses.replace(moe_cfg, expert_capacity=capacity,
                                  route_block=block or model.config.default_block_size)
    except InvalidConfig as e:
        raise UserError(f"model.expert_capacity: {e.describe({'expert_capacity': 'expert_capacity'})}") from None
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp = BlockRoutedMoE.adopt(layer.mlp, cfg)
    model.config = dataclasses.replace(model.config, moe=cfg, default_block_size=cfg.route_block)
    return model


def block_routed(model) -> bool:
    """Whether `model` (any model kind) routes its MoE per block."""
    moe = getattr(getattr(model, "config", None), "moe", None)
    return moe is not None and moe.expert_capacity is not None
