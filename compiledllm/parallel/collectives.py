"""What a module of a sharded model reads at forward time: the group its partial output is summed over (and, for
an MoE, which routed experts it holds). A module's `parallel` attribute is None in one process; the forward then
runs exactly as it does without this package."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True, eq=False)
class Shard:
    """group: the ranks whose partial outputs sum to the module's output. first_expert / experts: an MoE's routed
    experts [first_expert, first_expert + experts) held here (experts None: all of them, inner dims split)."""

    group: dist.ProcessGroup
    first_expert: int = 0
    experts: int | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # the functional collective (gpt-fast's tp.py): Dynamo traces it inside a compiled decoder layer, where
        # the in-place dist.all_reduce would be rewritten to it anyway; in eager it waits at the first use
        return funcol.all_reduce(x, "sum", self.group)
