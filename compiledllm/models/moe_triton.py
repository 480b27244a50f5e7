"""Routed experts as Triton kernels over expert-sorted (token, expert) pairs, as one torch op.

At decode batch sizes an expert sees a few to a few dozen pairs, so the MoE is bound by reading expert
weights. Each expert's pairs are cut into row tiles of BM; one program owns (row tile, N tile): it streams
that N tile of its expert's weights and applies it to the tile's pairs, gathering token rows through the
sort order instead of copying them. An expert many tokens chose (blocks of MASK tokens route alike) gets
many row tiles that run in parallel and re-read its weights from L2. Three to six launches per call:
  sort:    each pair's slot = its expert's offset (cumsum of the counts) + its position among that expert's pairs,
           the offsets and each BM's row tiles per expert: one program up to SORT_SMALL_PAIRS pairs (positions in
           pair order), else a zero fill of the E counters, positions by an atomic add on them (order within an
           expert arbitrary: see sort_position_kernel) and a placing kernel
  gate_up: act[p] = silu(x[tok(p)] @ Wg[e]^T) * (x[tok(p)] @ Wu[e]^T)      (fp32 epilogue, bf16 out)
  down:    y[pair(p)] = w[pair(p)] * (act[p] @ Wd[e]^T)                     (pair = token * k + rank)
  combine: out[t] = y[t*k] + ... + y[t*k + k-1]                             (fp32, that order, rounded once)
A shared expert of the experts' width (LLaDA2's) can ride along (FUSE_SHARED): its row tiles over every token in
gate_up and down, its row added last in combine.
Up to EXPERT_SCAN_TOKENS tokens (a decode row) there is no sort: a program per (expert, N tile) finds the pairs of
its expert by reading all the ids (act then in pair order); the same sums in the same order, so a token's bits do
not depend on the form. A pair whose id is >= E (a dead token's: MoE.route) is skipped: it is not counted or placed
(the scan form matches no expert to it), so no expert kernel reads it, and combine adds 0 for it. The router
(sigmoid, group-limited top-k, weights) is one more kernel; block routing (models/block_routing.py) two, or one for
rows of up to BLOCK_ROUTE_ROW_MAX tokens. Static shapes (the grid covers the most row tiles any routing can need;
spare programs return at once), no host sync: it compiles and captures.
Triton is imported lazily (CPU installs have none); `available()` says whether this path can run.
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


# Prefill-sized tiles: from PREFILL_PAIRS_PER_EXPERT pairs per expert on average (LLaDA2.0-mini, 256 experts top 8:
# 32 tokens per pair per expert, so 512 = 16K tokens), default_tiles returns PREFILL_TILE_SPECS, each
# (BM, BN cap, BK cap, warps, stages) for (gate_up, down), the caps cut to the dims by _block. Set both from
# `tools/bench/bench_moe.py --prefill-tokens ... --prefill-sweep` (its "prefill_decision"); until measured they equal
# the large-batch tiles below, so no shape runs differently. Tile changes have kept a row's result bitwise on the
# H200 (each output element sums its MMA K steps in order, whatever the tile): test_rows_do_not_depend_on_the_batch
# checks it across the decode and prefill tiles; run it after changing these.
PREFILL_PAIRS_PER_EXPERT: int = 512
PREFILL_TILE_SPECS: tuple[tuple[int, int, int, int, int], tuple[int, int, int, int, int]] = (
    (64, 256, 64, 8, 3), (128, 256, 64, 8, 3))
# From this many pairs per expert on average, backend "auto" runs the torch grouped GEMM instead of the Triton
# experts (None: never). Set it from the same bench_moe table, if grouped_mm is faster there. Unlike a tile
# choice, it changes a token's bits with the size of the forward: a decode window packed into one forward with a
# prefill chunk would then round differently than alone (batch invariance).
GROUPED_MM_FROM_PAIRS_PER_EXPERT: int | None = None


def _block(dim: int, cap: int) -> int:
    """The largest power of two <= cap dividing dim (tl.arange needs powers of two, tl.dot at least 16); 0 if < 16."""
    b = cap
    while b >= 16 and dim % b:
        b //= 2
    return b if b >= 16 else 0


def spec_tiles(up: tuple[int, ...], down: tuple[int, ...], dim: int, inner: int) -> tuple[MoETile, MoETile]:
    """(gate_up, down) tiles from (BM, BN cap, BK cap, warps, stages) specs, the caps cut to the dims."""
    (bm, bn, bk, w, st), (dbm, dbn, dbk, dw, dst) = up, down
    return (MoETile(bm, _block(inner, bn), _block(dim, bk), w, st),
            MoETile(dbm, _block(dim, dbn), _block(inner, dbk), dw, dst))


def default_tiles(pairs: int, experts: int, dim: int, inner: int) -> tuple[MoETile, MoETile]:
    """(gate_up, down) tiles, from the H200 sweeps of tools/bench/bench_moe.py: 16-row tiles with BN 128 and BK 128
    while experts see <= 16 pairs on average (rows there are mostly padding), 64-row tiles above, down with
    BN 128 (its K loop is only `inner` long: wider N tiles stream more weight per program), and from 64 pairs
    per expert gate_up with BN 256 on 8 warps (`bench_moe.py --sweep-split`: 1-4 % per kernel); from 128 pairs
    per expert down on 128 x 256 tiles, 8 warps (4-6 % of the op at 128 and 306 pairs per expert); from
    PREFILL_PAIRS_PER_EXPERT the prefill tiles."""
    if pairs >= PREFILL_PAIRS_PER_EXPERT * experts:
        return spec_tiles(*PREFILL_TILE_SPECS, dim, inner)
    if pairs <= 16 * experts:
        return (MoETile(16, _block(inner, 128), _block(dim, 128), 4, 3),
                MoETile(16, _block(dim, 128), _block(inner, 128), 4, 3))
    if pairs >= 128 * experts:
        down = MoETile(128, _block(dim, 256), _block(inner, 64), 8, 3)
    else:
        down = MoETile(64, _block(dim, 128), _block(inner, 64), 4, 3)
    if pairs >= 64 * experts:
        return MoETile(64, _block(inner, 256), _block(dim, 64), 8, 3), down
    return MoETile(64, _block(inner, 64), _block(dim, 64), 4, 3), down


def auto_uses_triton(pairs: int, experts: int) -> bool:
    """Whether backend "auto" runs the Triton experts for this many (token, expert) pairs (else grouped GEMM)."""
    return GROUPED_MM_FROM_PAIRS_PER_EXPERT is None or pairs < GROUPED_MM_FROM_PAIRS_PER_EXPERT * experts


def max_row_tiles(pairs: int, experts: int, block_m: int) -> int:
    """Row tiles the worst routing needs: sum over experts of ceil(count / BM) <= pairs // BM + experts used."""
    return pairs // block_m + min(experts, pairs)


