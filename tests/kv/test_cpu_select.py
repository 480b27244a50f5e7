"""compiledllm._cpu_select against the float32 torch reference (CPU; both dispatch paths)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import compiledllm.kv.cpu_select as cs
from compiledllm.kv.cpu_select_ref import gather_ref, importance_ref, select_ref


def test_extension_is_built():
    """The package build compiles ext/ (pip install); a missing module is a failed build, not a skip."""
    assert cs.extension_available()

PATHS = [False] + ([True] if cs.isa() == "avx512bf16" else [])  # portable=...; both when the CPU allows
AVX_FORMS = ["fma", "vdpbf16ps"] if cs.isa() == "avx512bf16" else []
AMX = cs.amx_status() if cs.isa() == "avx512bf16" else {"cpu": False, "active": False, "reason": "no AVX-512 path"}
needs_amx = pytest.mark.skipif(not AMX["active"], reason=f"AMX not active: {AMX['reason']}")


def _data(B, KVH, S, D, G, n_q, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(B, KVH, S, D, generator=g) * spread).to(torch.bfloat16)
    v = torch.randn(B, KVH, S, D, generator=g).to(torch.bfloat16)
    q = torch.randn(B, KVH * G, n_q, D, generator=g).to(torch.bfloat16)
    return q, k, v


def _check_topk(idx, ref_idx, imps, lengths, topk):
    """Identical sets, except positions whose reference importance ties the k-th one (float32 tolerance)."""
    B, KVH, _ = idx.shape
    for b in range(B):
        n = min(topk, int(lengths[b]))
        for h in range(KVH):
            got, want = idx[b, h], ref_idx[b, h]
            assert torch.all(got[n:] == -1) and torch.all(got[:n] >= 0), "padding / count"
            assert torch.all(got[:n][1:] > got[:n][:-1]), "positions must be strictly ascending"
            a, w = set(got[:n].tolist()), set(want[:n].tolist())
            if a == w:
                continue
            imp = imps[b][h]
            kth = imp[want[:n].long()].min()
            for x in a ^ w:
                assert abs(float(imp[x] - kth)) <= 2e-5 * float(kth) + 1e-9, (b, h, x, float(imp[x]), float(kth))


def _check(res, ref, q, k, lengths, topk, scale=None):
    if res.out is not None:
        torch.testing.assert_close(res.out, ref.out, rtol=1e-4, atol=2e-5)
    if res.lse is not None:
        finite = torch.isfinite(ref.lse)
        assert torch.equal(torch.isfinite(res.lse), finite)
        torch.testing.assert_close(res.lse[finite], ref.lse[finite], rtol=1e-5, atol=2e-5)
    if topk is not None:
        _check_topk(res.topk_idx, ref.topk_idx, importance_ref(q, k, lengths, scale), lengths, topk)


GRID = [  # B, KVH, S, D, G, n_q, lengths, topk
    (2, 2, 1000, 128, 4, 1, [1000, 777], 50),
    (1, 4, 5003, 64, 2, 3, [5003], 301),
    (3, 1, 300, 128, 8, 8, [0, 17, 300], 20),
    (2, 2, 257, 64, 1, 1, [257, 1], 300),  # topk > every length
    (1, 2, 4100, 128, 4, 32, [4099], 205),  # many rows: transposed key tiles
    (2, 1, 999, 64, 8, 2, [998, 999], 998),  # topk = length, and length - 1
    (1, 1, 129, 128, 1, 64, [129], 16),
    (1, 2, 640, 32, 3, 5, [640], 0),
    (2, 3, 333, 128, 2, 1, [333, 100], 33),  # R = 2 and 3: query rows held in registers
    (1, 1, 333, 64, 3, 1, [250], 31),
]


@pytest.mark.parametrize("case", GRID, ids=lambda c: "B{}_KVH{}_S{}_D{}_G{}_nq{}".format(*c[:6]))
@pytest.mark.parametrize("portable", PATHS, ids=lambda p: "portable" if p else "native")
def test_select_matches_reference(case, portable):
    B, KVH, S, D, G, n_q, lengths, topk = case
    q, k, v = _data(B, KVH, S, D, G, n_q, seed=S)
    res = cs.select(q, k, v, lengths, topk, portable=portable)
    assert res.path == ("portable" if portable else cs.isa())
    _check(res, select_ref(q, k, v, lengths, topk), q, k, lengths, topk)


@pytest.mark.parametrize("n_q", [2, 5])  # 8 and 20 rows: both AVX-512 scoring schemes
def test_paths_forms_and_threads_agree_bitwise(n_q):
    q, k, v = _data(2, 2, 6001, 128, 4, n_q, seed=1)
    lengths = [6001, 3001]
    base = cs.select(q, k, v, lengths, 400, threads=1, portable=True)
    variants = [{"threads": 2}, {"threads": 3, "portable": True}, {"threads": 2, "_score_budget": 1},
                {"prefetch": 2}, {"prefetch": 1, "prefetch_l2": True}]
    forms = AVX_FORMS + (["amx"] if AMX["active"] else []) or ["auto"]
    for form in forms:
        for kw in variants:
            other = cs.select(q, k, v, lengths, 400, dot_form=form, **kw)
            assert torch.equal(other.topk_idx, base.topk_idx), (form, kw)
            assert torch.equal(other.lse, base.lse), (form, kw)
            torch.testing.assert_close(other.out, base.out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("portable", PATHS, ids=lambda p: "portable" if p else "native")
def test_long_prefix_split_and_small_waves(portable):
    """A prefix split into many units, scores held in several waves, a peaked distribution."""
    q, k, v = _data(2, 2, 20011, 64, 2, 1, seed=7, spread=3.0)
    lengths = [20011, 12345]
    ref = select_ref(q, k, v, lengths, 1000)
    res = cs.select(q, k, v, lengths, 1000, portable=portable, _score_budget=40000)
    _check(res, ref, q, k, lengths, 1000)


@pytest.mark.parametrize("portable", PATHS, ids=lambda p: "portable" if p else "native")
def test_per_request_k_and_rank_lengths(portable):
    """Each request its own k, ranking only the first rank_lengths[b] positions while all lengths[b] count in the
    softmax (HERALD's scan: the draft block normalises, the prefix is ranked): the reference's positions, -1 past
    k_b; out and lse as without a rank length."""
    B, KVH, S, D, G = 4, 2, 3000, 128, 4
    q, k, v = _data(B, KVH, S, D, G, 1, seed=11)
    lengths, ranks, ks = [3000, 2500, 64, 900], [2968, 2500, 32, 0], [150, 2600, 40, 7]
    res = cs.select(q, k, v, lengths, torch.tensor(ks), rank_lengths=ranks, portable=portable)
    ref = select_ref(q, k, v, lengths, ks, rank_lengths=ranks)
    plain = cs.select(q, k, v, lengths, None, portable=portable)
    assert res.topk_idx.shape == (B, KVH, max(ks))
    assert torch.equal(res.lse, plain.lse) and torch.equal(res.out, plain.out)
    imps = importance_ref(q, k, lengths)
    for b in range(B):
        _check_topk(res.topk_idx[b : b + 1], ref.topk_idx[b : b + 1], [imps[b][:, : ranks[b]]], [ranks[b]], ks[b])
    assert torch.equal(res.topk_idx[1, :, :2500], torch.arange(2500, dtype=torch.int32).expand(KVH, -1))
    assert bool((res.topk_idx[3] == -1).all())  # nothing to rank
    _bad(ValueError, "rank_lengths must not exceed lengths", cs.select, q, k, v, lengths, 5,
         rank_lengths=[3001, 0, 0, 0])
    _bad(ValueError, "topk must have B=4", cs.select, q, k, v, lengths, [1, 2])


@pytest.mark.parametrize("portable", PATHS, ids=lambda p: "portable" if p else "native")
def test_exact_ties_prefer_lower_positions(portable):
    g = torch.Generator().manual_seed(3)
    B, KVH, S, D = 1, 2, 700, 64
    k = torch.randint(-1, 2, (B, KVH, S, D), generator=g).to(torch.bfloat16)  # integer scores: exact ties
    k[:, 1] = 1.0  # head 1: every position identical
    q = torch.randint(-1, 2, (B, KVH * 2, 2, D), generator=g).to(torch.bfloat16)
    res = cs.select(q, k, None, [S], 100, want_output=False, portable=portable, scale=0.125)
    ref = select_ref(q, k, None, [S], 100, want_output=False, scale=0.125)
    assert torch.equal(res.topk_idx, ref.topk_idx)
    assert torch.equal(res.topk_idx[0, 1], torch.arange(100, dtype=torch.int32))


def test_modes_and_strided_pool():
    """Selection only (no V), output only, lse only; a pool view [slot, S, KVH, D] permuted."""
    B, KVH, S, D, G = 3, 2, 900, 128, 4
    pool_k = torch.randn(5, S, KVH, D).to(torch.bfloat16)
    pool_v = torch.randn(5, S, KVH, D).to(torch.bfloat16)
    k = pool_k[1:4].permute(0, 2, 1, 3)  # [B, KVH, S, D], position stride KVH*D
    v = pool_v[1:4].permute(0, 2, 1, 3)
    q = torch.randn(B, 4, KVH * G, D).to(torch.bfloat16).transpose(1, 2)  # non-contiguous q
    lengths = torch.tensor([900, 451, 3], dtype=torch.int32)
    ref = select_ref(q, k.contiguous(), v.contiguous(), lengths.tolist(), 64)
    sel = cs.select(q, k, None, lengths, 64, want_output=False)
    assert sel.out is None
    _check(sel, ref, q, k.contiguous(), lengths.tolist(), 64)
    both = cs.select(q, k, v, lengths, 64)
    assert torch.equal(both.topk_idx, sel.topk_idx) and torch.equal(both.lse, sel.lse)
    out_only = cs.select(q, k, v, lengths, None)
    assert out_only.topk_idx is None
    torch.testing.assert_close(out_only.out, ref.out, rtol=1e-4, atol=2e-5)
    lse_only = cs.select(q, k, None, lengths, None, want_output=False)
    assert torch.equal(lse_only.lse, sel.lse)
    q32 = q.float()  # float32 queries are rounded to bf16
    assert torch.equal(cs.select(q32, k, None, lengths, 64, want_output=False).topk_idx, sel.topk_idx)


@pytest.mark.parametrize("portable", PATHS, ids=lambda p: "portable" if p else "native")
def test_gather_byte_exact(portable):
    B, KVH, S, D = 3, 2, 500, 128
    pool_k = torch.randn(B, S, KVH, D).to(torch.bfloat16)
    k = pool_k.permute(0, 2, 1, 3)
    v = torch.randn(B, KVH, S, D).to(torch.bfloat16)
    q = torch.randn(B, KVH * 4, 1, D).to(torch.bfloat16)
    idx = cs.select(q, k, None, [500, 300, 10], 37, want_output=False).topk_idx  # includes -1 rows
    assert (idx == -1).any()
    got = cs.gather(k, v, idx, portable=portable, pin_memory=False)
    assert torch.equal(got.view(torch.int16), gather_ref(k, v, idx).view(torch.int16))
    out = torch.full_like(got, 7.0)
    assert cs.gather(k, v, idx, out=out, portable=portable) is out
    assert torch.equal(out.view(torch.int16), got.view(torch.int16))
    for unaligned in (torch.empty(got.numel() + 1, dtype=torch.bfloat16)[1:].view(got.shape),):
        cs.gather(k, v, idx, out=unaligned, portable=portable)
        assert torch.equal(unaligned.view(torch.int16), got.view(torch.int16))


@pytest.mark.parametrize("portable", PATHS, ids=lambda p: "portable" if p else "native")
def test_rows_read_pool_entries_without_a_copy(portable):
    """select and gather with `rows` (one call over entries of a stacked [layers * slots] pool, any order, repeats)
    == the same calls on the entries copied out: bitwise, per-request k and rank lengths included."""
    L, slots, KVH, S, D, G = 3, 4, 2, 300, 64, 4
    g = torch.Generator().manual_seed(5)
    pool_k = torch.randn(L, slots, KVH, S, D, generator=g).to(torch.bfloat16)
    pool_v = torch.randn(L, slots, KVH, S, D, generator=g).to(torch.bfloat16)
    rows = torch.tensor([1 * slots + 2, 0 * slots + 3, 2 * slots + 2, 1 * slots + 2, 5])
    B = rows.numel()
    q = torch.randn(B, KVH * G, 1, D, generator=g).to(torch.bfloat16)
    lengths, ranks, keep = [300, 17, 250, 120, 0], [290, 17, 200, 100, 0], [30, 20, 5, 12, 0]
    flat_k, flat_v = pool_k.view(L * slots, KVH, S, D), pool_v.view(L * slots, KVH, S, D)
    copy_k, copy_v = flat_k[rows].contiguous(), flat_v[rows].contiguous()
    kw = dict(rank_lengths=ranks, portable=portable)
    got = cs.select(q, flat_k, flat_v, lengths, keep, rows=rows, **kw)
    want = cs.select(q, copy_k, copy_v, lengths, keep, **kw)
    for a, b in zip((got.topk_idx, got.out, got.lse), (want.topk_idx, want.out, want.lse)):
        assert torch.equal(a, b)
    staged = cs.gather(flat_k, flat_v, got.topk_idx, rows=rows, portable=portable, pin_memory=False)
    assert torch.equal(staged.view(torch.int16), gather_ref(copy_k, copy_v, want.topk_idx).view(torch.int16))
    values = cs.gather(None, flat_v, got.topk_idx, rows=rows, portable=portable, pin_memory=False)  # V alone
    assert values.shape[0] == 1 and torch.equal(values.view(torch.int16), staged[1:].view(torch.int16))
    _bad(ValueError, "rows must lie in", cs.select, q, flat_k, None, lengths, keep, want_output=False,
         rows=rows + L * slots)
    _bad(ValueError, "q must be", cs.select, q[:2], flat_k, None, lengths[:2], keep[:2], want_output=False, rows=rows)


def test_read_probe():
    buf = torch.arange(1 << 16, dtype=torch.int64)
    assert cs.read_probe(buf) == int(buf.sum())


def _bad(exc, match, fn, *args, **kw):
    with pytest.raises(exc, match=match):
        fn(*args, **kw)


def test_bad_arguments():
    q, k, v = _data(1, 2, 64, 64, 2, 1)
    L = [64]
    _bad(TypeError, "k_cache must be bfloat16", cs.select, q, k.float(), v, L, 4)
    _bad(TypeError, "k_cache must be a torch.Tensor", cs.select, q, k.numpy, v, L, 4)
    _bad(ValueError, "k_cache must be 4-D", cs.select, q, k[0], v, L, 4)
    _bad(ValueError, "v_cache is required", cs.select, q, k, None, L, 4)
    _bad(ValueError, "v_cache must have shape", cs.select, q, k, v[:, :1], L, 4)
    _bad(ValueError, "k_cache must be contiguous in its last dim", cs.select, q, k.transpose(2, 3), v, L, 4)
    _bad(ValueError, "head_dim must be a multiple of 32", cs.select, q[..., :48], k[..., :48], v[..., :48], L, 4)
    _bad(TypeError, "q must be bfloat16 or float32", cs.select, q.half(), k, v, L, 4)
    _bad(ValueError, "q heads", cs.select, q[:, :3], k, v, L, 4)
    _bad(ValueError, "1 <= G <= 8", cs.select, q.repeat(1, 9, 1, 1), k, v, L, 4)
    _bad(ValueError, "1..64 query tokens", cs.select, q.repeat(1, 1, 65, 1), k, v, L, 4)
    _bad(ValueError, "lengths must lie in", cs.select, q, k, v, [65], 4)
    _bad(ValueError, "lengths must have B=1", cs.select, q, k, v, [3, 4], 4)
    _bad(TypeError, "lengths must be an integer tensor", cs.select, q, k, v, torch.tensor([3.0]), 4)
    _bad(ValueError, "topk must be an int", cs.select, q, k, v, L, -1)
    _bad(ValueError, "scale must be a positive", cs.select, q, k, v, L, 4, scale=0.0)
    _bad(ValueError, "threads must be an int", cs.select, q, k, v, L, 4, threads=-2)
    _bad(ValueError, "nothing requested", cs.select, q, k, v, L, None, want_output=False, want_lse=False)
    idx = torch.zeros(1, 2, 4, dtype=torch.int32)
    _bad(TypeError, "topk_idx must be int32", cs.gather, k, v, idx.long())
    _bad(ValueError, "topk_idx must be a CPU tensor", cs.gather, k, v, idx[:, :1])
    _bad(ValueError, "topk_idx holds position 64", cs.gather, k, v, idx + 64)
    _bad(ValueError, "out must be a contiguous", cs.gather, k, v, idx, out=torch.empty(3))


def test_many_rows_default_waves_agree_bitwise():
    """128 rows per kv head: the default score wave (about L2 per thread) holds one item at 1 thread
    and two at 3; waves, thread counts and paths must not change any bit of idx or lse."""
    q, k, v = _data(1, 3, 5000, 128, 4, 32, seed=11)
    lengths = [5000]
    base = cs.select(q, k, v, lengths, 250, threads=1, portable=True)
    _check(base, select_ref(q, k, v, lengths, 250), q, k, lengths, 250)
    for kw in ({"threads": 1}, {"threads": 2}, {"threads": 3}, {"threads": 3, "_score_budget": 1}):
        other = cs.select(q, k, v, lengths, 250, **kw)
        assert torch.equal(other.topk_idx, base.topk_idx), kw
        assert torch.equal(other.lse, base.lse), kw


def _chain_order(k, q, c):
    """The many-row contract in torch: one float32 chain over the dim pairs, even element first."""
    kf, qf = k.float(), q.float()
    acc = torch.zeros(q.shape[0], k.shape[0])
    for d in range(0, k.shape[1], 2):  # separate mul and add: products of bf16 values are exact
        acc = acc + qf[:, d, None] * kf[None, :, d]
        acc = acc + qf[:, d + 1, None] * kf[None, :, d + 1]
    return acc * c


def _lane_order(k, q, c):
    """The few-row contract in torch: lane l sums pairs (32c + 2l, +1) odd first, then a fixed tree."""
    n, D = k.shape
    kf, qf = k.float().view(n, D // 32, 16, 2), q.float().view(q.shape[0], D // 32, 16, 2)
    a = torch.zeros(q.shape[0], n, 16)
    for ch in range(D // 32):
        a = a + qf[:, None, ch, :, 1] * kf[None, :, ch, :, 1]
        a = a + qf[:, None, ch, :, 0] * kf[None, :, ch, :, 0]
    g = [(a[..., 4 * L] + a[..., 4 * L + 2]) + (a[..., 4 * L + 1] + a[..., 4 * L + 3]) for L in range(4)]
    return ((g[0] + g[1]) + (g[2] + g[3])) * c


def _bits(x):
    return x.contiguous().view(torch.int32)


@pytest.mark.parametrize("form", ["portable"] + AVX_FORMS + (["amx"] if AMX["active"] else []))
@pytest.mark.parametrize("R,D,n", [(16, 64, 16), (20, 128, 7), (128, 128, 16), (33, 256, 16), (3, 128, 16),
                                   (15, 64, 9)])
def test_scores_follow_the_contract_order(form, R, D, n):
    """Every form's scores, bit for bit, against a torch emulation of the contract's add order (the
    chain for R >= 16 rows, the lane tree below), with magnitudes spread over many binades."""
    if form == "amx" and R < 16:
        pytest.skip("AMX scores many-row tiles only")
    g = torch.Generator().manual_seed(R * D + n)
    spread = lambda *shape: (torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 13, shape, generator=g)))
    pool = spread(3 * n, D).to(torch.bfloat16)
    k, q = pool[::3], spread(R, D).to(torch.bfloat16)  # keys with a row stride of 3 * D
    c = 0.0883883 * 1.4426950
    got = cs._score_tile(k, q, c, form)[:, :n]
    want = (_chain_order if R >= 16 else _lane_order)(k, q, c)
    assert torch.equal(_bits(got), _bits(want)), (form, int((_bits(got) != _bits(want)).sum()))


def test_amx_status_is_consistent():
    """Where AMX is not active, forcing it fails with the reason, and auto does not pick it."""
    f = cs.cpu_features()
    assert {"amx_bf16", "amx_os", "amx_active", "amx_reason"} <= f.keys()
    if f["amx_active"]:
        assert f["amx_reason"] == "" and f["amx_selfcheck"].startswith("passed")
        assert f["dot_many_rows"] == "amx"
        return
    assert f["amx_reason"]
    if cs.isa() == "avx512bf16":
        assert f["dot_many_rows"] in ("fma", "vdpbf16ps")
    with pytest.raises(RuntimeError, match="AMX is not active"):
        cs.cpu_features(dot_form="amx")


def test_amx_inexact_is_an_explicit_opt_in():
    """'amx_inexact' (AMX tiles whatever the self-check found) is never the auto choice, and where the tiles
    are missing forcing it fails with the reason instead of silently scoring another way."""
    if AMX["cpu"] and AMX.get("os"):
        assert cs.cpu_features(dot_form="amx_inexact")["dot_many_rows"] == "amx"
        assert cs.cpu_features()["dot_many_rows"] == ("amx" if AMX["active"] else cs.cpu_features()["dot"])
    else:
        with pytest.raises(RuntimeError, match="AMX tiles are not available"):
            cs.cpu_features(dot_form="amx_inexact")
    with pytest.raises(ValueError, match="amx_inexact"):
        cs.cpu_features(dot_form="amx-approx")


def test_amx_selfcheck_gives_a_verdict_where_amx_exists():
    """On a CPU with AMX-BF16 whose OS grants the tiles the self-check must have run: AMX is then either
    active (bit-identical) or off with the measured mismatch as the reason. The H200 host's CPU is the
    second case (TDPBF16PS does not round pair by pair as Intel's pseudocode reads; docs/results/selection.md)."""
    if not (AMX["cpu"] and AMX.get("os")):
        pytest.skip(f"no usable AMX-BF16 here: {AMX['reason']}")
    assert AMX["active"] or AMX["reason"].startswith("self-check failed"), AMX["reason"]


@needs_amx
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G,n_q,lengths", [(4, 32, [4099, 1]), (4, 32, [777, 4096, 16]), (3, 7, [1001, 2050])])
def test_amx_matches_other_forms_bitwise(D, G, n_q, lengths):
    """select() with AMX against FMA, VDPBF16PS and portable (128 or 21 rows per KV head, tails of
    partial tiles): idx and lse identical, out identical across the AVX-512 forms (the same p @ V)
    and close to portable's."""
    q, k, v = _data(len(lengths), 2, max(lengths), D, G, n_q, seed=D + len(lengths))
    topk = 205
    amx = cs.select(q, k, v, lengths, topk, dot_form="amx")
    assert cs.cpu_features(dot_form="amx")["dot_many_rows"] == "amx"
    for form in AVX_FORMS:
        other = cs.select(q, k, v, lengths, topk, dot_form=form)
        assert torch.equal(other.topk_idx, amx.topk_idx), form
        assert torch.equal(_bits(other.lse), _bits(amx.lse)), form
        assert torch.equal(_bits(other.out), _bits(amx.out)), form
    port = cs.select(q, k, v, lengths, topk, portable=True)
    assert torch.equal(port.topk_idx, amx.topk_idx) and torch.equal(_bits(port.lse), _bits(amx.lse))
    torch.testing.assert_close(port.out, amx.out, rtol=1e-5, atol=1e-6)


def test_amx_code_under_emulation(tmp_path):
    """ext/amx_score.h and ext/amx_selfcheck.h with the tile instructions replaced by a software
    model of Intel's pseudocode (ext/check/amx_emulation.cpp): row blocks, padding and tails give the
    contract's bits, and the self-check rejects a model that sums each pair before adding it."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or cs.isa() != "avx512bf16":
        pytest.skip("needs a C++ compiler and an AVX-512-BF16 CPU (the code scales scores with AVX-512)")
    ext = Path(__file__).resolve().parents[2] / "ext"
    exe = tmp_path / "amx_emulation"
    subprocess.run([cxx, "-std=c++17", "-O1", "-fopenmp", "-ffp-contract=off", "-mavx512f", "-mavx512bw",
                    "-mavx512dq", "-mavx512vl", "-mavx512bf16", f"-I{ext}", str(ext / "check" / "amx_emulation.cpp"),
                    "-o", str(exe)], check=True, timeout=300)
    ok = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=120).stdout
    assert "selfcheck: passed: 7168 of 7168" in ok, ok
    assert "layout: 0 of " in ok, ok
    bad = subprocess.run([str(exe), "pair-sum"], capture_output=True, text=True, check=True, timeout=120).stdout
    assert "selfcheck: failed" in bad and "pair-sum-first matches" in bad, bad
    assert "layout: 0 of " not in bad, bad


def test_dot_form_is_each_calls_argument_not_a_setting():
    """select(..., dot_form=F) scores with F for that call only: a later call without it takes 'auto' again, and
    cpu_features(dot_form=F) names the forms F gives."""
    assert not hasattr(cs, "set_dot_form")
    auto = cs.cpu_features()
    q, k, v = _data(1, 2, 300, 64, 4, 5, seed=3)
    base = cs.select(q, k, v, [300], 20)
    for form in AVX_FORMS:
        assert cs.cpu_features(dot_form=form)["dot"] == form
        other = cs.select(q, k, v, [300], 20, dot_form=form)
        assert torch.equal(other.topk_idx, base.topk_idx) and torch.equal(other.lse, base.lse)
        assert cs.cpu_features() == auto
    with pytest.raises(ValueError, match="amx_inexact"):
        cs.select(q, k, v, [300], 20, dot_form="amx-approx")
    assert cs.cpu_features() == auto
