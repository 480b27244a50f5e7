"""Triton kernels of the MoE router and routed experts (contracts in moe_triton.py); imported only where Triton is."""
import triton
import triton.language as tl


@triton.jit
def row_tile(tile_end_ptr, offs_ptr, E: tl.constexpr, E_P2: tl.constexpr, BM: tl.constexpr):
    """(expert, rows [BM], live rows mask) of this program's row tile; expert == E for a spare program."""
    j = tl.program_id(0)
    ends = tl.load(tile_end_ptr + tl.arange(0, E_P2), mask=tl.arange(0, E_P2) < E, other=2**30)
    e = tl.sum((ends <= j).to(tl.int32))  # tile_end is the inclusive cumsum of tiles per expert
    first_tile = tl.max(tl.where(ends <= j, ends, 0))
    e_safe = tl.minimum(e, E - 1)
    rows = tl.load(offs_ptr + e_safe) + (j - first_tile) * BM + tl.arange(0, BM)
    return e, rows, rows < tl.load(offs_ptr + e_safe + 1)


@triton.jit
def gate_up_tile(x_ptr, we_ptr, act_ptr, tok, act_rows, live, D: tl.constexpr, F: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """act[act_rows] = silu(x[tok] @ Wg^T) * (x[tok] @ Wu^T) on this program's N tile, rows where live; we_ptr: the
    expert's [2F, D] weights (Wg then Wu)."""
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xa = x_ptr + tok.to(tl.int64)[:, None] * D + rk[None, :]
    wg = we_ptr + n[None, :] * D + rk[:, None]  # [BK, BN] of Wg^T
    wu = wg + F * D
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        a = tl.load(xa + k0, mask=live[:, None], other=0.0)
        acc_g = tl.dot(a, tl.load(wg + k0), acc_g)
        acc_u = tl.dot(a, tl.load(wu + k0), acc_u)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(act_ptr + act_rows.to(tl.int64)[:, None] * F + n[None, :], h.to(act_ptr.dtype.element_ty),
             mask=live[:, None])


@triton.jit
def down_tile(act_ptr, we_ptr, y_ptr, scale, act_rows, out_rows, live, D: tl.constexpr, F: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[out_rows] = scale * (act[act_rows] @ Wd^T) on this program's N tile, rows where live (scale [BM] float32:
    the pairs' routing weights, 1 for the shared expert); we_ptr: the expert's [D, F] weights."""
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    aa = act_ptr + act_rows.to(tl.int64)[:, None] * F + rk[None, :]
    wd = we_ptr + n[None, :] * F + rk[:, None]  # [BK, BN] of Wd^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, F, BK):
        a = tl.load(aa + k0, mask=live[:, None], other=0.0)
        acc = tl.dot(a, tl.load(wd + k0), acc)
    acc = acc * scale[:, None]
    # y is [T * k (+ T), D] in pair order (token-major), the shared expert's rows after: combine_kernel reads a
    # token's k rows as one span
    tl.store(y_ptr + out_rows.to(tl.int64)[:, None] * D + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=live[:, None])


@triton.jit
def shared_rows(j, T, TOPK: tl.constexpr, BM: tl.constexpr):
    """The shared expert's row tile j: (tokens [BM], their rows of act / y: after the T * k pairs', live)."""
    t = j * BM + tl.arange(0, BM)
    return t, T * TOPK + t, t < T


# SHARED (the shared expert inside the op): its programs pick their rows and weights by tl.where and reach the same
# one call of the tile as the experts' programs. A second call site would be a second software-pipelined loop with
# its own shared-memory buffers: twice the bytes, over the SM's 227 KB at the sorted form's decode tiles (H100,
# 2026-12-06: 278,528 bytes asked for).
@triton.jit
def gate_up_kernel(x_ptr, w_ptr, ws_ptr, act_ptr, order_ptr, offs_ptr, tile_end_ptr, T, ROUTED_TILES,
                   E: tl.constexpr, E_P2: tl.constexpr, D: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SHARED: tl.constexpr = False):
    """Sorted form: program (row tile, N tile); act in sorted slot order. SHARED: the programs past ROUTED_TILES
    run the shared expert (ws_ptr) on every token, T rows after the pairs' (their tokens' order)."""
    e, rows, live = row_tile(tile_end_ptr, offs_ptr, E, E_P2, BM)
    tok = tl.load(order_ptr + rows, mask=live, other=0) // TOPK
    we = w_ptr + tl.minimum(e, E - 1).to(tl.int64) * (2 * F * D)
    if SHARED:
        mine = tl.program_id(0) >= ROUTED_TILES
        s_tok, s_rows, s_live = shared_rows(tl.program_id(0) - ROUTED_TILES, T, TOPK, BM)
        tok, rows = tl.where(mine, s_tok, tok), tl.where(mine, s_rows, rows)
        live, we, e = tl.where(mine, s_live, live), tl.where(mine, ws_ptr, we), tl.where(mine, 0, e)
    if e >= E:
        return
    gate_up_tile(x_ptr, we, act_ptr, tok, rows, live, D, F, BM, BN, BK)


@triton.jit
def down_kernel(act_ptr, w_ptr, ws_ptr, y_ptr, order_ptr, offs_ptr, tile_end_ptr, rw_ptr, T, ROUTED_TILES,
                E: tl.constexpr, E_P2: tl.constexpr, D: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SHARED: tl.constexpr = False):
    e, rows, live = row_tile(tile_end_ptr, offs_ptr, E, E_P2, BM)
    pair = tl.load(order_ptr + rows, mask=live, other=0)
    scale = tl.load(rw_ptr + pair, mask=live, other=0.0)
    we = w_ptr + tl.minimum(e, E - 1).to(tl.int64) * (D * F)
    if SHARED:
        mine = tl.program_id(0) >= ROUTED_TILES
        _, s_rows, s_live = shared_rows(tl.program_id(0) - ROUTED_TILES, T, TOPK, BM)
        rows, pair, live = tl.where(mine, s_rows, rows), tl.where(mine, s_rows, pair), tl.where(mine, s_live, live)
        scale, we, e = tl.where(mine, 1.0, scale), tl.where(mine, ws_ptr, we), tl.where(mine, 0, e)
    if e >= E:
        return
    down_tile(act_ptr, we, y_ptr, scale, rows, pair, live, D, F, BM, BN, BK)


@triton.jit
def scan_rows(ids_ptr, T, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BM: tl.constexpr):
    """Scan form: (expert, tokens [BM], their pairs with this expert, live) of program (expert, N tile): every
    token's ids are read and the tokens that chose the expert kept (top-k ids are distinct: at most one rank)."""
    e = tl.program_id(0)
    t = tl.arange(0, BM)
    r = tl.arange(0, TOPK_P2)
    ids = tl.load(ids_ptr + t[:, None] * TOPK + r[None, :], mask=(t[:, None] < T) & (r[None, :] < TOPK), other=-1)
    hit = ids == e
    live = tl.max(hit.to(tl.int32), axis=1) > 0
    pair = t * TOPK + tl.sum(tl.where(hit, r[None, :], 0), axis=1)
    return e, t, pair, live


