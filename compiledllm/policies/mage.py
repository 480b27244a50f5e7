"""`mage`: `threshold` decoding where the layers past the first `dense_layers` attend, after a block's first step, only
to the prefix keys that step selected (MAGE, as HERALD §III-C describes it and ../shared/papers/herald.txt uses it as
a baseline: exact selection once per block with the block's own [MASK] queries over the full KV, reused for the
block's remaining steps).

Per block of a row:

* its first step (phase "select", run whenever some row begins a block) reads the full cached prefix in every layer
  and adds, in each selecting layer, the attention mass every prefix key receives from the block's [MASK] queries,
  per KV head: the G query heads' softmax probabilities summed (sum over g of exp(s_g - m_g) / l_g, HERALD's s_hat,
  over the forward's visible keys: the prefix and the block), summed over the queries;
* the post-forward hook keeps, per (layer, KV head), the ceil(budget x prefix) prefix positions of largest mass
  (ties: the lower position) and gathers their K/V into the row's selection (kv/sparse.py);
* the block's later steps read only that selection in those layers; the block itself is always visible (it is the
  forward's own window), the first `dense_layers` layers always read the whole prefix;
* the forward that retires the block (it sees the block final) writes the block's KV as usual; the row reads its
  full prefix again for its next block's first step.

With budget 1.0 every position is selected, in order: the tokens are dense `threshold`'s. Decisions are threshold's
(rule, steps, sampling); the commit is the separate one (a fused commit's "commit" forward would carry two blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from compiledllm.errors import UserError
from compiledllm.kv.sparse import SparseLayout
from compiledllm.kv.store import DeviceKV
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy


@dataclass(frozen=True)
class MageConfig(ThresholdConfig):
    budget: float = 0.05   # share of the prefix each (layer, KV head) keeps
    dense_layers: int = 2  # layers [0, dense_layers) always read the whole prefix (MAGE / HERALD keep two)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget: must be within (0, 1], got {self.budget}")
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers: must be >= 0, got {self.dense_layers}")
        if self.commit == "fused":
            raise ValueError("commit: mage commits a block in its own forward (separate)")


class MagePolicy(ThresholdPolicy):
    name = "mage"
    config: MageConfig
    phases = ("decode", "select")
    kv_hook = True

    def __init__(self, config, mask_id, bidirectional=False):
        if bidirectional:
            raise UserError("policy.name: mage selects from a block-causal model's KV cache; this model is "
                            "bidirectional (nothing is cached): use threshold or fast_dllm_cache")
        super().__init__(config, mask_id, bidirectional)
        self.layers: tuple[int, ...] = ()  # the selecting layers, set with the store (kv_layout)

    def kv_layout(self, model, slots, capacity):
        n = model.config.num_layers
        if self.config.dense_layers >= n:
            raise UserError(f"policy.dense_layers: {self.config.dense_layers} leaves none of the model's {n} layers "
                            "to select in")
        self.layers = tuple(range(self.config.dense_layers, n))
        c = model.config
        self.kv_heads, self.heads, self.head_dim = c.num_kv_heads, c.num_heads, c.head_dim
        per_row = SparseLayout.budget_rows(self.config.budget, capacity)
        return SparseLayout(DeviceKV.for_model(model, slots, capacity), self.config.dense_layers, per_row)

    def capacity_state(self, batch, capacity, device):
        # per row, selecting layer and KV head: the mass each key (prefix, then the block) got in the select step
        shape = (batch, len(self.layers), self.kv_heads, capacity + self.block_size)
        return {"mass": torch.zeros(shape, dtype=torch.float32, device=device)}

    def schedule(self, step):
        """"select" when some row begins a block (its first step reads the full prefix and counts the mass), else
        "decode": one forward a step either way."""
        return ("select",) if set(step.begun) & set(step.rows) else ("decode",)

    def selecting(self, st) -> torch.Tensor:
        """[B] rows whose forward in a "select" phase is their block's first step."""
        return st.active & (st.policy["block_step"] == 0)

    def plan(self, phase, st):
        fwd = super().plan(phase, st)
        if phase != "select":
            return fwd
        idx, tokens, _ = self.block_window(st)
        queries = (tokens == self.mask_id) & self.selecting(st)[:, None]
        stats = replace(fwd.attention, stats=st.policy["mass"].transpose(0, 1), stats_queries=queries,
                        stats_layers=self.layers)
        return replace(fwd, attention=stats)

    def keep(self, prefix: torch.Tensor) -> torch.Tensor:
        """[B] keys each (layer, KV head) keeps of a prefix of `prefix` [B]: ceil(budget x prefix)."""
        return torch.ceil(prefix.double() * self.config.budget).long().clamp(max=prefix)

    def after_forward(self, phase, st, fwd, upd, kv):
        done = st.active & (upd.advance > 0)
        if phase == "select":
            self.select(st, done, kv)
        # a retired block's row reads its whole prefix (now with that block) for its next block's first step
        kv.read_full(done, torch.minimum(st.block_start + self.block_size * upd.advance, st.work_len))

    def select(self, st, done: torch.Tensor, kv) -> None:
        """The rows whose select step this was: their selection from the mass it counted; the counts reset."""
        mass = st.policy["mass"]
        rows = self.selecting(st) & ~done & kv.reads_full()  # (a row may begin a block on a prepared selection)
        kv.select(rows, mass.transpose(0, 1), st.block_start, self.keep(st.block_start))
        mass.masked_fill_(self.selecting(st)[:, None, None, None], 0.0)

    def on_blocks(self, host, rows):
        st = host.st
        fresh = torch.zeros_like(st.active)
        fresh[rows] = st.steps[rows] == 0  # just admitted: its prefilled prefix, in full
        host.kv.read_full(fresh, st.block_start)
