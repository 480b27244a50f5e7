"""The forwards of threshold / t2t (BlockPolicy.block_forward, both branches) and flowblock carry route_groups:
each token's block (position // block), -1 for a token that does not count (finished row, slot past the window,
padding past the working sequence). And t2t_step is the one M2T / T2T rule: flowblock with W = 1 plans and updates
as t2t does."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from compiledllm.policies import make_policy, policy_config

MASK, BK = 1, 4


def slots(block_start, prompt_len, work_len, active, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(active)
    seq = torch.where(torch.rand(B, T, generator=g) < 0.5, MASK, torch.randint(2, 9, (B, T), generator=g))
    return SimpleNamespace(seq=seq, block_start=torch.tensor(block_start), prompt_len=torch.tensor(prompt_len),
                           work_len=torch.tensor(work_len), active=torch.tensor(active),
                           steps=torch.zeros(len(active), dtype=torch.long), key=torch.zeros(len(active), dtype=torch.long),
                           params={})  # SlotState's fields that plan / update read


def test_block_forward_route_groups_block_causal_and_bidirectional():
    st = slots([4, 8], [3, 9], [12, 16], [True, False])
    for name in ("threshold", "t2t"):
        pol = make_policy(policy_config({"name": name, "block_size": BK}), MASK)
        st.policy = pol.init_state(2, "cpu")
        fwd = pol.plan("decode", st)
        assert fwd.route_groups.tolist() == [[1] * BK, [-1] * BK]  # the block's; the finished row's: none
        assert fwd.kv_write.tolist() == [[4, 5, 6, 7], [-1] * BK]
        bidir = make_policy(policy_config({"name": name, "block_size": BK}), MASK, bidirectional=True)
        fwd = bidir.plan("decode", st)
        T = st.seq.shape[1]
        assert fwd.route_groups[0].tolist() == [p // BK if p < 12 else -1 for p in range(T)]
        assert fwd.route_groups[1].tolist() == [-1] * T


def test_flowblock_route_groups_follow_the_window():
    pol = make_policy(policy_config({"name": "flowblock", "block_size": BK, "window": 3}), MASK)
    st = slots([4, 8, 0], [3, 9, 2], [12, 24, 24], [True, True, False])
    st.policy = pol.init_state(3, "cpu") | {"more": torch.tensor([2, 1, 2])}
    fwd = pol.plan("decode", st)
    # row 0: blocks 1, 2 (block 3 lies past its working length); row 1: blocks 2, 3 (more = 1); row 2 finished
    assert fwd.route_groups.tolist() == [[1] * BK + [2] * BK + [-1] * BK, [2] * BK + [3] * BK + [-1] * BK,
                                         [-1] * (3 * BK)]
    assert torch.equal(fwd.kv_write, torch.where(fwd.route_groups >= 0, fwd.positions, -1))


def test_flowblock_of_one_block_updates_as_t2t():
    t2t = make_policy(policy_config({"name": "t2t", "block_size": BK, "threshold": 0.4, "max_post_steps": 1}), MASK)
    fb = make_policy(policy_config({"name": "flowblock", "block_size": BK, "threshold": 0.4, "max_post_steps": 1,
                                    "window": 1}), MASK)
    for seed in range(20):
        st = slots([4, 8, 0, 12], [3, 9, 2, 12], [12, 16, 8, 20], [True, True, True, True], seed=seed)
        post = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(seed))
        logits = torch.randn(4, BK, 9, generator=torch.Generator().manual_seed(100 + seed)) * 3
        st.policy = {"post": post}
        a = t2t.update("decode", st, t2t.plan("decode", st), logits)
        st.policy = fb.init_state(4, "cpu") | {"post": post[:, None]}
        b = fb.update("decode", st, fb.plan("decode", st), logits)
        assert torch.equal(a.write_pos, b.write_pos) and torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.advance, b.advance)
        kept = a.advance == 0  # t2t resets a finished block's counter, flowblock slides it out
        assert torch.equal(a.state["post"][kept], b.state["post"][kept, 0])


def test_herald_draft_step_routes_and_writes_only_the_drafting_rows_drafts():
    """A folded draft step (herald's draft_fold): every row's block group, but the draft group of the drafting rows
    alone — the others' draft tokens route nowhere and write no K/V."""
    pol = make_policy(policy_config({"name": "herald", "block_size": BK, "budget": 0.3}), MASK)
    st = slots([4, 8], [3, 9], [12, 16], [True, True])
    st.policy = pol.init_state(2, "cpu")
    st.policy["drafting"][0] = True
    fwd = pol.plan("draft", st)
    block, draft = fwd.route_groups[:, :BK], fwd.route_groups[:, BK:]
    assert (block >= 0).all() and (draft[0] >= 0).all() and (draft[1] == -1).all()
    assert (fwd.kv_write[1, BK:] == -1).all() and (fwd.kv_write[0, BK:] >= 0).any()
