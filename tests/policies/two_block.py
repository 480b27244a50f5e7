"""A test-only decoding policy: two blocks per forward, advancing by up to two blocks per step.

It exists to show that a new decoding algorithm is a new file (here not even inside the package) with no edit to
the engine: registered with `register_policy`, the engine runs its plans like threshold's.

Each step forwards the window [L, L + 2 blocks) (the second block only where it is inside the working sequence)
block-causally against the cached prefix [0, L). In each block it accepts the masked positions with p > tau, or
the most confident one where none passes. Block L retires when the forward saw it without MASK; block L + 1
retires with it when it too was final. It also records, through the per-block host hook, every block a row begins.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.attention.spec import AttentionSpec, BlockCausal
from compiledllm.policies.base import Policy, PolicyConfig, check_probability, confidence, top_confident
from compiledllm.policies.plan import Forward, Update


@dataclass(frozen=True)
class TwoBlockConfig(PolicyConfig):
    threshold: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("threshold", self.threshold)


class TwoBlockPolicy(Policy):
    name = "two_block"
    config: TwoBlockConfig

    def __init__(self, config, mask_id, bidirectional=False):
        if bidirectional:
            raise ValueError("two_block forwards against a KV cache: block-causal models only")
        super().__init__(config, mask_id, bidirectional)
        self.begun: list[tuple[int, int]] = []  # (slot, first position of the window) per on_blocks call

    def window(self, st):
        Bk, T = self.block_size, st.seq.shape[1]
        idx = st.block_start[:, None] + torch.arange(2 * Bk, device=st.seq.device)
        live = idx < st.work_len[:, None]  # the second block exists
        idx = idx.clamp(max=T - 1)
        tokens = st.seq.gather(1, idx)
        gen = (idx >= st.prompt_len[:, None]) & live
        return idx, tokens, gen, live

    def plan(self, phase, st):
        idx, tokens, gen, live = self.window(st)
        write = torch.where(st.active[:, None] & live, idx, -1)
        spec = AttentionSpec(BlockCausal(self.block_size), prefix_len=st.block_start)
        return Forward(tokens, idx, spec, kv_write=write, logits_rows=(tokens == self.mask_id) & gen)

    def update(self, phase, st, fwd, logits):
        B, Bk = fwd.tokens.shape[0], self.block_size
        idx, tokens, gen, live = self.window(st)
        masked = (tokens == self.mask_id) & gen
        v, p = confidence(logits, self.mask_id, masked)
        # per block: [B, 2, Bk]
        m2, p2 = masked.view(B, 2, Bk), p.view(B, 2, Bk)
        accept = m2 & (p2 > self.config.threshold)
        one = torch.ones(B * 2, dtype=torch.long, device=p.device)
        fallback = top_confident(p2.reshape(B * 2, Bk), m2.reshape(B * 2, Bk), one).view(B, 2, Bk)
        accept = torch.where(accept.any(2, keepdim=True), accept, fallback).view(B, 2 * Bk)
        final = ~m2.any(2)  # a block without MASK in this forward: its KV is final
        advance = final[:, 0].long() * (1 + (final[:, 1] & live[:, Bk]).long())
        return Update(torch.where(gen, idx, -1), torch.where(accept, v, tokens), advance, {})

    def on_blocks(self, host, rows):
        starts = host.st.block_start.tolist()
        self.begun += [(s, starts[s]) for s in rows]
