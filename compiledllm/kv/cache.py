"""KV storage behind one protocol, and today's tier of it: the preallocated per-slot device cache.

Every layer's KV view follows `LayerKV` (docs/design.md §5): the attention reads `k` / `v` (a row's cache
[B, S, KVH, D], or a pool [N, KVH, D] that an AttentionSpec addresses through kv_index), `length` (the view's own
valid length per row, or None when the forward's prefix_len decides), and writes a forward's fresh K/V with
`write(index, k, v)`, index [B, Q] giving the position of each query's K/V and -1 meaning "not written".

The device cache is [slot][layer][position][kv_head][head_dim], slot-major so that the first b slots (a batch
bucket) are one contiguous block, with one spare position per row past the capacity: a -1 write lands there,
so skipping needs no gather and no branch (nothing ever reads that position).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class LayerKV(Protocol):
    @property
    def k(self) -> torch.Tensor: ...

    @property
    def v(self) -> torch.Tensor: ...

    @property
    def length(self) -> torch.Tensor | None: ...

    @property
    def index(self) -> torch.Tensor | None: ...  # [B, S]: this layer's own kv_index over a pool (None: the forward's)

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


def _spare(index: torch.Tensor, capacity: int) -> torch.Tensor:
    """-1 -> the spare position past the capacity."""
    return torch.where(index < 0, capacity, index)


@dataclass(frozen=True)
class CacheLayer:
    """One layer of the device cache as views [B, S + 1, KVH, D]. Under regional compilation (one compiled region
    per layer) the views are the region's inputs and the write stays in place: each region sees one view of each
    cache, so nothing aliases."""

    k_full: torch.Tensor
    v_full: torch.Tensor
    length: torch.Tensor | None = None
    index: torch.Tensor | None = None

    @property
    def k(self) -> torch.Tensor:
        return self.k_full[:, :-1]

    @property
    def v(self) -> torch.Tensor:
        return self.v_full[:, :-1]

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(index)
        index = _spare(index, self.k_full.shape[1] - 1)
        self.k_full.index_put_((rows, index), k)
        self.v_full.index_put_((rows, index), v)


@dataclass(frozen=True)
class IndexedCacheLayer:
    """The same for a step compiled as one graph: the whole caches and the layer index. Per-layer views made outside
    that graph would be 20 aliasing graph inputs, and writing through them makes Inductor copy the layer's cache
    (measured: 80 copies, 6.2 ms per LLaDA2.0-mini step at batch 32); views made in the graph do not."""

    k_all: torch.Tensor  # [B, layers, S + 1, KVH, D]
    v_all: torch.Tensor
    layer_index: int
    length: torch.Tensor | None = None
    index: torch.Tensor | None = None

    def _layer(self) -> CacheLayer:
        return CacheLayer(self.k_all[:, self.layer_index], self.v_all[:, self.layer_index])

    @property
    def k(self) -> torch.Tensor:
        return self._layer().k

    @property
    def v(self) -> torch.Tensor:
        return self._layer().v

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._layer().write(index, k, v)


@dataclass(frozen=True)
class RecordingLayer(CacheLayer):
    """Reads the cache but records the fresh K/V instead of writing them (pure forwards for export)."""

    written: list = field(default_factory=list)

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.written.append((k, v))


@dataclass(frozen=True)
class Tier:
    """One place KV lives, for the memory check: its name, device and bytes."""

    name: str
    device: torch.device
    nbytes: int


class KVCache:
    """The device tier: every layer of every slot on one device."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, recording: bool = False, indexed: bool = False):
        """k, v [slots, layers, capacity + 1, KVH, D]; indexed: layers as IndexedCacheLayer (a step compiled as one
        graph); recording: layers that record instead of writing (export)."""
        self.k_full, self.v_full = k, v
        self.recording, self.indexed = recording, indexed
        if indexed:
            self.layers = [IndexedCacheLayer(k, v, i) for i in range(k.shape[1])]
        else:
            layer_cls = RecordingLayer if recording else CacheLayer
            self.layers = [layer_cls(k[:, i], v[:, i]) for i in range(k.shape[1])]

    @staticmethod
    def shape(num_layers: int, slots: int, capacity: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (slots, num_layers, capacity + 1, kv_heads, head_dim)

    @classmethod
    def tiers(cls, num_layers, slots, capacity, kv_heads, head_dim, dtype, device) -> list[Tier]:
        """What allocate() will take, per tier (the memory check reads this before allocating)."""
        n = 2 * torch.Size(cls.shape(num_layers, slots, capacity, kv_heads, head_dim)).numel()
        return [Tier("device KV cache", torch.device(device), n * (torch.finfo(dtype).bits // 8))]

    @classmethod
    def allocate(cls, num_layers, slots, capacity, kv_heads, head_dim, dtype, device) -> "KVCache":
        shape = cls.shape(num_layers, slots, capacity, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def k(self) -> torch.Tensor:
        """[slots, layers, capacity, KVH, D]: the valid positions (views)."""
        return self.k_full[:, :, :-1]

    @property
    def v(self) -> torch.Tensor:
        return self.v_full[:, :, :-1]

    @property
    def capacity(self) -> int:
        return self.k_full.shape[2] - 1

    def layer(self, i: int) -> LayerKV:
        return self.layers[i]

    def rows(self, start: int, end: int, indexed: bool | None = None) -> "KVCache":
        """A view of slots [start, end) (writes go to this cache)."""
        return KVCache(self.k_full[start:end], self.v_full[start:end], self.recording,
                       self.indexed if indexed is None else indexed)

    def prefill_rows(self, start: int, end: int) -> "KVCache":
        return self.rows(start, end)

    def move(self, src: int, dst: int, length: int) -> None:
        """Slot src's first `length` positions (every layer) to slot dst."""
        self.k_full[dst, :, :length] = self.k_full[src, :, :length]
        self.v_full[dst, :, :length] = self.v_full[src, :, :length]

    def recording_view(self) -> "KVCache":
        return KVCache(self.k_full, self.v_full, recording=True)

    def recorded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, layers, L, KVH, D] K and V a recording forward produced."""
        return (torch.stack([layer.written[-1][0] for layer in self.layers], dim=1),
                torch.stack([layer.written[-1][1] for layer in self.layers], dim=1))
