"""Flash-Verify (../shared/papers/flash-dllm.txt; `flash_dllm verify: true`): after a step's draft pass (the decode
forward), the block's masked positions the confidence rule left are the search set, the S = `search` most confident
of them in decoding order (confidence, descending) with their draft tokens. One verify forward, writing no KV, holds:

* the tracked context: the block's decoded positions (this step's accepted ones included), the last steps' tokens
  and the tracked positions (policies/flash_dllm.py), their K/V recomputed;
* the draft view: the search positions with their draft tokens;
* the mask view: the same positions as [MASK];

over the cache everywhere else. With views indexed by decoding order, draft i sees drafts j <= i and masks j > i,
mask i sees drafts j < i and masks j >= i (so mask i predicts position i with the drafts before it filled in), and
the tracked context sees itself and the mask view (the sequence as it stands), never a draft. Acceptance runs along
the decoding order and stops at the first failure: `verify_rule: agree` (the paper) accepts draft i while the mask
view's argmax equals it and its confidence > gamma; `prefix_product` (the public code) while the product of the
mask view's probabilities of the drafts so far stays >= gamma. Accepted drafts are written like the draft pass's.
"""
from __future__ import annotations

import torch

from dataclasses import dataclass
from typing import Literal

from compiledllm.attention.spec import AttentionSpec, QueryGroups
from compiledllm.policies.base import check_probability
from compiledllm.policies.plan import Forward, Update, route_groups


@dataclass(frozen=True)
class VerifySettings:
    """A policy config's Flash-Verify keys (flash_dllm, threshold): a second forward a step checks the `search` most
    confident drafts the rule left, accepted along the decoding order by `verify_rule` at `gamma`."""

    verify: bool = False
    gamma: float = 0.8
    verify_rule: Literal["agree", "prefix_product"] = "agree"
    search: int = 8

    def check_verify(self) -> None:
        check_probability("gamma", self.gamma)
        if self.verify_rule not in ("agree", "prefix_product"):
            raise ValueError(f"verify_rule: must be agree or prefix_product, got {self.verify_rule!r}")
        if not 1 <= self.search <= 14:
            raise ValueError(f"search: must be within [1, 14] (two attention groups per position), got {self.search}")


def marks(positions: torch.Tensor, valid: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] bool: True at positions [B, K] where valid [B, K]."""
    out = torch.zeros(positions.shape[0], T + 1, dtype=torch.bool, device=positions.device)
    return out.scatter_(1, torch.where(valid, positions, T), True)[:, :T]


def verified(logits: torch.Tensor, on: torch.Tensor, drafts: torch.Tensor, mask_id: int, rule: str, gamma: float
             ) -> torch.Tensor:
    """[B, S] bool: the drafts accepted, along the decoding order up to the first failure: `agree`, while the mask
    view's argmax (logits [B, S, V]) is the draft and its probability > gamma; `prefix_product`, while the product
    of the mask view's probabilities of the drafts so far stays >= gamma. on [B, S]: the searched positions."""
    probs = torch.softmax(torch.where(on[..., None], logits, 0.0).float(), dim=-1)
    probs[..., mask_id] = 0.0  # never a prediction; probabilities over the full vocabulary (base.confidence)
    conf, pred = probs.max(-1)
    if rule == "agree":
        ok = on & (pred == drafts) & (conf > gamma)
    else:
        p_draft = probs.gather(-1, drafts.clamp(min=0)[..., None])[..., 0]
        ok = on & (torch.cumprod(torch.where(on, p_draft, 1.0), dim=1) >= gamma)
    return torch.cumprod(ok.long(), dim=1).bool()


def view_groups(S: int, device) -> torch.Tensor:
    """[2S + 2] int32 visibility bitmasks: group 0 the tracked context, 1 + i draft i, 1 + S + i mask i, 2S + 1
    padding (itself only)."""
    i = torch.arange(S, device=device)
    bit = lambda g: 1 << g  # noqa: E731
    drafts, masks = bit(1 + i), bit(1 + S + i)
    below = torch.tril(torch.ones(S, S, dtype=torch.bool, device=device))  # [i, j]: j <= i
    draft_see = bit(0) + (drafts[None] * below).sum(1) + (masks[None] * ~below).sum(1)
    mask_see = bit(0) + (drafts[None] * (below & ~torch.eye(S, dtype=torch.bool, device=device))).sum(1) \
        + (masks[None] * ~(below & ~torch.eye(S, dtype=torch.bool, device=device))).sum(1)
    tracked_see = bit(0) + masks.sum()
    pad = torch.full((1,), bit(2 * S + 1), device=device)  # (built on the device: a captured step copies nothing)
    return torch.cat([tracked_see[None], draft_see, mask_see, pad]).int()


class Search:
    """The decode step's side of a verify pass: the search set it leaves."""

    def search_state(self, p: torch.Tensor, masked: torch.Tensor, accept: torch.Tensor, v: torch.Tensor) -> dict:
        """The S most confident masked block positions the rule left (block offsets + 1; 0: none; ties: the lower
        offset) and their drafts: the state a verify pass reads."""
        S = self.config.search
        left = masked & ~accept
        order = torch.sort(torch.where(left, p, -1.0), dim=1, descending=True, stable=True).indices[:, :S]
        on = left.gather(1, order)
        pos, tok = torch.where(on, order + 1, 0), torch.where(on, v.gather(1, order), self.mask_id)
        if pos.shape[1] < S:  # a block smaller than the search: the rest stays empty
            pad = pos.new_zeros(pos.shape[0], S - pos.shape[1])
            pos, tok = torch.cat([pos, pad], 1), torch.cat([tok, pad + self.mask_id], 1)
        return {"search_pos": pos, "search_tok": tok}


