"""The Triton kernels (MoE routing, routed experts with their sort and combine, confidence) against their
torch forms (GPU only)."""
from __future__ import annotations

import functools

import pytest
import torch

from compiledllm.models import moe_triton
from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE
from compiledllm.policies import base

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and moe_triton.available()),
                                                  reason="needs a CUDA device with Triton (run on the GPU machine)")]

# (tokens, experts, top_k, dim, expert_dim): LLaDA2.0-mini's expert shape at batch 1 and 32, and small ones
# for each default tile (<= 16, >= 64 and >= 128 pairs per expert)
SHAPES = [(32, 256, 8, 2048, 512), pytest.param((1024, 256, 8, 2048, 512), marks=pytest.mark.bigmem),
          (37, 8, 2, 48, 16), (300, 16, 4, 128, 64), (600, 16, 4, 128, 64)]


def moe_layer(E, k, D, F, seed=0, shared=0) -> MoE:
    cfg = MoEConfig(num_experts=E, expert_dim=F, top_k=k, num_shared=shared, n_group=1, topk_group=1,
                    routed_scaling=1.0, norm_topk_prob=True, first_dense_layers=0)
    moe = MoE(D, cfg).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in (moe.gate, moe.w_gate_up, moe.w_down, *(moe.shared.parameters() if shared else ())):
            p.copy_(torch.randn(p.shape, generator=g, device="cuda") * D ** -0.5)
    return moe.to(torch.bfloat16)


@torch.no_grad()  # the weights are parameters: with autograd every chunk's gathered weights were kept (68 GiB)
def reference(moe: MoE, x, ids, w, chunk: int = 32) -> torch.Tensor:
    """float64 per (token, rank), from the same bf16 weights; the activation rounded to bf16 as the kernel stores it.
    `chunk` tokens at a time: the gathered float64 weights of 1,024 tokens x 8 ranks at LLaDA2.0-mini's expert shape
    are 128 GiB (an H100 ran out of memory, 2026-12-06)."""
    wgu, wd = moe.w_gate_up.double(), moe.w_down.double()
    out = []
    for i in range(0, x.shape[0], chunk):
        xi, ii = x[i:i + chunk].double(), ids[i:i + chunk]
        gu = torch.einsum("tkd,tkfd->tkf", xi[:, None, :].expand(-1, ii.shape[1], -1), wgu[ii])
        gate, up = gu.chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).double()
        y = torch.einsum("tkf,tkdf->tkd", act, wd[ii])
        out.append((y * w[i:i + chunk, :, None].double()).sum(1))
    return torch.cat(out)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_matches_reference_and_grouped_mm(shape):
    T, E, k, D, F = shape
    moe = moe_layer(E, k, D, F)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids, w = moe.route(x)
    ref = reference(moe, x, ids, w)
    scale = ref.abs().max().item()
    with torch.no_grad():
        tri = moe._routed(x, ids, w, "triton").double()
        assert torch.equal(moe._routed(x, ids, w, "triton"), tri.to(torch.bfloat16))  # deterministic
        gmm = moe._routed(x, ids, w, "grouped_mm").double()
    assert (tri - ref).abs().max().item() <= 0.02 * scale
    assert (gmm - ref).abs().max().item() <= 0.02 * scale


def test_rows_do_not_depend_on_the_batch():
    """A token's routed output is the same alone and among many (the row tile changes with the batch)."""
    moe = moe_layer(256, 8, 2048, 512)
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ids, w = moe.route(x)
        full = moe._routed(x, ids, w, "triton")
        for n in (1, 32, 256):
            assert torch.equal(moe._routed(x[:n], ids[:n], w[:n], "triton"), full[:n]), n


@pytest.mark.parametrize("routing", ["standard", "block48", "dead"])
def test_scan_form_equals_sorted_form(routing):
    """The experts' scan form (no sort: decode rows up to EXPERT_SCAN_TOKENS tokens) gives the sorted form's output
    bitwise, at LLaDA2.0-mini's expert shape: standard routing, a block's 48 admitted experts, and dead tokens."""
    E, k, D, F = 256, 8, 2048, 512
    moe = moe_layer(E, k, D, F)
    g = torch.Generator(device="cuda").manual_seed(3)
    for T in (1, 5, 32):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            ids, w = moe.route(x)
            if routing == "block48":  # each token's 8 of one block's 48 experts
                admitted = torch.randperm(E, device="cuda", generator=g)[:48]
                ids = admitted[torch.rand(T, 48, device="cuda", generator=g).argsort(-1)[:, :k]]
            if routing == "dead":
                ids[::2] = E
                w[::2] = 0
            outs = [moe_triton.launch(x, moe.w_gate_up, moe.w_down, ids, w, scan=scan) for scan in (False, True)]
        assert torch.equal(outs[0], outs[1]), (routing, T)
        assert torch.isfinite(outs[1]).all()


