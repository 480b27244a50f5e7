"""`threshold`: confidence-threshold parallel decoding (LLaDA2.0 / Fast-dLLM), docs/design.md §4.

Accept every masked position with p > tau; if fewer than k_min are accepted, accept the k_min most
confident masked ones instead (k_min = 1, or with `steps` the LLaDA2 reference schedule: block/steps
tokens per step, the remainder spread over the first steps, so that tau = 1.0 gives exactly `steps`
accepting forwards per block). `rule` picks a peer decoder's rule instead (policies/peer_rules.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.errors import UserError
from compiledllm.policies.base import BlockPolicy, PolicyConfig, State, check_probability
from compiledllm.policies.peer_rules import SDAR_RULES, Rule, check_rule, sdar_confidence, select


@dataclass(frozen=True)
class ThresholdConfig(PolicyConfig):
    threshold: float = 0.95
    steps: int | None = None
    rule: Rule = "engine"  # or sdar_static, sdar_dynamic, fast_dllm: a peer decoder's tokens (peer_rules.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("threshold", self.threshold)
        if self.steps is not None and not 1 <= self.steps <= (self.block_size or self.steps):
            raise ValueError(f"steps: must be within [1, block_size={self.block_size}], got {self.steps}")
        check_rule(self.rule)


class ThresholdPolicy(BlockPolicy):
    name = "threshold"
    config: ThresholdConfig

    def __init__(self, config, mask_id, bidirectional=False):
        if config.rule == "fast_dllm" and not bidirectional:
            raise UserError("policy.rule: fast_dllm is Fast-dLLM's decode of a bidirectional model (LLaDA); this "
                            "model is block-causal: use sdar_static, sdar_dynamic or engine")
        super().__init__(config, mask_id, bidirectional)

    def first_block(self, prompt_len: int) -> int:
        # Fast-dLLM's blocks start where the prompt ends (nothing is cached, so no block needs to align)
        return prompt_len if self.config.rule == "fast_dllm" else super().first_block(prompt_len)

    def choose(self, logits, need, keys):
        if keys is not None and self.config.rule in SDAR_RULES:
            return sdar_confidence(logits, self.mask_id, need, self.sampling, keys)
        return super().choose(logits, need, keys)

    def min_accept(self, block_step: torch.Tensor) -> torch.Tensor:
        """Tokens to accept at least at this step of the block: 1, or with `steps` block // steps, one more in the
        first block % steps steps (1 once past `steps`). Arithmetic only, so it needs no constant tensors."""
        steps = self.config.steps
        if steps is None:
            return torch.ones_like(block_step)
        base, extra = divmod(self.block_size, steps)
        return torch.where(block_step < steps, base + (block_step < extra).long(), torch.ones_like(block_step))

    def init_state(self, batch: int, device) -> State:
        return {"block_step": torch.zeros(batch, dtype=torch.long, device=device)}

    def row_params(self) -> dict[str, float]:
        return {"threshold": self.config.threshold}  # a request may ask for its own tau (the same shapes)

    def needed(self, tokens, gen, state):
        return (tokens == self.mask_id) & gen

    def decide(self, tokens, logits, gen, state, keys):
        masked = self.needed(tokens, gen, state)
        v, p = self.choose(logits, masked, keys)
        n_masked = masked.sum(1)
        k_min = torch.minimum(self.min_accept(state["block_step"]), n_masked)
        tau = state["threshold"][:, None] if "threshold" in state else self.config.threshold
        accept = select(self.config.rule, p, masked, k_min, tau, self.config.steps is not None)
        # Done when this forward saw the block final (its KV is the block's). Nothing is cached for bidirectional
        # models, so there the block is done as soon as its last MASK is filled: no forward only to look at it.
        done = n_masked == 0
        if self.bidirectional:
            done = done | (accept.sum(1) == n_masked)
        block_step = torch.where(done, 0, state["block_step"] + 1)
        return torch.where(accept, v, tokens), done, {"block_step": block_step}
