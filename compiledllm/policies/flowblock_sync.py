"""`flowblock_sync`: FlowBlock with one lock-step window schedule for the whole batch - the ablation HWP is measured
against (FlowBlock's synchronous wavefront).

Every row decodes exactly as `flowblock` alone would, but a window change (a retirement or an admission) is applied
only in a step where every active row changes its window; a row that would change it earlier waits, its step
discarded (same inputs next step, so the same decision then). So the tokens are flowblock's, row by row, whatever
the batch, and the cost of lock-step is forwards: rows idle until the slowest reaches its next window event.
"""
from __future__ import annotations

import torch

from compiledllm.policies.flowblock import FlowBlockConfig, FlowBlockPolicy
from compiledllm.policies.plan import Update


class FlowBlockSyncConfig(FlowBlockConfig):
    pass


class FlowBlockSyncPolicy(FlowBlockPolicy):
    name = "flowblock_sync"

    def update(self, phase, st, fwd, logits) -> Update:
        upd = super().update(phase, st, fwd, logits)
        wants = (upd.advance > 0) | (upd.state["more"] != st.policy["more"])
        go = ~wants | (wants | ~st.active).all()  # one schedule: changes only when every active row changes
        keep = lambda new, old: torch.where(go.view(-1, *[1] * (new.dim() - 1)), new, old)  # noqa: E731
        return Update(keep(upd.write_pos, torch.full_like(upd.write_pos, -1)), upd.tokens, keep(upd.advance, 0),
                      {k: keep(v, st.policy[k]) for k, v in upd.state.items()})
