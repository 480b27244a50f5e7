"""Attention metadata: what a forward attends to, decided by the host/policy, never by the model."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DenseAttention:
    """Attend among the forwarded tokens only, under `mask` ([B, L, L] or [L, L] bool, True = visible).

    With a KV cache given, the forwarded K/V are also written at their positions (prefill)."""

    mask: torch.Tensor


@dataclass(frozen=True)
class WindowAttention:
    """A window of W slots of `slot` tokens each, against each row's cached prefix [0, prefix_len[b]).

    The window's own K/V are written into the cache at their positions after use."""

    prefix_len: torch.Tensor  # [B] int
    slot: int


def block_causal_mask(length: int, block_size: int | None, device=None) -> torch.Tensor:
    """[L, L] bool: block-causal from absolute position 0 (query block i sees key blocks <= i); None = all."""
    if block_size is None:
        return torch.ones(length, length, dtype=torch.bool, device=device)
    blk = torch.arange(length, device=device) // block_size
    return blk[None, :] <= blk[:, None]
