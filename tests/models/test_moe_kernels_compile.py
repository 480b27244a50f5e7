"""The routed experts' Triton kernels compile for an H100 / H200 (sm_90) on a machine without a GPU, at
LLaDA2.0-mini's expert shape with the decode tiles: both forms (sorted pairs, and the scan form of decode rows at 16
and 32 row tiles and at its largest, SCAN_MAX_TOKENS), with and without the shared expert inside, each within the
SM's shared memory.
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


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with_shared"])
@pytest.mark.parametrize("bm", sorted({16, 32, moe_triton.SCAN_MAX_TOKENS}))
def test_scan_form_compiles_for_sm90(bm, shared):
    k = kernels()
    common = {"D": D, "F": F, "TOPK": K, "TOPK_P2": K, "BM": bm, "SHARED": shared, **TILES}
    up = compile_sm90(k.gate_up_scan_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16",
                                              "act_ptr": "*bf16", "ids_ptr": "*i64", "T": "i32", "E": "i32"}, common)
    down = compile_sm90(k.down_scan_kernel, {"act_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16",
                                             "y_ptr": "*bf16", "ids_ptr": "*i64", "rw_ptr": "*fp32", "T": "i32",
                                             "E": "i32"}, common)
    for kern in (up, down):
        assert 0 < kern.metadata.shared <= SM90_SHARED_BYTES


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with_shared"])
def test_sorted_form_compiles_for_sm90(shared):
    k = kernels()
    up_tile, down_tile = moe_triton.default_tiles(32 * K, E, D, F)
    ptrs = {"order_ptr": "*i32", "offs_ptr": "*i32", "tile_end_ptr": "*i32"}
    sizes = {"T": "i32", "ROUTED_TILES": "i32"}
    up = compile_sm90(k.gate_up_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "act_ptr": "*bf16",
                                         **ptrs, **sizes},
                      {"E": E, "E_P2": E, "D": D, "F": F, "TOPK": K, "BM": up_tile.block_m, "BN": up_tile.block_n,
                       "BK": up_tile.block_k, "SHARED": shared}, up_tile.warps, up_tile.stages)
    down = compile_sm90(k.down_kernel, {"act_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "y_ptr": "*bf16",
                                        **ptrs, "rw_ptr": "*fp32", **sizes},
                        {"E": E, "E_P2": E, "D": D, "F": F, "TOPK": K, "BM": down_tile.block_m,
                         "BN": down_tile.block_n, "BK": down_tile.block_k, "SHARED": shared},
                        down_tile.warps, down_tile.stages)
    for kern in (up, down):
        assert 0 < kern.metadata.shared <= SM90_SHARED_BYTES


def test_the_shared_expert_adds_no_second_pipelined_loop():
    """With SHARED each expert kernel still has one K loop and its pipeline buffers once: the shared expert's programs
    pick rows and weights and reach the same tile call. Two call sites compiled to two loops with their own shared
    memory, which on the device's Triton asked for 278,528 bytes at the sorted form's 256-token tiles (H100,
    2026-12-06; the limit is 232,448), while this machine's Triton reports a size that does not show it."""
    k = kernels()
    up_tile, down_tile = moe_triton.default_tiles(256 * K, E, D, F)
    sorted_ptrs = {"order_ptr": "*i32", "offs_ptr": "*i32", "tile_end_ptr": "*i32", "T": "i32", "ROUTED_TILES": "i32"}
    cases = [
        (k.gate_up_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "act_ptr": "*bf16", **sorted_ptrs},
         {"E": E, "E_P2": E, "TOPK": K}, up_tile),
        (k.down_kernel, {"act_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "y_ptr": "*bf16", **sorted_ptrs,
                         "rw_ptr": "*fp32"}, {"E": E, "E_P2": E, "TOPK": K}, down_tile),
        (k.gate_up_scan_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "act_ptr": "*bf16",
                                 "ids_ptr": "*i64", "T": "i32", "E": "i32"}, {"TOPK": K, "TOPK_P2": K}, None),
        (k.down_scan_kernel, {"act_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "y_ptr": "*bf16",
                              "ids_ptr": "*i64", "rw_ptr": "*fp32", "T": "i32", "E": "i32"},
         {"TOPK": K, "TOPK_P2": K}, None),
    ]
    for fn, signature, extra, tile in cases:
        counts = []
        for shared in (False, True):
            if tile is None:  # the scan form at its largest rows and the decode N / K tiles
                consts, warps, stages = {"BM": moe_triton.SCAN_MAX_TOKENS, **TILES}, 4, 3
            else:
                consts = {"BM": tile.block_m, "BN": tile.block_n, "BK": tile.block_k}
                warps, stages = tile.warps, tile.stages
            ir = compile_sm90(fn, signature, {"D": D, "F": F, "SHARED": shared, **extra, **consts}, warps,
                              stages).asm["ttgir"]
            counts.append((ir.count("scf.for"), ir.count("local_alloc")))
        assert counts[0] == counts[1] and counts[0][0] == 1, (fn.__name__, counts)
