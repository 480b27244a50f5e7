"""Packed attention (launch.PackedArgs) as Triton kernels: imported only where Triton is.

Same decomposition as the CUDA kernel (kernels/packed_attention.cu): one program owns BM query rows of
ONE (batch row, KV head), rows (query i, group head g) i-major, so the G heads of a KV head share every
K/V tile; the prefix is split over grid axis 2 (flash-decoding) with the window on the last split. The
difference is the matrix unit: tl.dot lowers to Hopper's wgmma (asynchronous, fed from shared memory),
where the CUDA kernel's mma.sync tops out near half the rate this shape needs to be bound by HBM
(G * Lq = 128 rows per key: ~128 FLOP per K/V byte).

Two constexpr switches, so that the block-causal dense form compiles to the code it had before them:
GROUPS (the QueryGroups rule: window key j is visible to query i iff bit group[j] of see[group[i]] is set;
else BlockCausal(SLOT)) and PAGED (prefix key s of row b is pool row kv_index[b, s]; else row b's cache).
attention_mass is the per-key attention probability of the same scores and mask, from the forward's lse, per
(row, KV head): the KV head's G query heads share a program, so the per-head mass needs no extra pass. The
attention's SCORE switch instead sums each key's raw scaled scores over the counted queries in the same pass (a
sum of logits needs no lse).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _update(q, k, v, seen, m_i, l_i, acc, scale_log2, MASKED: tl.constexpr):
    """One K/V tile into the online softmax (log2 domain); seen [BM, BN] masks scores out when MASKED (full
    prefix tiles skip the select: the loop is bound by the matrix unit and this elementwise work beside it)."""
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)  # scale > 0: the max of the scaled scores
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: keep the exps at 0
    alpha = tl.exp2(m_i - base)
    p = tl.exp2(s * scale_log2 - base[:, None])  # one fused multiply-add per score
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc, s


@triton.jit
def _score_cols(part, keys, s, seen, want, scale, ok):
    """SCORE: this tile's raw scaled scores summed over the counted rows that see each key, stored once per (row
    tile, key): Flash-dLLM's tracker score, linear in the scores, so the attention's own pass produces it."""
    tl.store(part + keys, tl.sum(tl.where(seen & want[:, None], s, 0.0), 0) * scale, mask=ok)


@triton.jit
def _prefix_rows(idx_b, keys, live, PAGED: tl.constexpr):
    """The source rows of prefix keys: the keys themselves in the row's cache, or (PAGED) their pool rows from
    kv_index, in int64 (a pool may pass 2^31 elements). live masks the index loads (None: all keys valid)."""
    rows = keys
    if PAGED:
        rows = tl.load(idx_b + keys, mask=live).to(tl.int64)
    return rows


@triton.jit
def _query_rule(grp_b, see_ptr, i, row_ok, GROUPS: tl.constexpr):
    """The query rows' side of the window rule: their group's see bitmask (GROUPS), else their window index."""
    qr = i
    if GROUPS:
        qr = tl.load(see_ptr + tl.load(grp_b + i, mask=row_ok, other=0), mask=row_ok, other=0)
    return qr


@triton.jit
def _window_seen(qr, keys, live, row_ok, grp_b, SLOT, GROUPS: tl.constexpr):
    """[BM, BN] visibility of window keys `keys` (live: inside the window) to the rows of `qr` (_query_rule)."""
    if GROUPS:
        rule = ((qr[:, None] >> tl.load(grp_b + keys, mask=live, other=0)[None, :]) & 1) != 0
    else:
        rule = (keys[None, :] // SLOT) <= (qr[:, None] // SLOT)
    return live[None, :] & rule & row_ok[:, None]


@triton.jit
def packed_attn_fwd(q_ptr, kc_ptr, vc_ptr, kw_ptr, vw_ptr, pl_ptr, out_ptr, lse_ptr, ws_o_ptr, ws_l_ptr,
                    grp_ptr, see_ptr, idx_ptr, qm_ptr, part_ptr,
                    q_sb, q_st, q_sh, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh,
                    kw_sb, kw_st, kw_sh, vw_sb, vw_st, vw_sh, grp_sb, idx_sb, qm_sb, qm_st,
                    S, n_out_rows, scale_log2, LQ, SLOT, NSPLIT,
                    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    WRITE_LSE: tl.constexpr, WS: tl.constexpr, GROUPS: tl.constexpr, PAGED: tl.constexpr,
                    SCORE: tl.constexpr):
    # LQ, SLOT and NSPLIT are runtime values: prefill chunks of every length share one compiled kernel.
    # PAGED: kc/vc are pools [N, KVH, D] (the launcher passes batch stride 0), kv_index rows [B, S] unit-stride.
    # SCORE: each key's raw scaled scores summed over the query rows marked in qm [B, Q] into part[b, kvh, row tile,
    # key] ([B, KVH, row_tiles, S + LQ], zeroed by the launcher: keys no program visits stay 0).
    G: tl.constexpr = H // KVH
    ROWS = G * LQ
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (bh // KVH).to(tl.int64)  # batch offsets of a large cache pass 2^31 elements
    kvh = bh % KVH
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = r < ROWS
    i = r // G
    hq = kvh * G + r % G
    d = tl.arange(0, D)
    n = tl.arange(0, BN)
    q = tl.load(q_ptr + b * q_sb + i[:, None] * q_st + hq[:, None] * q_sh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    ob = tl.minimum(tl.maximum(tl.load(pl_ptr + b).to(tl.int32), 0), S)
    want = row_ok
    part = part_ptr
    sc = scale_log2 * 0.6931471805599453  # the softmax scale
    if SCORE:
        want = row_ok & (tl.load(qm_ptr + b * qm_sb + i * qm_st, mask=row_ok, other=0) != 0)
        part += ((b * KVH + kvh) * tl.num_programs(0) + tl.program_id(0)) * (S + LQ)

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)

    # This split's share of the prefix, in whole tiles, proportional to the row's own o_b.
    ntp = tl.cdiv(ob, BN)
    per = tl.cdiv(ntp, NSPLIT)
    t_lo = tl.minimum(ntp, split * per)
    t_hi = tl.minimum(ntp, t_lo + per)
    kb = kc_ptr + b * kc_sb + kvh * kc_sh
    vb = vc_ptr + b * vc_sb + kvh * vc_sh
    idx_b = idx_ptr
    if PAGED:
        idx_b += b * idx_sb
    # Whole tiles need no mask (rows past ROWS read q = 0: finite scores, never stored); then the partial one.
    t_full = tl.minimum(t_hi, tl.maximum(t_lo, ob // BN))
    for t in tl.range(t_lo, t_full, warp_specialize=WS):  # WS: Triton's producer/consumer warp groups
        rows = _prefix_rows(idx_b, t * BN + n, None, PAGED)
        k = tl.load(kb + rows[:, None] * kc_st + d[None, :])
        v = tl.load(vb + rows[:, None] * vc_st + d[None, :])
        m_i, l_i, acc, s = _update(q, k, v, None, m_i, l_i, acc, scale_log2, False)
        if SCORE:
            _score_cols(part, t * BN + n, s, n[None, :] >= 0, want, sc, n >= 0)
    for t in range(t_full, t_hi):
        keys = t * BN + n
        live = keys < ob
        rows = _prefix_rows(idx_b, keys, live, PAGED)
        k = tl.load(kb + rows[:, None] * kc_st + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(vb + rows[:, None] * vc_st + d[None, :], mask=live[:, None], other=0.0)
        m_i, l_i, acc, s = _update(q, k, v, live[None, :], m_i, l_i, acc, scale_log2, True)
        if SCORE:
            _score_cols(part, keys, s, live[None, :], want, sc, keys < S)

    if split == NSPLIT - 1:  # the window: block-causal up to the end of the last slot a row here can see
        grp_b = grp_ptr
        if GROUPS:
            grp_b += b * grp_sb
            n_win = LQ
        else:
            i_max = (tl.minimum(tl.program_id(0) * BM + BM, ROWS) - 1) // G
            n_win = tl.minimum(LQ, (i_max // SLOT + 1) * SLOT)
        qr = _query_rule(grp_b, see_ptr, i, row_ok, GROUPS)
        kwb = kw_ptr + b * kw_sb + kvh * kw_sh
        vwb = vw_ptr + b * vw_sb + kvh * vw_sh
        for w0 in range(0, n_win, BN):
            keys = w0 + n
            live = keys < n_win
            k = tl.load(kwb + keys[:, None] * kw_st + d[None, :], mask=live[:, None], other=0.0)
            v = tl.load(vwb + keys[:, None] * vw_st + d[None, :], mask=live[:, None], other=0.0)
            seen = _window_seen(qr, keys, live, row_ok, grp_b, SLOT, GROUPS)
            m_i, l_i, acc, s = _update(q, k, v, seen, m_i, l_i, acc, scale_log2, True)
            if SCORE:
                _score_cols(part, S + keys, s, seen, want, sc, live)

    # A row that saw no key (l_i = 0) stores out 0 and lse -inf, as the reference does.
    inv = tl.where(l_i > 0.0, 1.0 / l_i, 0.0)
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_i)) * 0.6931471805599453, float("-inf"))
    orow = (b * LQ + i) * H + hq  # [B, Lq, H] row of out
    lrow = (b * H + hq) * LQ + i  # [B, H, Lq] entry of lse
    o = acc * inv[:, None]
    if NSPLIT == 1:
        tl.store(out_ptr + orow[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE:
            tl.store(lse_ptr + lrow, lse, mask=row_ok)
    else:
        tl.store(ws_o_ptr + (split * n_out_rows + orow[:, None]) * D + d[None, :], o, mask=row_ok[:, None])
        tl.store(ws_l_ptr + split * n_out_rows + lrow, lse, mask=row_ok)


@triton.jit
def packed_attn_combine(ws_o_ptr, ws_l_ptr, out_ptr, lse_ptr, n_out_rows, LQ, NSPLIT, H: tl.constexpr,
                        D: tl.constexpr, RB: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Merge the splits' normalised partials by their lse: RB output rows (b, i, h) per program."""
    row = tl.program_id(0).to(tl.int64) * RB + tl.arange(0, RB)
    ok = row < n_out_rows
    h = row % H
    i = (row // H) % LQ
    b = row // (H * LQ)
    lrow = (b * H + h) * LQ + i
    d = tl.arange(0, D)
    mx = tl.full([RB], float("-inf"), tl.float32)
    for s in range(NSPLIT):
        mx = tl.maximum(mx, tl.load(ws_l_ptr + s * n_out_rows + lrow, mask=ok, other=float("-inf")))
    base = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros([RB, D], tl.float32)
    wsum = tl.zeros([RB], tl.float32)
    for s in range(NSPLIT):
        w = tl.exp2((tl.load(ws_l_ptr + s * n_out_rows + lrow, mask=ok, other=float("-inf")) - base)
                    * 1.4426950408889634)
        wsum += w
        acc += w[:, None] * tl.load(ws_o_ptr + (s * n_out_rows + row[:, None]) * D + d[None, :], mask=ok[:, None],
                                    other=0.0)
    inv = tl.where(wsum > 0.0, 1.0 / wsum, 0.0)
    tl.store(out_ptr + row[:, None] * D + d[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
             mask=ok[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr + lrow, tl.where(wsum > 0.0, base + tl.log2(wsum) * 0.6931471805599453, float("-inf")),
                 mask=ok)


@triton.jit
def _mass_cols(q, k, seen, lse2, scale_log2):
    """[BN] attention probability per key, summed over the rows where seen."""
    s = tl.dot(q, tl.trans(k))
    p = tl.exp2(s * scale_log2 - lse2[:, None])
    return tl.sum(tl.where(seen, p, 0.0), 0)


@triton.jit
def attention_mass_fwd(q_ptr, kc_ptr, kw_ptr, pl_ptr, grp_ptr, see_ptr, idx_ptr, lse_ptr, qm_ptr, part_ptr,
                       q_sb, q_st, q_sh, kc_sb, kc_st, kc_sh, kw_sb, kw_st, kw_sh, grp_sb, idx_sb, qm_sb, qm_st,
                       S, scale_log2, LQ, SLOT, TPP,
                       H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       GROUPS: tl.constexpr, PAGED: tl.constexpr):
    """Per-key attention mass: program (row tile, (b, kv head), chunk) covers TPP key tiles of the keys
    [prefix S | window LQ] and writes, per key, the sum of exp(score - lse) over its rows (the G query heads of
    KV head kvh, for the queries marked in qm) into part[b, kvh, row_tile, key] ([B, KVH, row_tiles, S + LQ]):
    the per-KV-head mass, in row-tile partials (each entry written once: their sums over row tiles, and over
    KV heads for the [B, S + Q] figure, are deterministic). Keys nobody here sees get 0."""
    G: tl.constexpr = H // KVH
    ROWS = G * LQ
    bh = tl.program_id(1)
    b = (bh // KVH).to(tl.int64)
    kvh = bh % KVH
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = r < ROWS
    i = r // G
    hq = kvh * G + r % G
    d = tl.arange(0, D)
    n = tl.arange(0, BN)
    q = tl.load(q_ptr + b * q_sb + i[:, None] * q_st + hq[:, None] * q_sh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    lse2 = tl.load(lse_ptr + (b * H + hq) * LQ + i, mask=row_ok, other=0.0) * 1.4426950408889634
    want = row_ok & (tl.load(qm_ptr + b * qm_sb + i * qm_st, mask=row_ok, other=0) != 0)
    ob = tl.minimum(tl.maximum(tl.load(pl_ptr + b).to(tl.int32), 0), S)
    part = part_ptr + ((b * KVH + kvh) * tl.num_programs(0) + tl.program_id(0)) * (S + LQ)

    ntp = tl.cdiv(S, BN)
    t_lo = tl.program_id(2) * TPP
    t_hi = tl.minimum(t_lo + TPP, ntp + tl.cdiv(LQ, BN))
    kb = kc_ptr + b * kc_sb + kvh * kc_sh
    idx_b = idx_ptr
    if PAGED:
        idx_b += b * idx_sb
    # a tile of rows nobody counts, or of keys past the row's prefix, is zeros without a load or a dot (a select
    # step counts a few rows' queries over the bucket's whole capacity; the other rows' prefixes are short)
    counted = tl.max(want.to(tl.int32), axis=0) > 0
    live_tiles = tl.where(counted, tl.cdiv(ob, BN), 0)
    zeros = tl.zeros([BN], dtype=tl.float32)
    for t in range(t_lo, tl.minimum(t_hi, ntp)):
        keys = t * BN + n
        if t < live_tiles:
            live = keys < ob
            rows = _prefix_rows(idx_b, keys, live, PAGED)
            k = tl.load(kb + rows[:, None] * kc_st + d[None, :], mask=live[:, None], other=0.0)
            tl.store(part + keys, _mass_cols(q, k, live[None, :] & want[:, None], lse2, scale_log2), mask=keys < S)
        else:
            tl.store(part + keys, zeros, mask=keys < S)

    grp_b = grp_ptr
    if GROUPS:
        grp_b += b * grp_sb
    qr = _query_rule(grp_b, see_ptr, i, row_ok, GROUPS)
    kwb = kw_ptr + b * kw_sb + kvh * kw_sh
    for t in range(tl.maximum(t_lo, ntp), t_hi):
        keys = (t - ntp) * BN + n
        live = keys < LQ
        if counted:
            k = tl.load(kwb + keys[:, None] * kw_st + d[None, :], mask=live[:, None], other=0.0)
            seen = _window_seen(qr, keys, live, want, grp_b, SLOT, GROUPS)
            tl.store(part + S + keys, _mass_cols(q, k, seen, lse2, scale_log2), mask=live)
        else:
            tl.store(part + S + keys, zeros, mask=live)
