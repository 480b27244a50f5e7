"""The packed-attention Triton kernels (triton_kernels.py) as torch ops.

`torch.ops.compiledllm.packed_attention_triton(q, k_cache, v_cache, prefix_len, k_win, v_win, group, see,
kv_index, slot, scale, return_lse) -> (out, lse)` takes the kernels' form of launch.PackedArgs (slot > 0:
BlockCausal(slot); slot 0: QueryGroups(group, see); kv_index: a paged source) and returns the same as the CuPy
op. `torch.ops.compiledllm.attention_mass(q, k_cache, prefix_len, k_win, group, see, kv_index, slot, scale,
lse, queries, per_head=False) -> mass [B, S + Q]` is the attention probability each key receives (prefix keys,
then window keys) summed over the heads and the queries marked in queries [B, Q], from the forward's lse; with
per_head, mass [B, KVH, S + Q] per KV head (summed over its H / KVH query heads).
`torch.ops.compiledllm.packed_attention_scored(..., scale, queries) -> (out, score [B, S + Q])` is the attention
with Flash-dLLM's tracker score made in its own pass: per key, the raw scaled scores summed over the marked queries.

Static launches: no host synchronisation, scratch from torch's allocator per call (launch.split_scratch), so
they compile and capture. Triton is imported lazily: registering the ops needs none.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from compiledllm.attention.launch import (PackedArgs, check_inputs, fake_outputs, kernel_rule, num_splits, op_args,
                                         split_scratch)

_MASS_TILES_PER_PROGRAM = 4  # key tiles one mass program covers: its Q tile is read once for these


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


def _source_strides(a: PackedArgs, t: torch.Tensor) -> tuple[int, ...]:
    """(batch, token, head) strides of a row cache, or (0, row, head) of a pool (the kernels add kv_index rows)."""
    return (0, *t.stride()[:2]) if a.kv_index is not None else t.stride()[:3]


def packed_attention_triton_launch(args: PackedArgs, return_lse: bool, tile: TritonTile | None = None,
                                   splits: int | None = None, score_queries: torch.Tensor | None = None
                                   ) -> tuple[torch.Tensor, ...]:
    """Launch (tile/splits override the heuristics, for tests and the benchmark) -> (out, lse); with score_queries
    [B or 1, Q] bool also the tracker score [B, S + Q] float32: per key, its raw scaled scores q.k * scale summed over
    the marked queries that see it and their heads, made in the same pass (row tiles' partials summed here in a fixed
    order: deterministic)."""
    from compiledllm.attention.triton_kernels import packed_attn_combine, packed_attn_fwd

    check_inputs(args)
    slot, group, see, idx = kernel_rule(args)
    q, k_cache, v_cache, k_win, v_win = args.q, args.k_cache, args.v_cache, args.k_win, args.v_win
    B, Lq, H, D = q.shape
    S, KVH = args.keys, k_cache.shape[-2]
    rows = (H // KVH) * Lq
    out = torch.empty((B, Lq, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Lq) if return_lse else (0,), dtype=torch.float32, device=q.device)
    scored = score_queries is not None
    if out.numel() == 0:
        empty = torch.zeros((B, S + Lq), dtype=torch.float32, device=q.device)
        return (out, lse, empty) if scored else (out, lse)
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, k_win, v_win)):
        q, k_cache, v_cache, k_win, v_win = (t.contiguous() for t in (q, k_cache, v_cache, k_win, v_win))
    tile = tile or default_triton_tile(rows)
    row_tiles = -(-rows // tile.block_m)
    if splits is None:
        dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
        splits = num_splits(row_tiles * B * KVH, S, _num_sms(dev) * tile.ctas_per_sm)
    ns = splits
    n_out = B * Lq * H
    ws = split_scratch(q.device, ns, n_out, D) if ns > 1 else out
    ws_o, ws_l = (ws, ws[ns * n_out * D:]) if ns > 1 else (out, lse)
    strides = [*q.stride()[:3], *_source_strides(args, k_cache), *_source_strides(args, v_cache),
               *k_win.stride()[:3], *v_win.stride()[:3]]
    qm, part = out, out  # any pointers when no score is made
    if scored:
        if score_queries.dtype != torch.bool or score_queries.dim() != 2 or score_queries.shape[1] != Lq:
            raise ValueError(f"attention score: queries must be a bool [B or 1, {Lq}] tensor")
        qm = score_queries.expand(B, Lq).view(torch.uint8)
        part = torch.zeros((B, KVH, row_tiles, S + Lq), dtype=torch.float32, device=q.device)
    packed_attn_fwd[(row_tiles, B * KVH, ns)](
        q, k_cache, v_cache, k_win, v_win, args.prefix_len, out, lse, ws_o, ws_l, group, see, idx, qm, part,
        *strides, 0 if group is None else group.stride(0), 0 if idx is None else idx.stride(0),
        *(qm.stride() if scored else (0, 0)), S, n_out, args.softmax_scale * math.log2(math.e), Lq, slot, ns, H=H,
        KVH=KVH, D=D, BM=tile.block_m, BN=tile.block_n, WRITE_LSE=return_lse, WS=tile.warp_specialize,
        GROUPS=group is not None, PAGED=idx is not None, SCORE=scored, num_warps=tile.warps,
        num_stages=tile.stages)
    if ns > 1:
        rb = 16
        packed_attn_combine[(-(-n_out // rb),)](ws_o, ws_l, out, lse, n_out, Lq, ns, H=H, D=D, RB=rb,
                                                WRITE_LSE=return_lse, num_warps=4)
    return (out, lse, part.view(B, KVH * row_tiles, S + Lq).sum(1)) if scored else (out, lse)


def attention_mass_triton_launch(args: PackedArgs, lse: torch.Tensor, queries: torch.Tensor,
                                 tile: TritonTile | None = None, per_head: bool = False) -> torch.Tensor:
    """mass float32 from the forward's lse [B, H, Q] and queries [B or 1, Q] bool: per KV head [B, KVH, S + Q]
    with per_head, else [B, S + Q] (tile: for tests). The kernel writes one partial per (row, KV head, row tile)
    and key; the row tiles' partials are summed here in a fixed order (deterministic), and when the G * Q query
    rows of a KV head fit one tile (decode) the per-head mass is the kernel's output itself."""
    from compiledllm.attention.triton_kernels import attention_mass_fwd

    check_inputs(args)
    slot, group, see, idx = kernel_rule(args)
    q, k_cache, k_win = args.q, args.k_cache, args.k_win
    B, Lq, H, D = q.shape
    S, KVH = args.keys, k_cache.shape[-2]
    if lse.shape != (B, H, Lq) or lse.dtype != torch.float32:
        raise ValueError(f"attention mass: lse must be the forward's float32 [B, H, Q] = {(B, H, Lq)}")
    if queries.dtype != torch.bool or queries.dim() != 2 or queries.shape[1] != Lq:
        raise ValueError(f"attention mass: queries must be a bool [B or 1, {Lq}] tensor")
    if B * Lq == 0:
        return torch.zeros((B, KVH, S + Lq) if per_head else (B, S + Lq), dtype=torch.float32, device=q.device)
    if any(t.stride(-1) != 1 for t in (q, k_cache, k_win)):
        q, k_cache, k_win = (t.contiguous() for t in (q, k_cache, k_win))
    lse = lse.contiguous()
    qm = queries.expand(B, Lq).view(torch.uint8)
    rows = (H // KVH) * Lq
    tile = tile or default_triton_tile(rows)
    row_tiles = -(-rows // tile.block_m)
    key_tiles = -(-S // tile.block_n) + -(-Lq // tile.block_n)
    part = torch.empty((B, KVH, row_tiles, S + Lq), dtype=torch.float32, device=q.device)
    attention_mass_fwd[(row_tiles, B * KVH, -(-key_tiles // _MASS_TILES_PER_PROGRAM))](
        q, k_cache, k_win, args.prefix_len, group, see, idx, lse, qm, part, *q.stride()[:3],
        *_source_strides(args, k_cache), *k_win.stride()[:3], 0 if group is None else group.stride(0),
        0 if idx is None else idx.stride(0), *qm.stride(), S, args.softmax_scale * math.log2(math.e), Lq, slot,
        _MASS_TILES_PER_PROGRAM, H=H, KVH=KVH, D=D, BM=tile.block_m, BN=tile.block_n, GROUPS=group is not None,
        PAGED=idx is not None, num_warps=tile.warps, num_stages=tile.stages)
    if not per_head:
        return part.view(B, KVH * row_tiles, S + Lq).sum(1)
    return part.view(B, KVH, S + Lq) if row_tiles == 1 else part.sum(2)


@torch.library.custom_op("compiledllm::packed_attention_triton", mutates_args=(), device_types="cuda")
def packed_attention_triton_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               prefix_len: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
                               group: torch.Tensor | None, see: torch.Tensor | None, kv_index: torch.Tensor | None,
                               slot: int, scale: float, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Lq, H, D] and lse [B, H, Lq] (an empty tensor when return_lse is False)."""
    args = op_args(q, k_cache, v_cache, prefix_len, k_win, v_win, group, see, kv_index, slot, scale)
    return packed_attention_triton_launch(args, return_lse)


@packed_attention_triton_op.register_fake
def _(q, k_cache, v_cache, prefix_len, k_win, v_win, group, see, kv_index, slot, scale, return_lse):
    return fake_outputs(q, return_lse)


@torch.library.custom_op("compiledllm::packed_attention_scored", mutates_args=(), device_types="cuda")
def packed_attention_scored_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               prefix_len: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
                               group: torch.Tensor | None, see: torch.Tensor | None, kv_index: torch.Tensor | None,
                               slot: int, scale: float, queries: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Lq, H, D] and the tracker score [B, S + Q] float32 of the queries marked in queries, one pass."""
    args = op_args(q, k_cache, v_cache, prefix_len, k_win, v_win, group, see, kv_index, slot, scale)
    out, _, score = packed_attention_triton_launch(args, False, score_queries=queries)
    return out, score


@packed_attention_scored_op.register_fake
def _(q, k_cache, v_cache, prefix_len, k_win, v_win, group, see, kv_index, slot, scale, queries):
    S = kv_index.shape[1] if kv_index is not None else k_cache.shape[1]
    return torch.empty_like(q), q.new_empty((q.shape[0], S + q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("compiledllm::attention_mass", mutates_args=(), device_types="cuda")
def attention_mass_op(q: torch.Tensor, k_cache: torch.Tensor, prefix_len: torch.Tensor, k_win: torch.Tensor,
                      group: torch.Tensor | None, see: torch.Tensor | None, kv_index: torch.Tensor | None, slot: int,
                      scale: float, lse: torch.Tensor, queries: torch.Tensor,
                      per_head: bool = False) -> torch.Tensor:
    """mass [B, S + Q] float32, or with per_head [B, KVH, S + Q] (S: prefix keys addressable per row)."""
    args = op_args(q, k_cache, k_cache, prefix_len, k_win, k_win, group, see, kv_index, slot, scale)
    return attention_mass_triton_launch(args, lse, queries, per_head=per_head)


@attention_mass_op.register_fake
def _(q, k_cache, prefix_len, k_win, group, see, kv_index, slot, scale, lse, queries, per_head=False):
    S = kv_index.shape[1] if kv_index is not None else k_cache.shape[1]
    heads = (k_cache.shape[-2],) if per_head else ()
    return q.new_empty((q.shape[0], *heads, S + q.shape[1]), dtype=torch.float32)
