"""The packed-attention Triton kernels (triton_kernels.py) as a torch op.

`torch.ops.compiledllm.packed_attention_triton(...)` takes the same arguments and returns the same as the
CuPy op (packed.py's contract). Static launch: no host synchronisation, the split-K workspace only grows,
so it compiles and captures. Triton is imported lazily: registering the op needs none.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from compiledllm.attention.launch import Workspace, check_inputs, fake_outputs, num_splits


@dataclass(frozen=True)
class TritonTile:
    """block_m query rows x block_n keys per step; warps and software-pipeline stages of the K/V loads."""

    block_m: int = 128
    block_n: int = 64
    warps: int = 8
    stages: int = 3
    ctas_per_sm: int = 1  # what the split count assumes fits on one SM
    warp_specialize: bool = False  # the whole-tile loop as Triton's automatic producer/consumer warp groups


TRITON_TILES = {
    "m128n64": TritonTile(128, 64, 8, 3, 1),
    "m128n64s4": TritonTile(128, 64, 8, 4, 1),
    "m128n64ws": TritonTile(128, 64, 8, 3, 1, True),
    "m128n128ws": TritonTile(128, 128, 8, 2, 1, True),
    "m128n128": TritonTile(128, 128, 8, 2, 1),
    "m64n64": TritonTile(64, 64, 4, 3, 2),
    "m64n128": TritonTile(64, 128, 4, 2, 2),
}


def default_triton_tile(rows: int) -> TritonTile:
    """rows = G * Lq query rows per KV head: 128-row tiles where they fill, else 64 (tl.dot needs >= 16)."""
    return TRITON_TILES["m128n64"] if rows > 64 else TRITON_TILES["m64n64"]


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def packed_attention_triton_launch(q, k_cache, v_cache, prefix_len, k_win, v_win, slot: int, scale: float,
                                   return_lse: bool, tile: TritonTile | None = None, splits: int | None = None):
    """Launch (tile/splits override the heuristics, for tests and the benchmark)."""
    from compiledllm.attention.triton_kernels import packed_attn_combine, packed_attn_fwd

    check_inputs(q, k_cache, v_cache, prefix_len, k_win, v_win)
    B, Lq, H, D = q.shape
    S, KVH = k_cache.shape[1], k_cache.shape[2]
    rows = (H // KVH) * Lq
    out = torch.empty((B, Lq, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Lq) if return_lse else (0,), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, k_win, v_win)):
        q, k_cache, v_cache, k_win, v_win = (t.contiguous() for t in (q, k_cache, v_cache, k_win, v_win))
    tile = tile or default_triton_tile(rows)
    row_tiles = -(-rows // tile.block_m)
    if splits is None:
        dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
        splits = num_splits(row_tiles * B * KVH, S, _num_sms(dev) * tile.ctas_per_sm)
    ns = splits
    n_out = B * Lq * H
    ws = Workspace.get(q.device, ns * n_out * (D + 1)) if ns > 1 else out
    ws_o, ws_l = (ws, ws[ns * n_out * D:]) if ns > 1 else (out, lse)
    strides = [x for t in (q, k_cache, v_cache, k_win, v_win) for x in t.stride()[:3]]
    packed_attn_fwd[(row_tiles, B * KVH, ns)](
        q, k_cache, v_cache, k_win, v_win, prefix_len, out, lse, ws_o, ws_l, *strides, S, n_out,
        scale * math.log2(math.e), Lq, slot, ns, H=H, KVH=KVH, D=D, BM=tile.block_m, BN=tile.block_n,
        WRITE_LSE=return_lse, WS=tile.warp_specialize, num_warps=tile.warps, num_stages=tile.stages)
    if ns > 1:
        rb = 16
        packed_attn_combine[(-(-n_out // rb),)](ws_o, ws_l, out, lse, n_out, Lq, ns, H=H, D=D, RB=rb,
                                                WRITE_LSE=return_lse, num_warps=4)
    return out, lse


@torch.library.custom_op("compiledllm::packed_attention_triton", mutates_args=(), device_types="cuda")
def packed_attention_triton_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               prefix_len: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, slot: int,
                               scale: float, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Lq, H, D] and lse [B, H, Lq] (an empty tensor when return_lse is False)."""
    return packed_attention_triton_launch(q, k_cache, v_cache, prefix_len, k_win, v_win, slot, scale, return_lse)


@packed_attention_triton_op.register_fake
def _(q, k_cache, v_cache, prefix_len, k_win, v_win, slot, scale, return_lse):
    return fake_outputs(q, return_lse)
