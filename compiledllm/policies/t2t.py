"""`t2t`: LLaDA2.1 mask-to-token plus token-to-token editing, docs/design.md §4.

Per step: M2T fills masked positions with p > tau_mask (at least the most confident one while masks
remain); T2T rewrites already generated, non-prompt tokens whose argmax differs with p > tau_edit.
Once a block has no MASK, each further step counts as a post step; the block ends when a step without
MASK edits nothing, or when post steps exceed max_post_steps (that last forward is a pure re-forward of
the final tokens, so the cache holds the block's true KV).

EditRecord (used by `t2t` and `flowblock`) keeps, on request, what evaluate needs to score the edits: an edit is a
write that changes an already generated, non-MASK token; per request, the first token ever written at each edited
position (the M2T draft), the count of edits and of blocks that had one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from compiledllm.policies.base import BlockPolicy, PolicyConfig, State, check_probability, logits_view, top_confident


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


def slide_blocks(x: torch.Tensor, blocks: torch.Tensor, per_block: int) -> torch.Tensor:
    """x [B, n * per_block] window-aligned, slid left by `blocks` [B] blocks per row (zeros enter on the right)."""
    j = torch.arange(x.shape[1], device=x.device)[None] + blocks[:, None] * per_block
    return torch.where(j < x.shape[1], x.gather(1, j.clamp(max=x.shape[1] - 1)), 0)


class EditRecord:
    """Opt-in edit statistics for T2T policies (evaluate turns them on). Off (the default) nothing is added: no
    state, no work in the step, report unchanged. On, four state buffers, updated by tensor ops only (so the step
    still compiles and captures): `edits` [B] edits made, `edit_blocks` [B] retired blocks that had one,
    `edit_flags` [B, blocks] whether each block in the window had one, and `drafts` [B, span + 1]: at each
    generated offset (position - prompt length) below `span` that was edited, its draft token + 1 (0: never
    edited); the last column takes the writes that record nothing. The decoded tokens are the same either way."""

    mask_id: int
    edit_span: int = 0  # generated offsets whose drafts are kept (0: no record)

    def track_edits(self, span: int) -> None:
        """Record edits at the first `span` generated positions; call before generate() (init_state sizes the
        buffers)."""
        if span < 1:
            raise ValueError(f"span: must be >= 1, got {span}")
        self.edit_span = span

    def edit_state(self, batch: int, blocks: int, device) -> State:
        if not self.edit_span:
            return {}
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        return {"edits": z(batch), "edit_blocks": z(batch), "edit_flags": z(batch, blocks),
                "drafts": z(batch, self.edit_span + 1)}

    def edit_update(self, s: State, pos: torch.Tensor, old: torch.Tensor, new: torch.Tensor, gen: torch.Tensor,
                    prompt_len: torch.Tensor, retire: torch.Tensor) -> State:
        """The record's new state: pos / old / new / gen [B, K] the window's positions, tokens before and after this
        update and which are generated (K = blocks x block size, window-aligned); retire [B] blocks retired now."""
        if not self.edit_span:
            return {}
        span, (B, nb) = self.edit_span, s["edit_flags"].shape
        edit = gen & (old != self.mask_id) & (new != old)
        off = (pos - prompt_len[:, None]).clamp(0, span)
        drafts = s["drafts"]
        first = edit & (off < span) & (drafts.gather(1, off) == 0)  # window positions are distinct: no clashes
        drafts = drafts.scatter(1, torch.where(first, off, span), old + 1)
        flags = s["edit_flags"] | edit.view(B, nb, -1).any(-1).long()
        gone = torch.arange(nb, device=pos.device)[None] < retire[:, None]
        return {"edits": s["edits"] + edit.sum(1), "edit_blocks": s["edit_blocks"] + (flags * gone).sum(1),
                "edit_flags": slide_blocks(flags, retire, 1), "drafts": drafts}

    def edit_report(self, st, slot: int) -> dict:
        """{"edits", "edit_blocks", "edit_offsets", "edit_drafts"} of the request in `slot` ({} when off): the
        offsets (from the prompt's end, ascending) of the edited positions and their drafts."""
        if not self.edit_span:
            return {}
        s = st.policy
        row = s["drafts"][slot, : self.edit_span]
        offsets = row.nonzero().flatten()
        edits, blocks = torch.stack([s["edits"][slot], s["edit_blocks"][slot]]).tolist()
        return {"edits": edits, "edit_blocks": blocks, "edit_offsets": offsets.tolist(),
                "edit_drafts": (row[offsets] - 1).tolist()}


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