def test_shared_expert_inside_the_op(monkeypatch):
    """LLaDA2.0-mini's layer with its shared expert inside the routed op (FUSE_SHARED) against the
    float64 reference of routed + shared, as close as the separate GatedMLP; a token's output bitwise the same alone
    (scan form), in a 32-token row (scan) and among 256 (sorted form), dead tokens included."""
    E, k, D, F = 256, 8, 2048, 512
    moe = moe_layer(E, k, D, F, shared=1)
    x = torch.randn(256, D, device="cuda", dtype=torch.bfloat16)
    groups = torch.zeros(256, dtype=torch.long, device="cuda")
    groups[::5] = -1  # dead tokens: no pairs, the shared expert still runs
    monkeypatch.setattr(moe_triton, "FUSE_SHARED", True)
    with torch.no_grad():
        assert moe_triton.fuses_shared(moe.shared, x, F)
        full = moe(x, "auto", groups)
        for n in (1, 32):
            assert torch.equal(moe(x[:n], "auto", groups[:n]), full[:n]), n
        ids, w = moe.route(x, "auto", groups[None])
        gu = x.double() @ moe.shared.gate_up.weight.double().t()
        gate, up = gu.chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).double()
        live = ids < E
        ref = reference(moe, x[:64], ids[:64].clamp(max=E - 1), (w * live)[:64]) + (
            act @ moe.shared.down.weight.double().t())[:64]
        monkeypatch.setattr(moe_triton, "FUSE_SHARED", False)
        separate = moe(x, "auto", groups)
    scale = ref.abs().max().item()
    fused_err = (full[:64].double() - ref).abs().max().item()
    separate_err = (separate[:64].double() - ref).abs().max().item()
    assert fused_err <= 0.02 * scale and separate_err <= 0.02 * scale, (fused_err, separate_err, scale)
    assert torch.isfinite(full).all()


def test_prefill_tiles_keep_rows_bitwise():
    """At prefill sizes (from PREFILL_PAIRS_PER_EXPERT pairs per expert) the prefill tiles run, and a token's routed
    output there is bitwise its output in a decode-sized call (other tiles): chunked prefill and decode agree."""
    E, k, D, F = 256, 8, 2048, 512
    T = moe_triton.PREFILL_PAIRS_PER_EXPERT * E // k
    prefill = moe_triton.default_tiles(T * k, E, D, F)
    assert prefill[0].block_m == moe_triton.PREFILL_TILE_SPECS[0][0]
    assert prefill[1].block_m == moe_triton.PREFILL_TILE_SPECS[1][0]
    moe = moe_layer(E, k, D, F)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ids, w = moe.route(x)
        full = moe._routed(x, ids, w, "triton")
        for n in (32, 1024):
            assert torch.equal(moe._routed(x[:n], ids[:n], w[:n], "triton"), full[:n]), n
        gmm = moe._routed(x[:64], ids[:64], w[:64], "grouped_mm").double()
    assert (full[:64].double() - gmm).abs().max().item() <= 0.02 * gmm.abs().max().item()


