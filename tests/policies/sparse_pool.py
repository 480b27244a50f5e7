"""A test-only policy shaped like HERALD's KV handling: `threshold` decoding where layers from `dense_layers` on attend
to a per-layer sparse pool instead of the whole cached prefix, from outside the package.

The store (SparseStore) keeps every layer's full KV in a device cache (HERALD keeps it in pinned CPU memory; the
stand-in is the full KVCache) plus, per sparse layer, a pool of `capacity` rows per slot with its own index and
valid length (the layer's KV view: kv/cache.LayerKV's `index` and `length`). Every forward writes its fresh K/V to
the full cache; the pool is filled

* at admission, by the host hook `on_blocks` (the prefilled prefix), and
* after every forward that retires a block, by the captured post-forward hook `after_forward`: the selection of the
  new prefix gathered from the full cache into the pool (the finished block's KV was written by that forward).

Selection keeps the first `sink` positions and the most recent ones, ceil(budget x prefix) in all: a stand-in for
HERALD's top-k (what matters here is where the pool lives and who fills it). With budget 1.0 the pool holds the
whole prefix in order, so every token equals dense `threshold`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.kv.cache import CacheLayer, KVCache, Tier
from compiledllm.kv.store import DeviceKV
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy


@dataclass(frozen=True)
class SparsePoolConfig(ThresholdConfig):
    budget: float = 1.0     # share of the prefix a sparse layer keeps
    dense_layers: int = 2   # layers [0, dense_layers) read the full prefix (HERALD keeps the first two dense)
    sink: int = 4           # leading positions always kept

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget: must be within (0, 1], got {self.budget}")


@dataclass(frozen=True)
class PoolLayer:
    """A sparse layer's view: keys / values in the pool [N, KVH, D] addressed through `index` [B, S] up to `length`
    [B]; fresh K/V go to the full cache."""

    k: torch.Tensor
    v: torch.Tensor
    index: torch.Tensor
    length: torch.Tensor
    full: CacheLayer

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.full.write(index, k, v)


class SparseStore:
    def __init__(self, full: KVCache, pool_k: list, pool_v: list, index: torch.Tensor, length: torch.Tensor,
                 dense_layers: int, first: int = 0):
        self.full, self.pool_k, self.pool_v = full, pool_k, pool_v
        self.index, self.length, self.dense_layers, self.first = index, length, dense_layers, first

    @property
    def capacity(self) -> int:
        return self.full.capacity

    def layer(self, i: int):
        if i < self.dense_layers:
            return self.full.layer(i)
        j = i - self.dense_layers
        return PoolLayer(self.pool_k[j], self.pool_v[j], self.index, self.length, self.full.layer(i))

    def rows(self, start: int, end: int, indexed: bool | None = None) -> "SparseStore":
        return SparseStore(self.full.rows(start, end, indexed=False), self.pool_k, self.pool_v,
                           self.index[start:end], self.length[start:end], self.dense_layers, self.first + start)

    def prefill_rows(self, start: int, end: int) -> KVCache:
        return self.full.rows(start, end)  # prefill chunks attend to the whole prefix

    def move(self, src: int, dst: int, length: int) -> None:
        self.full.move(src, dst, length)
        S = self.capacity
        for pk, pv in zip(self.pool_k, self.pool_v):
            pk[dst * S : dst * S + length] = pk[src * S : src * S + length]
            pv[dst * S : dst * S + length] = pv[src * S : src * S + length]
        self.length[dst] = self.length[src]

    def fill(self, prefix: torch.Tensor, keep: torch.Tensor, sink: int, rows: torch.Tensor) -> None:
        """Pool rows of slots where `rows` [B] is True <- the selection of their first `prefix` [B] positions
        (`keep` [B] of them: the first `sink`, then the most recent). Pure tensor work: capturable."""
        S = self.capacity
        s = torch.arange(S, device=prefix.device)[None]
        pos = torch.where(s < sink, s, s + (prefix - keep)[:, None]).clamp(0, S - 1)  # [B, S] positions selected
        slots = self.first + torch.arange(prefix.shape[0], device=prefix.device)
        for j, (pk, pv) in enumerate(zip(self.pool_k, self.pool_v)):
            layer = self.full.layer(self.dense_layers + j)
            k, v = layer.k.gather(1, _expand(pos, layer.k)), layer.v.gather(1, _expand(pos, layer.v))
            dest = (slots[:, None] * S + s).flatten()
            old_k, old_v = pk[dest].view_as(k), pv[dest].view_as(v)
            take = rows[:, None, None, None]
            pk[dest] = torch.where(take, k, old_k).flatten(0, 1)
            pv[dest] = torch.where(take, v, old_v).flatten(0, 1)
        self.length.copy_(torch.where(rows, keep, self.length))


def _expand(pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return pos[:, :, None, None].expand(-1, -1, cache.shape[2], cache.shape[3])


@dataclass(frozen=True)
class SparseLayout:
    full: DeviceKV
    dense_layers: int

    def tiers(self) -> list[Tier]:
        f = self.full
        pools = 2 * (f.num_layers - self.dense_layers) * f.slots * f.capacity * f.kv_heads * f.head_dim
        return f.tiers() + [Tier("sparse pools", torch.device(f.device), pools * torch.finfo(f.dtype).bits // 8)]

    def allocate(self) -> SparseStore:
        f = self.full
        full = f.allocate()
        n = f.num_layers - self.dense_layers
        pool = lambda: torch.zeros(f.slots * f.capacity, f.kv_heads, f.head_dim, dtype=f.dtype, device=f.device)  # noqa: E731
        index = torch.arange(f.slots * f.capacity, device=f.device).view(f.slots, f.capacity)
        length = torch.zeros(f.slots, dtype=torch.long, device=f.device)
        return SparseStore(full, [pool() for _ in range(n)], [pool() for _ in range(n)], index, length,
                           self.dense_layers)


class SparsePoolPolicy(ThresholdPolicy):
    name = "sparse_pool"
    config: SparsePoolConfig
    kv_hook = True

    def kv_layout(self, model, slots, capacity):
        return SparseLayout(DeviceKV.for_model(model, slots, capacity), self.config.dense_layers)

    def keep(self, prefix: torch.Tensor) -> torch.Tensor:
        """[B] positions a sparse layer keeps of a prefix of `prefix` [B]: ceil(budget x prefix), >= sink."""
        c = self.config
        want = torch.ceil(prefix.double() * c.budget).long()
        return torch.minimum(prefix, torch.maximum(want, torch.full_like(want, c.sink)))

    def after_forward(self, phase, st, fwd, upd, kv) -> None:
        new = torch.minimum(st.block_start + self.block_size * upd.advance, st.work_len)
        kv.fill(new, self.keep(new), self.config.sink, st.active & (upd.advance > 0))

    def on_blocks(self, host, rows) -> None:
        st = host.st
        fresh = torch.zeros_like(st.active)
        fresh[rows] = st.steps[rows] == 0  # just admitted: its prefilled prefix into the pool
        host.kv.fill(st.block_start, self.keep(st.block_start), self.config.sink, fresh)