@triton.jit
def gate_up_scan_kernel(x_ptr, w_ptr, ws_ptr, act_ptr, ids_ptr, T, E, D: tl.constexpr, F: tl.constexpr,
                        TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, SHARED: tl.constexpr = False):
    """Scan form (T <= BM tokens): program (expert, N tile); act in pair order; an unchosen expert returns.
    SHARED: program E runs the shared expert (ws_ptr) on every token (rows after the pairs', as the sorted form)."""
    e, t, pair, live = scan_rows(ids_ptr, T, TOPK, TOPK_P2, BM)
    we = w_ptr + tl.minimum(e, E - 1).to(tl.int64) * (2 * F * D)
    if SHARED:
        mine = e == E
        _, s_rows, s_live = shared_rows(0, T, TOPK, BM)  # its tokens are t, as scan_rows's
        pair, live, we = tl.where(mine, s_rows, pair), tl.where(mine, s_live, live), tl.where(mine, ws_ptr, we)
    if tl.max(live.to(tl.int32), axis=0) == 0:
        return
    gate_up_tile(x_ptr, we, act_ptr, t, pair, live, D, F, BM, BN, BK)


@triton.jit
def down_scan_kernel(act_ptr, w_ptr, ws_ptr, y_ptr, ids_ptr, rw_ptr, T, E, D: tl.constexpr, F: tl.constexpr,
                     TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, SHARED: tl.constexpr = False):
    e, t, pair, live = scan_rows(ids_ptr, T, TOPK, TOPK_P2, BM)
    scale = tl.load(rw_ptr + pair, mask=live, other=0.0)
    we = w_ptr + tl.minimum(e, E - 1).to(tl.int64) * (D * F)
    if SHARED:
        mine = e == E
        _, s_rows, s_live = shared_rows(0, T, TOPK, BM)
        pair, live, we = tl.where(mine, s_rows, pair), tl.where(mine, s_live, live), tl.where(mine, ws_ptr, we)
        scale = tl.where(mine, 1.0, scale)
    if tl.max(live.to(tl.int32), axis=0) == 0:
        return
    down_tile(act_ptr, we, y_ptr, scale, pair, pair, live, D, F, BM, BN, BK)


