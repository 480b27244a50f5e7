"""Checks of the Triton kernels run by the Triton interpreter on the CPU (TRITON_INTERPRET=1, set by
test_triton_interpreter.py, which runs this file in a subprocess so the setting never leaks into other tests).
Usage: TRITON_INTERPRET=1 python tests/triton_interp_checks.py {routed,routing,confidence,attention,head}
The interpreter has no bf16 (numpy), so the expert and attention kernels run in fp16 here; bf16 runs on the
GPU tests."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from compiledllm.attention.packed import packed_attention_ref
from compiledllm.attention.triton_packed import TritonTile, packed_attention_triton_launch
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
             (37, 8, 3, 64, 32, "skip", (16, 32)), (150, 4, 2, 64, 32, "same", (32, 16))]
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
        for bm_pair in [(16, 32), (64, 64)]:
            order, offs, tile_end = moe_triton.sort_pairs(ids, E, bm_pair)
            assert torch.equal(offs, F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))), (T, E, k, routing)
            for row, bm in zip(tile_end, bm_pair):
                assert torch.equal(row, ((counts + bm - 1) // bm).cumsum(0, dtype=torch.int32)), (T, E, k, routing, bm)
            assert torch.equal(order.sort().values, torch.arange(T * k, dtype=torch.int32)), (T, E, k, routing)
            assert torch.equal(flat[order.long()], flat.sort().values), (T, E, k, routing)
        # the whole op (sort, experts, combine) against float64, the activation rounded to fp16 as stored
        out = moe_triton.launch(x, wgu, wd, ids, w, tiles)
        gate, up = torch.einsum("td,tkfd->tkf", x.double(), wgu.double()[ids]).chunk(2, dim=-1)
        act = (F.silu(gate) * up).half().double()
        ref = torch.einsum("tkf,tkdf,tk->td", act, wd.double()[ids], w.double())
        assert out.shape == (T, D) and out.dtype == x.dtype
        err = (out.double() - ref).abs().max().item()
        assert err <= 2e-3 * ref.abs().max().item(), (T, E, k, D, F_, routing, bms, err)
    # the registered op and its fake agree (shapes, dtypes, strides) on the last case
    torch.library.opcheck(torch.ops.compiledllm.moe_routed, (x, wgu, wd, ids, w),
                          test_utils=("test_schema", "test_faketensor"))


def routing() -> None:
    torch.manual_seed(0)
    for E, G, TG, K in [(256, 8, 4, 8), (8, 2, 1, 2), (64, 4, 2, 6), (16, 1, 1, 4)]:
        cfg = MoEConfig(num_experts=E, expert_dim=16, top_k=K, num_shared=0, n_group=G, topk_group=TG,
                        routed_scaling=2.5, norm_topk_prob=True)
        moe = MoE(32, cfg)
        with torch.no_grad():
            moe.gate.normal_()
            moe.expert_bias.normal_(std=0.1)
            x = torch.randn(40, 32)
            ids, w = moe.route(x)  # torch routing (no CUDA)
            fused_ids, fused_w = torch.ops.compiledllm.moe_route(x @ moe.gate.t(), moe.expert_bias, G, TG, K, True,
                                                                 2.5)
        assert torch.equal(fused_ids, ids), (E, G, TG, K)
        torch.testing.assert_close(fused_w, w, rtol=1e-6, atol=1e-6)


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
        pl = torch.tensor(prefix)
        out, lse = packed_attention_triton_launch(q, kc, vc, pl, kw, vw, slot, 0.125, True, tile=tile, splits=splits)
        ref, ref_lse = packed_attention_ref(q.float(), kc.float(), vc.float(), pl, kw.float(), vw.float(), slot,
                                            0.125, return_lse=True)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, (B, S, Lq, H, KVH, slot, prefix, splits, err)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-3)


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


if __name__ == "__main__":
    {"routed": routed, "routing": routing, "confidence": confidence_kernel, "attention": attention, "head": head}[
        sys.argv[1]]()
    print("ok")
