"""Packed block-diffusion attention: each row's frozen KV prefix plus a window of W slots.

Contract (shared by the torch reference here and the CuPy kernel on CUDA):

    q        [B, Lq, H, D]     queries of each row's window (Lq = W * slot)
    k_cache  [B, S, KVH, D]    per-row KV cache; positions [0, prefix_len[b]) are valid
    v_cache  [B, S, KVH, D]
    prefix_len [B] int         o_b, the row's frozen prefix length (0 allowed)
    k_win    [B, Lq, KVH, D]   the window's own fresh K/V
    v_win    [B, Lq, KVH, D]
    slot     int               slot size bl; query i (slot i // bl) sees prefix [0, o_b)
                               and window positions j with j // bl <= i // bl
    scale    float             softmax scale (default D ** -0.5)

Returns out [B, Lq, H, D] in q's dtype, and with return_lse the log-sum-exp [B, H, Lq] (float32).
Query head h reads KV head h // (H // KVH) (GQA). Accumulation is float32.
"""
from __future__ import annotations

import functools
import importlib.util
import warnings

import torch

from compiledllm.attention import cupy_packed  # noqa: F401  (registers torch.ops.compiledllm.packed_attention)
from compiledllm.attention import triton_packed  # noqa: F401  (registers ...packed_attention_triton)
from compiledllm.attention.launch import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from compiledllm.triton_support import triton_on_cuda

# Whether the CuPy kernel can be used at all (the optional extra compiledllm[cupy-cuda13]).
HAS_CUPY = importlib.util.find_spec("cupy") is not None
# The kernels auto dispatch tries on CUDA, first usable wins: Triton's wgmma kernel first (faster than the
# CuPy mma.sync kernel at decode shapes on the H200, docs/results/attention.md), CuPy where Triton is missing.
CUDA_BACKENDS = ("triton", "cupy")
_REF_CHUNK_BYTES = 256 << 20  # float32 scores + K/V of one batch chunk in the reference


def window_slot_mask(q_len: int, slot: int, device: torch.device | None = None) -> torch.Tensor:
    """[Lq, Lq] bool: window query i may see window key j iff j // slot <= i // slot."""
    s = torch.arange(q_len, device=device) // slot
    return s[None, :] <= s[:, None]


def _ref_rows(q, k_cache, v_cache, prefix_len, k_win, v_win, seen_win, scale):
    """The reference on a chunk of batch rows: float32 scores against prefix and window, one softmax."""
    B, Lq, H, D = q.shape
    S, KVH = k_cache.shape[1], k_cache.shape[2]
    qf = q.float().view(B, Lq, KVH, H // KVH, D)
    s_pre = torch.einsum("bikgd,bjkd->bkgij", qf, k_cache.float())  # [B, KVH, G, Lq, S]
    s_win = torch.einsum("bikgd,bjkd->bkgij", qf, k_win.float())  # [B, KVH, G, Lq, Lq]
    seen_pre = torch.arange(S, device=q.device)[None, :] < prefix_len[:, None]  # [B, S]
    s_pre = s_pre.masked_fill(~seen_pre[:, None, None, None, :], float("-inf"))
    s_win = s_win.masked_fill(~seen_win, float("-inf"))
    scores = torch.cat([s_pre, s_win], dim=-1) * scale
    lse = torch.logsumexp(scores, dim=-1)  # [B, KVH, G, Lq]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bkgij,bjkd->bikgd", probs[..., :S], v_cache.float())
    out = out + torch.einsum("bkgij,bjkd->bikgd", probs[..., S:], v_win.float())
    return out.reshape(B, Lq, H, D), lse.reshape(B, H, Lq)


def packed_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    slot: int,
    scale: float | None = None,
    return_lse: bool = False,
):
    """The torch reference of the contract above (float32 math, explicit mask).

    Processes the batch in chunks so that its float32 scores and K/V copies stay near
    _REF_CHUNK_BYTES; no host synchronisation, so it also runs inside a CUDA graph.
    """
    B, Lq, H, D = q.shape
    S, KVH = k_cache.shape[1], k_cache.shape[2]
    scale = D ** -0.5 if scale is None else scale
    prefix_len = prefix_len.to(q.device)
    seen_win = window_slot_mask(Lq, slot, q.device)
    per_row = 4 * (H * Lq * (S + Lq) * 2 + 2 * (S + Lq) * KVH * D)
    step = max(1, _REF_CHUNK_BYTES // max(per_row, 1))
    outs, lses = [], []
    for b0 in range(0, B, step):
        rows = slice(b0, b0 + step)
        o, l = _ref_rows(q[rows], k_cache[rows], v_cache[rows], prefix_len[rows], k_win[rows], v_win[rows],
                         seen_win, scale)
        outs.append(o.to(q.dtype))
        lses.append(l)
    out = torch.cat(outs) if len(outs) != 1 else outs[0]
    if return_lse:
        return out, (torch.cat(lses) if len(lses) != 1 else lses[0])
    return out


@functools.cache
def _warn_no_kernel() -> None:
    warnings.warn(
        "compiledllm: CUDA tensors but neither Triton nor CuPy is installed (install compiledllm[cupy-cuda13]); "
        "using the slower torch reference for packed attention",
        RuntimeWarning,
        stacklevel=3,
    )


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernels (CuPy and Triton) cover these inputs (else the reference runs)."""
    return (
        q.is_cuda
        and q.dtype in SUPPORTED_DTYPES
        and q.shape[-1] in SUPPORTED_HEAD_DIMS
        and q.shape[2] % k_cache.shape[2] == 0
    )


def _auto_backend(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    if not q.is_cuda or not kernel_supports(q, k_cache):
        return "torch"
    usable = {"cupy": HAS_CUPY, "triton": triton_on_cuda()}
    for name in CUDA_BACKENDS:
        if usable[name]:
            return name
    if not any(usable.values()):  # none installed (an empty CUDA_BACKENDS is a choice: see export.aten_only)
        _warn_no_kernel()
    return "torch"


def packed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    slot: int,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Dispatch: a kernel on CUDA (CUDA_BACKENDS order, among those installed), the torch reference elsewhere.

    backend: None (auto), "cupy" or "triton" (force that kernel) or "torch" (force the reference).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend is None:
        backend = _auto_backend(q, k_cache)
    if backend in ("cupy", "triton"):
        op = torch.ops.compiledllm.packed_attention if backend == "cupy" else torch.ops.compiledllm.packed_attention_triton
        out, lse = op(q, k_cache, v_cache, prefix_len, k_win, v_win, slot, scale, return_lse)
        return (out, lse) if return_lse else out
    if backend != "torch":
        raise ValueError(f"unknown packed attention backend {backend!r} (use None, 'cupy', 'triton' or 'torch')")
    return packed_attention_ref(q, k_cache, v_cache, prefix_len, k_win, v_win, slot, scale, return_lse)
