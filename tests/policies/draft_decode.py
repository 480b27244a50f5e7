"""A test-only two-phase policy shaped like HERALD's step 1: phase "draft" forwards 2 x block tokens - the block and
a copy of it, both seeing the cached prefix and not each other (QueryGroups) - writes no KV and changes no token,
and keeps the copy's argmax as a draft (the copy is a route group of its own); phase "decode" is `threshold`
unchanged. So its tokens must be threshold's,
with two forwards per step, and each draft must equal what the decode phase of the same step predicts."""
from __future__ import annotations

import torch

from compiledllm.attention.spec import AttentionSpec, QueryGroups
from compiledllm.policies.base import confidence, logits_view
from compiledllm.policies.plan import Forward, Update, route_groups
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy


class DraftDecodeConfig(ThresholdConfig):
    pass


class DraftDecodePolicy(ThresholdPolicy):
    name = "draft_decode"
    phases = ("draft", "decode")

    def __init__(self, config, mask_id, bidirectional=False):
        super().__init__(config, mask_id, bidirectional)
        self.mismatches: list[int] = []  # read through the host hook: drafts that differ from the decode argmax

    def init_state(self, batch, device):
        zeros = torch.zeros(batch, self.block_size, dtype=torch.long, device=device)
        return super().init_state(batch, device) | {"draft": zeros, "mismatch": torch.zeros_like(zeros[:, 0])}

    def plan(self, phase, st):
        if phase == "decode":
            return super().plan(phase, st)
        idx, tokens, gen = self.block_window(st)
        Bk = self.block_size
        group = (torch.arange(2 * Bk, device=idx.device) >= Bk).int()[None]  # [block | copy]
        see = 1 << torch.arange(2, dtype=torch.int32, device=idx.device)  # [0b01, 0b10], made on the device
        spec = AttentionSpec(QueryGroups(group, see), prefix_len=st.block_start)
        copy = torch.arange(Bk, 2 * Bk, device=idx.device).expand_as(idx)
        live = st.active[:, None].expand_as(idx)
        groups = torch.cat([route_groups(idx, Bk, live), route_groups(idx, Bk, live, copy=1)], dim=1)
        return Forward(tokens.repeat(1, 2), idx.repeat(1, 2), spec, kv_write=torch.full_like(idx, -1).repeat(1, 2),
                       logits_at=copy, logits_rows=self.needed(tokens, gen, st.policy), route_groups=groups)

    def update(self, phase, st, fwd, logits):
        if phase == "draft":
            pos, tokens = logits_view(fwd)
            v, _ = confidence(logits, self.mask_id, fwd.logits_rows)
            state = st.policy | {"draft": v}
            return Update(torch.full_like(pos, -1), tokens, torch.zeros_like(pos[:, 0]), state)
        upd = super().update(phase, st, fwd, logits)
        v, _ = confidence(logits, self.mask_id, fwd.logits_rows)
        miss = ((v != st.policy["draft"]) & fwd.logits_rows).sum(1)
        return Update(upd.write_pos, upd.tokens, upd.advance,
                      upd.state | {"draft": st.policy["draft"], "mismatch": st.policy["mismatch"] + miss})

    def on_blocks(self, host, rows):
        m = host.st.policy["mismatch"].tolist()
        self.mismatches += [m[s] for s in rows]
