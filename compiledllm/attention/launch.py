"""The one arguments type of packed attention (reference and kernels), its checks, the split-K (flash-decoding)
split count, the split-K scratch and the ops' fake (shape-only) outputs.

Scratch is allocated per call from torch's caching allocator: inside a captured CUDA graph it comes from that
graph's private pool and lives exactly as long as the graph (owned by the Stepper that holds the graphs). A
process-wide buffer that grows on demand could be freed under a captured graph by a later, larger call.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from compiledllm.attention.spec import MAX_GROUPS, BlockCausal, Bidirectional, ExplicitMask, MaskRule, QueryGroups

_MAX_SPLITS = 64
_MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs outweigh the parallelism it adds
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class PackedArgs:
    """q [B, Q, H, D] of the forward's tokens; their fresh k_win / v_win [B, Q, KVH, D]; the KV source: a row's
    cache k_cache / v_cache [B, S, KVH, D] with keys [0, prefix_len[b]) visible, or with kv_index [B, S] a pool
    [N, KVH, D] where key s of row b is pool row kv_index[b, s]; the rule among the window's tokens; the softmax
    scale (None: D ** -0.5). Query head h reads KV head h // (H // KVH) (GQA)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    prefix_len: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    rule: MaskRule
    kv_index: torch.Tensor | None = None
    scale: float | None = None

    @property
    def keys(self) -> int:
        """S: prefix keys addressable per row."""
        return self.kv_index.shape[1] if self.kv_index is not None else self.k_cache.shape[1]

    @property
    def softmax_scale(self) -> float:
        return self.q.shape[-1] ** -0.5 if self.scale is None else float(self.scale)

    def rule_tensors(self) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """The kernels' form of the rule: (slot, group, see); slot 0 = QueryGroups (Bidirectional is the groups
        {live keys, padding} per row)."""
        r = self.rule
        if isinstance(r, BlockCausal):
            return r.block, None, None
        if isinstance(r, QueryGroups):
            return 0, r.group.to(torch.int32).expand(self.q.shape[0], -1), r.see.to(torch.int32)
        if isinstance(r, Bidirectional):
            # groups {live, padding}: every query sees the live keys only (see = [1, 1]), as the rule's torch form
            pad = torch.arange(self.q.shape[1], device=self.q.device) >= r.length[:, None]
            return 0, pad.to(torch.int32), torch.ones(2, dtype=torch.int32, device=self.q.device)
        raise ValueError(f"{type(r).__name__} has no kernel form (the torch reference takes it)")


def op_args(q, k_cache, v_cache, prefix_len, k_win, v_win, group, see, kv_index, slot: int,
            scale: float) -> PackedArgs:
    """The ops' flat arguments back as PackedArgs (shared by the CuPy op)."""
    if slot > 0:
        rule = BlockCausal(slot)
    elif group is not None and see is not None:
        rule = QueryGroups(group, see)
    else:
        raise ValueError("packed attention op: slot 0 (QueryGroups) needs group and see")
    return PackedArgs(q, k_cache, v_cache, prefix_len, k_win, v_win, rule, kv_index, scale)


def kernel_rule(a: PackedArgs) -> tuple[int, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(slot, group [B, Q] int32 with unit last stride (its batch stride may be 0), see int32, kv_index with unit
    last stride): what both kernels read. Copies only what is not already in that layout."""
    slot, group, see = a.rule_tensors()
    if group is not None:
        group = group if group.stride(-1) == 1 else group.contiguous()
        see = see.contiguous()
    idx = a.kv_index
    if idx is not None and idx.stride(-1) != 1:
        idx = idx.contiguous()
    return slot, group, see, idx


def kernel_rule_ok(args: PackedArgs) -> bool:
    return isinstance(args.rule, (BlockCausal, QueryGroups, Bidirectional))


def check_inputs(a: PackedArgs) -> None:
    q, kc, vc, kw, vw = a.q, a.k_cache, a.v_cache, a.k_win, a.v_win
    B, Lq, H, D = q.shape
    if q.dtype not in SUPPORTED_DTYPES or D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"packed attention kernel: dtype {q.dtype} / head dim {D} not supported")
    paged = a.kv_index is not None
    kvh = kc.shape[-2]
    rows_ok = (kc.dim() == 3) if paged else (kc.dim() == 4 and kc.shape[0] == B)
    if kc.shape != vc.shape or kw.shape != vw.shape or not rows_ok or kc.shape[-1] != D \
            or kw.shape != (B, Lq, kvh, D) or H % kvh:
        raise ValueError(f"packed attention kernel: bad K/V shapes {tuple(kc.shape)} / {tuple(kw.shape)} for q "
                         f"{tuple(q.shape)}{' (a pool [N, KVH, D] with kv_index)' if paged else ''}")
    if any(t.dtype != q.dtype for t in (kc, vc, kw, vw)):
        raise ValueError("packed attention kernel: q, caches and window K/V must share one dtype")
    if a.prefix_len.shape != (B,) or a.prefix_len.dtype not in (torch.int32, torch.int64):
        raise ValueError("packed attention kernel: prefix_len must be an int32/int64 tensor of shape [B]")
    if paged and (a.kv_index.dim() != 2 or a.kv_index.shape[0] != B
                  or a.kv_index.dtype not in (torch.int32, torch.int64)):
        raise ValueError("packed attention kernel: kv_index must be an int32/int64 tensor of shape [B, S]")
    if isinstance(a.rule, QueryGroups):
        if a.rule.group.shape[-1] != Lq or a.rule.group.shape[0] not in (1, B) or a.rule.see.dim() != 1 \
                or not 1 <= a.rule.see.numel() <= MAX_GROUPS:
            raise ValueError(f"packed attention kernel: QueryGroups needs group [B or 1, {Lq}] and see [G <= "
                             f"{MAX_GROUPS}]")
    if isinstance(a.rule, Bidirectional) and a.rule.length.shape != (B,):
        raise ValueError(f"packed attention kernel: Bidirectional needs length [{B}]")
    if isinstance(a.rule, ExplicitMask):
        raise ValueError("packed attention kernel: ExplicitMask is for the reference")


@functools.lru_cache(maxsize=1024)
def num_splits(n_ctas: int, cache_len: int, slots: int) -> int:
    """Flash-decoding split count: fill the GPU's CTA slots, each split keeping >= _MIN_KEYS_PER_SPLIT."""
    max_splits = max(1, min(_MAX_SPLITS, cache_len // _MIN_KEYS_PER_SPLIT))
    if n_ctas >= slots or max_splits == 1:
        return 1
    eff = [n_ctas * s / slots / math.ceil(n_ctas * s / slots) for s in range(1, max_splits + 1)]
    best = max(eff)
    return next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * best)


def split_scratch(device: torch.device, splits: int, n_out: int, head_dim: int) -> torch.Tensor:
    """fp32 split-K partials (outputs, then lse) for `splits` > 1, allocated for this call (see the module note)."""
    return torch.empty(splits * n_out * (head_dim + 1), dtype=torch.float32, device=device)


def fake_outputs(q: torch.Tensor, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops' outputs for tracing: out like q, lse [B, H, Lq] float32 (empty without return_lse)."""
    B, Lq, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, Lq) if return_lse else (0,), dtype=torch.float32)