class FlashVerify(Search):
    """flash_dllm's verify phase (uses its config, block, tracker, compaction and cache reads)."""

    def verify_slots(self, capacity: int) -> int:
        """The verify forward's tracked-context query slots (block, last steps' tokens, tracked)."""
        return 2 * self.block_size + min(self.config.track, capacity)

    def verify_plan(self, st, act: torch.Tensor) -> Forward:
        """The verify forward: [tracked context | draft view | mask view] over the cache elsewhere, no KV written;
        logits at the mask view."""
        B, T = st.seq.shape
        Bk, S, dev = self.block_size, self.config.search, st.seq.device
        pos, in_block, working = self.regions(st)
        masked = (st.seq == self.mask_id) & (pos >= st.prompt_len[:, None]) & working
        j = st.policy["search_pos"] - 1
        on = (j >= 0) & act[:, None]
        spos = self.block(st).gather(1, j.clamp(min=0))
        member = ((in_block & ~masked) | (st.policy["new"] & working) | self.tracked(st, masked)) & act[:, None]
        t_pos, t_live = self.compact(member, self.verify_slots(T))
        q_pos = torch.cat([t_pos, spos, spos], 1)
        q_live = torch.cat([t_live, on, on], 1)
        tokens = torch.cat([st.seq.gather(1, t_pos), st.policy["search_tok"],
                            torch.full_like(spos, self.mask_id)], 1)
        i = torch.arange(S, device=dev)[None]
        group = torch.cat([torch.zeros_like(t_pos), (1 + i).expand(B, S), (1 + S + i).expand(B, S)], 1)
        group = torch.where(q_live, group, 2 * S + 1).int()
        prefix_len, kv_index = self.cache_around(st, q_pos, q_live, act)
        spec = AttentionSpec(QueryGroups(group, view_groups(S, dev)), prefix_len=prefix_len, kv_index=kv_index)
        masks_at = t_pos.shape[1] + S + i.expand(B, S)
        return Forward(tokens, q_pos, spec, kv_write=None, logits_at=masks_at, logits_rows=on,
                       route_groups=route_groups(q_pos, Bk, q_live))

    def verify_update(self, st, act: torch.Tensor, logits: torch.Tensor) -> Update:
        """Accept the drafts along the decoding order up to the first failure of the rule (see the module)."""
        j, drafts = st.policy["search_pos"] - 1, st.policy["search_tok"]
        on = (j >= 0) & act[:, None]
        search_pos = torch.where(on, self.block(st).gather(1, j.clamp(min=0)), -1)
        accept = verified(logits, on, drafts, self.mask_id, self.config.verify_rule, self.config.gamma)
        T = st.seq.shape[1]
        write = torch.where(accept, search_pos, -1)
        idx = self.block(st)
        left = ((st.seq.gather(1, idx) == self.mask_id) & (idx >= st.prompt_len[:, None])).sum(1)
        done = act & (left > 0) & (accept.sum(1) == left)
        new = st.policy["new"] | marks(search_pos, accept, T)
        state = {"new": torch.where(act[:, None], new, st.policy["new"]),
                 "nfe": st.policy["nfe"] + (act & on.any(1)).long(),
                 "verified": st.policy["verified"] + accept.sum(1)}
        return Update(write, drafts, done.long(), state)


class BlockVerify(Search):
    """Flash-Verify on a block-causal model (`threshold verify: true`, past the paper): after a decode step the
    block's positions outside the search set (its decided tokens and its other masks) are the context, the search
    set's draft and mask views as above, all over the cached prefix; no KV is written and no block retires in it
    (a block whose last masks it fills retires in the next forward, which sees it final)."""

    def block_verify_plan(self, st) -> Forward:
        idx, tokens, gen = self.block_window(st)
        B, Bk = idx.shape
        S, dev = self.config.search, idx.device
        j = st.policy["search_pos"] - 1
        on = (j >= 0) & st.active[:, None]
        at = idx.gather(1, j.clamp(min=0))
        searched = marks(j.clamp(min=0), on, Bk)
        i = torch.arange(S, device=dev)[None]
        group = torch.cat([torch.where(searched, 2 * S + 1, 0), torch.where(on, 1 + i, 2 * S + 1),
                           torch.where(on, 1 + S + i, 2 * S + 1)], 1)
        group = torch.where(st.active[:, None], group, 2 * S + 1).int()
        positions = torch.cat([idx, at, at], 1)
        live = group < 2 * S + 1
        spec = AttentionSpec(QueryGroups(group, view_groups(S, dev)), prefix_len=st.block_start)
        return Forward(torch.cat([tokens, st.policy["search_tok"], torch.full_like(at, self.mask_id)], 1), positions,
                       spec, kv_write=None, logits_at=Bk + S + i.expand(B, S), logits_rows=on,
                       route_groups=torch.cat([route_groups(idx, Bk, live[:, :Bk]),
                                               route_groups(at, Bk, on, copy=1), route_groups(at, Bk, on, copy=2)], 1))

    def block_verify_update(self, st, logits: torch.Tensor) -> Update:
        idx, _, _ = self.block_window(st)
        j = st.policy["search_pos"] - 1
        on = (j >= 0) & st.active[:, None]
        drafts = st.policy["search_tok"]
        accept = verified(logits, on, drafts, self.mask_id, self.config.verify_rule, self.config.gamma)
        write = torch.where(accept, idx.gather(1, j.clamp(min=0)), -1)
        return Update(write, drafts, torch.zeros_like(st.block_start),
                      {"verified": st.policy["verified"] + accept.sum(1)})
