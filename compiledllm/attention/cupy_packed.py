"""The packed-attention CUDA kernel (kernels/packed_attention.cu) through CuPy/NVRTC, as a torch op.

`torch.ops.compiledllm.packed_attention(q, k_cache, v_cache, prefix_len, k_win, v_win, group, see, kv_index,
slot, scale, return_lse) -> (out, lse)` takes the kernels' form of launch.PackedArgs, as the Triton op does
(slot > 0: BlockCausal(slot); slot 0: QueryGroups(group, see); kv_index: a paged source). The kernel is
compiled at first use per (device, dtype, head dim, tile, rule, source) and launched on torch's current stream
with raw pointers: a call does no host synchronisation and no cudaMalloc (split-K scratch comes from torch's
allocator, launch.split_scratch), so it can be captured in a CUDA graph. CuPy is imported lazily: importing
this module (and registering the op) works without it. No attention-mass kernel here (packed.py asks Triton).
"""
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compiledllm.attention.launch import (PackedArgs, check_inputs, fake_outputs, kernel_rule, num_splits, op_args,
                                         split_scratch)

_SOURCE = Path(__file__).with_name("kernels") / "packed_attention.cu"


@dataclass(frozen=True)
class Tile:
    """A compile-time kernel configuration: a CTA of `nwarps` warps owns nwarps*16*mtiles query rows."""

    nwarps: int = 4
    mtiles: int = 1
    block_n: int = 64
    stages: int = 2
    qregs: bool = True  # keep Q fragments in registers (else re-read from shared memory)
    minblocks: int = 2  # __launch_bounds__ occupancy hint (caps registers)

    @property
    def rows(self) -> int:
        return self.nwarps * 16 * self.mtiles

    @property
    def threads(self) -> int:
        return self.nwarps * 32

    def smem_bytes(self, head_dim: int) -> int:
        return (self.rows + 2 * self.stages * self.block_n) * head_dim * 2


TILES = {
    "w4": Tile(4, 1, 64, 2, True, 2),
    "w8": Tile(8, 1, 64, 3, True, 1),
    "w4m2": Tile(4, 2, 64, 2, False, 1),
    "w8s": Tile(8, 1, 64, 2, False, 2),
}


def default_tile(head_dim: int, rows: int) -> Tile:
    """rows = G * Lq query rows per KV head. On the H200 sweep (docs/results/attention.md) 4 warps x 16
    rows with 2 CTAs/SM beat the 128-row tiles: the extra K/V reads of the row tiles hit L2."""
    return TILES["w4"]


@dataclass(frozen=True)
class _Kernels:
    fwd: object  # cupy.RawKernel
    combine: object
    ctas_per_sm: int
    num_sms: int