def _kernels():
    from compiledllm.models import moe_kernels  # imports triton

    return moe_kernels


# How the routers pick. ROUTER_TOPK_SORT: each token's top-k by one bitonic sort of packed (score, id) keys (else
# top_k dependent max reductions); BLOCK_ADMIT_SORT: a block's admitted experts by the same sort (else each
# expert's rank counted over comparison tiles); BLOCK_ROUTE_ROW_MAX: rows of up to this many tokens (decode) take
# phase 1 inside the pick kernel (no aggregate buffer, fill or atomic-max kernel; 0: never; such a row's admission
# is always by sort); BLOCK_TOPK_SORT: the block router's top-k form. The standard router keeps dependent max picks
# (at B1 its sort took 15-33 us against 15-17 by max picks in the H100 / H200 sweeps of 2026-12-05/06). The block
# router takes the per-row phase 1 and sorted top-k, the fastest form of every H100 sweep (2026-12-06,
# `bench_block_routing.py --sweep 1,8`: mini B1 / B8, flash-shaped B1 / B8), and in the A/B of 5 interleaved rounds
# (`--ab 5`) the mini B1 block layer 0.1394 ms against 0.1462 by atomic max and rank tiles (standard 0.352 either
# way). The H200 sweep (2026-12-05) timed the forms within its noise.
ROUTER_TOPK_SORT = False
BLOCK_TOPK_SORT = True
BLOCK_ADMIT_SORT = False
BLOCK_ROUTE_ROW_MAX = 128
BLOCK_ROUTE_WARPS = 4


