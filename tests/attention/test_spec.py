"""What an AttentionSpec means (docs/design.md §3): the rules' masks, the reference under each rule and KV source,
per-key attention mass (summed, and per layer and KV head), the backend's read-then-write order with -1 writes
skipped, and a layer's own KV index and length over the forward's."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from compiledllm.attention.backend import attend
from compiledllm.attention.launch import PackedArgs
from compiledllm.attention.reference import reference
from compiledllm.attention.spec import (AttentionSpec, Bidirectional, BlockCausal, ExplicitMask, QueryGroups,
                                        block_causal_mask)
from compiledllm.kv.cache import KVCache
from compiledllm.policies.plan import Forward


def test_rule_masks_by_hand():
    assert BlockCausal(2).window_mask(4)[0].int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert torch.equal(block_causal_mask(6, 3), BlockCausal(3).window_mask(6)[0])
    herald = QueryGroups(torch.tensor([[0, 0, 1, 1]]), torch.tensor([0b01, 0b10]))  # block | draft copy
    assert herald.window_mask(4)[0].int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    verify = QueryGroups(torch.tensor([[0, 1, 2]]), torch.tensor([1, 3, 5]))  # tracked, draft view, mask view
    assert verify.window_mask(3)[0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    assert Bidirectional(torch.tensor([2, 3])).window_mask(3).int().tolist() == [[[1, 1, 0]], [[1, 1, 1]]]


def inputs(B=2, S=7, Q=4, H=4, KVH=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return r(B, Q, H, D), r(B, S, KVH, D), r(B, S, KVH, D), r(B, Q, KVH, D), r(B, Q, KVH, D)


def naive(q, kc, vc, prefix, kw, vw, seen_win, scale):
    """Row by row in float64: prefix keys [0, prefix[b]) and window keys j where seen_win[b, i, j]."""
    B, Q, H, D = q.shape
    G = H // kc.shape[2]
    out = torch.zeros(B, Q, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                ks = [kc[b, s, h // G] for s in range(int(prefix[b]))] + [kw[b, j, h // G] for j in range(Q) if seen_win[b, i, j]]
                vs = [vc[b, s, h // G] for s in range(int(prefix[b]))] + [vw[b, j, h // G] for j in range(Q) if seen_win[b, i, j]]
                if ks:
                    w = torch.softmax(torch.stack(ks).double() @ q[b, i, h].double() * scale, 0)
                    out[b, i, h] = w @ torch.stack(vs).double()
    return out


def test_reference_under_each_rule_matches_row_by_row_loops():
    q, kc, vc, kw, vw = inputs()
    prefix = torch.tensor([3, 7])
    rules = [BlockCausal(2), QueryGroups(torch.tensor([[0, 0, 1, 1], [1, 0, 1, 0]]), torch.tensor([0b01, 0b11])),
             Bidirectional(torch.tensor([4, 2]))]
    for rule in rules:
        out, _, _ = reference(PackedArgs(q, kc, vc, prefix, kw, vw, rule))
        seen = rule.window_mask(4).expand(2, 4, 4)
        torch.testing.assert_close(out.double(), naive(q, kc, vc, prefix, kw, vw, seen, 8 ** -0.5), rtol=1e-5, atol=1e-5)


def test_explicit_mask_and_paged_source_are_the_same_attention():
    q, kc, vc, kw, vw = inputs()
    prefix = torch.tensor([5, 2])
    want, want_lse, _ = reference(PackedArgs(q, kc, vc, prefix, kw, vw, BlockCausal(2)), return_lse=True)
    explicit = torch.cat([(torch.arange(7) < prefix[:, None])[:, None, :].expand(2, 4, 7),
                          BlockCausal(2).window_mask(4).expand(2, 4, 4)], dim=2)
    got, got_lse, _ = reference(PackedArgs(q, kc, vc, torch.tensor([7, 7]), kw, vw, ExplicitMask(explicit)), True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_lse, want_lse)
    # the same keys as a shuffled pool [N, KVH, D] addressed through kv_index
    perm = torch.randperm(14, generator=torch.Generator().manual_seed(1))
    pool_k, pool_v = torch.empty(14, 2, 8), torch.empty(14, 2, 8)
    pool_k[perm], pool_v[perm] = kc.reshape(14, 2, 8), vc.reshape(14, 2, 8)
    index = perm.view(2, 7)
    paged, _, _ = reference(PackedArgs(q, pool_k, pool_v, prefix, kw, vw, BlockCausal(2), kv_index=index))
    torch.testing.assert_close(paged, want)


def test_attention_mass_is_probability_summed_over_heads_and_chosen_queries():
    q, kc, vc, kw, vw = inputs()
    prefix = torch.tensor([3, 7])
    chosen = torch.tensor([[True, False, True, True], [False, False, False, True]])
    _, _, mass = reference(PackedArgs(q, kc, vc, prefix, kw, vw, BlockCausal(2)), mass_queries=chosen)
    assert mass.shape == (2, 7 + 4)
    torch.testing.assert_close(mass.sum(1), chosen.sum(1).float() * 4)  # each (query, head) row sums to 1
    assert (mass[0, 3:7] == 0).all()  # past row 0's prefix
    assert (mass[1, 7 + 2:] > 0).all() and (mass[1, 7:9] > 0).all()  # row 1's last query sees the whole window


def test_logit_score_is_the_raw_scaled_scores_summed_over_heads_and_chosen_queries():
    """stats_score "logits" (Flash-dLLM's tracker score): per key, q . k * scale summed over the chosen queries that
    see it and every head, by hand; keys past a row's prefix and window keys a query cannot see add nothing."""
    q, kc, vc, kw, vw = inputs()
    prefix = torch.tensor([3, 7])
    chosen = torch.tensor([[True, False, True, True], [False, False, False, True]])
    a = PackedArgs(q, kc, vc, prefix, kw, vw, BlockCausal(2))
    _, _, score = reference(a, mass_queries=chosen, mass_logits=True)
    B, Q, H, D = q.shape
    G = H // kc.shape[2]
    want = torch.zeros(B, 7 + Q)
    for b in range(B):
        for i in range(Q):
            if not chosen[b, i]:
                continue
            for h in range(H):
                for j in range(int(prefix[b])):
                    want[b, j] += (q[b, i, h] @ kc[b, j, h // G]) * a.softmax_scale
                for j in range(Q):
                    if j // 2 <= i // 2:  # block-causal window, blocks of 2
                        want[b, 7 + j] += (q[b, i, h] @ kw[b, j, h // G]) * a.softmax_scale
    torch.testing.assert_close(score, want)
    assert (score[0, 3:7] == 0).all()


def test_attend_adds_the_logit_score_where_the_spec_asks_for_it():
    q, kc, vc, kw, vw = inputs()
    prefix, chosen = torch.tensor([3, 7]), torch.tensor([[True, False, True, True], [False, True, False, True]])
    kv = KVCache.allocate(1, 2, 7, 2, 8, torch.float32, "cpu")
    kv.k[:, 0], kv.v[:, 0] = kc, vc
    acc = torch.zeros(2, 7 + 4)
    spec = AttentionSpec(BlockCausal(2), prefix_len=prefix, stats=acc, stats_queries=chosen, stats_score="logits")
    attend(q, kw, vw, Forward(torch.zeros(2, 4, dtype=torch.long), prefix[:, None] + torch.arange(4), spec),
           kv.layer(0), 0)
    _, _, want = reference(PackedArgs(q, kc, vc, prefix, kw, vw, BlockCausal(2)), mass_queries=chosen,
                           mass_logits=True)
    torch.testing.assert_close(acc, want)
    with pytest.raises(ValueError, match="stats_score"):
        AttentionSpec(BlockCausal(2), stats=torch.zeros(1, 2, 2, 11), stats_score="logits")


def test_attend_reads_the_cache_before_writing_and_skips_minus_one():
    B, Q, H, KVH, D = 2, 4, 4, 2, 8
    kv = KVCache.allocate(1, B, 12, KVH, D, torch.float32, "cpu")
    kv.k.normal_()
    kv.v.normal_()
    cache_k, cache_v = kv.k.clone(), kv.v.clone()
    q, _, _, kw, vw = inputs(B, 12, Q, H, KVH, D)
    prefix = torch.tensor([4, 8])
    pos = prefix[:, None] + torch.arange(Q)
    write = torch.where(torch.tensor([[True, True, False, True], [False] * 4]), pos, -1)
    fwd = Forward(torch.zeros(B, Q, dtype=torch.long), pos, AttentionSpec(BlockCausal(Q), prefix_len=prefix),
                  kv_write=write)
    out = attend(q, kw, vw, fwd, kv.layer(0), 0)
    want, _, _ = reference(PackedArgs(q, cache_k[:, 0], cache_v[:, 0], prefix, kw, vw, BlockCausal(Q)))
    torch.testing.assert_close(out, want)
    for b in range(B):
        for j in range(Q):
            p = int(write[b, j])
            if p >= 0:
                cache_k[b, 0, p], cache_v[b, 0, p] = kw[b, j], vw[b, j]
    assert torch.equal(kv.k, cache_k) and torch.equal(kv.v, cache_v)


def test_stats_accumulate_over_the_layers_asked():
    q, kc, vc, kw, vw = inputs()
    kv = KVCache(torch.cat([kc, kc[:, :1]], 1)[:, None], torch.cat([vc, vc[:, :1]], 1)[:, None])
    stats = torch.zeros(2, 11)
    spec = AttentionSpec(BlockCausal(2), prefix_len=torch.tensor([3, 7]), stats=stats, stats_layers=(1,))
    fwd = Forward(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), spec)
    attend(q, kw, vw, fwd, kv.layer(0), 0)
    assert (stats == 0).all()  # layer 0 was not asked
    attend(q, kw, vw, fwd, kv.layer(0), 1)
    attend(q, kw, vw, fwd, kv.layer(0), 1)
    _, _, mass = reference(PackedArgs(q, kc, vc, torch.tensor([3, 7]), kw, vw, BlockCausal(2)),
                           mass_queries=torch.ones(2, 4, dtype=torch.bool))
    torch.testing.assert_close(stats, 2 * mass)


# ---------------------------------------------------------------- per-(layer, KV head) statistics, per-layer KV views

@dataclass(frozen=True)
class ViewKV:
    """A LayerKV stand-in: a layer's K/V (a row cache [B, S, KVH, D] or a pool [N, KVH, D]) with its own valid
    length and kv_index (None: the forward's); records its writes."""

    k: torch.Tensor
    v: torch.Tensor
    length: torch.Tensor | None = None
    index: torch.Tensor | None = None
    written: list = field(default_factory=list)

    def write(self, index, k, v) -> None:
        self.written.append(index)


def literal_mass(q, kc, kw, prefix, seen_win, queries, scale):
    """[B, KVH, S + Q] float64: per query head h and counted query i, softmax over the prefix keys [0, prefix[b])
    and the window keys j with seen_win[b, i, j], added into KV head h // G."""
    B, Q, H, _ = q.shape
    S, KVH = kc.shape[1], kc.shape[2]
    G = H // KVH
    mass = torch.zeros(B, KVH, S + Q, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                cols = list(range(int(prefix[b]))) + [S + j for j in range(Q) if seen_win[b, i, j]]
                if not queries[b, i] or not cols:
                    continue
                keys = torch.stack([kc[b, c, h // G] if c < S else kw[b, c - S, h // G] for c in cols]).double()
                mass[b, h // G, cols] += torch.softmax(keys @ q[b, i, h].double() * scale, 0)
    return mass


RULES_4 = [BlockCausal(2),
           QueryGroups(torch.tensor([[0, 0, 1, 1], [1, 0, 2, 0]]), torch.tensor([0b001, 0b011, 0b101])),
           Bidirectional(torch.tensor([4, 2]))]


def _source(kind, kc, vc, seed=1):
    """The row cache itself (dense), or the same keys in a shuffled pool [B * S, KVH, D] and their kv_index."""
    if kind == "dense":
        return kc, vc, None
    B, S = kc.shape[:2]
    perm = torch.randperm(B * S, generator=torch.Generator().manual_seed(seed))
    pool_k, pool_v = torch.empty(B * S, *kc.shape[2:]), torch.empty(B * S, *kc.shape[2:])
    pool_k[perm], pool_v[perm] = kc.reshape(B * S, *kc.shape[2:]), vc.reshape(B * S, *kc.shape[2:])
    return pool_k, pool_v, perm.view(B, S)


@pytest.mark.parametrize("source", ["dense", "paged"])
@pytest.mark.parametrize("rule", RULES_4, ids=["block_causal", "query_groups", "bidirectional"])
def test_per_head_stats_are_the_literal_mass_per_layer_and_kv_head(rule, source):
    """stats [L, B, KVH, S + Q]: layer stats_layers[i] adds into stats[i] the mass per KV head (its query heads and
    the stats queries); layers not asked add nothing; summed over KV heads it is the [B, S + Q] form."""
    q, kc, vc, kw, vw = inputs()
    prefix = torch.tensor([3, 7])
    chosen = torch.tensor([[True, False, True, True], [False, True, False, True]])
    src_k, src_v, index = _source(source, kc, vc)
    per_head, flat = torch.zeros(2, 2, 2, 11), torch.zeros(2, 11)
    for stats in (per_head, flat):
        spec = AttentionSpec(rule, prefix_len=prefix, kv_index=index, stats=stats, stats_queries=chosen,
                             stats_layers=(1, 3))
        fwd = Forward(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), spec)
        for layer in range(4):
            attend(q, kw, vw, fwd, ViewKV(src_k, src_v), layer)
    want = literal_mass(q, kc, kw, prefix, rule.window_mask(4).expand(2, 4, 4), chosen, 8 ** -0.5)
    for i in range(2):  # layers 1 and 3, one call each
        torch.testing.assert_close(per_head[i].double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat.double(), 2 * want.sum(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_head.sum((0, 2)), flat, rtol=1e-6, atol=1e-6)


def test_per_head_stats_index_by_layer_and_skip_other_layers():
    """stats_layers None: layer i adds into stats[i]; with stats_layers, a layer outside it adds nothing."""
    q, kc, vc, kw, vw = inputs()
    prefix = torch.tensor([3, 7])
    make = lambda stats, layers=None: Forward(  # noqa: E731
        torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long),
        AttentionSpec(BlockCausal(2), prefix_len=prefix, stats=stats, stats_layers=layers))
    every = torch.zeros(3, 2, 2, 11)
    attend(q, kw, vw, make(every), ViewKV(kc, vc), 2)
    assert (every[:2] == 0).all() and (every[2] > 0).any()
    every_query = torch.ones(2, 4, dtype=torch.bool)
    want = literal_mass(q, kc, kw, prefix, BlockCausal(2).window_mask(4).expand(2, 4, 4), every_query, 8 ** -0.5)
    torch.testing.assert_close(every[2].double(), want, rtol=1e-5, atol=1e-6)
    some = torch.zeros(1, 2, 2, 11)
    attend(q, kw, vw, make(some, (2,)), ViewKV(kc, vc), 0)
    attend(q, kw, vw, make(some, (2,)), ViewKV(kc, vc), 1)
    assert (some == 0).all()
    # without a KV source: the window keys alone, [B, KVH, Q] per layer
    none = torch.zeros(1, 2, 2, 4)
    spec = AttentionSpec(BlockCausal(2), stats=none)
    attend(q, kw, vw, Forward(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), spec), None, 0)
    want = literal_mass(q, kc[:, :0], kw, torch.zeros(2), BlockCausal(2).window_mask(4).expand(2, 4, 4), every_query,
                        8 ** -0.5)
    torch.testing.assert_close(none[0].double(), want, rtol=1e-5, atol=1e-6)


def test_stats_shapes_are_checked():
    with pytest.raises(ValueError):
        AttentionSpec(BlockCausal(2), stats=torch.zeros(2, 2, 11))
    with pytest.raises(ValueError):
        AttentionSpec(BlockCausal(2), stats=torch.zeros(3, 2, 2, 11), stats_layers=(0, 1))
    assert not AttentionSpec(BlockCausal(2), stats=torch.zeros(2, 11)).stats_per_head


def test_a_layer_view_with_its_own_index_and_length_is_used_instead_of_the_specs():
    """HERALD: dense layers read the forward's kv_index / prefix_len, sparse layers their own index and length."""
    q, kc, vc, kw, vw = inputs()
    pool_k, pool_v, index = _source("paged", kc, vc)
    B, S = index.shape
    spec_prefix, own_length = torch.tensor([7, 7]), torch.tensor([2, 5])
    own_index = index.flip(1)  # the layer's own (different) order of the pool's rows
    stats = torch.zeros(2, 2, 2, S + 4)
    spec = AttentionSpec(BlockCausal(2), prefix_len=spec_prefix, kv_index=index, stats=stats)
    write = torch.arange(4).expand(2, 4)
    fwd = Forward(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), spec, kv_write=write)
    dense, sparse = ViewKV(pool_k, pool_v), ViewKV(pool_k, pool_v, length=own_length, index=own_index)
    out_dense = attend(q, kw, vw, fwd, dense, 0)
    out_sparse = attend(q, kw, vw, fwd, sparse, 1)
    want_dense, _, _ = reference(PackedArgs(q, kc, vc, spec_prefix, kw, vw, BlockCausal(2)))
    want_sparse, _, _ = reference(PackedArgs(q, kc.flip(1), vc.flip(1), own_length, kw, vw, BlockCausal(2)))
    torch.testing.assert_close(out_dense, want_dense)
    torch.testing.assert_close(out_sparse, want_sparse)
    assert not torch.allclose(out_sparse, want_dense)
    seen = BlockCausal(2).window_mask(4).expand(2, 4, 4)
    every = torch.ones(2, 4, dtype=torch.bool)
    torch.testing.assert_close(stats[1].double(), literal_mass(q, kc.flip(1), kw, own_length, seen, every, 8 ** -0.5),
                               rtol=1e-5, atol=1e-6)
    assert (stats[1, 0, :, 2:S] == 0).all() and (stats[1, 1, :, 5:S] == 0).all()  # past each row's own length
    assert [w is write for w in dense.written + sparse.written] == [True, True]
