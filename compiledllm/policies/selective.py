"""What the caches that recompute a query set against a pooled KV cache share (Flash-dLLM's `flash_dllm`,
Elastic-Cache's `elastic_cache`): one "refresh" forward of the whole working sequence at a request's first step,
then forwards of a few positions whose KV source is the pool everywhere but those positions.

Here: the pooled store (the rows that refresh are those a step admits: StepView.admitted), the query set's
compaction into query slots, the KV source around it, and the attention mass a forward's statistics give each
position.
"""
from __future__ import annotations

import torch

from compiledllm.kv.pooled import PooledLayout, pool_index
from compiledllm.policies.fast_dllm_cache import RefreshCachePolicy
from compiledllm.policies.flash_verify import marks


class SelectiveCachePolicy(RefreshCachePolicy):
    def kv_layout(self, model, slots: int, capacity: int):
        self.layers = model.config.num_layers
        return PooledLayout.for_model(model, slots, capacity)

    def regions(self, st) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T] each: every position, whether it is in the row's current block, whether in its working sequence."""
        B, T = st.seq.shape
        pos = torch.arange(T, device=st.seq.device).expand(B, T)
        bs = st.block_start[:, None]
        return pos, (pos >= bs) & (pos < bs + self.block_size), pos < st.work_len[:, None]

    @staticmethod
    def compact(member: torch.Tensor, Q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [B, Q], live [B, Q]): the positions where `member` [B, T], in order, then padding."""
        B, T = member.shape
        pos = torch.arange(T, device=member.device).expand(B, T)
        q_pos = torch.sort(torch.where(member, pos, T + pos), dim=1).values % T  # members first, in order
        q_pos = q_pos[:, :Q] if Q <= T else torch.cat([q_pos, q_pos.new_zeros(B, Q - T)], 1)
        return q_pos, torch.arange(Q, device=member.device)[None] < member.sum(1, keepdim=True)

    @staticmethod
    def cache_around(st, q_pos: torch.Tensor, q_live: torch.Tensor, act: torch.Tensor) -> tuple:
        """(prefix_len [B], kv_index [B, T]): the cache everywhere but the live queries' positions, in position order
        (the KV source a forward of these queries reads)."""
        B, T = st.seq.shape
        pos = torch.arange(T, device=st.seq.device).expand(B, T)
        cached = (pos < st.work_len[:, None]) & ~marks(q_pos, q_live, T) & act[:, None]
        order = torch.sort(torch.where(cached, pos, T + pos), dim=1).indices  # cached positions first, in order
        return cached.sum(1), pool_index(order, st.capacity)

    @staticmethod
    def position_mass(stats: torch.Tensor, fwd, T: int, capacity: int) -> torch.Tensor:
        """[B, ..., T]: the attention mass (or score) each position's key got in `fwd`, from its statistics [B, ...,
        S + Q] as the attention fills them: the KV source's S keys through kv_index (into pools of `capacity`
        positions a slot), then the window's Q keys at the forward's positions (those it writes; the others are
        padding)."""
        B, lead = stats.shape[0], stats.shape[1:-1]
        flat = stats.reshape(B, -1, stats.shape[-1])
        out = torch.zeros(B, flat.shape[1], T + 1, device=stats.device)
        spec = fwd.attention
        S = 0 if spec.kv_index is None else spec.kv_index.shape[1]
        if S:
            rows = torch.arange(B, device=stats.device)[:, None]
            at = spec.kv_index - rows * (capacity + 1)
            out.scatter_add_(2, at[:, None].expand(-1, flat.shape[1], -1), flat[..., :S])
        live = fwd.kv_write >= 0
        Q = live.shape[1]
        at = torch.where(live, fwd.positions, T)[:, None].expand(-1, flat.shape[1], -1)
        out.scatter_add_(2, at, torch.where(live[:, None], flat[..., S:S + Q], 0.0))
        return out[..., :T].reshape(B, *lead, T)
