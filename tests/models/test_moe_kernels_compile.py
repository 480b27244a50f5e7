"""The routed experts' Triton kernels compile for an H100 / H200 (sm_90) on a machine without a GPU, at
LLaDA2.0-mini's expert shape with the decode tiles: both forms (sorted pairs, and the scan form of decode rows at 16
and 32 row tiles and at its largest, SCAN_MAX_TOKENS), with and without the shared expert inside, each within the
SM's shared memory as this machine's Triton counts it (the device's Triton counts more; so the shared expert is
also checked to add no second pipelined loop, which is what overflowed on an H100).
(test_triton_interpreter.py compiles every launch of the interpreter checks the same way, but those are small
shapes: the production tiles' shared memory is checked here.)"""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install '.[test]' brings it)")

from compiledllm.models import moe_triton  # noqa: E402
from triton_launches import SM90_SHARED_BYTES, compile_kernel, sm90_unavailable  # noqa: E402

E, D, F, K = 256, 2048, 512, 8  # LLaDA2.0-mini
TILES = {"BN": 128, "BK": 128}  # moe_triton.default_tiles at decode sizes


def compile_sm90(fn, signature: dict, constexprs: dict, warps: int = 4, stages: int = 3):
    if (why := sm90_unavailable()) is not None:
        pytest.skip(f"Triton cannot compile for sm_90 here: {why}")
    return compile_kernel(fn, signature, constexprs, {"num_warps": warps, "num_stages": stages})


def kernels():
    from compiledllm.models import moe_kernels
    return moe_kernels


_SORTED = {"order_ptr": "*i32", "offs_ptr": "*i32", "tile_end_ptr": "*i32", "T": "i32", "ROUTED_TILES": "i32"}
_SCAN = {"ids_ptr": "*i64", "T": "i32", "E": "i32"}
_UP = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "act_ptr": "*bf16"}
_DOWN = {"act_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "y_ptr": "*bf16", "rw_ptr": "*fp32"}
SIGNATURES = {"gate_up_kernel": _UP | _SORTED, "down_kernel": _DOWN | _SORTED, "gate_up_scan_kernel": _UP | _SCAN,
              "down_scan_kernel": _DOWN | _SCAN}


def compile_sorted(name: str, tile, shared: bool):
    """A sorted-form kernel at LLaDA2.0-mini's shape on `tile` (moe_triton.MoETile)."""
    consts = {"E": E, "E_P2": E, "D": D, "F": F, "TOPK": K, "BM": tile.block_m, "BN": tile.block_n,
              "BK": tile.block_k, "SHARED": shared}
    return compile_sm90(getattr(kernels(), name), SIGNATURES[name], consts, tile.warps, tile.stages)


def compile_scan(name: str, bm: int, shared: bool):
    """A scan-form kernel at LLaDA2.0-mini's shape, `bm` token rows and the decode N / K tiles."""
    consts = {"D": D, "F": F, "TOPK": K, "TOPK_P2": K, "BM": bm, "SHARED": shared, **TILES}
    return compile_sm90(getattr(kernels(), name), SIGNATURES[name], consts)


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with_shared"])
@pytest.mark.parametrize("bm", sorted({16, 32, moe_triton.SCAN_MAX_TOKENS}))
def test_scan_form_compiles_for_sm90(bm, shared):
    for name in ("gate_up_scan_kernel", "down_scan_kernel"):
        assert 0 < compile_scan(name, bm, shared).metadata.shared <= SM90_SHARED_BYTES


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with_shared"])
def test_sorted_form_compiles_for_sm90(shared):
    up_tile, down_tile = moe_triton.default_tiles(32 * K, E, D, F)
    for name, tile in (("gate_up_kernel", up_tile), ("down_kernel", down_tile)):
        assert 0 < compile_sorted(name, tile, shared).metadata.shared <= SM90_SHARED_BYTES


def test_the_shared_expert_adds_no_second_pipelined_loop():
    """With SHARED each expert kernel still has one K loop and its pipeline buffers once: the shared expert's programs
    pick rows and weights and reach the same tile call. Two call sites compiled to two loops with their own shared
    memory, which on the device's Triton asked for 278,528 bytes at the sorted form's 256-token tiles (H100,
    2026-12-06; the limit is 232,448), while this machine's Triton reports a size that does not show it."""
    up_tile, down_tile = moe_triton.default_tiles(256 * K, E, D, F)
    tiles = {"gate_up_kernel": up_tile, "down_kernel": down_tile, "gate_up_scan_kernel": None, "down_scan_kernel": None}
    for name, tile in tiles.items():
        counts = []
        for shared in (False, True):
            kern = (compile_scan(name, moe_triton.SCAN_MAX_TOKENS, shared) if tile is None
                    else compile_sorted(name, tile, shared))
            counts.append((kern.asm["ttgir"].count("scf.for"), kern.asm["ttgir"].count("local_alloc")))
        assert counts[0] == counts[1] and counts[0][0] == 1, (name, counts)
