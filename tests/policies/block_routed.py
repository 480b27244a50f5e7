"""A test-only block-routed MoE (LLaDA2.2 style), plugged into a model with no edit to the package.

It shows that a routing of whole blocks is a subclass of `MoE` overriding `route(x, backend, groups)`: the engine's
forwards carry `Forward.route_groups` (each token's block, -1 = a dead token), the decoder layer hands them to the
MoE, and `block_routed(model, capacity)` swaps each MoE layer of a built model for this one, sharing its weights.

Per route group (one row's block; a group never spans rows):

* phase 1, admission: the router's biased scores (sigmoid + expert bias, as selection uses them) aggregated by max
  over the group's live tokens; the `capacity` experts with the largest aggregate are admitted (ties -> the lower
  expert id). Dead tokens take no part.
* phase 2, per token: the model's own group-limited top-k, inside the admitted set. Experts not admitted have the
  biased score -inf. A group's score is the sum of its two best admitted experts' biased scores (one admitted
  expert: its score alone; none: -inf, never kept while `topk_group` groups with admitted experts exist); the
  `topk_group` best groups are kept, then the token's top_k admitted experts in them. When those are fewer than
  top_k, the remaining picks go to no expert (id num_experts, weight 0; MoE.forward skips such pairs).
  Weights: the unbiased sigmoid scores of the chosen experts, normalised as the model's router does (sum + 1e-20,
  times routed_scaling). With capacity = num_experts every expert is admitted and this is exactly the model's
  routing (same ops on the same values).

Static shapes and no host sync (a stable sort makes each group's index dense), so it compiles and captures; the
router math is torch's (the fused Triton router is not used).
"""
from __future__ import annotations

import torch

from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE, router_logits


class BlockRoutedMoE(MoE):
    def __init__(self, dim: int, cfg: MoEConfig, capacity: int):
        super().__init__(dim, cfg)
        if not cfg.top_k <= capacity <= cfg.num_experts:
            raise ValueError(f"capacity {capacity}: between top_k {cfg.top_k} and the {cfg.num_experts} experts")
        self.capacity = capacity

    @classmethod
    def adopt(cls, moe: MoE, capacity: int) -> BlockRoutedMoE:
        """A block-routed MoE holding `moe`'s own weights (shared, not copied)."""
        with torch.device("meta"):
            new = cls(moe.gate.shape[1], moe.cfg, capacity)
        for name, tensor in [*moe.named_parameters(recurse=False), *moe.named_buffers(recurse=False)]:
            setattr(new, name, tensor)  # Module.__setattr__ replaces the registered parameter / buffer
        new.shared, new.parallel = moe.shared, moe.parallel
        return new

    def route(self, x: torch.Tensor, backend: str = "auto", groups: torch.Tensor | None = None):
        if groups is None:
            raise ValueError("a block-routed MoE needs the forward's route_groups (Forward.route_groups)")
        scores = torch.sigmoid(router_logits(x, self.gate))
        biased = scores + self.expert_bias
        return pick(scores, biased, admitted(biased, groups, self.capacity), self.cfg)


def group_index(groups: torch.Tensor) -> torch.Tensor:
    """groups [R, Q] -> [R * Q] long: a dense index of each token's (row, group) in [0, R * Q), equal exactly for
    tokens of one row's one group. Dead tokens (-1) get indices of their own rows' dead groups (never read)."""
    R = groups.shape[0]
    key = (groups * R + torch.arange(R, device=groups.device)[:, None]).reshape(-1)  # dead: r - R < 0, per row
    order = key.argsort(stable=True)
    sorted_key = key[order]
    new = torch.ones_like(sorted_key)
    new[1:] = sorted_key[1:] != sorted_key[:-1]
    return torch.empty_like(key).scatter_(0, order, new.cumsum(0) - 1)


def admitted(biased: torch.Tensor, groups: torch.Tensor, capacity: int) -> torch.Tensor:
    """Phase 1: [T, E] bool, the experts admitted to each token's group."""
    T, E = biased.shape
    index = group_index(groups)
    live = (groups.reshape(-1) >= 0)[:, None]
    agg = torch.full((T, E), float("-inf"), device=biased.device).scatter_reduce_(
        0, index[:, None].expand(-1, E), biased.masked_fill(~live, float("-inf")), "amax")
    best = agg.sort(dim=-1, descending=True, stable=True).indices[:, :capacity]  # stable: ties -> lower id
    admit = torch.zeros(T, E, dtype=torch.bool, device=biased.device).scatter_(1, best, True)
    return admit[index]


def pick(scores: torch.Tensor, biased: torch.Tensor, allowed: torch.Tensor, c: MoEConfig):
    """Phase 2: the group-limited top-k among `allowed` experts (module docstring) -> (ids [T, k], weights [T, k])."""
    E = c.num_experts
    biased = biased.masked_fill(~allowed, float("-inf"))
    if c.n_group > 1:
        grouped = biased.view(-1, c.n_group, E // c.n_group)
        top2 = grouped.topk(2, dim=-1).values
        second = top2[..., 1].masked_fill(top2[..., 1] == float("-inf"), 0.0)
        group_score = top2[..., 0] + second  # -inf where the group has no allowed expert
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, True)
        biased = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(biased)
    top = biased.topk(c.top_k, dim=-1)
    none = top.values == float("-inf")  # fewer reachable admitted experts than top_k: the pair goes nowhere
    ids = top.indices.masked_fill(none, E)
    w = scores.gather(1, top.indices).masked_fill(none, 0.0)
    if c.norm_topk_prob and c.top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * c.routed_scaling


def block_routed(model, capacity: int):
    """Swap every MoE layer of `model` for a BlockRoutedMoE with its weights; returns the model."""
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp = BlockRoutedMoE.adopt(layer.mlp, capacity)
    return model
