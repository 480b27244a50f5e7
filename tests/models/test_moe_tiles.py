"""The MoE size-dependent choices on the CPU: default_tiles' prefill branch and the "auto" grouped-GEMM threshold
with its wiring in MoE._routed, and where the shared expert rides in the routed op (the kernels at 128-row tiles and
with the shared expert: the "routed" interpreter check)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from compiledllm.models import moe_triton
from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE

SHAPES = [(256, 2048, 512), (8, 128, 64), (4, 48, 16)]  # (experts, dim, expert_dim): LLaDA2.0-mini, tiny ones


def _valid(t: moe_triton.MoETile, n_dim: int, k_dim: int) -> bool:
    pow2 = lambda b: b >= 16 and b & (b - 1) == 0  # noqa: E731
    return all(map(pow2, (t.block_m, t.block_n, t.block_k))) and n_dim % t.block_n == 0 and k_dim % t.block_k == 0


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_branch_gives_tiles_that_divide_the_dims(shape):
    E, D, F = shape
    for ppe in (1, 16, 17, 64, 128, moe_triton.PREFILL_PAIRS_PER_EXPERT, 4 * moe_triton.PREFILL_PAIRS_PER_EXPERT):
        up, down = moe_triton.default_tiles(ppe * E, E, D, F)
        assert _valid(up, F, D) and _valid(down, D, F), (ppe, up, down)


def test_prefill_tiles_from_the_threshold(monkeypatch):
    monkeypatch.setattr(moe_triton, "PREFILL_PAIRS_PER_EXPERT", 300)
    monkeypatch.setattr(moe_triton, "PREFILL_TILE_SPECS", ((128, 128, 32, 8, 5), (256, 64, 128, 4, 4)))
    E, D, F = 256, 2048, 512
    up, down = moe_triton.default_tiles(300 * E, E, D, F)
    assert up == moe_triton.MoETile(128, 128, 32, 8, 5)
    assert down == moe_triton.MoETile(256, 64, 128, 4, 4)
    assert moe_triton.default_tiles(300 * E - 1, E, D, F)[0].block_m == 64  # below: the large-batch tiles
    # caps cut to a small model's dims: N 128 -> 64 (F = 64), K 128 -> 64 (F)
    up, down = moe_triton.default_tiles(300 * 8, 8, 128, 64)
    assert (up.block_n, up.block_k, down.block_n, down.block_k) == (64, 32, 64, 64)


def test_auto_threshold(monkeypatch):
    assert moe_triton.GROUPED_MM_FROM_PAIRS_PER_EXPERT is None or moe_triton.auto_uses_triton(8, 256)
    monkeypatch.setattr(moe_triton, "GROUPED_MM_FROM_PAIRS_PER_EXPERT", None)
    assert moe_triton.auto_uses_triton(10**9, 256)
    monkeypatch.setattr(moe_triton, "GROUPED_MM_FROM_PAIRS_PER_EXPERT", 256)
    assert moe_triton.auto_uses_triton(256 * 256 - 1, 256) and not moe_triton.auto_uses_triton(256 * 256, 256)


def test_auto_backend_follows_the_threshold(monkeypatch):
    """MoE._routed("auto") runs the Triton op below the threshold and the torch grouped path from it (the op
    and supports() faked: no CUDA here)."""
    cfg = MoEConfig(num_experts=4, expert_dim=16, top_k=2, num_shared=0, n_group=1, topk_group=1,
                    routed_scaling=1.0, norm_topk_prob=True)
    moe = MoE(32, cfg)
    with torch.no_grad():
        for p in (moe.gate, moe.w_gate_up, moe.w_down):
            p.normal_()
    x = torch.randn(40, 32)  # 80 pairs, 20 per expert
    ids, w = moe.route(x)
    calls = []

    def fake_op(*args):
        calls.append(args[0].shape)
        return torch.full_like(args[0], 7.0)

    monkeypatch.setattr(moe_triton, "supports", lambda *a: True)
    monkeypatch.setattr(torch.ops.compiledllm, "moe_routed", fake_op)
    with torch.no_grad():
        torch_path = moe._routed(x, ids, w, "grouped_mm")
        monkeypatch.setattr(moe_triton, "GROUPED_MM_FROM_PAIRS_PER_EXPERT", 21)
        assert torch.equal(moe._routed(x, ids, w, "auto"), torch.full_like(x, 7.0)) and len(calls) == 1
        monkeypatch.setattr(moe_triton, "GROUPED_MM_FROM_PAIRS_PER_EXPERT", 20)
        assert torch.equal(moe._routed(x, ids, w, "auto"), torch_path) and len(calls) == 1


def test_scan_form_only_where_its_rows_fit(monkeypatch):
    """The experts' scan form holds every token's rows in one program: above SCAN_MAX_TOKENS it is refused when
    asked for (it ran an H100 out of shared memory at 256 tokens), and the default never picks it there, whatever
    EXPERT_SCAN_TOKENS says; up to EXPERT_SCAN_TOKENS it is the default."""
    cap = moe_triton.SCAN_MAX_TOKENS
    with pytest.raises(ValueError, match="SCAN_MAX_TOKENS"):
        moe_triton.scan_form(cap + 1, scan=True)
    assert moe_triton.scan_form(cap, scan=True) and not moe_triton.scan_form(1, scan=False)
    monkeypatch.setattr(moe_triton, "EXPERT_SCAN_TOKENS", 1 << 20)
    assert moe_triton.scan_form(cap) and not moe_triton.scan_form(cap + 1)
    monkeypatch.setattr(moe_triton, "EXPERT_SCAN_TOKENS", 32)
    assert moe_triton.scan_form(32) and not moe_triton.scan_form(33)


@pytest.mark.parametrize("dim,inner", [(2048, 512), (4096, 1024)])  # LLaDA2.0-mini, LLaDA2.2-flash-shaped
def test_scan_tiles_fit_an_sm90_at_the_most_tokens(dim, inner):
    """The device's Triton (torch 2.11) holds every pipeline stage of a scan program's tiles in shared memory: a [BM,
    BK] row tile, and gate_up's two [BK, BN] weight tiles (down's one), bf16. At 64 tokens that count was 245,760
    bytes and the H100 refused the launch (OutOfResources, 2026-12-06); Triton 3.9's sm_90 compile on the CPU reports
    less, so the count itself is checked here, at SCAN_MAX_TOKENS rows, against an SM's 227 KB."""
    bm = 1 << (moe_triton.SCAN_MAX_TOKENS - 1).bit_length()
    up, down = moe_triton.scan_tiles(dim, inner)
    assert up.stages * (bm * up.block_k + 2 * up.block_k * up.block_n) * 2 <= 227 * 1024
    assert down.stages * (bm * down.block_k + down.block_k * down.block_n) * 2 <= 227 * 1024


