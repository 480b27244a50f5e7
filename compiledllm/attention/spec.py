"""What a forward attends to, as data a policy builds and the attention backend reads (docs/design.md §3).

A forward's queries are its own Q tokens ("the window"). Every query sees

* the visible prefix of the layer's KV source: keys [0, prefix_len[b]) of the row's cache, or of a pool through
  an index (`kv_index`: key s of row b is pool row kv_index[b, s]); a layer's KV view that holds its own valid
  length or index (LayerKV.length / .index: a sparse pool, e.g. HERALD's layers past the dense ones) overrides
  prefix_len or kv_index for that layer;
* the window's own fresh keys, as the mask rule says.

Mask rules (each has a torch form, `window_mask`, which the reference and the dense path use):

* `BlockCausal(block)`: window key j is visible to window query i iff j // block <= i // block. A window of W
  blocks decoded together (FlowBlock) is block-causal among its blocks and bidirectional inside each; block = Q is
  a fully bidirectional window. Window indices, so the window must start on a block boundary.
* `QueryGroups(group, see)`: each window token is in a group (group [B, Q] int32, or [1, Q] for every row); a
  query of group a sees the window keys of group b iff bit b of see[a] is set (G <= 31). HERALD's 2B forward:
  groups {block, draft}, see = [0b01, 0b10]; Flash-Verify's views: {tracked, draft, mask}, see = [1, 3, 5].
  Build group and see on the device (e.g. `1 << torch.arange(G)`): a captured step cannot copy from the host.
* `Bidirectional(length)`: every query sees window keys j < length[b] (bidirectional models: the whole
  working sequence, padding hidden).
* `ExplicitMask(mask)`: [B, Q, S + Q] bool over the prefix keys then the window keys (the reference only).

Statistics: with `stats` set, each layer in `stats_layers` (None: every layer) adds the attention mass every key
receives (prefix keys, then window keys), summed over the `stats_queries` ([B, Q] bool; None: all), into a float32
accumulator of one of two shapes:

* [B, S + Q]: summed over every head and the layers asked - the tracker score of `flash_dllm`; with
  `stats_score: "logits"` each key's raw scaled scores are summed instead of its probabilities (Flash-dLLM's own
  score: linear in the scores, so the Triton attention kernel makes it in its own pass, where the mass needs the
  finished lse and a second kernel);
* [L, B, KVH, S + Q]: per (layer, KV head) - MAGE / HERALD's KV budgets. The i-th layer of `stats_layers` adds
  into stats[i] (L = len(stats_layers)), or layer i when stats_layers is None (L = the model's layers); KV head g's
  mass is summed over its H / KVH query heads. Summed over its KV heads it is the [B, S + Q] figure.

With `stats_skew` [L, KVH, D, r] the per-head mass is that of an approximate attention (InfiniGen's speculation):
scores from the first r coordinates of q and k rotated by the layer's skew (softmax over the same visible keys, the
same scale); the forward's output stays exact. Computed by the torch reference on the rotated tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_GROUPS = 31


@dataclass(frozen=True)
class BlockCausal:
    block: int

    def window_mask(self, q_len: int, device=None) -> torch.Tensor:
        """[1, Q, Q] bool."""
        s = torch.arange(q_len, device=device) // self.block
        return (s[None, :] <= s[:, None])[None]


@dataclass(frozen=True)
class QueryGroups:
    group: torch.Tensor  # [B or 1, Q] int32
    see: torch.Tensor    # [G] int32 bitmasks

    def window_mask(self, q_len: int, device=None) -> torch.Tensor:
        """[B or 1, Q, Q] bool."""
        g = self.group.long()
        vis = self.see.long()[g]  # [B, Q]: the bitmask of each query's group
        return ((vis[:, :, None] >> g[:, None, :]) & 1).bool()


@dataclass(frozen=True)
class Bidirectional:
    length: torch.Tensor  # [B]

    def window_mask(self, q_len: int, device=None) -> torch.Tensor:
        """[B, 1, Q] bool (every query of a row sees the same keys)."""
        return (torch.arange(q_len, device=self.length.device) < self.length[:, None])[:, None, :]


@dataclass(frozen=True)
class ExplicitMask:
    mask: torch.Tensor  # [B, Q, S + Q] bool

    def window_mask(self, q_len: int, device=None) -> torch.Tensor:
        return self.mask[..., self.mask.shape[-1] - q_len:]


MaskRule = BlockCausal | QueryGroups | Bidirectional | ExplicitMask


@dataclass(frozen=True)
class Kernels:
    """Which implementations a forward uses (None / "auto": the fastest available). Export passes
    Kernels("torch", "grouped_mm"): an AOTInductor package can only run torch's own ops."""

    attention: str | None = None  # None, "triton", "cupy" or "torch" (the reference)
    moe: str = "auto"             # "auto", "triton" or "grouped_mm"


