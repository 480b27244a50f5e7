"""`infinigen`: `mage`'s once-per-block selection and reuse, ranked by InfiniGen's speculation (Lee et al., OSDI'24)
instead of the exact attention: scores from a fraction of the query and key coordinates, after an offline skew that
puts most of each (layer, KV head)'s query energy into the first coordinates.

* The skew (once per model, when the store is sized): a dense forward over `calibration` seeded random token ids;
  per selecting layer and KV head, the right singular vectors of its query heads' post-norm, post-RoPE queries
  stacked (Q = U S V^T; columns by decreasing singular value). Rotating q and k by the same orthogonal V keeps
  q . k, so the whole skew gives the exact scores; its first r = ceil(partial x head_dim) columns give InfiniGen's
  partial query x partial key. (LLaDA2: q is normed and partly rotated before; the columns are taken after.)
* The selection: at a block's first step, the [MASK] queries' mass under the approximate scores (softmax over the
  same visible keys, summed over a KV head's query heads and the queries), the budget's top-k per (layer, KV head),
  ties to the lower position; the block's later steps read it (kv/sparse.py), as `mage`'s do.

With partial 1.0 the ranking is the exact one up to float rounding (mage's selection); with budget 1.0 the tokens are
dense `threshold`'s. The approximate mass runs as the torch reference on the rotated tensors (a baseline, not a
kernel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from compiledllm.attention.spec import AttentionSpec, BlockCausal
from compiledllm.policies.mage import MageConfig, MagePolicy
from compiledllm.policies.plan import Forward


@dataclass(frozen=True)
class InfiniGenConfig(MageConfig):
    partial: float = 0.3     # share of the head dim the speculation reads (InfiniGen's partial weight ratio)
    calibration: int = 512   # seeded random tokens of the skew's calibration forward

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.partial <= 1.0:
            raise ValueError(f"partial: must be within (0, 1], got {self.partial}")
        if self.calibration < 1:
            raise ValueError(f"calibration: must be >= 1, got {self.calibration}")


class InfiniGenPolicy(MagePolicy):
    name = "infinigen"
    config: InfiniGenConfig

    def kv_layout(self, model, slots, capacity):
        layout = super().kv_layout(model, slots, capacity)
        r = math.ceil(self.config.partial * model.config.head_dim)
        self.skew = skew(model, self.layers, self.config.calibration)[..., :r].contiguous().to(model.device)
        return layout

    def plan(self, phase, st):
        fwd = super().plan(phase, st)
        if phase != "select":
            return fwd
        return replace(fwd, attention=replace(fwd.attention, stats_skew=self.skew))


@torch.no_grad()
def skew(model, layers: tuple[int, ...], tokens: int, seed: int = 0) -> torch.Tensor:
    """[len(layers), KVH, D, D] float32: per layer and KV head, the right singular vectors of its query heads'
    queries over a dense forward of `tokens` seeded random ids (columns by decreasing singular value)."""
    c = model.config
    tokens = max(tokens, c.head_dim)  # enough queries for a full rotation
    g = torch.Generator().manual_seed(seed)
    special = {model.mask_token_id, model.eos_token_id}
    ids = torch.randint(0, c.vocab_size, (1, tokens), generator=g)
    ids = torch.where(torch.isin(ids, torch.tensor(sorted(special))), (ids + 1) % c.vocab_size, ids)
    queries: dict[int, torch.Tensor] = {}
    attns = [m for m in model.modules() if hasattr(m, "project") and getattr(m, "index", None) in layers]

    def keep(module, args):
        queries[module.index] = module.project(*args[:4])[0][0].float()  # [L, H, D]

    hooks = [a.register_forward_pre_hook(keep) for a in attns]
    try:
        pos = torch.arange(tokens)[None]
        fwd = Forward(ids.to(model.device), pos.to(model.device), AttentionSpec(BlockCausal(tokens)))
        model(fwd, None)
    finally:
        for h in hooks:
            h.remove()
    KVH, D = c.num_kv_heads, c.head_dim
    out = []
    for layer in layers:
        q = queries[layer].view(tokens, KVH, -1, D).transpose(0, 1).reshape(KVH, -1, D)  # [KVH, L * G, D]
        out.append(torch.linalg.svd(q, full_matrices=False).Vh.transpose(1, 2))  # [KVH, D, D]: columns = V
    return torch.stack(out)