def _moe_with_shared(inner: int) -> MoE:
    cfg = MoEConfig(num_experts=4, expert_dim=16, top_k=2, num_shared=1, n_group=1, topk_group=1,
                    routed_scaling=1.0, norm_topk_prob=True)
    moe = MoE(32, cfg)
    if inner != 16:
        from compiledllm.models.layers import GatedMLP
        moe.shared = GatedMLP(32, inner)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
    return moe


@pytest.mark.parametrize("case", ["fused", "off", "wider", "sharded"])
def test_shared_expert_rides_in_the_routed_op_where_it_can(monkeypatch, case):
    """MoE.forward hands a shared expert of the experts' width to the Triton op (FUSE_SHARED), which adds it, and
    then does not add it again; with the setting off, a wider shared expert (num_shared 2) or a tensor-parallel
    one it adds the GatedMLP's output itself (the op and supports() faked: no CUDA here)."""
    moe = _moe_with_shared(32 if case == "wider" else 16)
    if case == "sharded":
        moe.shared.parallel = SimpleNamespace(all_reduce=lambda t: t)  # a rank's share of the inner dim
    monkeypatch.setattr(moe_triton, "FUSE_SHARED", case != "off")
    monkeypatch.setattr(moe_triton, "supports", lambda *a: True)
    calls = []

    def fake_op(x, wgu, wd, ids, w, shared_gate_up=None, shared_down=None):
        calls.append(shared_gate_up is not None)
        if shared_gate_up is not None:
            assert shared_gate_up is moe.shared.gate_up.weight and shared_down is moe.shared.down.weight
        return torch.full_like(x, 7.0)

    monkeypatch.setattr(torch.ops.compiledllm, "moe_routed", fake_op)
    x = torch.randn(6, 32)
    with torch.no_grad():
        out = moe(x)
        want = torch.full_like(x, 7.0) + (0 if case == "fused" else moe.shared(x))
    assert calls == [case == "fused"]
    assert torch.equal(out, want)
