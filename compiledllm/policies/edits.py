"""What the T2T policies (`t2t`, `flowblock`, `flowblock_sync`) share besides their decoding rule: the opt-in edit
record and the window slide.

EditRecord keeps, on request, what evaluate needs to score the edits: an edit is a write that changes an already
generated, non-MASK token; per request, the first token ever written at each edited position (the M2T draft), the
count of edits and of blocks that had one. It is on where the policy's config says so (`T2TConfig(edit_span=N)`,
what evaluate builds): the config, frozen, is the one place that decides it.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from compiledllm.policies.plan import State


def slide_blocks(x: torch.Tensor, blocks: torch.Tensor, per_block: int) -> torch.Tensor:
    """x [B, n * per_block] window-aligned, slid left by `blocks` [B] blocks per row (zeros enter on the right)."""
    j = torch.arange(x.shape[1], device=x.device)[None] + blocks[:, None] * per_block
    return torch.where(j < x.shape[1], x.gather(1, j.clamp(max=x.shape[1] - 1)), 0)


class EditRecord:
    """Opt-in edit statistics for T2T policies (a mixin of Policy; the config has `edit_span`, T2TConfig's).
    Off (edit_span 0, the default) nothing is added: no state, no work in the step, report unchanged. On, four state
    buffers, updated by tensor ops only (so the step still compiles and captures): `edits` [B] edits made,
    `edit_blocks` [B] retired blocks that had one, `edit_flags` [B, blocks] whether each block in the window had one,
    and `drafts` [B, span + 1]: at each generated offset (position - prompt length) below `span` that was edited, its
    draft token + 1 (0: never edited); the last column takes the writes that record nothing. The decoded tokens are
    the same either way."""

    mask_id: int

    @property
    def edit_span(self) -> int:
        """Generated offsets whose drafts are kept (0: no record): the config's."""
        return self.config.edit_span

    def track_edits(self, span: int) -> None:
        """Record edits at the first `span` generated positions: the policy's config becomes the same config with
        edit_span=span. Build the config with edit_span instead where you can (evaluate does); this is the one
        mutator of a policy after creation, for a policy an Engine already built. Call it before generate()
        (init_state sizes the buffers)."""
        if span < 1:
            raise ValueError(f"span: must be >= 1, got {span}")
        self.config = replace(self.config, edit_span=span)

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