@torch.library.custom_op("compiledllm::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, bias: torch.Tensor, groups: torch.Tensor | None, n_group: int, topk_group: int,
              top_k: int, norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] float32 -> (expert ids [T, k] int64, weights [T, k] float32), as MoE.route; groups
    [T] (the route groups, or None): a token's whose is < 0 is dead, its pairs id E and weight 0 (no expert)."""
    return route_launch(logits, bias, groups, n_group, topk_group, top_k, norm, scaling)


def route_launch(logits, bias, groups, n_group: int, topk_group: int, top_k: int, norm: bool, scaling: float,
                 topk_sort: bool | None = None):
    """The op's body (`topk_sort`: the benchmark's A/B; None: ROUTER_TOPK_SORT)."""
    from compiledllm.models.moe_kernels import route_kernel

    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T:
        route_kernel[(T,)](logits, bias, ids if groups is None else groups, ids, w, scaling, E=E, GROUPS=n_group,
                           TOPK_GROUP=topk_group, TOPK=top_k, NORM=norm and top_k > 1,
                           SORT=ROUTER_TOPK_SORT if topk_sort is None else topk_sort, DEAD=groups is not None)
    return ids, w


@moe_route.register_fake
def _(logits, bias, groups, n_group, topk_group, top_k, norm, scaling):
    T = logits.shape[0]
    return logits.new_empty(T, top_k, dtype=torch.long), logits.new_empty(T, top_k)


def route_supported(x: torch.Tensor, experts: int, n_group: int) -> bool:
    """The fused router needs power-of-two expert and group counts (Triton block shapes) and groups of >= 16
    experts (on the H200 a run with groups of 4 chose other experts than torch; not resolved, so excluded)."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return x.is_cuda and pow2(experts) and pow2(n_group) and experts // n_group >= 16 and available()


@torch.library.custom_op("compiledllm::moe_block_route", mutates_args=())
def moe_block_route(logits: torch.Tensor, bias: torch.Tensor, groups: torch.Tensor, row: int, capacity: int,
                    top_k: int, norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Block routing (models/block_routing.py): router logits [T, E] float32, groups [T] int64 (a dense group index
    in [0, T), -1 = a dead token: block_routing.route_index), row: tokens per row (T = rows * row; no group spans
    two rows) -> (expert ids [T, k] int64, weights [T, k] float32); a dead token's pairs get id E and weight 0
    (no expert)."""
    return block_route_launch(logits, bias, groups, row, capacity, top_k, norm, scaling)


def block_route_launch(logits, bias, groups, row: int, capacity: int, top_k: int, norm: bool, scaling: float,
                       warps: int | None = None, admit_sort: bool | None = None, topk_sort: bool | None = None,
                       row_max: int | None = None):
    """The op's body (the keywords: the benchmark's sweeps; None: the module's settings above). Rows of at most
    row_max tokens: one kernel, each token aggregating its group over its row; longer rows (prefill chunks): the
    groups' max aggregates by atomic max into [T, E] (a row per possible group, most unused), then each token's
    admission and top-k."""
    from compiledllm.models.moe_kernels import block_max_kernel, block_pick_kernel

    T, E = logits.shape
    warps = BLOCK_ROUTE_WARPS if warps is None else warps
    row_max = BLOCK_ROUTE_ROW_MAX if row_max is None else row_max
    fused = 0 < row <= row_max
    ids = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    agg = ids if fused else torch.full((max(T, 1), E), float("-inf"), dtype=torch.float32, device=logits.device)
    if T:
        if not fused:
            block_max_kernel[(T,)](logits, bias, groups, agg, E=E, num_warps=warps)
        block_pick_kernel[(T,)](
            logits, bias, groups, agg, ids, w, scaling, E=E, CAPACITY=capacity, TOPK=top_k, NORM=norm and top_k > 1,
            ROW=row if fused else 0, ROW_CHUNK=8, CHUNK=min(32, E),
            ADMIT_SORT=fused or (BLOCK_ADMIT_SORT if admit_sort is None else admit_sort),
            TOPK_SORT=BLOCK_TOPK_SORT if topk_sort is None else topk_sort, num_warps=warps)
    return ids, w