@dataclass(frozen=True)
class AttentionSpec:
    rule: MaskRule
    prefix_len: torch.Tensor | None = None   # [B]; None: no KV source, the forward attends among its own tokens
    kv_index: torch.Tensor | None = None     # [B, S] int: a pool addressed through an index (None: dense rows)
    # float32 accumulator of per-key attention mass: [B, S + Q] (summed over heads and layers) or
    # [L, B, KVH, S + Q] (per layer of stats_layers, or per model layer when that is None, and per KV head)
    stats: torch.Tensor | None = None
    stats_queries: torch.Tensor | None = None  # [B, Q] bool: the queries whose mass counts (None: all)
    stats_layers: tuple[int, ...] | None = None  # layers that add to stats (None: all)
    # "logits": stats [B, S + Q] adds each key's raw scaled scores q.k * scale summed over the counted queries that
    # see it and their heads (Flash-dLLM's tracker score, made by the attention's own pass) instead of its mass
    stats_score: str = "mass"
    # [L, KVH, D, r] per stats layer: the mass is instead that of an approximate attention whose scores take only the
    # first r coordinates of q and k after this rotation (InfiniGen's partial queries and keys); per-head stats only
    stats_skew: torch.Tensor | None = None
    # [L, B, H, D] per stats layer: the q (normed, rotated) of query capture_at[b] ([B]) of each row is copied here
    # (HERALD's K-only scan takes its representative query from the main forward)
    capture: torch.Tensor | None = None
    capture_at: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rule, ExplicitMask) and self.kv_index is not None:
            raise ValueError("ExplicitMask addresses the prefix by position: it takes no kv_index")
        if self.stats is not None:
            if self.stats.dim() not in (2, 4):
                raise ValueError(f"stats must be [B, S + Q] or [L, B, KVH, S + Q], not {tuple(self.stats.shape)}")
            if self.stats_skew is not None and not self.stats_per_head:
                raise ValueError("stats_skew needs the per-head stats [L, B, KVH, S + Q]")
            if self.stats_score not in ("mass", "logits") or (self.stats_score == "logits" and self.stats_per_head):
                raise ValueError(f"stats_score: mass, or logits with stats [B, S + Q]; got {self.stats_score!r}")
            if self.stats_per_head and self.stats_layers is not None and self.stats.shape[0] != len(self.stats_layers):
                raise ValueError(f"per-head stats [L, B, KVH, S + Q] need L = len(stats_layers) = "
                                 f"{len(self.stats_layers)}, not {self.stats.shape[0]}")

    @property
    def stats_per_head(self) -> bool:
        """Whether stats is the per-(layer, KV head) form [L, B, KVH, S + Q]."""
        return self.stats is not None and self.stats.dim() == 4

    def wants_stats(self, layer: int) -> bool:
        return self.stats is not None and (self.stats_layers is None or layer in self.stats_layers)

    def capture_target(self, layer: int) -> torch.Tensor | None:
        """[B, H, D]: where `layer` copies the captured query's q (None: nothing captured)."""
        if self.capture is None or not (self.stats_layers is None or layer in self.stats_layers):
            return None
        return self.capture[layer if self.stats_layers is None else self.stats_layers.index(layer)]

    def skew_target(self, layer: int) -> torch.Tensor | None:
        """[KVH, D, r]: the rotation `layer`'s approximate mass uses (None: the exact mass)."""
        if self.stats_skew is None or not self.wants_stats(layer):
            return None
        return self.stats_skew[layer if self.stats_layers is None else self.stats_layers.index(layer)]

    def stats_target(self, layer: int) -> torch.Tensor | None:
        """Where `layer` adds its mass: stats [B, S + Q] itself, or its slice [B, KVH, S + Q] of the per-head
        form (a view, chosen on the host from the layer number: nothing data-dependent); None: it adds none."""
        if not self.wants_stats(layer):
            return None
        if not self.stats_per_head:
            return self.stats
        return self.stats[layer if self.stats_layers is None else self.stats_layers.index(layer)]


def block_causal_mask(length: int, block_size: int | None, device=None) -> torch.Tensor:
    """[L, L] bool: block-causal from absolute position 0 (query block i sees key blocks <= i); None = all."""
    if block_size is None:
        return torch.ones(length, length, dtype=torch.bool, device=device)
    return BlockCausal(block_size).window_mask(length, device)[0]
