"""`threshold`: confidence-threshold parallel decoding (LLaDA2.0 / Fast-dLLM), DESIGN.md §4.

Accept every masked position with p > tau; if fewer than k_min are accepted, accept the k_min most
confident masked ones instead (k_min = 1, or with `steps` the LLaDA2 reference schedule: block/steps
tokens per step, the remainder spread over the first steps, so that tau = 1.0 gives exactly `steps`
accepting forwards per block).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.policies.base import (Policy, PolicyConfig, State, check_probability, confidence,
                                       top_confident)


@dataclass(frozen=True)
class ThresholdConfig(PolicyConfig):
    threshold: float = 0.95
    steps: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("threshold", self.threshold)
        if self.steps is not None and not 1 <= self.steps <= self.block_size:
            raise ValueError(f"steps: must be within [1, block_size={self.block_size}], got {self.steps}")


def transfer_schedule(block: int, steps: int | None) -> list[int]:
    """Minimum tokens accepted at each step of a block."""
    if steps is None:
        return [1] * block
    base, extra = divmod(block, steps)
    return [base + (i < extra) for i in range(steps)] + [1] * block


class ThresholdPolicy(Policy):
    name = "threshold"
    config: ThresholdConfig

    def __init__(self, config: ThresholdConfig, mask_id: int):
        super().__init__(config, mask_id)
        self.schedule = transfer_schedule(config.block_size, config.steps)

    def init_state(self, batch: int, device) -> State:
        return {"block_step": torch.zeros(batch, dtype=torch.long, device=device)}

    def update(self, window, logits, gen, state):
        v, p = confidence(logits, self.mask_id)
        masked = (window == self.mask_id) & gen
        n_masked = masked.sum(1)
        schedule = torch.tensor(self.schedule, device=window.device)
        k_min = torch.minimum(schedule[state["block_step"].clamp(max=len(self.schedule) - 1)], n_masked)
        accept = masked & (p > self.config.threshold)
        accept = torch.where((accept.sum(1) < k_min)[:, None], top_confident(p, masked, k_min), accept)
        new_window = torch.where(accept, v, window)
        return new_window, n_masked == 0, {"block_step": state["block_step"] + 1}
