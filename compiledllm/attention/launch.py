"""What both packed-attention kernels (CuPy/CUDA and Triton) share at launch: input checks, the split-K
(flash-decoding) split count, the split-K workspace and the ops' fake (shape-only) outputs."""
from __future__ import annotations

import functools
import math

import torch

_MAX_SPLITS = 64
_MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs outweigh the parallelism it adds
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128)


def check_inputs(q, k_cache, v_cache, prefix_len, k_win, v_win) -> None:
    B, Lq, H, D = q.shape
    if q.dtype not in SUPPORTED_DTYPES or D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"packed attention kernel: dtype {q.dtype} / head dim {D} not supported")
    kc, kw = k_cache.shape, k_win.shape
    if kc != v_cache.shape or kw != v_win.shape or kc[0] != B or kc[3] != D or kw != (B, Lq, kc[2], D) or H % kc[2]:
        raise ValueError(f"packed attention kernel: bad K/V shapes {tuple(kc)} / {tuple(kw)} for q {tuple(q.shape)}")
    if any(t.dtype != q.dtype for t in (k_cache, v_cache, k_win, v_win)):
        raise ValueError("packed attention kernel: q, caches and window K/V must share one dtype")
    if prefix_len.shape != (B,) or prefix_len.dtype not in (torch.int32, torch.int64):
        raise ValueError("packed attention kernel: prefix_len must be an int32/int64 tensor of shape [B]")


@functools.lru_cache(maxsize=1024)
def num_splits(n_ctas: int, cache_len: int, slots: int) -> int:
    """Flash-decoding split count: fill the GPU's CTA slots, each split keeping >= _MIN_KEYS_PER_SPLIT."""
    max_splits = max(1, min(_MAX_SPLITS, cache_len // _MIN_KEYS_PER_SPLIT))
    if n_ctas >= slots or max_splits == 1:
        return 1
    eff = [n_ctas * s / slots / math.ceil(n_ctas * s / slots) for s in range(1, max_splits + 1)]
    best = max(eff)
    return next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * best)


class Workspace:
    """Per-device fp32 split-K partials; grows on demand, so steady-state calls allocate nothing."""

    buffers: dict = {}  # device index -> flat float32 tensor (the only state besides the kernel cache)

    @classmethod
    def get(cls, device: torch.device, numel: int) -> torch.Tensor:
        buf = cls.buffers.get(device.index)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float32, device=device)
            cls.buffers[device.index] = buf
        return buf[:numel]


def fake_outputs(q: torch.Tensor, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops' outputs for tracing: out like q, lse [B, H, Lq] float32 (empty without return_lse)."""
    B, Lq, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, Lq) if return_lse else (0,), dtype=torch.float32)
