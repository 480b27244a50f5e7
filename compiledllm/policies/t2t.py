"""`t2t`: LLaDA2.1 mask-to-token plus token-to-token editing, docs/design.md §4.

Per step: M2T fills masked positions with p > tau_mask (at least the most confident one while masks
remain); T2T rewrites already generated, non-prompt tokens whose argmax differs with p > tau_edit.
Once a block has no MASK, each further step counts as a post step; the block ends when a step without
MASK edits nothing, or when post steps exceed max_post_steps (that last forward is a pure re-forward of
the final tokens, so the cache holds the block's true KV).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.policies.base import BlockPolicy, PolicyConfig, State, check_probability, top_confident


@dataclass(frozen=True)
class T2TConfig(PolicyConfig):
    threshold: float = 0.7
    edit_threshold: float = 0.5
    max_post_steps: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("threshold", self.threshold)
        check_probability("edit_threshold", self.edit_threshold)
        if self.max_post_steps < 0:
            raise ValueError(f"max_post_steps: must be >= 0, got {self.max_post_steps}")


class T2TPolicy(BlockPolicy):
    name = "t2t"
    config: T2TConfig

    def init_state(self, batch: int, device) -> State:
        return {"post": torch.zeros(batch, dtype=torch.long, device=device)}

    def decide(self, tokens, logits, gen, state, keys):
        c = self.config
        masked = (tokens == self.mask_id) & gen
        v, p = self.choose(logits, gen, keys)
        no_mask = ~masked.any(1)
        post = state["post"] + no_mask.long()
        expired = no_mask & (post > c.max_post_steps)
        m2t = masked & (p > c.threshold)
        fallback = top_confident(p, masked, torch.ones_like(post))
        m2t = torch.where(m2t.any(1, keepdim=True), m2t, fallback)
        t2t = gen & ~masked & (p > c.edit_threshold) & (v != tokens)
        change = (m2t | t2t) & ~expired[:, None]
        done = expired | (no_mask & ~t2t.any(1))
        return torch.where(change, v, tokens), done, {"post": torch.where(done, 0, post)}