@triton.jit
def sort_position_kernel(ids_ptr, counts_ptr, pos_ptr, P, E, BLOCK: tl.constexpr):
    """Each pair's position among its expert's pairs, by an atomic add on the expert's counter (zeroed by the
    caller; it ends as the expert's pair count). Positions within an expert come in whatever order the atomics
    run, which varies between runs: the expert kernels' results do not depend on it, as each pair's output row
    depends on its own row of A alone (tl.dot rows are independent) and is stored to its own pair row of y,
    whichever row of which tile computed it. A pair whose id is >= E (skipped) is not counted."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < P
    e = tl.load(ids_ptr + p, mask=live, other=0)
    held = live & (e < E)
    pos = tl.atomic_add(counts_ptr + e, 1, mask=held, sem="relaxed")  # atomicity alone makes positions distinct
    tl.store(pos_ptr + p, pos, mask=held)


@triton.jit
def sort_place_kernel(ids_ptr, counts_ptr, pos_ptr, order_ptr, offs_ptr, tile_end_ptr, P, E: tl.constexpr,
                      E_P2: tl.constexpr, BM_UP: tl.constexpr, BM_DOWN: tl.constexpr, BLOCK: tl.constexpr):
    """order[offs[e] + position] = pair. Every program takes the exclusive cumsum of the E counts itself (cheaper
    than one more launch to take it once); program 0 also stores offs [E+1] (offs[E]: the pairs some expert
    runs, P less the skipped ones) and tile_end [2, E] (inclusive cumsum of row tiles per expert, for gate_up's BM
    then down's). Skipped pairs (id >= E) get no slot: order[offs[E]:] is never written, and never read."""
    ex = tl.arange(0, E_P2)
    counts = tl.load(counts_ptr + ex, mask=ex < E, other=0)
    starts = tl.cumsum(counts, 0) - counts
    if tl.program_id(0) == 0:
        tl.store(offs_ptr + ex, starts, mask=ex < E)
        tl.store(offs_ptr + E, tl.sum(counts, 0))
        tl.store(tile_end_ptr + ex, tl.cumsum((counts + BM_UP - 1) // BM_UP, 0), mask=ex < E)
        tl.store(tile_end_ptr + E + ex, tl.cumsum((counts + BM_DOWN - 1) // BM_DOWN, 0), mask=ex < E)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < P
    e = tl.load(ids_ptr + p, mask=live, other=0)
    held = live & (e < E)
    slot = tl.gather(starts, tl.minimum(e, E - 1).to(tl.int32), 0) + tl.load(pos_ptr + p, mask=held, other=0)
    tl.store(order_ptr + slot, p, mask=held)


@triton.jit
def sort_small_kernel(ids_ptr, order_ptr, offs_ptr, tile_end_ptr, P, E: tl.constexpr, E_P2: tl.constexpr,
                      BM_UP: tl.constexpr, BM_DOWN: tl.constexpr, BLOCK: tl.constexpr):
    """sort_position_kernel + sort_place_kernel (and their zero fill) in one program, for decode-sized pair counts:
    the counts by one-hot sums over [BLOCK, E] tiles, then each pair's slot = its expert's start + the pairs of that
    expert before it (a cumsum down the tile), so pairs keep their order within an expert (deterministic, unlike
    the atomics; the results do not depend on it either way). Same offs / tile_end / order contract."""
    ex = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + p, mask=p < P, other=E)
        counts += tl.sum(((e[:, None] == ex[None, :]) & (ex[None, :] < E)).to(tl.int32), axis=0)
    running = tl.cumsum(counts, 0) - counts
    tl.store(offs_ptr + ex, running, mask=ex < E)
    tl.store(offs_ptr + E, tl.sum(counts, 0))
    tl.store(tile_end_ptr + ex, tl.cumsum((counts + BM_UP - 1) // BM_UP, 0), mask=ex < E)
    tl.store(tile_end_ptr + E + ex, tl.cumsum((counts + BM_DOWN - 1) // BM_DOWN, 0), mask=ex < E)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + p, mask=p < P, other=E)
        hit = ((e[:, None] == ex[None, :]) & (ex[None, :] < E)).to(tl.int32)
        before = tl.cumsum(hit, 0) - hit  # this tile's earlier pairs of the same expert
        slot = tl.sum(hit * (before + running[None, :]), axis=1)
        tl.store(order_ptr + slot, p, mask=(p < P) & (e < E))
        running += tl.sum(hit, axis=0)


@triton.jit
def combine_kernel(y_ptr, ids_ptr, out_ptr, T, E, D: tl.constexpr, TOPK: tl.constexpr, BT: tl.constexpr,
                   BD: tl.constexpr, SHARED: tl.constexpr = False):
    """out[t] = sum over ranks 0..k-1 of y[t * k + rank] (then, SHARED, the shared expert's y[T * k + t]) in
    float32, in that order, rounded once; a skipped pair (id >= E: no expert wrote its row of y) adds 0."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    live = t < T
    rows = y_ptr + (t.to(tl.int64) * TOPK * D)[:, None] + d[None, :]
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for r in tl.static_range(TOPK):
        held = live & (tl.load(ids_ptr + t.to(tl.int64) * TOPK + r, mask=live, other=E) < E)
        acc += tl.load(rows + r * D, mask=held[:, None], other=0.0).to(tl.float32)
    if SHARED:
        shared = y_ptr + ((T * TOPK + t).to(tl.int64) * D)[:, None] + d[None, :]
        acc += tl.load(shared, mask=live[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live[:, None])


@triton.jit
def first_max(values, index, size: tl.constexpr):
    """(max, lowest index holding it) of a 1-D block: max and min reductions only (no argmax)."""
    top = tl.max(values, axis=0)
    return top, tl.min(tl.where(values == top, index, size), axis=0)


@triton.jit
def store_dead(ids_ptr, w_ptr, t, E: tl.constexpr, TOPK: tl.constexpr):
    """A dead token (route group -1): every pair to no expert, id E and weight 0 (the experts skip it)."""
    for j in tl.static_range(TOPK):
        tl.store(ids_ptr + t * TOPK + j, E)
        tl.store(w_ptr + t * TOPK + j, 0.0)


@triton.jit
def desc_keys(values, e, E: tl.constexpr):
    """int64 keys of a float32 block whose descending order is the values' descending order with ties to the lower
    index e: the float's bits made monotone as a signed int (negatives' magnitude bits flipped) above E - 1 - e.
    (-0.0 would sort below +0.0; no score here is -0.0: sigmoid > 0 and x + -x is +0.0.)"""
    bits = values.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (E - 1 - e).to(tl.int64)


@triton.jit
def store_topk(score, biased, e, logits_ptr, ids_ptr, w_ptr, t, scaling, E: tl.constexpr, TOPK: tl.constexpr,
               NORM: tl.constexpr, SORT: tl.constexpr):
    """Token t's TOPK largest `biased` (descending, ties -> lower id) to ids, their unbiased `score` to w (over
    their sum + 1e-20 with NORM, times scaling). SORT: one bitonic sort of desc_keys, whose first TOPK positions
    are stored at once (scores re-made from the logits: the same sigmoid of the same value, the same bits); else
    TOPK dependent (max, first index) reductions, the picks kept in registers (re-reading ids_ptr could see
    another thread's store not yet visible: no barrier between a program's global stores and loads)."""
    if SORT:
        keys = tl.sort(desc_keys(biased, e, E), descending=True)
        top = e < TOPK  # position e of the sorted block
        best = E - 1 - (keys & 0xFFFFFFFF).to(tl.int32)
        picked = tl.sigmoid(tl.load(logits_ptr + t * E + best, mask=top, other=0.0))
        wsum = tl.sum(tl.where(top, picked, 0.0)) + 1e-20 if NORM else 1.0
        tl.store(ids_ptr + t * TOPK + e, best.to(tl.int64), mask=top)
        tl.store(w_ptr + t * TOPK + e, picked / wsum * scaling, mask=top)
    else:
        rank = tl.full((E,), -1, dtype=tl.int32)
        total = 0.0
        for j in tl.static_range(TOPK):
            _, best = first_max(tl.where(rank >= 0, float("-inf"), biased), e, E)
            rank = tl.where(e == best, j, rank)
            tl.store(ids_ptr + t * TOPK + j, best.to(tl.int64))
            total += tl.sum(tl.where(e == best, score, 0.0))
        wsum = total + 1e-20 if NORM else 1.0
        for j in tl.static_range(TOPK):
            tl.store(w_ptr + t * TOPK + j, tl.sum(tl.where(rank == j, score, 0.0)) / wsum * scaling)


@triton.jit
def route_kernel(logits_ptr, bias_ptr, group_ptr, ids_ptr, w_ptr, scaling, E: tl.constexpr, GROUPS: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr, NORM: tl.constexpr, SORT: tl.constexpr,
                 DEAD: tl.constexpr):
    """One token: sigmoid scores, + bias for selection, keep the TOPK_GROUP groups with the largest top-2
    sums, then the TOPK best experts in descending order (ties -> lower id); weights from unbiased scores.
    DEAD: group_ptr holds the tokens' route groups, and a dead one's (-1) pairs go to no expert."""
    t = tl.program_id(0).to(tl.int64)
    if DEAD:
        if tl.load(group_ptr + t) < 0:
            store_dead(ids_ptr, w_ptr, t, E, TOPK)
            return
    e = tl.arange(0, E)
    score = tl.sigmoid(tl.load(logits_ptr + t * E + e))
    biased = score + tl.load(bias_ptr + e)
    if GROUPS > 1:
        grid = tl.reshape(biased, (GROUPS, E // GROUPS))
        top1 = tl.max(grid, axis=1)
        ties = tl.sum((grid == top1[:, None]).to(tl.int32), axis=1)
        rest = tl.max(tl.where(grid == top1[:, None], float("-inf"), grid), axis=1)
        gscore = top1 + tl.where(ties > 1, top1, rest)  # the sum of the two largest, duplicates included
        g = tl.arange(0, GROUPS)
        keep = tl.zeros((GROUPS,), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            _, best = first_max(tl.where(keep > 0, float("-inf"), gscore), g, GROUPS)
            keep = tl.where(g == best, 1, keep)
        kept = tl.reshape(tl.broadcast_to(keep[:, None], (GROUPS, E // GROUPS)), (E,))
        biased = tl.where(kept > 0, biased, float("-inf"))  # dropped groups never picked, as the torch path
    store_topk(score, biased, e, logits_ptr, ids_ptr, w_ptr, t, scaling, E, TOPK, NORM, SORT)


@triton.jit
def block_max_kernel(logits_ptr, bias_ptr, group_ptr, agg_ptr, E: tl.constexpr):
    """Block routing, phase 1 (models/block_routing.py): agg[group(t)] = max over its live tokens t of the biased
    scores sigmoid(logits[t]) + bias (agg starts at -inf; a dead token, group -1, adds nothing). Max is order-free,
    so the atomics give the same bits whatever order they run in."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.load(group_ptr + t)
    if g < 0:
        return
    e = tl.arange(0, E)
    biased = tl.sigmoid(tl.load(logits_ptr + t * E + e)) + tl.load(bias_ptr + e)
    tl.atomic_max(agg_ptr + g * E + e, biased, sem="relaxed")


@triton.jit
def block_pick_kernel(logits_ptr, bias_ptr, group_ptr, agg_ptr, ids_ptr, w_ptr, scaling, E: tl.constexpr,
                      CAPACITY: tl.constexpr, TOPK: tl.constexpr, NORM: tl.constexpr, ROW: tl.constexpr,
                      ROW_CHUNK: tl.constexpr, CHUNK: tl.constexpr, ADMIT_SORT: tl.constexpr,
                      TOPK_SORT: tl.constexpr):
    """Block routing, phase 2 for one token: its group's CAPACITY experts with the largest aggregate (ties -> lower
    id), then its TOPK best biased scores among them (ties -> lower id), weights from the unbiased scores; a dead
    token (group -1) gets id E and weight 0 for every rank.

    ROW > 0 (decode-sized rows of ROW tokens; a group never spans rows): phase 1 here too, without agg_ptr or
    block_max_kernel: the max over the row's tokens of this token's group, in [ROW_CHUNK, E] tiles (the same max,
    the same bits). ROW 0: the aggregate block_max_kernel left in agg_ptr.
    Admission: ADMIT_SORT, the CAPACITY-th largest desc_keys of one bitonic sort as the threshold; else (ROW 0
    only) each expert's rank (experts ahead: a larger aggregate, or an equal one and a lower id) counted over
    [CHUNK, E] comparison tiles of agg_ptr, admitted when < CAPACITY. Both are the stable descending sort's first."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.load(group_ptr + t)
    if g < 0:
        store_dead(ids_ptr, w_ptr, t, E, TOPK)
        return
    e = tl.arange(0, E)
    bias = tl.load(bias_ptr + e)
    if ROW > 0:
        first = (t // ROW) * ROW
        agg = tl.full((E,), float("-inf"), dtype=tl.float32)
        for q0 in tl.static_range(0, ROW, ROW_CHUNK):
            q = first + q0 + tl.arange(0, ROW_CHUNK)
            same = tl.load(group_ptr + q, mask=q0 + tl.arange(0, ROW_CHUNK) < ROW, other=-1) == g
            lg = tl.load(logits_ptr + q[:, None] * E + e[None, :], mask=same[:, None], other=0.0)
            agg = tl.maximum(agg, tl.max(tl.where(same[:, None], tl.sigmoid(lg) + bias[None, :], float("-inf")), 0))
    else:
        agg = tl.load(agg_ptr + g * E + e)
    if ADMIT_SORT:
        keys = desc_keys(agg, e, E)
        cut = tl.min(tl.where(e < CAPACITY, tl.sort(keys, descending=True), 0x7FFFFFFFFFFFFFFF))
        admitted = keys >= cut
    else:
        ahead = tl.zeros((E,), dtype=tl.int32)
        for c in tl.static_range(0, E, CHUNK):
            other = c + tl.arange(0, CHUNK)
            a = tl.load(agg_ptr + g * E + other)[:, None]
            before = (a > agg[None, :]) | ((a == agg[None, :]) & (other[:, None] < e[None, :]))
            ahead += tl.sum(before.to(tl.int32), axis=0)
        admitted = ahead < CAPACITY
    score = tl.sigmoid(tl.load(logits_ptr + t * E + e))
    biased = tl.where(admitted, score + bias, float("-inf"))
    store_topk(score, biased, e, logits_ptr, ids_ptr, w_ptr, t, scaling, E, TOPK, NORM, TOPK_SORT)
