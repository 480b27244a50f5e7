"""Flash-Cache's fused KV-cache kernel (Flash-dLLM §3.1): the QKV projection, RoPE and the cache write in one Triton
kernel. Each program computes one head's D columns for BLOCK_M tokens as two halves (the dims RoPE pairs), rotates
q and k in registers and stores q, k, v once, k and v also straight into the layer's pool rows, so the projection's
output, RoPE's float32 temporaries and the separate cache write never go through HBM.

Scope: full rotary (rotary_dim == head_dim), no per-head q/k norm (LLaDA-8B / 1.5, the bidirectional models Flash-dLLM
targets), head_dim 32..256 (a power of two), a pooled KV layout (kv/pooled.PoolView). Elsewhere `project_write` takes
the separate path in the same order (projection, RoPE, the write, then the attention), so a forward that asks for the
fused cache gives the same tokens on every device.
"""
from __future__ import annotations

import torch

from compiledllm.kv.pooled import PoolView, pool_index

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: project_write takes the separate path
    triton = None


def supports(attn, rotary, x: torch.Tensor, kv_layer) -> bool:
    """Whether the Triton kernel runs this layer's projection: CUDA, Triton, full rotary, no q/k norm, a pooled
    layout."""
    D = attn.hd
    return (triton is not None and x.is_cuda and isinstance(kv_layer, PoolView) and kv_layer.k.is_contiguous()
            and kv_layer.v.is_contiguous() and attn.q_norm is None
            and rotary.rotary_dim == D and 32 <= D <= 256 and D & (D - 1) == 0 and attn.parallel is None
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def project_write(attn, rotary, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer,
                  kv_write: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, L, hidden] -> q [B, L, H, D], k, v [B, L, KVH, D] (as Attention.project), with k and v already written
    into kv_layer at kv_write [B, L] (-1: not written; None: nothing written): the fused kernel where `supports`,
    else the separate path in the same order."""
    if kv_write is None or kv_layer is None or not supports(attn, rotary, x, kv_layer):
        q, k, v = attn.project(x, rotary, cos, sin)
        if kv_write is not None and kv_layer is not None:
            kv_layer.write(kv_write, k, v)
        return q, k, v
    rows = pool_index(torch.where(kv_write < 0, kv_layer.capacity, kv_write), kv_layer.capacity)
    return qkv_rope_write_op(x, attn.qkv.weight, cos, sin, attn.h, attn.kvh, rows, kv_layer.k, kv_layer.v)


@torch.library.custom_op("compiledllm::qkv_rope_write", mutates_args=("k_pool", "v_pool"), device_types="cuda")
def qkv_rope_write_op(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, KVH: int,
                      rows: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_qkv_rope_write as one op that compiled and captured steps keep whole (it writes the pools)."""
    return fused_qkv_rope_write(x, w, cos, sin, H, KVH, rows, k_pool, v_pool)


@qkv_rope_write_op.register_fake
def _(x, w, cos, sin, H, KVH, rows, k_pool, v_pool):
    B, L, _ = x.shape
    D = w.shape[0] // (H + 2 * KVH)
    return x.new_empty(B, L, H, D), x.new_empty(B, L, KVH, D), x.new_empty(B, L, KVH, D)


def fused_qkv_rope_write(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, KVH: int,
                         rows: torch.Tensor | None = None, k_pool: torch.Tensor | None = None,
                         v_pool: torch.Tensor | None = None, block_m: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, L, K], w [(H + 2 KVH) * D, K] (nn.Linear's weight), cos / sin [B, L, D] float32 -> q [B, L, H, D], k, v
    [B, L, KVH, D] in x's dtype, q and k rotated (NeoX rotate-half); with rows [B, L] (pool rows) k and v are also
    stored at k_pool / v_pool [N, KVH, D][rows]. The GEMM's output is rounded to x's dtype before RoPE reads it, as the
    separate path's is."""
    B, L, K = x.shape
    D = w.shape[0] // (H + 2 * KVH)
    T = B * L
    xf = x.reshape(T, K)
    if xf.stride(1) != 1:
        xf = xf.contiguous()
    q = torch.empty(B, L, H, D, dtype=x.dtype, device=x.device)  # contiguous: token t's head h at (t * H + h) * D
    k = torch.empty(B, L, KVH, D, dtype=x.dtype, device=x.device)
    v = torch.empty(B, L, KVH, D, dtype=x.dtype, device=x.device)
    write = rows is not None
    rows_ = rows.reshape(T).contiguous() if write else q  # any pointer when nothing is written
    kp, vp = (k_pool, v_pool) if write else (k, v)
    BM = block_m or (16 if T <= 16 else 32 if T <= 256 else 64)
    BK = 64 if K % 64 == 0 or K > 64 else max(16, triton.next_power_of_2(K))
    grid = (triton.cdiv(T, BM) * (H + 2 * KVH),)
    _qkv_rope_write[grid](
        xf, w, cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous(), q, k, v, kp, vp, rows_,
        T, K, xf.stride(0), w.stride(0), H=H, KVH=KVH, D=D, WRITE=write, IEEE=x.dtype == torch.float32,
        BLOCK_M=BM, BLOCK_K=BK, GROUP_M=8)
    return q, k, v  # (not views: a custom op's outputs are fresh tensors)


if triton is not None:
    @triton.jit
    def _store_halves(base, o1, o2, offs_h, in_m, HALF: tl.constexpr):
        """A head's two halves (the dims RoPE pairs) into its D columns at base ([BLOCK_M, 1] row pointers)."""
        tl.store(base + offs_h[None, :], o1, mask=in_m[:, None])
        tl.store(base + HALF + offs_h[None, :], o2, mask=in_m[:, None])

    @triton.jit
    def _qkv_rope_write(x_ptr, w_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, rows_ptr,
                        T, K, stride_x, stride_w,
                        H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, WRITE: tl.constexpr,
                        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        HALF: tl.constexpr = D // 2
        HEADS: tl.constexpr = H + 2 * KVH  # q heads [0, H), then k heads, then v heads
        # programs in groups of GROUP_M token tiles x every head, token tile fastest: the programs running at once
        # share a band of x and a few heads' weights in L2 (a whole token range per head would re-read x per head)
        pid = tl.program_id(0)
        tiles = tl.cdiv(T, BLOCK_M)
        group = pid // (GROUP_M * HEADS)
        first = group * GROUP_M
        size = tl.minimum(tiles - first, GROUP_M)
        pid_m = first + (pid % (GROUP_M * HEADS)) % size
        head = (pid % (GROUP_M * HEADS)) // size
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_h = tl.arange(0, HALF)
        offs_k = tl.arange(0, BLOCK_K)
        in_m = offs_m < T
        n1 = head * D + offs_h  # the head's first half of columns; the second half is n1 + HALF
        acc1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            in_k = kk < K
            xt = tl.load(x_ptr + offs_m[:, None] * stride_x + kk[None, :], mask=in_m[:, None] & in_k[None, :],
                         other=0.0)
            w1 = tl.load(w_ptr + n1[None, :] * stride_w + kk[:, None], mask=in_k[:, None], other=0.0)
            w2 = tl.load(w_ptr + (n1 + HALF)[None, :] * stride_w + kk[:, None], mask=in_k[:, None], other=0.0)
            if IEEE:  # float32: no TF32, as F.linear in float32
                acc1 += tl.dot(xt, w1, input_precision="ieee")
                acc2 += tl.dot(xt, w2, input_precision="ieee")
            else:
                acc1 += tl.dot(xt, w1)
                acc2 += tl.dot(xt, w2)
        out_ty = q_ptr.dtype.element_ty
        a1 = acc1.to(out_ty).to(tl.float32)  # the projection's output as the separate path stores it
        a2 = acc2.to(out_ty).to(tl.float32)
        if head < H + KVH:  # q and k: rotate-half RoPE (cos / sin repeat over the two halves)
            c = tl.load(cos_ptr + offs_m[:, None] * D + offs_h[None, :], mask=in_m[:, None], other=0.0)
            s = tl.load(sin_ptr + offs_m[:, None] * D + offs_h[None, :], mask=in_m[:, None], other=0.0)
            o1 = a1 * c - a2 * s
            o2 = a2 * c + a1 * s
        else:
            o1 = a1
            o2 = a2
        o1 = o1.to(out_ty)
        o2 = o2.to(out_ty)
        if head < H:
            base = q_ptr + offs_m[:, None] * (H * D) + head * D
        elif head < H + KVH:
            base = k_ptr + offs_m[:, None] * (KVH * D) + (head - H) * D
        else:
            base = v_ptr + offs_m[:, None] * (KVH * D) + (head - H - KVH) * D
        _store_halves(base, o1, o2, offs_h, in_m, HALF)
        if WRITE:
            if head >= H:  # k and v also into the pool rows (the spare row for a position not written)
                r = tl.load(rows_ptr + offs_m, mask=in_m, other=0)
                if head < H + KVH:
                    dst = kp_ptr + r[:, None] * (KVH * D) + (head - H) * D
                else:
                    dst = vp_ptr + r[:, None] * (KVH * D) + (head - H - KVH) * D
                _store_halves(dst, o1, o2, offs_h, in_m, HALF)
