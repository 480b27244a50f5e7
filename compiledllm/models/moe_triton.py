"""Routed experts as two Triton kernels over expert-sorted (token, expert) pairs, as a torch op.

At decode batch sizes an expert sees a few to a few dozen pairs, so the MoE is bound by reading expert
weights. Each expert's pairs are cut into row tiles of BM; one program owns (row tile, N tile): it streams
that N tile of its expert's weights and applies it to the tile's pairs, gathering token rows through the
sort order instead of copying them. An expert many tokens chose (blocks of MASK tokens route alike) gets
many row tiles that run in parallel and re-read its weights from L2.
  gate_up: act[p] = silu(x[tok(p)] @ Wg[e]^T) * (x[tok(p)] @ Wu[e]^T)      (fp32 epilogue, bf16 out)
  down:    y[rank, token] = w[pair(p)] * (act[p] @ Wd[e]^T)                 (pair(p) = token * k + rank)
The caller sums y over the k ranks. The router (sigmoid, group-limited top-k, weights) is one more kernel.
Static shapes (the grid covers the most row tiles any routing can need; spare programs return at once), no
host sync: it compiles and captures. Triton is imported lazily (CPU installs have none); `available()` says
whether this path can run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.triton_support import triton_on_cuda as available


@dataclass(frozen=True)
class MoETile:
    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 4


def _block(dim: int, cap: int) -> int:
    """The largest power of two <= cap dividing dim (tl.arange needs powers of two, tl.dot at least 16); 0 if < 16."""
    b = cap
    while b >= 16 and dim % b:
        b //= 2
    return b if b >= 16 else 0


def default_tiles(pairs: int, experts: int, dim: int, inner: int) -> tuple[MoETile, MoETile]:
    """(gate_up, down) tiles, from the H200 sweep of tools/bench_moe.py: 16-row tiles with BN 128 and BK 128
    while experts see <= 16 pairs on average (rows there are mostly padding), 64x64x64 tiles above."""
    if pairs <= 16 * experts:
        return (MoETile(16, _block(inner, 128), _block(dim, 128), 4, 3),
                MoETile(16, _block(dim, 128), _block(inner, 128), 4, 3))
    return MoETile(64, _block(inner, 64), _block(dim, 64), 4, 3), MoETile(64, _block(dim, 64), _block(inner, 64), 4, 3)


def max_row_tiles(pairs: int, experts: int, block_m: int) -> int:
    """Row tiles the worst routing needs: sum over experts of ceil(count / BM) <= pairs // BM + experts used."""
    return pairs // block_m + min(experts, pairs)


def _kernels():
    from compiledllm.models import moe_kernels  # imports triton

    return moe_kernels.gate_up_kernel, moe_kernels.down_kernel


@torch.library.custom_op("compiledllm::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
              norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] float32 -> (expert ids [T, k] int64, weights [T, k] float32), as MoE.route."""
    from compiledllm.models.moe_kernels import route_kernel

    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    route_kernel[(T,)](logits, bias, ids, w, scaling, E=E, GROUPS=n_group, TOPK_GROUP=topk_group, TOPK=top_k,
                       NORM=norm and top_k > 1)
    return ids, w


@moe_route.register_fake
def _(logits, bias, n_group, topk_group, top_k, norm, scaling):
    T = logits.shape[0]
    return logits.new_empty(T, top_k, dtype=torch.long), logits.new_empty(T, top_k)


def route_supported(x: torch.Tensor, experts: int, n_group: int) -> bool:
    """The fused router needs power-of-two expert and group counts (Triton block shapes) and groups of >= 16
    experts (on the H200 a run with groups of 4 chose other experts than torch; not resolved, so excluded)."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return x.is_cuda and pow2(experts) and pow2(n_group) and experts // n_group >= 16 and available()


@torch.library.custom_op("compiledllm::moe_routed", mutates_args=())
def moe_routed(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, order: torch.Tensor,
               offs: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [T, D]; w_gate_up [E, 2F, D]; w_down [E, D, F]; order [T*k] int32 pair ids sorted by expert;
    offs [E+1] int32 pair offsets per expert; weights [T*k] float32 routing weights.
    Returns y [k, T, D]: each pair's weighted expert output by (rank, token); the MoE output is y.sum(0)."""
    return launch(x, w_gate_up, w_down, order, offs, weights, top_k)


def launch(x, w_gate_up, w_down, order, offs, weights, top_k: int,
           tiles: tuple[MoETile, MoETile] | None = None) -> torch.Tensor:
    """The op's body; `tiles` overrides the default (gate_up, down) tiles (benchmark sweeps)."""
    gate_up_kernel, down_kernel = _kernels()
    T, D = x.shape
    E, F = w_down.shape[0], w_down.shape[2]
    pairs = T * top_k
    t_up, t_down = tiles or default_tiles(pairs, E, D, F)
    counts = offs[1:] - offs[:-1]
    e_p2 = 1 << (E - 1).bit_length()
    act = torch.empty(pairs, F, dtype=x.dtype, device=x.device)
    y = torch.empty(top_k, T, D, dtype=x.dtype, device=x.device)
    bm = t_up.block_m
    tile_end = ((counts + bm - 1) // bm).cumsum(0, dtype=torch.int32)
    gate_up_kernel[(max_row_tiles(pairs, E, bm), F // t_up.block_n)](
        x, w_gate_up, act, order, offs, tile_end, E=E, E_P2=e_p2, D=D, F=F, TOPK=top_k, BM=bm,
        BN=t_up.block_n, BK=t_up.block_k, num_warps=t_up.warps, num_stages=t_up.stages)
    if t_down.block_m != bm:
        bm = t_down.block_m
        tile_end = ((counts + bm - 1) // bm).cumsum(0, dtype=torch.int32)
    down_kernel[(max_row_tiles(pairs, E, bm), D // t_down.block_n)](
        act, w_down, y, order, offs, tile_end, weights, T, E=E, E_P2=e_p2, D=D, F=F, TOPK=top_k, BM=bm,
        BN=t_down.block_n, BK=t_down.block_k, num_warps=t_down.warps, num_stages=t_down.stages)
    return y


@moe_routed.register_fake
def _(x, w_gate_up, w_down, order, offs, weights, top_k):
    return x.new_empty(top_k, x.shape[0], x.shape[1])


def supports(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Shapes and dtypes the kernels handle: bf16/fp16 on CUDA, contiguous weights, dims divisible by 16."""
    D, F = w_down.shape[1:]
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w_gate_up.is_contiguous()
            and w_down.is_contiguous() and _block(D, 64) > 0 and _block(F, 64) > 0 and available())
