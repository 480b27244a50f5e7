"""Packed block-diffusion attention: each row's KV prefix plus the forward's own tokens, under a mask rule.

`run(args)` takes the one arguments type (launch.PackedArgs) and dispatches: a kernel on CUDA (CUDA_BACKENDS
order, among those installed and covering the rule / source / statistics asked for), the torch reference
(reference.py) elsewhere. `packed_attention(q, k_cache, v_cache, prefix_len, k_win, v_win, slot)` is the
block-causal form every decode step of a single window used before mask rules existed (kept: tests and tools
call it).

    q        [B, Lq, H, D]     queries of each row's window (Lq = W * slot)
    k_cache  [B, S, KVH, D]    per-row KV cache; positions [0, prefix_len[b]) are valid
    prefix_len [B] int         o_b, the row's frozen prefix length (0 allowed)
    k_win    [B, Lq, KVH, D]   the window's own fresh K/V
    slot     int               query i sees prefix [0, o_b) and window positions j with j // slot <= i // slot

Returns out [B, Lq, H, D] in q's dtype and with return_lse the log-sum-exp [B, H, Lq] (float32).
"""
from __future__ import annotations

import functools
import importlib.util
import warnings

import torch

from compiledllm.attention import cupy_packed  # noqa: F401  (registers torch.ops.compiledllm.packed_attention)
from compiledllm.attention import triton_packed  # noqa: F401  (registers ...packed_attention_triton)
from compiledllm.attention.launch import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, PackedArgs, kernel_rule_ok
from compiledllm.attention.reference import reference
from compiledllm.attention.spec import BlockCausal
from compiledllm.triton_support import triton_on_cuda

# Whether the CuPy kernel can be used at all (the optional extra compiledllm[cupy-cuda13]).
HAS_CUPY = importlib.util.find_spec("cupy") is not None
# The kernels auto dispatch tries on CUDA, first usable wins: Triton's wgmma kernel first (faster than the
# CuPy mma.sync kernel at decode shapes on the H200, docs/results/attention.md), CuPy where Triton is missing.
CUDA_BACKENDS = ("triton", "cupy")
BACKENDS = ("triton", "cupy", "torch")


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
        and q.shape[2] % k_cache.shape[-2] == 0
    )


def _covers(name: str, a: PackedArgs, stats: bool) -> bool:
    """What each kernel implements beyond the block-causal dense form."""
    if name == "triton":
        return True
    return not stats  # CuPy: every kernel rule and source, no statistics


def _auto_backend(a: PackedArgs, stats: bool) -> str:
    if not kernel_supports(a.q, a.k_cache) or not kernel_rule_ok(a):
        return "torch"
    usable = {"cupy": HAS_CUPY, "triton": triton_on_cuda()}
    for name in CUDA_BACKENDS:
        if usable[name] and _covers(name, a, stats):
            return name
    if not any(usable.values()):
        _warn_no_kernel()
    return "torch"


def run(a: PackedArgs, return_lse: bool = False, backend: str | None = None,
        mass_queries: torch.Tensor | None = None, mass_per_head: bool = False, mass_logits: bool = False):
    """(out, lse or None, mass or None); backend None (auto), "triton", "cupy" or "torch" (the reference). With
    mass_queries [B or 1, Q] bool the per-key attention mass of those queries: [B, S + Q] summed over heads, or
    with mass_per_head [B, KVH, S + Q] per KV head (the Triton kernel or the reference: CuPy has none); with
    mass_logits the keys' raw scaled scores summed instead ([B, S + Q], made in the attention's own pass)."""
    stats = mass_queries is not None
    if backend is None:
        backend = _auto_backend(a, stats) if a.q.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown packed attention backend {backend!r} (use None, 'cupy', 'triton' or 'torch')")
    if mass_logits and (not stats or mass_per_head or return_lse):
        raise ValueError("mass_logits: needs mass_queries and the summed form (no mass_per_head, no return_lse)")
    if backend == "torch":
        return reference(a, return_lse or stats, mass_queries, mass_per_head, mass_logits)
    slot, group, see = a.rule_tensors()
    if mass_logits:  # the Triton kernel's own pass (_covers: no other kernel makes statistics)
        out, score = torch.ops.compiledllm.packed_attention_scored(
            a.q, a.k_cache, a.v_cache, a.prefix_len, a.k_win, a.v_win, group, see, a.kv_index, slot,
            a.softmax_scale, mass_queries)
        return out, None, score
    op = torch.ops.compiledllm.packed_attention if backend == "cupy" else torch.ops.compiledllm.packed_attention_triton
    out, lse = op(a.q, a.k_cache, a.v_cache, a.prefix_len, a.k_win, a.v_win, group, see, a.kv_index, slot,
                  a.softmax_scale, return_lse or stats)
    mass = None
    if stats:
        mass = torch.ops.compiledllm.attention_mass(a.q, a.k_cache, a.prefix_len, a.k_win, group, see, a.kv_index,
                                                    slot, a.softmax_scale, lse, mass_queries, mass_per_head)
    return out, (lse if return_lse or stats else None), mass


def packed_attention_ref(q, k_cache, v_cache, prefix_len, k_win, v_win, slot: int, scale: float | None = None,
                         return_lse: bool = False):
    """The block-causal reference (float32 math): out, or (out, lse) with return_lse."""
    out, lse, _ = reference(PackedArgs(q, k_cache, v_cache, prefix_len.to(q.device), k_win, v_win,
                                       BlockCausal(slot), scale=scale), return_lse)
    return (out, lse) if return_lse else out


def packed_attention(q, k_cache, v_cache, prefix_len, k_win, v_win, slot: int, scale: float | None = None,
                     return_lse: bool = False, backend: str | None = None):
    """Block-causal packed attention through the dispatch: out, or (out, lse) with return_lse."""
    out, lse, _ = run(PackedArgs(q, k_cache, v_cache, prefix_len, k_win, v_win, BlockCausal(slot), scale=scale),
                      return_lse, backend)
    return (out, lse) if return_lse else out