@pytest.mark.parametrize("routing", ["random", "same", "skewed"])
def test_sort_prelude(routing):
    """Offsets and row tiles exact, order an expert-grouped permutation of the pairs, output bitwise the same
    over runs although the atomics place the pairs within an expert differently each run ("same": 2048
    tokens on experts 0..7, 2048 atomic adds on each counter)."""
    T, E, k = 2048, 256, 8
    g = torch.Generator(device="cuda").manual_seed(1)
    if routing == "same":
        ids = torch.arange(k, device="cuda").expand(T, k).contiguous()
    else:
        hot = 16 if routing == "skewed" else E  # skewed: every token within 16 experts, the other 240 empty
        ids = torch.rand(T, hot, device="cuda", generator=g).topk(k, dim=-1).indices
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=E).int()
    order, offs, tile_end = moe_triton.sort_pairs(ids, E, (16, 64))
    assert torch.equal(offs, torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0)))
    for row, bm in zip(tile_end, (16, 64)):
        assert torch.equal(row, ((counts + bm - 1) // bm).cumsum(0, dtype=torch.int32))
    assert torch.equal(order.sort().values, torch.arange(T * k, dtype=torch.int32, device="cuda"))
    assert torch.equal(flat[order.long()], flat.sort().values)
    moe = moe_layer(E, k, 2048, 512)
    x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(T, k, device="cuda", generator=g)
    with torch.no_grad():
        out = moe._routed(x, ids, w, "triton")
        for _ in range(3):
            assert torch.equal(moe._routed(x, ids, w, "triton"), out)
        ref = reference(moe, x[:64], ids[:64], w[:64])  # float64 over all 2048 tokens would need 256 GiB
    assert (out[:64].double() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


def test_compiled_and_captured():
    """The op under torch.compile (fullgraph) and replayed from a CUDA graph equals the eager call."""
    moe = moe_layer(256, 8, 2048, 512)
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ids, w = moe.route(x)
        eager = moe._routed(x, ids, w, "triton")
        compiled = torch.compile(functools.partial(moe._routed, backend="triton"), fullgraph=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compiled(x, ids, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(x, ids, w)
        for _ in range(2):
            out.zero_()
            graph.replay()
            assert torch.equal(out, eager)


@pytest.mark.parametrize("experts,groups,topk_group,top_k", [(256, 8, 4, 8), (32, 2, 1, 4), (128, 4, 2, 6), (64, 1, 1, 6)])
def test_fused_routing_equals_torch_routing(experts, groups, topk_group, top_k):
    cfg = MoEConfig(num_experts=experts, expert_dim=16, top_k=top_k, num_shared=0, n_group=groups,
                    topk_group=topk_group, routed_scaling=2.5, norm_topk_prob=True)
    moe = MoE(64, cfg).cuda()
    with torch.no_grad():
        moe.gate.normal_()
        moe.expert_bias.normal_(std=0.1)
        x = torch.randn(500, 64, device="cuda")
        assert moe_triton.route_supported(x, experts, groups)
        ids, w = moe.route(x, "grouped_mm")  # the torch routing
        fused_ids, fused_w = moe.route(x)
    assert torch.equal(fused_ids, ids)
    torch.testing.assert_close(fused_w, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab,mask_id", [(157184, 156895), (1000, 0), (5000, 4999)])
def test_fused_confidence_equals_softmax_form(vocab, mask_id):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4, 32, vocab, device="cuda", generator=g) * 4
    logits[0, 0, mask_id] = 1e4  # MASK is the largest logit: excluded from the argmax, counted in the sum
    logits[1, 2, 3] = logits[1, 2, vocab - 5] = 1e3  # a tie across chunks goes to the lower id
    need = torch.rand(4, 32, device="cuda", generator=g) < 0.7
    need[0, 0] = need[1, 2] = True
    assert base.fused_confidence_available()  # registers the op; the policies use it on CUDA
    for x in (logits, logits.to(torch.bfloat16)):  # the decode step hands over bf16 logits
        v, p = torch.ops.compiledllm.confidence(x, need, mask_id)
        probs = torch.softmax(x.float(), dim=-1)
        probs[..., mask_id] = -1.0
        ref_p, ref_v = probs.max(dim=-1)
        assert torch.equal(v[need], ref_v[need])
        assert v[1, 2].item() == 3
        torch.testing.assert_close(p[need], ref_p[need], rtol=1e-5, atol=1e-7)
        assert (v[~need] == mask_id).all() and (p[~need] == -1).all()


def test_bf16_router_logits_match_the_float32_upcast():
    """The tensor-core router GEMM (bf16 in, float32 out) equals the upcast float32 GEMM up to the order of the
    float32 sums, and picks the same experts (LLaDA2.0-mini's router at batch 32)."""
    from compiledllm.models.layers import router_logits

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1024, 2048, device="cuda", generator=g).to(torch.bfloat16)
    gate = (torch.randn(256, 2048, device="cuda", generator=g) * 2048 ** -0.5).to(torch.bfloat16)
    fast, ref = router_logits(x, gate), x.float() @ gate.float().t()
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    same = (fast.topk(8).indices.sort().values == ref.topk(8).indices.sort().values).all(1)
    assert same.float().mean() > 0.99


@pytest.mark.parametrize("shape", [(32, 256, 8, 2048, 512), (37, 8, 2, 48, 16), (600, 16, 4, 128, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_dead_tokens_are_skipped(shape):
    """Pairs with the id E (dead tokens, MoE.route) take no expert work: the live tokens' outputs are bitwise those
    of the call where the dead tokens routed (Triton), the dead tokens' sums are 0, the torch grouped path agrees."""
    T, E, k, D, F = shape
    moe = moe_layer(E, k, D, F)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    groups = torch.where(torch.rand(T, device="cuda") < 0.3, -1, 0)
    groups[-1] = -1
    live = groups >= 0
    with torch.no_grad():
        ids, w = moe.route(x)
        dead_ids, dead_w = moe.route(x, "auto", groups[None])
        assert (dead_ids[~live] == E).all() and (dead_w[~live] == 0).all()
        today = moe._routed(x, ids, w, "triton")
        tri = moe._routed(x, dead_ids, dead_w, "triton")
        assert torch.equal(tri[live], today[live]) and (tri[~live] == 0).all()
        gmm = moe._routed(x, dead_ids, dead_w, "grouped_mm", skip=True)
        assert (gmm[~live] == 0).all() and torch.isfinite(gmm).all()
        ref = reference(moe, x[live], ids[live], w[live])
    assert (gmm[live].double() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
