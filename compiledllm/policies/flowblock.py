"""`flowblock`: gated wavefront decoding (GWD) with heterogeneous wavefront packing (HWP), FlowBlock Algorithm 1.

Each row keeps its own window [L, R) of at most W blocks (L = the engine's block_start / Bk, R - L in the state).
A step is one forward of the window's W x Bk query positions (slots past R: not written, their logits unused) under
the W-shaped mask - BlockCausal(Bk) against the row's frozen prefix [0, o_L): a query of block g sees the prefix
and blocks L..g, bidirectionally inside its block. Then, in every active block, t2t's M2T and T2T rules
(docs/design.md §4), each block with its own post-step counter; then

* retire from the left while block L is locally finished - LLaDA2.1's per-block exit: this forward saw it without
  MASK and it made no edit, or its post-step counter passed max_post_steps (that forward is then a pure re-forward
  of its final tokens, so its KV, written at the block's absolute positions, is the block's true KV);
* admit block R while R - L < W, R is inside the working sequence and the readiness rho(B_{R-1}) >= spawn, rho =
  the share of B_{R-1}'s masked positions with p >= tau_mask (1 when none is masked). `readiness: before` (the
  default) reads the masks this step's forward saw; `after` the masks left after this step's update (with this
  forward's p: the block is ready only once nearly all its masks are filled). A block admitted this step has no
  prediction yet (rho 0), so at most one block joins per step unless spawn is 0 (ungated: the window fills).

With W = 1 this is exactly `t2t`. All rows are packed into one dense forward whatever their windows (HWP): the plan's
shapes never change, so one CUDA graph per batch bucket serves every state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from compiledllm.errors import UserError
from compiledllm.policies.base import Policy, State, check_probability
from compiledllm.policies.edits import EditRecord, slide_blocks
from compiledllm.policies.plan import Forward, Update, window_forward
from compiledllm.policies.t2t import T2TConfig, t2t_step

# where a token was first drafted (M2T): in block L, or in a block after it; EDITED added once T2T changed it
FRONT, DOWNSTREAM, EDITED = 1, 2, 2


@dataclass(frozen=True)
class FlowBlockConfig(T2TConfig):
    window: int = 2
    spawn: float = 0.6
    readiness: Literal["before", "after"] = "before"

    def __post_init__(self, edit_span: int) -> None:
        super().__post_init__(edit_span)
        if self.window < 1:
            raise ValueError(f"window: must be >= 1, got {self.window}")
        check_probability("spawn", self.spawn)


class FlowBlockPolicy(EditRecord, Policy):
    name = "flowblock"
    config: FlowBlockConfig

    def __init__(self, config, mask_id, bidirectional=False):
        if bidirectional:
            raise UserError(f"policy {self.name} decodes a window of blocks against a KV cache; this model is "
                            "bidirectional (nothing is cached): use threshold or t2t")
        super().__init__(config, mask_id, bidirectional)
        self.W = config.window

    def init_state(self, batch, device) -> State:
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        q = self.W * self.block_size
        # more: R - L - 1; post: each window block's post-step counter; drafted: FRONT / DOWNSTREAM (+ EDITED) per
        # window position; the four counters feed report(): drafts, and drafts T2T edited later (each counted once)
        return {"more": z(batch), "post": z(batch, self.W), "drafted": z(batch, q), "front_drafts": z(batch),
                "down_drafts": z(batch), "front_edits": z(batch), "down_edits": z(batch), "draws": z(batch),
                **self.edit_state(batch, self.W, device)}

    def window(self, st):
        """(idx, tokens, gen, live) [B, W * Bk]: window positions, tokens, changeable, admitted (inside R)."""
        q, T = self.W * self.block_size, st.seq.shape[1]
        j = torch.arange(q, device=st.seq.device)
        idx = st.block_start[:, None] + j
        live = ((j // self.block_size)[None] <= st.policy["more"][:, None]) & (idx < st.work_len[:, None])
        idx = idx.clamp(max=T - 1)
        tokens = st.seq.gather(1, idx)
        return idx, tokens, live & (idx >= st.prompt_len[:, None]), live

    def plan(self, phase, st) -> Forward:
        idx, tokens, gen, live = self.window(st)
        return window_forward(tokens, idx, st.block_start, self.block_size, st.active[:, None] & live,
                              logits_rows=gen)

    def update(self, phase, st, fwd, logits) -> Update:
        c, W, Bk = self.config, self.W, self.block_size
        idx, tokens, gen, live = self.window(st)
        B = idx.shape[0]
        v, p = self.choose(logits, gen, self.noise_keys(st, idx, st.policy["draws"]))
        blk, rows = (B, W, Bk), (B * W, Bk)  # t2t's rule on every window block: one row per block
        step = t2t_step(c, self.mask_id, tokens.reshape(rows), gen.reshape(rows), v.reshape(rows), p.reshape(rows),
                        st.policy["post"].reshape(B * W), live.reshape(rows)[:, 0])
        masked, m2t, t2t, p3 = step.masked.view(blk), step.m2t.view(blk), step.t2t.view(blk), p.view(blk)
        post, finished = step.post.view(B, W), step.done.view(B, W)
        retire = finished.long().cumprod(1).sum(1)  # the leading run of finished blocks

        width = st.policy["more"] + 1
        ready = masked if c.readiness == "before" else masked & ~m2t
        last = (width - 1)[:, None, None].expand(B, 1, Bk)
        ready_last, p_last = ready.gather(1, last)[:, 0], p3.gather(1, last)[:, 0]
        n = ready_last.sum(1)
        rho = torch.where(n == 0, 1.0, (ready_last & (p_last >= c.threshold)).sum(1) / n.clamp(min=1))
        remaining = (st.work_len - st.block_start) // Bk - retire  # blocks from the new L to the end
        kept = width - retire
        if c.spawn <= 0:  # ungated: admit every block the window holds
            new_width = torch.minimum(torch.full_like(kept, W), remaining)
        else:
            new_width = kept + ((kept < W) & (kept < remaining) & (rho >= c.spawn)).long()

        new_tokens = step.tokens.view(B, W * Bk)
        state = self._track(st.policy, m2t.view(B, -1), t2t.view(B, -1), retire)
        state |= self.edit_update(st.policy, idx, tokens, new_tokens, gen, st.prompt_len, retire)
        state |= {"more": (new_width - 1).clamp(min=0), "post": slide_blocks(post, retire, 1),
                  "draws": st.policy["draws"] + 1}  # kept updates: sampling's counter (flowblock_sync discards some)
        return Update(torch.where(gen, idx, -1), new_tokens, retire, state)

    def _track(self, s: State, m2t: torch.Tensor, t2t: torch.Tensor, retire: torch.Tensor) -> State:
        """Where each token was first drafted, and how many of those drafts T2T edited later (the share of
        downstream drafts edited is what starting blocks early costs in rework)."""
        front = (torch.arange(m2t.shape[1], device=m2t.device) < self.block_size)[None]
        was = s["drafted"]
        first_edit = t2t & ((was == FRONT) | (was == DOWNSTREAM))
        drafted = torch.where(m2t, torch.where(front, FRONT, DOWNSTREAM), was + EDITED * first_edit.long())
        return {"drafted": slide_blocks(drafted, retire, self.block_size),
                "front_drafts": s["front_drafts"] + (m2t & front).sum(1),
                "down_drafts": s["down_drafts"] + (m2t & ~front).sum(1),
                "front_edits": s["front_edits"] + (first_edit & (was == FRONT)).sum(1),
                "down_edits": s["down_edits"] + (first_edit & (was == DOWNSTREAM)).sum(1)}

    def report(self, st, slot: int) -> dict:
        keys = ("front_drafts", "down_drafts", "front_edits", "down_edits")
        return dict(zip(keys, torch.stack([st.policy[k][slot] for k in keys]).tolist())) | self.edit_report(st, slot)
