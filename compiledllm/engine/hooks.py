"""What the host sees between steps, and what a policy's host hooks get (docs/design.md §2)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.engine.state import SlotState


@dataclass(frozen=True)
class StepReport:
    """The one host sync of a step: per slot, whether it still decodes and how many blocks it retired."""

    active: list[bool]
    retired: list[int]


@dataclass(frozen=True)
class HostContext:
    """Handed to Policy.on_blocks: the engine's buffers and its side stream (None on the CPU) for work that must
    overlap the main stream (HERALD's selection, for one)."""

    model: object
    st: SlotState
    kv: object | None
    side_stream: torch.cuda.Stream | None
