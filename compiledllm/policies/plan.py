"""Step plans: what a policy asks the engine to forward, and what it changes afterwards (docs/design.md §2).

A step is one or more phases in the policy's fixed order. Each phase is one `Forward` (built by Policy.plan from
the slot buffers) and one `Update` (Policy.update from that forward's logits); the engine runs the forward, hands
the logits over, and applies the update. Everything is static-shape tensors: a phase runs eagerly, compiled, or
replayed as a CUDA graph per (phase, batch bucket).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compiledllm.attention.spec import AttentionSpec, BlockCausal, Kernels

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Forward:
    """One model forward over Q query tokens per row.

    tokens / positions [B, Q] long: any positions (RoPE uses them), not only one contiguous block.
    attention: what the queries see (mask rule, KV source, statistics).
    kv_write [B, Q] long: the cache position each query's K/V is written at after the attention read it (before,
        with fused_cache); -1 = not written (None: the forward writes nothing).
    logits_at [B, K] long: the query indices whose logits are returned (None: all Q), logits_rows [B, K] bool:
        those the policy reads (the head may skip the others; None: all).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    attention: AttentionSpec
    kv_write: torch.Tensor | None = None
    logits_at: torch.Tensor | None = None
    logits_rows: torch.Tensor | None = None
    float_logits: bool = False  # float32 logits (the reference); else the model's dtype (the decode step)
    kernels: Kernels = field(default_factory=Kernels)
    route_groups: torch.Tensor | None = None
    route_index: torch.Tensor | None = None  # made by the model from route_groups (BlockDiffusionLM.forward)
    # the projection writes the K/V itself, before the attention (Flash-Cache's fused kernel, models/qkv_kernel.py):
    # only for a forward whose attention reads none of the positions it writes
    fused_cache: bool = False
    # the store also keeps each layer's input (a store with hidden pools, kv/pooled.py): each layer writes its input
    # at the positions it writes K/V at (Elastic-Cache, policies/elastic_cache.py)
    keep_hidden: bool = False
    resume: Resume | None = None  # a forward that starts inside the model, from those kept inputs


@dataclass(frozen=True)
class Resume:
    """A forward that starts at a layer: layers before `first` do not run; row b's input to layer at[b] (within
    [first, last]) is the store's kept input of that layer at the forward's positions, and the layers before at[b]
    write neither K/V nor inputs for it (what they compute for it is discarded). `first` and `last` are numbers,
    one pair per captured phase (past `last` no row resumes, so nothing is read); at [B] long is data."""

    first: int
    at: torch.Tensor
    last: int | None = None  # None: any layer


@dataclass(frozen=True)
class Update:
    """What a phase changes, applied by the engine to active rows only.

    write_pos [B, K] long: sequence positions to set (-1 = none; never a prompt position) to tokens [B, K].
    advance [B] long: blocks retired this phase (0..k). A retired block must be final in this phase's forward(s),
        so the KV they wrote is the block's KV (for models that cache it).
    state: the policy's new per-row state (reset by the policy itself where a block begins).
    """

    write_pos: torch.Tensor
    tokens: torch.Tensor
    advance: torch.Tensor
    state: State


COPY_STRIDE = 1 << 32  # route-group ids of copy k start at k * COPY_STRIDE: apart from any block's (< 2^24)


def route_groups(positions: torch.Tensor, block: int, live: torch.Tensor | None = None, copy: int = 0
                 ) -> torch.Tensor:
    """[B, Q] long: each token's block (position // block), -1 where `live` is False (padding, finished rows).
    copy k > 0: the tokens are copy k of positions another part of the forward also holds (a draft group): their
    groups are their own, never merged with the originals' (a block-routed MoE admits experts per group)."""
    groups = positions // block + copy * COPY_STRIDE
    return groups if live is None else torch.where(live, groups, -1)


def window_forward(tokens: torch.Tensor, positions: torch.Tensor, prefix_len: torch.Tensor, block: int,
                   live: torch.Tensor, *, write: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                   logits_rows: torch.Tensor | None = None) -> Forward:
    """The block-causal window forward every cached policy and prefill chunk makes: queries at `positions` (a whole
    number of blocks from a block boundary) see the row's cached prefix [0, prefix_len) and, among themselves,
    BlockCausal(block). `live` [B, Q]: the tokens that count (written at their positions unless `write` says
    otherwise; dead ones route nowhere)."""
    kv_write = torch.where(live, positions, -1) if write is None else write
    return Forward(tokens, positions, AttentionSpec(BlockCausal(block), prefix_len=prefix_len), kv_write=kv_write,
                   logits_at=logits_at, logits_rows=logits_rows, route_groups=route_groups(positions, block, live))
