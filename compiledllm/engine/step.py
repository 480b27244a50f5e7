"""The decode step: one forward of every slot's current block window, then the policy's update.

A pure tensor function over SlotState's static buffers: per-row progress, acceptance, block ends and EOS
are masks, never host branches, so the same function runs eagerly, under torch.compile, or captured.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from compiledllm.attention.metadata import DenseAttention, WindowAttention
from compiledllm.engine.state import SlotState
from compiledllm.kv.cache import KVCache
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.policies.base import Policy
from compiledllm.profiling import phase


@dataclass(frozen=True)
class Regions:
    """Compiled forms of the step's pieces (stepper.compiled_regions): the decoder layers and the acceptance."""

    layers: tuple
    accept: Callable


def block_logits(model: BlockDiffusionLM, st: SlotState, idx: torch.Tensor, window: torch.Tensor,
                 kv: KVCache | None, need: torch.Tensor | None = None, layers=None) -> torch.Tensor:
    """Logits [B, Bk, V] (the model's dtype) of each row's block window (tokens `window` at positions idx [B, Bk]);
    with `need` [B, Bk] bool only those rows are defined; `layers`: what runs as the decoder layers."""
    if model.bidirectional:
        # Bidirectional models forward the whole working sequence each step (no cache); padding keys are hidden.
        B, T = st.seq.shape
        pos = torch.arange(T, device=st.seq.device).expand(B, T)
        visible = (pos < st.work_len[:, None])[:, None, :]  # [B, 1, T] -> every query sees the row's sequence
        return model(st.seq, pos, DenseAttention(visible), logits_index=idx, float_logits=False, logits_rows=need,
                     layers=layers)
    return model(window, idx, WindowAttention(st.block_start, idx.shape[1]), kv=kv, float_logits=False,
                 logits_rows=need, layers=layers)


def decode_step(model: BlockDiffusionLM, policy: Policy, st: SlotState, kv: KVCache | None,
                regions: Regions | None = None) -> None:
    """One step of every slot; `regions`: compiled forms of the layers and the acceptance (default: eager)."""
    block = policy.block_size
    T = st.seq.shape[1]
    idx = (st.block_start[:, None] + torch.arange(block, device=st.seq.device)).clamp(max=T - 1)
    window = st.seq.gather(1, idx)
    gen = idx >= st.prompt_len[:, None]
    logits = block_logits(model, st, idx, window, kv, policy.needed(window, gen, st.policy),
                          None if regions is None else regions.layers)
    with phase("acceptance"):
        (accept_step if regions is None else regions.accept)(model, policy, st, idx, window, gen, logits)


def accept_step(model: BlockDiffusionLM, policy: Policy, st: SlotState, idx, window, gen, logits) -> None:
    """The policy's update plus per-row bookkeeping: block ends, EOS stop, step counts."""
    block = policy.block_size
    new_window, block_done, pstate = policy.update(window, logits, gen, st.policy)

    act = st.active
    new_window = torch.where(act[:, None], new_window, window)
    block_done = block_done & act
    st.seq.scatter_(1, idx, new_window)
    eos_hit = ((new_window == model.eos_token_id) & gen).any(1)
    new_start = st.block_start + block * block_done.long()
    finished = block_done & (eos_hit | (new_start >= st.work_len))
    st.block_start.copy_(new_start)
    st.steps.add_(act.long())
    st.active.copy_(act & ~finished)
    for k, v in policy.reset(pstate, block_done).items():
        st.policy[k].copy_(v)
