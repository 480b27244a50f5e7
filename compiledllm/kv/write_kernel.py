"""Triton kernel of kv_write (contract in cache.py); imported only where Triton is."""
import triton
import triton.language as tl


@triton.jit
def kv_write_kernel(k_cache_ptr, v_cache_ptr, pos_ptr, k_ptr, v_ptr, L, stride_b, stride_s, stride_kvb, stride_kvl,
                    ROW: tl.constexpr, ROW_P2: tl.constexpr):
    """One program per (row b, window position l): K and V's [KVH * D] at cache position positions[b, l]. The cache
    views' (KVH, D) dims and the fresh k/v's are contiguous; batch and position strides are arguments."""
    b = tl.program_id(0) // L
    l = tl.program_id(0) % L
    pos = tl.load(pos_ptr + b * L + l).to(tl.int64)
    i = tl.arange(0, ROW_P2)
    live = i < ROW
    src = b.to(tl.int64) * stride_kvb + l * stride_kvl + i
    dst = b.to(tl.int64) * stride_b + pos * stride_s + i
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=live), mask=live)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=live), mask=live)
