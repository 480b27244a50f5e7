"""Checks of the Triton kernels run by the Triton interpreter on the CPU (TRITON_INTERPRET=1, set by
test_triton_interpreter.py, which runs this file in a subprocess so the setting never leaks into other tests).
Usage: TRITON_INTERPRET=1 python tests/attention/triton_interp_checks.py CHECK
(CHECK: routed, routing, confidence, attention, mass, score, head or qkv)
The interpreter has no bf16 (numpy), so the expert and attention kernels run in fp16 here; bf16 runs on the
GPU tests."""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from compiledllm.attention.launch import PackedArgs
from compiledllm.attention.reference import reference
from compiledllm.attention.spec import Bidirectional, BlockCausal, QueryGroups
from compiledllm.attention.triton_packed import (TritonTile, attention_mass_triton_launch,
                                                 packed_attention_triton_launch)
from compiledllm.models import moe_triton
from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE
from compiledllm.policies.base import confidence


def routed() -> None:
    g = torch.Generator().manual_seed(0)
    # (tokens, experts, top_k, dim, expert_dim, routing, (gate_up BM, down BM) or None for the default tiles).
    # routing: "random"; "same": every token on experts 0..k-1 (each many row tiles, the other experts empty);
    # "skip": experts E//2 and E-1 never chosen (empty experts inside and at the end). T*k is a multiple of
    # none of the sort, row-tile and combine blocks.
    cases = [(5, 4, 2, 48, 16, "random", None), (200, 4, 2, 128, 64, "random", None),
             (203, 4, 2, 128, 64, "same", None), (61, 8, 4, 128, 128, "skip", None),
             (37, 8, 3, 64, 32, "skip", (16, 32)), (150, 4, 2, 64, 32, "same", (32, 16)),
             (300, 4, 2, 128, 64, "random", (128, 128))]  # prefill-sized rows: two 128-row tiles per expert
    for T, E, k, D, F_, routing, bms in cases:
        x = torch.randn(T, D, generator=g).half()
        wgu = (torch.randn(E, 2 * F_, D, generator=g) * D ** -0.5).half()
        wd = (torch.randn(E, D, F_, generator=g) * F_ ** -0.5).half()
        pool = torch.tensor([e for e in range(E) if routing != "skip" or e not in (E // 2, E - 1)])
        ids = torch.stack([torch.arange(k) if routing == "same" else pool[torch.randperm(len(pool), generator=g)[:k]]
                           for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        tiles = bms and (moe_triton.MoETile(bms[0], moe_triton._block(F_, 64), moe_triton._block(D, 64)),
                         moe_triton.MoETile(bms[1], moe_triton._block(D, 64), moe_triton._block(F_, 64)))
        # the sort prelude: exact offsets and row tiles, and an expert-grouped permutation of the pairs
        flat = ids.flatten()
        counts = torch.bincount(flat, minlength=E).int()
        for bm_pair, small in [((16, 32), True), ((16, 32), False), ((64, 64), True), ((64, 64), False)]:
            order, offs, tile_end = moe_triton.sort_pairs(ids, E, bm_pair, small)
            case = (T, E, k, routing, small)
            assert torch.equal(offs, F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))), case
            for row, bm in zip(tile_end, bm_pair):
                assert torch.equal(row, ((counts + bm - 1) // bm).cumsum(0, dtype=torch.int32)), (*case, bm)
            assert torch.equal(order.sort().values, torch.arange(T * k, dtype=torch.int32)), case
            assert torch.equal(flat[order.long()], flat.sort().values), case
            if small:  # one program: pairs keep their order within an expert
                assert torch.equal(order.long(), flat.sort(stable=True).indices), case
        dead = ids.clone()
        dead[::3] = E  # a dead token's pairs (id E): no slot, not counted
        want = torch.bincount(dead.flatten(), minlength=E + 1)[:E].int()
        for small in (True, False):
            order, offs, _ = moe_triton.sort_pairs(dead, E, (16, 16), small)
            assert torch.equal(offs, F.pad(want.cumsum(0, dtype=torch.int32), (1, 0))), (T, E, k, routing, small)
            assert torch.equal(dead.flatten()[order[: offs[E]].long()],
                               dead.flatten()[dead.flatten() < E].sort().values), (T, E, k, routing, small)
        # the whole op (sort, experts, combine) against float64, the activation rounded to fp16 as stored
        # (the sorted form, and the scan form where it applies: up to SCAN_MAX_TOKENS tokens)
        gate, up = torch.einsum("td,tkfd->tkf", x.double(), wgu.double()[ids]).chunk(2, dim=-1)
        act = (F.silu(gate) * up).half().double()
        ref = torch.einsum("tkf,tkdf,tk->td", act, wd.double()[ids], w.double())
        outs = [moe_triton.launch(x, wgu, wd, ids, w, tiles, scan=scan)
                for scan in (False, True)[: 1 + (T <= moe_triton.SCAN_MAX_TOKENS)]]
        for out in outs:
            assert out.shape == (T, D) and out.dtype == x.dtype
            err = (out.double() - ref).abs().max().item()
            assert err <= 2e-3 * ref.abs().max().item(), (T, E, k, D, F_, routing, bms, err)
        # the two forms sum the same products in the same order (bitwise on the GPU; numpy may block by rows)
        assert (outs[0].double() - outs[-1].double()).abs().max().item() <= 1e-3 * ref.abs().max().item()
        # a shared expert of the same width inside the op (FUSE_SHARED): added to every token, weight 1, also a
        # token whose pairs are all skipped (dead: its output is the shared expert's alone)
        wsu, wsd = wgu[0] * 0.5 + 0.1 * wgu[-1], wd[0] * 0.5 - 0.1 * wd[-1]
        sg, su = (x.double() @ wsu.double().t()).chunk(2, dim=-1)
        sref = (F.silu(sg) * su).half().double() @ wsd.double().t()
        skipped = ids.clone()
        skipped[::4] = E
        held = (skipped < E).double()
        ref_s = torch.einsum("tkf,tkdf,tk->td", act, wd.double()[ids], w.double() * held) + sref
        shared_outs = [moe_triton.launch(x, wgu, wd, skipped, w * held, tiles, scan=scan, shared=(wsu, wsd))
                       for scan in (False, True)[: 1 + (T <= moe_triton.SCAN_MAX_TOKENS)]]
        for out in shared_outs:
            err = (out.double() - ref_s).abs().max().item()
            assert err <= 2e-3 * ref_s.abs().max().item(), ("shared", T, E, k, D, F_, routing, bms, err)
        assert (shared_outs[0].double() - shared_outs[-1].double()).abs().max().item() <= (
            1e-3 * ref_s.abs().max().item())
    # the registered op and its fake agree (shapes, dtypes, strides) on the last case, with and without the shared
    # expert
    for args in [(x, wgu, wd, ids, w), (x, wgu, wd, ids, w, wsu, wsd)]:
        torch.library.opcheck(torch.ops.compiledllm.moe_routed, args, test_utils=("test_schema", "test_faketensor"))


def routing() -> None:
    torch.manual_seed(0)
    for E, G, TG, K in [(256, 8, 4, 8), (8, 2, 1, 2), (64, 4, 2, 6), (16, 1, 1, 4)]:
        cfg = MoEConfig(num_experts=E, expert_dim=16, top_k=K, num_shared=0, n_group=G, topk_group=TG,
                        routed_scaling=2.5, norm_topk_prob=True)
        moe = MoE(32, cfg)
        with torch.no_grad():
            moe.gate.normal_()
            x = torch.randn(40, 32)
            for shift in (0.0, -0.8):  # -0.8: most biased scores negative (the dropped groups' fill matters)
                moe.expert_bias.normal_(std=0.1).add_(shift)
                groups = (torch.arange(40) // 8)[None].clone()
                groups[0, 5:9] = -1  # dead tokens: no expert (id E, weight 0)
                for given in (None, groups):
                    ids, w = moe.route(x, groups=given)  # torch routing (no CUDA)
                    assert given is None or ((ids[5:9] == E).all() and (w[5:9] == 0).all())
                    for topk_sort in (True, False):
                        fused_ids, fused_w = moe_triton.route_launch(
                            x @ moe.gate.t(), moe.expert_bias, None if given is None else given.reshape(-1), G, TG,
                            K, True, 2.5, topk_sort=topk_sort)
                        assert torch.equal(fused_ids, ids), (E, G, TG, K, shift, topk_sort)
                        torch.testing.assert_close(fused_w, w, rtol=1e-6, atol=1e-6)
    block_routing()


def block_routing() -> None:
    """Every form of the block router (phase 1 by atomic max or inside the pick kernel per row; admission by sort or
    by rank tiles; top-k by sort or by dependent max picks) against the torch block_route: exact ties, a dead token
    (no expert), capacities from top_k to every expert, groups sharing a row and rows sharing a value."""
    from compiledllm.models.block_routing import block_route, route_index

    g = torch.Generator().manual_seed(1)
    for E, C, K, rows, Q, block in [(64, 12, 6, 2, 24, 8), (16, 16, 4, 1, 9, 4), (32, 4, 4, 3, 8, 8)]:
        cfg = MoEConfig(num_experts=E, expert_dim=16, top_k=K, num_shared=0, routed_scaling=2.5,
                        expert_capacity=C, route_block=block)
        logits = torch.randn(rows * Q, E, generator=g)
        logits[:, 3:6] = logits[:, 3:4]  # exact ties: the lower id first on every path
        bias = torch.randn(E, generator=g) * 0.1
        bias[3:6] = bias[3]  # biased scores tie too (selection compares them)
        logits[:, 3:6] += 3.0  # in every token's top-k and every group's admitted set: the ties decide the order
        logits[1, 7] = -60.0  # a biased score below 0 (the sort keys' negative half) in the admitted pools
        groups = (torch.arange(Q) // block).repeat(rows, 1)
        groups[0, -1] = -1
        want_ids, want_w = block_route(logits, bias, groups, cfg)
        index = route_index(groups)
        for row_max, admit_sort, topk_sort in [(0, True, True), (0, False, False), (0, False, True), (Q, None, True),
                                               (Q, None, False)]:
            ids, w = moe_triton.block_route_launch(logits, bias, index, Q, C, K, True, 2.5, admit_sort=admit_sort,
                                                   topk_sort=topk_sort, row_max=row_max)
            case = (E, C, K, row_max, admit_sort, topk_sort)
            assert torch.equal(ids, want_ids) and (ids[Q - 1] == E).all(), case
            torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-6)


def confidence_kernel() -> None:
    from compiledllm.policies.confidence_kernel import confidence_op

    torch.manual_seed(0)
    for V, mask in [(10000, 7), (5000, 4999), (3 * 4096, 0)]:
        logits = torch.randn(3, 5, V) * 3
        logits[0, 0, mask] = 100.0  # MASK is the best logit: excluded from the argmax, counted in the sum
        logits[0, 1, mask] = 1e4  # every other probability underflows to 0: the lowest non-MASK id wins
        logits[1, 1, 10] = logits[1, 1, 4500] = 50.0  # a tie across chunks: the lower id
        need = torch.rand(3, 5) < 0.7
        need[0, :2] = need[1, 1] = True
        for x in (logits, logits.to(torch.bfloat16)):  # the decode step hands over the model's dtype
            v, p = confidence(x, mask, need)  # the softmax form (no CUDA)
            fused_v, fused_p = confidence_op(x.contiguous(), need, mask)
            assert torch.equal(fused_v, v), (V, x.dtype)
            torch.testing.assert_close(fused_p, p, rtol=1e-5, atol=1e-7)
            assert (fused_v[~need] == mask).all() and (fused_p[~need] == -1).all()


def _f32(a: PackedArgs) -> PackedArgs:
    """The same arguments in float32: the reference's float32 math on the kernel's fp16 values."""
    return replace(a, **{f: getattr(a, f).float() for f in ("q", "k_cache", "v_cache", "k_win", "v_win")})


def _check_attention(a: PackedArgs, tile: TritonTile, splits: int, rows: torch.Tensor | None = None,
                     what=()) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel vs reference on the query rows marked in rows [B, Q] (None: all); returns the kernel's out, lse."""
    out, lse = packed_attention_triton_launch(a, True, tile=tile, splits=splits)
    ref, ref_lse, _ = reference(_f32(a), return_lse=True)
    o, l = out, lse
    if rows is not None:
        o, ref, l, ref_lse = out[rows], ref[rows], lse.transpose(1, 2)[rows], ref_lse.transpose(1, 2)[rows]
    err = ((o.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-3, (what, splits, err)
    torch.testing.assert_close(l, ref_lse, rtol=0, atol=2e-3)
    return out, lse


def _rule_cases(g: torch.Generator):
    """(B, S, Lq, H, KVH, prefix per row, rule, pool rows N (None: dense cache) or (N, index dtype), tile, splits,
    the query rows to compare (None: all)): QueryGroups with 2 and 3 groups, broadcast and per-row layouts (a
    query may see window keys after it: no block-causal shortcut), Bidirectional with padding, a paged source
    (shuffled pool, S < N, prefix < S), split-K, row tiles, and a row that sees no key at all."""
    herald = torch.tensor([[0] * 8 + [1] * 8])  # [block | draft]: each sees its own group
    verify = torch.randint(0, 3, (1, 12), generator=g)  # {tracked, draft, mask} interleaved
    per_row = torch.randint(0, 3, (3, 16), generator=g)
    length = torch.tensor([16, 9, 0])
    blind = torch.zeros(2, 16, dtype=torch.int32)  # group 0 sees only group 1's keys: row 0 (no prefix) sees nothing
    blind[1, 5:] = 1
    t16 = TritonTile(16, 16, 4, 1)
    return [
        (2, 37, 16, 4, 2, [37, 12], QueryGroups(herald, torch.tensor([1, 2])), None, t16, 1, None),
        (2, 70, 12, 8, 2, [70, 29], QueryGroups(verify, torch.tensor([1, 3, 5])), None, t16, 3, None),
        (3, 40, 16, 4, 2, [0, 40, 17], QueryGroups(per_row, torch.tensor([1, 3, 5])), None, TritonTile(16, 32, 4, 1),
         2, None),
        (3, 20, 16, 4, 4, [20, 0, 5], Bidirectional(length), None, t16, 1, None),
        (3, 40, 8, 4, 2, [40, 11, 0], BlockCausal(4), (97, torch.int64), t16, 2, None),
        (3, 40, 16, 4, 2, [0, 40, 23], QueryGroups(per_row, torch.tensor([1, 3, 5])), (130, torch.int32), t16, 3,
         None),
        (2, 24, 16, 2, 1, [0, 9], QueryGroups(blind, torch.tensor([2, 2])), None, t16, 2, None),
    ]


def _rule_args(g: torch.Generator, B, S, Lq, H, KVH, prefix, rule, pool) -> PackedArgs:
    q = torch.randn(B, Lq, H, 64, generator=g).half()
    kw, vw = torch.randn(B, Lq, KVH, 64, generator=g).half(), torch.randn(B, Lq, KVH, 64, generator=g).half()
    if pool is None:
        kc, vc = torch.randn(B, S, KVH, 64, generator=g).half(), torch.randn(B, S, KVH, 64, generator=g).half()
        return PackedArgs(q, kc, vc, torch.tensor(prefix), kw, vw, rule, scale=0.125)
    N, dtype = pool
    kc, vc = torch.randn(N, KVH, 64, generator=g).half(), torch.randn(N, KVH, 64, generator=g).half()
    idx = torch.stack([torch.randperm(N, generator=g)[:S] for _ in range(B)]).to(dtype)
    return PackedArgs(q, kc, vc, torch.tensor(prefix, dtype=torch.int32), kw, vw, rule, kv_index=idx, scale=0.125)


def attention() -> None:
    g = torch.Generator().manual_seed(0)
    # (B, S, Lq, H, KVH, slot, prefix per row, tile, splits): empty / partial / full prefixes, GQA, slots smaller
    # than the window, row tiles (G * Lq > block_m), window longer than a key tile, split-K with empty splits.
    cases = [(3, 40, 8, 4, 2, 4, [0, 17, 40], TritonTile(16, 16, 4, 1), 1),
             (2, 70, 8, 8, 2, 8, [70, 33], TritonTile(16, 16, 4, 1), 3),
             (2, 50, 24, 2, 1, 8, [50, 5], TritonTile(16, 16, 4, 1), 2),
             (1, 16, 4, 4, 4, 4, [9], TritonTile(16, 32, 4, 1), 4)]
    for B, S, Lq, H, KVH, slot, prefix, tile, splits in cases:
        q = torch.randn(B, Lq, H, 64, generator=g).half()
        kc, vc = torch.randn(B, S, KVH, 64, generator=g).half(), torch.randn(B, S, KVH, 64, generator=g).half()
        kw, vw = torch.randn(B, Lq, KVH, 64, generator=g).half(), torch.randn(B, Lq, KVH, 64, generator=g).half()
        _check_attention(PackedArgs(q, kc, vc, torch.tensor(prefix), kw, vw, BlockCausal(slot), scale=0.125), tile,
                         splits, what=(B, S, Lq, H, KVH, slot, prefix))
    # The other rules and the paged source.
    for B, S, Lq, H, KVH, prefix, rule, pool, tile, splits, rows in _rule_cases(g):
        a = _rule_args(g, B, S, Lq, H, KVH, prefix, rule, pool)
        out, lse = _check_attention(a, tile, splits, rows, what=(B, S, Lq, type(rule).__name__, prefix, pool))
        if isinstance(rule, QueryGroups) and torch.equal(rule.see, torch.tensor([2, 2])):  # the blind row
            assert (out[0] == 0).all() and (lse[0] == float("-inf")).all() and lse[1].isfinite().all()


def _statistic_cases(seed: int):
    """(args, counted queries [B, Q] (the last row none), prefix per row, tile, splits) for the statistics' checks:
    a block-causal case, then every rule case, each with some queries left out."""
    g = torch.Generator().manual_seed(seed)
    cases = [(2, 45, 8, 4, 2, [45, 20], BlockCausal(4), None, TritonTile(16, 16, 4, 1), 2, None),
             *_rule_cases(g)]
    for B, S, Lq, H, KVH, prefix, rule, pool, tile, splits, rows in cases:
        a = _rule_args(g, B, S, Lq, H, KVH, prefix, rule, pool)
        queries = torch.rand(B, Lq, generator=g) < 0.6
        queries[-1] = False
        if rows is not None:
            queries &= rows
        yield a, queries, prefix, tile, splits


def mass() -> None:
    """The per-key attention mass against the reference's, from the kernel's own lse, over query masks with some
    (or all) queries left out; keys no counted query sees get exactly 0. Per KV head too ([B, KVH, S + Q], one row
    tile per KV head or several): against the reference's, summing over KV heads to the summed mass."""
    for a, queries, prefix, tile, splits in _statistic_cases(1):
        B, Lq, H, _ = a.q.shape
        S, KVH = a.keys, a.k_cache.shape[-2]
        _, lse = packed_attention_triton_launch(a, True, tile=tile, splits=splits)
        m = attention_mass_triton_launch(a, lse, queries, tile=tile)
        _, _, ref = reference(_f32(a), mass_queries=queries)
        assert m.shape == (B, S + Lq) and m.dtype == torch.float32
        torch.testing.assert_close(m, ref, rtol=1e-3, atol=1e-6)
        assert (m[-1] == 0).all()
        for b, o in enumerate(prefix):
            assert (m[b, o:S] == 0).all(), (b, o)
        mh = attention_mass_triton_launch(a, lse, queries, tile=tile, per_head=True)
        _, _, ref_h = reference(_f32(a), mass_queries=queries, mass_per_head=True)
        assert mh.shape == (B, KVH, S + Lq) and mh.dtype == torch.float32
        torch.testing.assert_close(mh, ref_h, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(mh.sum(1), m, rtol=1e-5, atol=1e-6)
    # Broadcast queries [1, Q] are every row's.
    m1 = attention_mass_triton_launch(a, lse, queries[:1], tile=tile)
    torch.testing.assert_close(m1, attention_mass_triton_launch(a, lse, queries[:1].expand(B, Lq).clone(),
                                                                tile=tile), rtol=0, atol=0)


def score() -> None:
    """The tracker score made in the attention's own pass (SCORE): each key's raw scaled scores summed over the
    counted queries that see it and their heads, against the reference's, every rule and source, split-K and row
    tiles; keys nobody counted sees get exactly 0, and out is the plain launch's, bit for bit."""
    for a, queries, prefix, tile, splits in _statistic_cases(2):
        B, Lq = a.q.shape[:2]
        S = a.keys
        out, _, sc = packed_attention_triton_launch(a, False, tile=tile, splits=splits, score_queries=queries)
        plain, _ = packed_attention_triton_launch(a, False, tile=tile, splits=splits)
        _, _, ref = reference(_f32(a), mass_queries=queries, mass_logits=True)
        assert sc.shape == (B, S + Lq) and sc.dtype == torch.float32
        torch.testing.assert_close(sc, ref, rtol=1e-3, atol=1e-3)
        assert torch.equal(out, plain) and (sc[-1] == 0).all()
        for b, o in enumerate(prefix):
            assert (sc[b, o:S] == 0).all(), (b, o)


def head() -> None:
    """The row-selective head: wanted rows equal the float64 product; compaction covers none, some and all rows."""
    from compiledllm.models import head as head_mod

    g = torch.Generator().manual_seed(0)
    for T, D, V, frac in [(40, 64, 300, 0.5), (200, 128, 512, 0.3), (130, 64, 256, 1.0), (17, 64, 100, 0.0)]:
        h = torch.randn(T, D, generator=g).half()
        w = (torch.randn(V, D, generator=g) * D ** -0.5).half()
        rows = torch.rand(T, generator=g) < frac
        for tile in (head_mod.SMALL_TILE, head_mod.HeadTile(16, 32, 32, 4, 2)):
            out = head_mod.launch(h, w, rows, tile)
            ref = h.double() @ w.double().t()
            err = (out[rows].double() - ref[rows]).abs().max().item() if rows.any() else 0.0
            assert err <= 2e-3 * ref.abs().max().item(), (T, D, V, frac, tile, err)


def qkv() -> None:
    """Flash-Cache's fused projection + RoPE + cache write (models/qkv_kernel.py) against the separate path
    (F.linear, Rotary.apply, PoolView.write): q, k, v and the pool rows it writes (-1: the spare row), GQA, token
    counts off the row tile, K off the K tile, float32 (ieee dots) and float16."""
    from compiledllm.kv.pooled import PoolView, pool_index
    from compiledllm.models.layers import Rotary
    from compiledllm.models.qkv_kernel import fused_qkv_rope_write

    g = torch.Generator().manual_seed(0)
    for B, L, K, H, KVH, D, dtype, bm in [(2, 19, 96, 4, 2, 32, torch.float32, None),
                                          (1, 70, 128, 2, 2, 64, torch.float32, 32),
                                          (3, 5, 64, 4, 1, 64, torch.float16, None),
                                          (2, 40, 192, 2, 1, 128, torch.float16, 16),
                                          (2, 150, 64, 2, 1, 32, torch.float32, 16)]:  # 19 token tiles: 3 groups
        cap = 2 * L
        x = torch.randn(B, L, K, generator=g).to(dtype)
        w = (torch.randn((H + 2 * KVH) * D, K, generator=g) * K ** -0.5).to(dtype)
        rotary = Rotary(D, 10000.0)
        pos = torch.stack([torch.randperm(cap, generator=g)[:L] for _ in range(B)])
        write = torch.where(torch.rand(B, L, generator=g) < 0.7, pos, -1)
        cos, sin = rotary.cos_sin(pos)
        q, k, v = F.linear(x, w).view(B, L, H + 2 * KVH, D).split([H, KVH, KVH], dim=2)
        want = (rotary.apply(q, cos, sin), rotary.apply(k, cos, sin), v)
        pools = [(torch.zeros(B * (cap + 1), KVH, D, dtype=dtype), torch.zeros(B * (cap + 1), KVH, D, dtype=dtype))
                 for _ in range(2)]
        PoolView(*pools[0], cap).write(write, want[1], want[2])
        rows = pool_index(torch.where(write < 0, cap, write), cap)
        got = fused_qkv_rope_write(x, w, cos, sin, H, KVH, rows, *pools[1], block_m=bm)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
        case = (B, L, K, H, KVH, D, dtype)
        kept = torch.arange(B * (cap + 1)) % (cap + 1) < cap  # the spare rows take every -1 write, in any order
        for a, b in zip((*got, *(p[kept] for p in pools[1])), (*want, *(p[kept] for p in pools[0]))):
            torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{case}: {m}")
        assert pools[1][0][kept].abs().sum() > 0, case
        # no rows: nothing written, the same q, k, v at the same row tile (Triton 3.9's interpreter rounds a float16
        # dot differently at another tile: 3 of 20,480 q values at 16 against the default 32, 2026-12-06)
        bare = fused_qkv_rope_write(x, w, cos, sin, H, KVH, block_m=bm)
        for a, b in zip(bare, got):
            assert torch.equal(a, b), case


if __name__ == "__main__":
    if os.environ.get("TRITON_LAUNCH_LOG"):  # test_triton_interpreter.py compiles these launches for sm_90 after
        from triton_launches import record  # tests/triton_launches.py (the test puts tests/ on PYTHONPATH)
        record(Path(os.environ["TRITON_LAUNCH_LOG"]))
    {"routed": routed, "routing": routing, "confidence": confidence_kernel, "attention": attention, "mass": mass,
     "head": head, "qkv": qkv, "score": score}[sys.argv[1]]()
    print("ok")
