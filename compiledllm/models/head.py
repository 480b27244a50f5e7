"""The output head, optionally only for the rows a decoding policy reads.

A decode step needs the logits of few window positions (`threshold`: the still-masked ones, about half of a
block on average), but the head is the largest GEMM of the step (157K vocabulary). On CUDA with Triton the
head runs as two kernels over static shapes: one compacts the wanted row indices on the device, the other is
a GEMM whose row tiles past the wanted count return at once. No host sync, so it compiles and captures; a
row's logits do not depend on which other rows are wanted (each output row is its own dot products, in the same
K order). Rows not wanted hold unspecified values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.triton_support import triton_on_cuda


@dataclass(frozen=True)
class HeadTile:
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# Few rows: the head reads its weights (memory-bound), small row tiles; many rows: compute-bound, large tiles.
SMALL_TILE = HeadTile(64, 128, 64, 4, 4)
LARGE_TILE = HeadTile(128, 256, 64, 8, 3)


def default_tile(rows: int) -> HeadTile:
    return SMALL_TILE if rows <= 128 else LARGE_TILE


def supports(h: torch.Tensor, weight: torch.Tensor) -> bool:
    return (h.is_cuda and h.dtype in (torch.bfloat16, torch.float16) and weight.dtype == h.dtype
            and weight.is_contiguous() and h.shape[-1] % 64 == 0 and triton_on_cuda())


def head_logits(h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """h [..., D] @ weight [V, D]^T -> [..., V] in h's dtype; `rows` [...] bool: the rows wanted (None: all)."""
    if rows is None or not supports(h, weight):
        return h @ weight.t()
    out = torch.ops.compiledllm.head_rows(h.reshape(-1, h.shape[-1]).contiguous(), weight, rows.reshape(-1))
    return out.view(*h.shape[:-1], weight.shape[0])


@torch.library.custom_op("compiledllm::head_rows", mutates_args=())
def head_rows(h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """h [T, D], weight [V, D], rows [T] bool -> [T, V]: h[t] @ weight^T where rows[t], unspecified elsewhere."""
    return launch(h, weight, rows)


@head_rows.register_fake
def _(h, weight, rows):
    return h.new_empty(h.shape[0], weight.shape[0])


def launch(h: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, tile: HeadTile | None = None) -> torch.Tensor:
    """The op's body; `tile` overrides the default (benchmark sweeps)."""
    from compiledllm.models.head_kernels import compact_rows_kernel, head_rows_kernel

    T, D = h.shape
    V = weight.shape[0]
    t = tile or default_tile(T)
    ids = torch.empty(T, dtype=torch.int32, device=h.device)
    count = torch.empty(1, dtype=torch.int32, device=h.device)
    compact_rows_kernel[(1,)](rows.contiguous(), ids, count, T, T_P2=max(16, 1 << (T - 1).bit_length()))
    out = torch.empty(T, V, dtype=h.dtype, device=h.device)
    grid = (-(-T // t.block_m), -(-V // t.block_n))
    head_rows_kernel[grid](h, weight, out, ids, count, V, D=D, BM=t.block_m, BN=t.block_n, BK=t.block_k,
                           EVEN_N=V % t.block_n == 0, num_warps=t.warps, num_stages=t.stages)
    return out
