"""`t2t`: LLaDA2.1 mask-to-token plus token-to-token editing, docs/design.md §4.

Per step: M2T fills masked positions with p > tau_mask (at least the most confident one while masks
remain); T2T rewrites already generated, non-prompt tokens whose argmax differs with p > tau_edit.
Once a block has no MASK, each further step counts as a post step; the block ends when a step without
MASK edits nothing, or when post steps exceed max_post_steps (that last forward is a pure re-forward of
the final tokens, so the cache holds the block's true KV). `t2t_step` is that rule over any number of block rows:
`flowblock` applies it to every block of its window.
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass, replace
from typing import NamedTuple

import torch

from compiledllm.policies.base import BlockPolicy, PolicyConfig, State, check_probability, logits_view, top_confident
from compiledllm.policies.edits import EditRecord


@dataclass(frozen=True)
class T2TConfig(PolicyConfig):
    """edit_span: record edits at the first edit_span generated positions (policies/edits.py EditRecord; 0: no
    record). An init-only value, kept on the frozen config, that evaluate sets: not a decoding parameter, so not a
    recipe key, nor in the resolved recipe, nor in ==; `replace` keeps it. A subclass's __post_init__ takes it."""

    threshold: float = 0.7
    edit_threshold: float = 0.5
    max_post_steps: int = 16
    edit_span: InitVar[int] = 0

    def __post_init__(self, edit_span: int) -> None:
        super().__post_init__()
        check_probability("threshold", self.threshold)
        check_probability("edit_threshold", self.edit_threshold)
        if self.max_post_steps < 0:
            raise ValueError(f"max_post_steps: must be >= 0, got {self.max_post_steps}")
        if not isinstance(edit_span, int) or isinstance(edit_span, bool) or edit_span < 0:
            raise ValueError(f"edit_span: must be an int >= 0, got {edit_span!r}")
        object.__setattr__(self, "edit_span", edit_span)  # frozen: set once, here


class T2TStep(NamedTuple):
    """One step of the rule over N block rows: masked / m2t / t2t [N, Bk] bool (m2t and t2t: the positions written,
    none in an expired block), tokens [N, Bk] the block's tokens after it, post [N] the post-step counters
    (not reset), done [N] bool: the block is finished (this forward saw it final)."""

    masked: torch.Tensor
    m2t: torch.Tensor
    t2t: torch.Tensor
    tokens: torch.Tensor
    post: torch.Tensor
    done: torch.Tensor


def t2t_step(config: T2TConfig, mask_id: int, tokens: torch.Tensor, gen: torch.Tensor, v: torch.Tensor,
             p: torch.Tensor, post: torch.Tensor, live: torch.Tensor | None = None) -> T2TStep:
    """LLaDA2.1's per-block rule (docs/design.md §4) on block rows: tokens / gen (changeable) / v / p [N, Bk] (the
    forward's choice and its probability), post [N] the counters before this step, live [N] the rows that hold a
    block (None: all; a dead row gets post 0 and is never done). M2T: masked positions with p > tau_mask, else the
    most confident masked one; T2T: generated non-MASK positions with p > tau_edit and v != token; a block without
    MASK counts a post step, expires past max_post_steps (then nothing is written), and is done if it expired or
    edited nothing."""
    masked = (tokens == mask_id) & gen
    no_mask = ~masked.any(-1)
    if live is not None:
        no_mask = live & no_mask
    post = post + no_mask.long()
    if live is not None:
        post = torch.where(live, post, 0)
    expired = no_mask & (post > config.max_post_steps)
    m2t = masked & (p > config.threshold)
    fallback = top_confident(p, masked, torch.ones_like(post))
    m2t = torch.where(m2t.any(-1, keepdim=True), m2t, fallback) & ~expired[:, None]
    t2t = gen & ~masked & (p > config.edit_threshold) & (v != tokens) & ~expired[:, None]
    done = expired | (no_mask & ~t2t.any(-1))
    return T2TStep(masked, m2t, t2t, torch.where(m2t | t2t, v, tokens), post, done)


class T2TPolicy(EditRecord, BlockPolicy):
    name = "t2t"
    config: T2TConfig

    def init_state(self, batch: int, device) -> State:
        return {"post": torch.zeros(batch, dtype=torch.long, device=device)} | self.edit_state(batch, 1, device)

    def update(self, phase, st, fwd, logits):
        upd = super().update(phase, st, fwd, logits)
        if not self.edit_span:
            return upd
        pos, old = logits_view(fwd)
        stats = self.edit_update(st.policy, pos, old, upd.tokens, pos >= st.prompt_len[:, None], st.prompt_len,
                                 upd.advance)
        return replace(upd, state=upd.state | stats)

    def report(self, st, slot: int) -> dict:
        return self.edit_report(st, slot)

    def decide(self, tokens, logits, gen, state, keys):
        v, p = self.choose(logits, gen, keys)
        step = t2t_step(self.config, self.mask_id, tokens, gen, v, p, state["post"])
        return step.tokens, step.done, {"post": torch.where(step.done, 0, step.post)}
