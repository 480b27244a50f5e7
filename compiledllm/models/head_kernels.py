"""Triton kernels of the row-selective head (contract in head.py); imported only where Triton is."""
import triton
import triton.language as tl


@triton.jit
def compact_rows_kernel(need_ptr, ids_ptr, count_ptr, T, T_P2: tl.constexpr):
    """One program: ids[0:count] = the indices i with need[i], in increasing order; count = their number."""
    i = tl.arange(0, T_P2)
    need = tl.load(need_ptr + i, mask=i < T, other=0).to(tl.int32)
    rank = tl.cumsum(need, axis=0) - 1
    tl.store(ids_ptr + rank, i, mask=need > 0)
    tl.store(count_ptr, tl.sum(need, axis=0))


@triton.jit
def head_rows_kernel(h_ptr, w_ptr, out_ptr, ids_ptr, count_ptr, V, D: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, EVEN_N: tl.constexpr):
    """out[ids[r], n] = h[ids[r]] . w[n] for r < count. Axis 0 (row tiles) is the fastest-launched, so the row
    tiles that share an N tile run together and read its weights from HBM once; tiles past count return."""
    count = tl.load(count_ptr)
    if tl.program_id(0) * BM >= count:
        return
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    live = r < count
    row = tl.load(ids_ptr + r, mask=live, other=0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = h_ptr + row[:, None] * D + rk[None, :]
    b_ptrs = w_ptr + n.to(tl.int64)[None, :] * D + rk[:, None]  # [BK, BN] of w^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        a = tl.load(a_ptrs + k0, mask=live[:, None], other=0.0)
        if EVEN_N:
            b = tl.load(b_ptrs + k0)
        else:
            b = tl.load(b_ptrs + k0, mask=(n < V)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + row[:, None] * V + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (n < V)[None, :])