@moe_block_route.register_fake
def _(logits, bias, groups, row, capacity, top_k, norm, scaling):
    T = logits.shape[0]
    return logits.new_empty(T, top_k, dtype=torch.long), logits.new_empty(T, top_k)


def block_route_supported(x: torch.Tensor, experts: int) -> bool:
    """The block router needs a power-of-two expert count (Triton block shapes) on CUDA."""
    return x.is_cuda and experts > 0 and experts & (experts - 1) == 0 and available()


@torch.library.custom_op("compiledllm::moe_routed", mutates_args=())
def moe_routed(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor, shared_gate_up: torch.Tensor | None = None,
               shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D]; w_gate_up [E, 2F, D]; w_down [E, D, F]; ids [T, k] int64 expert ids; weights [T, k] float32
    routing weights (all contiguous). Returns the routed MoE output [T, D]: each token's k weighted expert
    outputs summed. A pair with an id >= E (a dead token's, MoE.route) is skipped: no expert kernel reads or
    computes it and it adds 0 to its token's sum. shared_gate_up [2F, D] / shared_down [D, F] (both or neither): a
    shared expert of the routed experts' width, run on every token inside the same launches and added, weight 1,
    after the k pairs in the token's float32 sum (FUSE_SHARED)."""
    return launch(x, w_gate_up, w_down, ids, weights, shared=None if shared_gate_up is None else
                  (shared_gate_up, shared_down))


@moe_routed.register_fake
def _(x, w_gate_up, w_down, ids, weights, shared_gate_up=None, shared_down=None):
    return torch.empty_like(x)


# MoE.forward runs a shared expert of the routed experts' width (LLaDA2's: num_shared_experts 1) inside the routed
# op: its row tiles in the gate_up and down launches, its output in combine's float32 sum, instead of its own four
# kernels (gate_up GEMM, silu * up, down GEMM, add) per MoE layer. Off: the shared expert as its own GatedMLP.
# Measured on an H100 (2026-12-06, eighteenth session, the fixed kernels): test_shared_expert_inside_the_op passed
# (scan and sorted forms); the LLaDA2.0-mini layer with its shared expert at B1, block 48 / standard, 0.1351 / 0.3587
# ms (2.65x) against 0.1490 / 0.3726 ms (2.50x) separate; decode end to end +3 % at B1, +2 % at B8.
FUSE_SHARED = True


def fuses_shared(shared, x: torch.Tensor, inner: int) -> bool:
    """Whether the routed op can take `shared` (a GatedMLP or None) for input x: the routed experts' width and
    dtype, contiguous, not sharded (tensor parallel)."""
    return (FUSE_SHARED and shared is not None and shared.parallel is None and shared.inner == inner
            and all(w.dtype == x.dtype and w.is_contiguous() for w in (shared.gate_up.weight, shared.down.weight)))


# Up to this many tokens the experts take the scan form: no sort, one program per (expert, N tile) reads every
# token's ids and runs on the rows that chose its expert (a decode row of one 32-token block: 256 pairs whose sort
# is three launches). Above it, the sorted form (a scan program's rows are all T tokens, most of them masked).
# 0: never. Measured on an H100 (2026-12-06, bench_block_routing.py --sweep, LLaDA2.0-mini layer at batch 1):
# standard / block-48 layer 0.360 / 0.146 ms sorted, 0.355 / 0.142 ms scan, bitwise the same output
# (test_scan_form_equals_sorted_form); decode end to end +1 %.
EXPERT_SCAN_TOKENS = 32
# A scan program holds every token's rows (BM = T rounded up to a power of two), each pipeline stage a [BM, BK] row
# tile and gate_up's two [BK, BN] weight tiles: on the device's Triton (torch 2.11) 245,760 bytes of shared memory at
# 64 tokens (3 x (64 x 128 + 2 x 128 x 128) x 2; an H100 SM has 227 KB: OutOfResources, 2026-12-06), 221,184 at 32
# (tests/models/test_moe_tiles.py checks that count; Triton 3.9 on the CPU reports less, so its sm_90 compile alone
# did not catch it). At 256 tokens it asked 384 KB.
SCAN_MAX_TOKENS = 32
# The scan form's (gate_up, down) tiles, each (BN cap, BK cap, warps, stages); BM is the call's tokens. The same BK
# as the sorted form's decode tiles keeps a token's sums, so its bits, whatever the form. N tiles of 64: the best of
# the H100 tile sweep at mini B1 (experts 0.1180 against 0.1245 ms with default_tiles' 128-wide decode tiles); in
# the A/B (`--ab 5`) worth ~1 % of the block layer, beside the router's 5 %.
SCAN_TILE_SPECS: tuple[tuple[int, int, int, int], tuple[int, int, int, int]] = ((64, 128, 4, 4), (64, 128, 2, 3))


def scan_tiles(dim: int, inner: int) -> tuple[MoETile, MoETile]:
    """The scan form's (gate_up, down) tiles from SCAN_TILE_SPECS (BM 16: unused, the scan's rows are the call's)."""
    up, down = SCAN_TILE_SPECS
    return spec_tiles((16, *up), (16, *down), dim, inner)


# Up to this many (token, expert) pairs, sort_pairs runs as one program (sort_small_kernel) instead of a zero fill
# and two kernels over all the pairs: fewer launches at decode sizes, but one program's loop grows with the pairs.
# 0 (never) until tools/bench/bench_block_routing.py --sweep has timed both on a GPU.
SORT_SMALL_PAIRS = 0


def sort_pairs(ids: torch.Tensor, experts: int, block_ms: tuple[int, int], small: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (order [T*k] int32: pair ids grouped by expert, offs [E+1] int32: each expert's first
    slot, offs[E] the end of the last, tile_end [2, E] int32: inclusive cumsum of ceil(count / BM) for the two
    BMs). Pairs with ids >= E are skipped (no slot; order past offs[E] is unspecified). `small` (None: up to
    SORT_SMALL_PAIRS pairs) picks the one-program form; else a zero fill and two kernels over all the pairs
    (counting in one program took longer from T ~ 1024 tokens on the H200: 9.6 vs 6.3 us at T = 1024, k = 8)."""
    kern = _kernels()
    pairs = ids.numel()
    i32 = dict(dtype=torch.int32, device=ids.device)
    order = torch.empty(pairs, **i32)
    offs, tile_end = torch.empty(experts + 1, **i32), torch.empty(2, experts, **i32)
    e_p2 = 1 << (experts - 1).bit_length()
    if (pairs <= SORT_SMALL_PAIRS) if small is None else small:
        kern.sort_small_kernel[(1,)](ids, order, offs, tile_end, pairs, E=experts, E_P2=e_p2, BM_UP=block_ms[0],
                                     BM_DOWN=block_ms[1], BLOCK=32, num_warps=4)
        return order, offs, tile_end
    counts, pos = torch.zeros(experts, **i32), torch.empty(pairs, **i32)
    grid = (-(-pairs // 128),)
    kern.sort_position_kernel[grid](ids, counts, pos, pairs, experts, BLOCK=128)
    kern.sort_place_kernel[grid](ids, counts, pos, order, offs, tile_end, pairs, E=experts, E_P2=e_p2,
                                 BM_UP=block_ms[0], BM_DOWN=block_ms[1], BLOCK=128)
    return order, offs, tile_end


def scan_form(tokens: int, scan: bool | None = None) -> bool:
    """Whether a call of `tokens` tokens takes the experts' scan form (`scan`: asked for; None: the default)."""
    use = tokens <= min(EXPERT_SCAN_TOKENS, SCAN_MAX_TOKENS) if scan is None else scan
    if use and tokens > SCAN_MAX_TOKENS:
        raise ValueError(f"the experts' scan form takes at most SCAN_MAX_TOKENS = {SCAN_MAX_TOKENS} tokens, "
                         f"got {tokens}")
    return use


def launch(x, w_gate_up, w_down, ids, weights, tiles: tuple[MoETile, MoETile] | None = None,
           scan: bool | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The op's body; `tiles` overrides the default (gate_up, down) tiles, `scan` the form (None: the scan form up
    to EXPERT_SCAN_TOKENS tokens) (benchmark sweeps); `shared`: the shared expert's (gate_up [2F, D], down [D, F])."""
    T, D = x.shape
    scan = scan_form(T, scan)
    kern = _kernels()
    E, F = w_down.shape[0], w_down.shape[2]
    top_k = ids.shape[1]
    pairs = T * top_k
    t_up, t_down = tiles or (scan_tiles(D, F) if scan else default_tiles(pairs, E, D, F))
    ws_up, ws_down = shared or (w_gate_up, w_down)  # unread without a shared expert
    rows = pairs + (T if shared else 0)  # the shared expert's rows of act and y after the pairs'
    act = torch.empty(rows, F, dtype=x.dtype, device=x.device)
    # y in pair order [T * k, D] (not [k, T, D]): the down kernel stores at row `pair` as it is, and the
    # combine reads each token's k rows as one contiguous k * D span
    y = torch.empty(rows, D, dtype=x.dtype, device=x.device)
    if scan:
        bm, k_p2 = max(16, 1 << (T - 1).bit_length()), 1 << (top_k - 1).bit_length()
        kern.gate_up_scan_kernel[(E + bool(shared), F // t_up.block_n)](
            x, w_gate_up, ws_up, act, ids, T, E, D=D, F=F, TOPK=top_k, TOPK_P2=k_p2, BM=bm, BN=t_up.block_n,
            BK=t_up.block_k, SHARED=bool(shared), num_warps=t_up.warps, num_stages=t_up.stages)
        kern.down_scan_kernel[(E + bool(shared), D // t_down.block_n)](
            act, w_down, ws_down, y, ids, weights, T, E, D=D, F=F, TOPK=top_k, TOPK_P2=k_p2, BM=bm,
            BN=t_down.block_n, BK=t_down.block_k, SHARED=bool(shared), num_warps=t_down.warps,
            num_stages=t_down.stages)
    else:
        order, offs, tile_end = sort_pairs(ids, E, (t_up.block_m, t_down.block_m))
        e_p2 = 1 << (E - 1).bit_length()
        up_tiles, down_tiles = (max_row_tiles(pairs, E, t.block_m) for t in (t_up, t_down))
        extra = [-(-T // t.block_m) if shared else 0 for t in (t_up, t_down)]  # the shared expert's row tiles
        kern.gate_up_kernel[(up_tiles + extra[0], F // t_up.block_n)](
            x, w_gate_up, ws_up, act, order, offs, tile_end[0], T, up_tiles, E=E, E_P2=e_p2, D=D, F=F, TOPK=top_k,
            BM=t_up.block_m, BN=t_up.block_n, BK=t_up.block_k, SHARED=bool(shared), num_warps=t_up.warps,
            num_stages=t_up.stages)
        kern.down_kernel[(down_tiles + extra[1], D // t_down.block_n)](
            act, w_down, ws_down, y, order, offs, tile_end[1], weights, T, down_tiles, E=E, E_P2=e_p2, D=D, F=F,
            TOPK=top_k, BM=t_down.block_m, BN=t_down.block_n, BK=t_down.block_k, SHARED=bool(shared),
            num_warps=t_down.warps, num_stages=t_down.stages)
    out = torch.empty_like(x)
    bd = _block(D, 256)  # [4, 256] tiles: one 16-byte bf16 load per thread and rank at 4 warps (H200: BT 4 best)
    kern.combine_kernel[(-(-T // 4), D // bd)](y, ids, out, T, E, D=D, TOPK=top_k, BT=4, BD=bd,
                                               SHARED=bool(shared))
    return out


def supports(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Shapes and dtypes the kernels handle: bf16/fp16 on CUDA, contiguous weights, dims divisible by 16."""
    D, F = w_down.shape[1:]
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w_gate_up.is_contiguous()
            and w_down.is_contiguous() and _block(D, 64) > 0 and _block(F, 64) > 0 and available())
