"""Preallocated per-slot KV cache: [slot][layer][position][kv_head][head_dim] on the device.

Slot-major, so that the first b slots (a batch bucket) are one contiguous block."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LayerKV:
    """One layer of the cache as views [B, S, KVH, D]; attention reads k/v and writes a forward's fresh K/V at its
    positions. Under regional compilation (one compiled region per layer) the views are the region's inputs and
    the write stays in place: each region sees one view of each cache, so nothing aliases."""

    k: torch.Tensor
    v: torch.Tensor

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(positions)
        self.k.index_put_((rows, positions), k)
        self.v.index_put_((rows, positions), v)


@dataclass(frozen=True)
class IndexedLayerKV:
    """The same for a step compiled as one graph: the whole caches and the layer index. Per-layer views made outside
    that graph would be 20 aliasing graph inputs, and writing through them makes Inductor copy the layer's cache
    (measured: 80 copies, 6.2 ms per LLaDA2.0-mini step at batch 32); views made in the graph do not."""

    k_all: torch.Tensor  # [B, layers, S, KVH, D]
    v_all: torch.Tensor
    index: int

    @property
    def k(self) -> torch.Tensor:
        return self.k_all[:, self.index]

    @property
    def v(self) -> torch.Tensor:
        return self.v_all[:, self.index]

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        LayerKV(self.k, self.v).write(positions, k, v)


@dataclass(frozen=True)
class RecordingLayerKV(LayerKV):
    """Reads the cache but records the fresh K/V instead of writing them (pure forwards for export)."""

    written: list = field(default_factory=list)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.written.append((k, v))


class KVCache:
    def __init__(self, k: torch.Tensor, v: torch.Tensor, recording: bool = False, indexed: bool = False):
        """indexed: layers as IndexedLayerKV (for a step compiled as one graph)."""
        self.k, self.v = k, v  # [slots, layers, capacity, KVH, D]
        self.recording, self.indexed = recording, indexed
        if indexed:
            self.layers = [IndexedLayerKV(k, v, i) for i in range(k.shape[1])]
        else:
            layer_cls = RecordingLayerKV if recording else LayerKV
            self.layers = [layer_cls(k[:, i], v[:, i]) for i in range(k.shape[1])]

    @classmethod
    def allocate(cls, num_layers, slots, capacity, kv_heads, head_dim, dtype, device) -> "KVCache":
        shape = (slots, num_layers, capacity, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def layer(self, i: int) -> LayerKV | IndexedLayerKV:
        return self.layers[i]

    def rows(self, start: int, end: int, indexed: bool | None = None) -> "KVCache":
        """A view of slots [start, end) (writes go to this cache)."""
        return KVCache(self.k[start:end], self.v[start:end], self.recording,
                       self.indexed if indexed is None else indexed)

    def recorded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, layers, L, KVH, D] K and V a recording forward produced."""
        return (torch.stack([layer.written[-1][0] for layer in self.layers], dim=1),
                torch.stack([layer.written[-1][1] for layer in self.layers], dim=1))
