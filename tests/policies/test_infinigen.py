"""`infinigen` (compiledllm/policies/infinigen.py): mage's selection ranked by InfiniGen's partial scores after an
offline skew. The skew is orthogonal with columns by decreasing query energy; the approximate mass equals a float64
hand computation (dense cache and pool source); with every coordinate it ranks as mage does (same tokens); with the
whole budget it is dense threshold; batched == alone."""
from __future__ import annotations

import pytest
import torch
from selection_cases import DENSE, ckpt, model, prompts  # noqa: F401  (fixtures)
from selection_cases import run as run_cases

from compiledllm.attention.backend import _approximate_mass
from compiledllm.attention.launch import PackedArgs
from compiledllm.attention.spec import BlockCausal
from compiledllm.errors import UserError
from compiledllm.policies.infinigen import skew

def run(model, policy, batch, ps):
    return [r.output_ids for r in run_cases(model, policy, batch, ps)]


def test_skew_is_orthogonal_with_the_query_energy_first(model):
    A = skew(model, (2, 3), 256)
    D = model.config.head_dim
    assert A.shape == (2, model.config.num_kv_heads, D, D)
    eye = torch.eye(D).expand_as(A)
    torch.testing.assert_close(A.transpose(-1, -2) @ A, eye, atol=1e-4, rtol=0)
    # the queries' energy along the columns decreases (the SVD's order): recompute it from the same calibration
    energy = []

    def keep(module, args):
        if module.index == 2:
            energy.append(module.project(*args[:4])[0][0].float())

    attn = next(m for m in model.modules() if getattr(m, "index", None) == 2 and hasattr(m, "project"))
    hook = attn.register_forward_pre_hook(keep)
    try:
        skew(model, (2,), 256)
    finally:
        hook.remove()
    q = energy[0].view(256, model.config.num_kv_heads, -1, D).transpose(0, 1).reshape(model.config.num_kv_heads, -1, D)
    per_column = (q @ A[0]).pow(2).sum(1)  # [KVH, D]
    assert (per_column[:, :-1] >= per_column[:, 1:] * (1 - 1e-4)).all()


@pytest.mark.parametrize("pooled", [False, True])
def test_approximate_mass_is_the_partial_scores_softmax(pooled):
    g = torch.Generator().manual_seed(3)
    B, Q, H, KVH, D, S, r = 2, 3, 4, 2, 8, 5, 3
    q, kw = torch.randn(B, Q, H, D, generator=g), torch.randn(B, Q, KVH, D, generator=g)
    keys = torch.randn(B, S, KVH, D, generator=g)
    A = torch.linalg.qr(torch.randn(KVH, D, D, generator=g)).Q[..., :r]
    prefix = torch.tensor([5, 2])
    queries = torch.tensor([[True, False, True], [True, True, True]])
    if pooled:  # the same keys as a pool read through an index, rows reversed
        pool = keys.flip(1).reshape(B * S, KVH, D)
        index = (torch.arange(B)[:, None] * S + (S - 1 - torch.arange(S))[None])
        args = PackedArgs(q, pool, pool, prefix, kw, kw, BlockCausal(Q), index)
    else:
        args = PackedArgs(q, keys, keys, prefix, kw, kw, BlockCausal(Q))
    got = _approximate_mass(args, A, queries)
    want = torch.zeros(B, KVH, S + Q, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kvh = h // (H // KVH)
            ks = torch.cat([keys[b, : prefix[b], kvh], kw[b, :, kvh]]).double() @ A[kvh].double()
            for i in range(Q):
                if not queries[b, i]:
                    continue
                s = (q[b, i, h].double() @ A[kvh].double()) @ ks.T * D ** -0.5
                p = torch.softmax(s, 0)
                want[b, kvh, : prefix[b]] += p[: prefix[b]]
                want[b, kvh, S:] += p[prefix[b]:]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_every_coordinate_ranks_as_mage_and_the_whole_budget_is_threshold(model):
    ps = prompts(model.config.vocab_size)
    mage = run(model, DENSE | {"name": "mage", "budget": 0.3}, 3, ps)
    assert run(model, DENSE | {"name": "infinigen", "budget": 0.3, "partial": 1.0}, 3, ps) == mage
    assert run(model, DENSE | {"name": "infinigen", "budget": 1.0}, 3, ps) == run(model, DENSE, 3, ps)


def test_partial_scores_select_otherwise_and_batch_invariantly(model):
    ps = prompts(model.config.vocab_size)
    policy = DENSE | {"name": "infinigen", "budget": 0.3, "partial": 0.25}
    got = run(model, policy, 3, ps)
    assert got != run(model, DENSE | {"name": "mage", "budget": 0.3}, 3, ps)
    assert got == [run(model, policy, 1, [p])[0] for p in ps]


@pytest.mark.parametrize("params,message", [({"partial": 0.0}, "partial"), ({"calibration": 0}, "calibration")])
def test_bad_settings_are_one_line_errors(params, message):
    from compiledllm.policies import policy_config

    with pytest.raises(UserError, match=message):
        policy_config({"name": "infinigen"} | params)
