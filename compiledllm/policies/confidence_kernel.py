"""The confidence rule (policies/base.py `confidence`) as one Triton kernel over each logits row, as a torch op.

The torch form writes the softmax of the whole vocabulary and reads it back (1.6 GB per step at batch 32 with
LLaDA2's 157K vocabulary); this reads each row twice in the model's dtype (float32 in registers) and writes
nothing: an online max / sum of exponentials, then the most probable non-MASK token by its probability
exp(x - max) / sum (ties -> lower id). Rows the policy does not need are skipped (v = MASK, p = -1), so
`threshold` reads only its masked positions. Imported only where Triton is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _confidence_kernel(logits_ptr, need_ptr, v_ptr, p_ptr, V: tl.constexpr, MASK_ID: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(need_ptr + row) == 0:
        tl.store(v_ptr + row, MASK_ID)
        tl.store(p_ptr + row, -1.0)
        return
    base = logits_ptr + row * V
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK):  # pass 1: max and sum of exponentials, online
        i = start + tl.arange(0, BLOCK)
        x = tl.load(base + i, mask=i < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    best = -1.0
    best_id = 0
    for start in range(0, V, BLOCK):  # pass 2: the most probable non-MASK token, on probabilities as the
        i = start + tl.arange(0, BLOCK)  # torch form compares them (tokens whose probability underflows tie)
        x = tl.load(base + i, mask=i < V, other=float("-inf")).to(tl.float32)
        prob = tl.where(i == MASK_ID, -1.0, tl.exp(x - m) / s)
        cbest = tl.max(prob, axis=0)
        cid = tl.min(tl.where(prob == cbest, i, V), axis=0)
        take = cbest > best  # strictly: an earlier chunk keeps its (lower) id on a tie
        best_id = tl.where(take, cid, best_id)
        best = tl.where(take, cbest, best)
    tl.store(v_ptr + row, best_id.to(tl.int64))
    tl.store(p_ptr + row, best)


@torch.library.custom_op("compiledllm::confidence", mutates_args=())
def confidence_op(logits: torch.Tensor, need: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] float32 / bfloat16 / float16 (contiguous), need [...] bool -> (v [...] int64, p [...] float32)."""
    V = logits.shape[-1]
    rows = logits.numel() // V
    v = torch.empty(logits.shape[:-1], dtype=torch.long, device=logits.device)
    p = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    _confidence_kernel[(rows,)](logits, need.contiguous(), v, p, V=V, MASK_ID=mask_id, BLOCK=BLOCK, num_warps=8)
    return v, p


@confidence_op.register_fake
def _(logits, need, mask_id):
    return (logits.new_empty(logits.shape[:-1], dtype=torch.long),
            logits.new_empty(logits.shape[:-1], dtype=torch.float32))