@functools.cache
def _kernels(device_index: int, bf16: bool, head_dim: int, tile: Tile, groups: bool, paged: bool) -> _Kernels:
    import cupy

    defines = {
        "IS_BF16": int(bf16), "HEAD_DIM": head_dim, "NWARPS": tile.nwarps, "MTILES": tile.mtiles,
        "BLOCK_N": tile.block_n, "STAGES": tile.stages, "QREGS": int(tile.qregs), "MINBLOCKS": tile.minblocks,
        "RULE_GROUPS": int(groups), "PAGED_KV": int(paged),
    }
    options = ("--std=c++17",) + tuple(f"-D{k}={v}" for k, v in defines.items())
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE.read_text(), options=options)
        fwd = module.get_function("packed_attn_fwd")
        combine = module.get_function("packed_attn_combine")
        smem = tile.smem_bytes(head_dim)
        fwd.max_dynamic_shared_size_bytes = smem
        props = torch.cuda.get_device_properties(device_index)
        # Resident CTAs per SM from registers (allocated per warp in units of 256), smem and threads.
        warp_regs = -(-fwd.num_regs * 32 // 256) * 256
        by_regs = 65536 // (warp_regs * tile.nwarps)
        by_smem = (228 * 1024) // (smem + 1024)
        per_sm = max(1, min(by_regs, by_smem, 2048 // tile.threads))
    return _Kernels(fwd, combine, per_sm, props.multi_processor_count)


class _StreamHandle:
    """A raw cudaStream_t speaking the CUDA stream protocol (what cupy.cuda.Stream.from_external takes)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@functools.lru_cache(maxsize=64)
def _cupy_stream(handle: int):
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle)


def _prepare(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The tensor in a layout the kernel's 16-byte cp.async loads take (last dim contiguous, rows
    16-byte aligned; else a contiguous copy) and its (batch, token, head) element strides: batch 0 for a
    pool [N, KVH, D] (the kernel adds its kv_index rows)."""
    st = t.stride()
    if st[-1] != 1 or any(x & 7 for x in st[:-1]) or t.data_ptr() & 15:
        t = t.clone(memory_format=torch.contiguous_format)
        st = t.stride()
    return t, ((0,) * (4 - t.dim()) + st)[:3]


@functools.lru_cache(maxsize=4096)
def _scalars(B: int, Lq: int, H: int, KVH: int, S: int, slot: int, ns: int, scale: float) -> tuple:
    """The kernel's 32-bit scalar arguments (cached: building numpy scalars per call costs microseconds)."""
    ints = tuple(np.int32(x) for x in (B, Lq, H, KVH, S, slot, ns))
    return ints + (np.float32(scale * math.log2(math.e)),)


def packed_attention_cuda(args: PackedArgs, return_lse: bool, tile: Tile | None = None,
                          splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel (tile/splits override the heuristics, for tests and the benchmark)."""
    check_inputs(args)
    slot, group, see, idx = kernel_rule(args)
    B, Lq, H, D = args.q.shape
    S, KVH = args.keys, args.k_cache.shape[-2]
    rows = (H // KVH) * Lq
    out = torch.empty((B, Lq, H, D), dtype=args.q.dtype, device=args.q.device)
    lse = torch.empty((B, H, Lq) if return_lse else (0,), dtype=torch.float32, device=args.q.device)
    if out.numel() == 0:
        return out, lse
    (q, sq), (k_cache, skc), (v_cache, svc), (k_win, skw), (v_win, svw) = map(
        _prepare, (args.q, args.k_cache, args.v_cache, args.k_win, args.v_win)
    )
    prefix_len = args.prefix_len.contiguous()
    tile = tile or default_tile(D, rows)
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    ks = _kernels(dev, q.dtype == torch.bfloat16, D, tile, group is not None, idx is not None)
    row_tiles = -(-rows // tile.rows)
    ns = splits or num_splits(row_tiles * B * KVH, S, ks.num_sms * ks.ctas_per_sm)
    ws_o = ws_lse = 0
    if ns > 1:
        n_rows = B * Lq * H
        ws = split_scratch(q.device, ns, n_rows, D)
        ws_o, ws_lse = ws.data_ptr(), ws[ns * n_rows * D :].data_ptr()
    scalars = _scalars(B, Lq, H, KVH, S, slot, ns, args.softmax_scale)
    kargs = (
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_win.data_ptr(), v_win.data_ptr(),
        prefix_len.data_ptr(), np.int32(prefix_len.dtype == torch.int64),
        out.data_ptr(), lse.data_ptr() if (return_lse and ns == 1) else 0, ws_o, ws_lse,
        *scalars, *sq, *skc, *svc, *skw, *svw,
        0 if group is None else group.data_ptr(), 0 if group is None else group.stride(0),
        0 if see is None else see.data_ptr(),
        0 if idx is None else idx.data_ptr(), np.int32(idx is not None and idx.dtype == torch.int64),
        0 if idx is None else idx.stride(0),
    )
    import cupy

    with cupy.cuda.Device(dev), _cupy_stream(torch.cuda.current_stream(q.device).cuda_stream):
        ks.fwd((row_tiles, B * KVH, ns), (tile.threads, 1, 1), kargs, shared_mem=tile.smem_bytes(D))
        if ns > 1:
            warps_per_block = 4
            n_blocks = -(-(B * Lq * H) // warps_per_block)
            ks.combine(
                (n_blocks, 1, 1), (32 * warps_per_block, 1, 1),
                (ws_o, ws_lse, out.data_ptr(), lse.data_ptr() if return_lse else 0,
                 scalars[0], scalars[1], scalars[2], scalars[6]),
            )
    return out, lse


@torch.library.custom_op("compiledllm::packed_attention", mutates_args=(), device_types="cuda")
def packed_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    group: torch.Tensor | None,
    see: torch.Tensor | None,
    kv_index: torch.Tensor | None,
    slot: int,
    scale: float,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Lq, H, D] and lse [B, H, Lq] (an empty tensor when return_lse is False)."""
    args = op_args(q, k_cache, v_cache, prefix_len, k_win, v_win, group, see, kv_index, slot, scale)
    return packed_attention_cuda(args, return_lse)


@packed_attention_op.register_fake
def _(q, k_cache, v_cache, prefix_len, k_win, v_win, group, see, kv_index, slot, scale, return_lse):
    return fake_outputs(q, return_lse)
