"""LLaDA2's group-limited routing as the published modeling file does it (LLaDA2MoeGate.group_limited_topk, the
same in dInfer and dFactory): the experts of dropped groups are filled with -inf before the top-k, so they are never
picked, also when the biased scores of kept experts are negative (expert_bias below -sigmoid(logit))."""
from __future__ import annotations

import pytest
import torch

from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE


def published_route(logits, bias, n_group, topk_group, top_k, fill=float("-inf")):
    """Token by token, in plain loops: the published rule (fill -inf), or the old 0.0 fill for comparison."""
    ids = []
    for row in torch.sigmoid(logits.double()) + bias.double():
        groups = row.view(n_group, -1)
        group_score = [sorted(g.tolist(), reverse=True)[0] + sorted(g.tolist(), reverse=True)[1] for g in groups]
        kept = sorted(range(n_group), key=lambda i: -group_score[i])[:topk_group]
        masked = [v if i // groups.shape[1] in kept else fill for i, v in enumerate(row.tolist())]
        ids.append(sorted(range(len(masked)), key=lambda i: -masked[i])[:top_k])
    return torch.tensor(ids)


@pytest.mark.parametrize("E, G, TG, K", [(16, 4, 2, 4), (64, 8, 4, 8), (8, 2, 1, 2)])
def test_torch_routing_is_the_published_rule_with_negative_biased_scores(E, G, TG, K):
    torch.manual_seed(E + K)
    moe = MoE(32, MoEConfig(num_experts=E, expert_dim=8, top_k=K, num_shared=0, n_group=G, topk_group=TG,
                            routed_scaling=2.5, norm_topk_prob=True))
    with torch.no_grad():
        moe.gate.normal_()
        moe.expert_bias.normal_(std=0.2).sub_(1.2)  # nearly every biased score negative
        x = torch.randn(64, 32)
        ids, w = moe.route(x, backend="grouped_mm")  # the torch path
        logits = x @ moe.gate.t()
    want = published_route(logits, moe.expert_bias, G, TG, K)
    assert torch.equal(ids.sort(-1).values, want.sort(-1).values)
    # the case the fill decides: the old 0.0 fill picks dropped groups' experts for some tokens
    assert not torch.equal(published_route(logits, moe.expert_bias, G, TG, K, fill=0.0).sort(-1).values,
                           want.sort(-1).values)
    scores = torch.sigmoid(logits).gather(1, ids)
    torch.testing.assert_close(w, scores / scores.sum(-1, keepdim=True) * 2.5)
