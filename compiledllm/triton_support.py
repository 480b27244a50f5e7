"""Whether the Triton kernels can run here (Triton importable and a CUDA device): one check for all of them."""
from __future__ import annotations

import functools

import torch


@functools.cache
def _triton_on_cuda() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@torch.compiler.assume_constant_result  # a constant to torch.compile: not traced, no cache-wrapper warning
def triton_on_cuda() -> bool:
    return _triton_on_cuda()
