"""Where a policy keeps KV: the store protocol the engine and the model talk to, and the layout a policy picks.

A policy chooses its store (`Policy.kv_layout`): the layout reports what it will take (`tiers`, read by the memory
check before anything is allocated) and then allocates the store. The engine only ever calls the protocol below;
the model only asks a store for `layer(i)`, whose view brings its own valid length and index (kv/cache.LayerKV), so
one store may keep some layers dense and others on a sparse pool (HERALD keeps layers 0-1 dense).

* `layer(i)`: layer i's view for a forward over this store's rows;
* `rows(start, end)`: the store of slots [start, end) as a step sees it (a batch bucket), writing into this one;
* `prefill_rows(start, end)`: the same as prefill chunks see it: every layer reads the whole cached prefix (a
  sparse store gives its full cache here);
* `move(src, dst, length)`: slot src's first `length` positions to slot dst (the engine compacts live rows into
  the low slots so the batch bucket follows them);
* optional, for a store that lends rows memory while they prefill (kv/offload.py): `admit(slot)` before a request
  takes slot `slot` (False: not now, the request waits), `free(slot)` once the slot is vacated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from compiledllm.kv.cache import KVCache, LayerKV, Tier


class KVStore(Protocol):
    def layer(self, i: int) -> LayerKV: ...

    def rows(self, start: int, end: int, indexed: bool | None = None) -> "KVStore": ...

    def prefill_rows(self, start: int, end: int) -> "KVStore": ...

    def move(self, src: int, dst: int, length: int) -> None: ...


class KVLayout(Protocol):
    def tiers(self) -> list[Tier]: ...

    def allocate(self) -> KVStore: ...


@dataclass(frozen=True)
class DeviceKV:
    """Every layer of every slot in one device cache (KVCache): the layout of every block-causal policy here."""

    num_layers: int
    slots: int
    capacity: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def for_model(cls, model, slots: int, capacity: int) -> "DeviceKV":
        c = model.config
        return cls(c.num_layers, slots, capacity, c.num_kv_heads, c.head_dim, model.dtype, model.device)

    def _args(self) -> tuple:
        return (self.num_layers, self.slots, self.capacity, self.kv_heads, self.head_dim, self.dtype, self.device)

    def tiers(self) -> list[Tier]:
        return KVCache.tiers(*self._args())

    def allocate(self) -> KVCache:
        return KVCache.allocate(*self._args())
