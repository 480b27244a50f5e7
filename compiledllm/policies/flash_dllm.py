"""`flash_dllm`: Flash-dLLM's Flash-Cache for a bidirectional model (LLaDA-8B / 1.5; ../shared/papers/flash-dllm.txt,
"Selective cache update"): after one forward of the whole working sequence, each step recomputes only a fixed-size
query set and serves every other position's KV from the cache (exact for the query set, approximate elsewhere).

Blocks start at the prompt's end (as `threshold` with `rule: fast_dllm`) and the working sequence ends a whole number
of blocks after it. Per request:

* phase "refresh", once, at its first step: one forward of the whole working sequence (Bidirectional(work length))
  writes the KV of every position; its logits at the first block make the first transfer;
* phase "decode", every later step: the query set, each of its positions' K/V recomputed and written to the cache,
  attending to the set itself and to the cache everywhere else (a KV source read through an index, with holes at
  the set's positions). The set, at most 2B + `ahead` + `track` positions, padding hidden:
  - the current block (B positions; its masked ones are the ones decoded, Fast-dLLM's rule: the most confident
    always, plus every one with p >= threshold; with `steps` its fixed-step count instead);
  - the positions decoded in the previous step outside the block (a block that just retired: its last tokens);
  - the next `ahead` masked positions after the block (refreshed, not decoded: Elastic-Cache's sliding window);
  - the `track` decoded positions (prompt included) outside those that the masked queries of the block and the
    window attended to most in the previous forward (the tracker).

The tracker's score: the attention mass a key gets from those masked queries, summed over heads and the layers past
the first two, from the attention itself (AttentionSpec.stats, [B, S + Q]), reset every step. Flash-dLLM ranks by
unnormalised logits averaged over queries and heads: `track_score: logits` does (summed, the same order), and the
Triton attention kernel then makes the score in its own pass, where the mass takes a second kernel.

The query set is kept in position order, so with `ahead` and `track` at least the capacity every position is
recomputed every step in the order a no-cache forward reads them: the tokens are `threshold` (rule fast_dllm)'s
without a cache.

`verify: true` adds Flash-Verify's forward after each decode step (phase "verify", policies/flash_verify.py).
`fused_cache` (on by default) makes the projection write the K/V (Flash-Cache's fused kernel, models/qkv_kernel.py):
safe in both phases, as the refresh reads only its own keys and a decode forward's cache has holes at the set's
positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from compiledllm.attention.spec import AttentionSpec, Bidirectional, QueryGroups
from compiledllm.policies.base import PolicyConfig, check_probability
from compiledllm.policies.flash_verify import FlashVerify, VerifySettings, marks
from compiledllm.policies.peer_rules import check_steps
from compiledllm.policies.plan import Forward, Update, route_groups
from compiledllm.policies.selective import SelectiveCachePolicy

TRACK_FROM_LAYER = 2  # the tracker counts the layers past the first two


@dataclass(frozen=True)
class FlashDLLMConfig(VerifySettings, PolicyConfig):  # + Flash-Verify's keys (policies/flash_verify.py)
    threshold: float = 0.9
    steps: int | None = None  # Fast-dLLM's fixed-step mode, a fixed count a step (policies/fast_dllm_cache.py)
    track: int = 64   # decoded positions of largest attention mass recomputed each step
    # the tracker's score: softmax mass (the default until the one-pass form is measured on the device), or logits:
    # Flash-dLLM's raw scores summed, which the Triton attention kernel makes in its own pass (AttentionSpec)
    track_score: Literal["mass", "logits"] = "mass"
    ahead: int = 64   # masked positions past the block recomputed each step (not decoded)
    # Flash-Cache's fused kernel: the projection writes the K/V itself (models/qkv_kernel.py; Triton on CUDA for
    # LLaDA-8B-like layers, elsewhere the separate path in that order). On: 8 % less decode time on an H100
    fused_cache: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("threshold", self.threshold)
        check_steps(self.steps, self.block_size)
        if self.track_score not in ("mass", "logits"):
            raise ValueError(f"track_score: must be mass or logits, got {self.track_score!r}")
        for key in ("track", "ahead"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}: must be >= 0, got {getattr(self, key)}")
        self.check_verify()


class FlashDLLMPolicy(FlashVerify, SelectiveCachePolicy):
    name = "flash_dllm"
    cache = "Flash-dLLM's cache"
    config: FlashDLLMConfig

    def __init__(self, config, mask_id, bidirectional=False):
        super().__init__(config, mask_id, bidirectional)
        if config.verify:
            self.phases = ("refresh", "decode", "verify")

    def queries(self, capacity: int) -> int:
        """Q: the decode forward's query slots (block, previous step's tokens, window ahead, tracked)."""
        Bk = self.block_size
        return 2 * Bk + min(self.config.ahead, capacity) + min(self.config.track, capacity)

    def init_state(self, batch, device):
        zeros = lambda: torch.zeros(batch, dtype=torch.long, device=device)  # noqa: E731
        state = {"fresh": zeros(), "nfe": zeros()}
        if self.config.verify:  # the search set (block offsets + 1, 0: none) and its drafts; drafts accepted so far
            S = self.config.search
            state |= {"search_pos": torch.zeros(batch, S, dtype=torch.long, device=device),
                      "search_tok": torch.zeros(batch, S, dtype=torch.long, device=device), "verified": zeros()}
        return state

    def capacity_state(self, batch, capacity, device):
        # stats: the attention mass per key of the last forward (its KV source, then its window); mass: that mass at
        # each position (the tracker's score); new: the positions decoded in the last step
        return {"stats": torch.zeros(batch, capacity + self.queries(capacity), device=device),
                "mass": torch.zeros(batch, capacity, device=device),
                "new": torch.zeros(batch, capacity, dtype=torch.bool, device=device)}

    # --- the step ------------------------------------------------------------------------------------------------
    def block(self, st) -> torch.Tensor:
        T = st.seq.shape[1]
        return (st.block_start[:, None] + torch.arange(self.block_size, device=st.seq.device)).clamp(max=T - 1)

    def stats_layers(self) -> tuple[int, ...] | None:
        return tuple(range(TRACK_FROM_LAYER, self.layers)) if self.layers > TRACK_FROM_LAYER else None

    def plan(self, phase, st):
        act = self.acting(phase, st)
        if phase == "verify":
            return self.verify_plan(st, act)
        T, dev = st.seq.shape[1], st.seq.device
        idx = self.block(st)
        pos, _, working = self.regions(st)
        masked = (st.seq == self.mask_id) & (pos >= st.prompt_len[:, None]) & working
        need = masked.gather(1, idx) & act[:, None]
        if phase == "refresh":  # the whole working sequence, no KV source; writes every position
            live = working & act[:, None]
            counted = masked & (pos < st.block_start[:, None] + self.block_size + self.config.ahead) & act[:, None]
            spec = AttentionSpec(Bidirectional(st.work_len), stats=st.policy["stats"][:, :T], stats_queries=counted,
                                 stats_layers=self.stats_layers(), stats_score=self.config.track_score)
            return Forward(st.seq, pos, spec, kv_write=torch.where(live, pos, -1), logits_at=idx, logits_rows=need,
                           route_groups=route_groups(pos, self.block_size, live), fused_cache=self.config.fused_cache)
        q_pos, q_live, counted, logits_at = self.query_set(st, masked, act)
        prefix_len, kv_index = self.cache_around(st, q_pos, q_live, act)
        see = 1 << torch.arange(2, dtype=torch.int32, device=dev)  # live queries see live keys; padding only itself
        spec = AttentionSpec(QueryGroups((~q_live).int(), see), prefix_len=prefix_len, kv_index=kv_index,
                             stats=st.policy["stats"][:, :T + q_pos.shape[1]], stats_queries=counted,
                             stats_layers=self.stats_layers(), stats_score=self.config.track_score)
        # the cache it reads has holes at the set's positions (cache_around), so the set's K/V may be written first
        return Forward(st.seq.gather(1, q_pos), q_pos, spec, kv_write=torch.where(q_live, q_pos, -1),
                       logits_at=logits_at, logits_rows=need, route_groups=route_groups(q_pos, self.block_size, q_live),
                       fused_cache=self.config.fused_cache)

    def tracked(self, st, masked: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: the `track` decoded positions outside the block and the last step's tokens that the masked
        queries attended to most in the last forward."""
        _, in_block, working = self.regions(st)
        score = torch.where(working & ~masked & ~in_block & ~st.policy["new"], st.policy["mass"], float("-inf"))
        top = torch.topk(score, min(self.config.track, st.seq.shape[1]), dim=1)
        return marks(top.indices, top.values > float("-inf"), st.seq.shape[1])

    def query_set(self, st, masked: torch.Tensor, act: torch.Tensor) -> tuple:
        """(positions [B, Q], live [B, Q], counted [B, Q]: the masked queries whose attention the tracker counts,
        logits_at [B, B_k]: the block's queries): the set in position order, padding (not live) last."""
        T, Bk, dev = st.seq.shape[1], self.block_size, st.seq.device
        pos, in_block, working = self.regions(st)
        bs = st.block_start[:, None]
        past = masked & (pos >= bs + Bk)
        ahead = past & (past.cumsum(1) <= self.config.ahead)
        new = st.policy["new"] & working & ~in_block
        member = (in_block | new | ahead | self.tracked(st, masked)) & act[:, None]
        Q = self.queries(T)
        q_pos, q_live = self.compact(member, Q)
        counted = q_live & (masked.gather(1, q_pos)) & (in_block | ahead).gather(1, q_pos)
        before = (member & (pos < bs)).sum(1, keepdim=True)  # the block's first query: after the set's earlier ones
        logits_at = (before + torch.arange(Bk, device=dev)).clamp(max=Q - 1)
        return q_pos, q_live, counted, logits_at

    def update(self, phase, st, fwd, logits):
        T = st.seq.shape[1]
        act = self.acting(phase, st)
        if phase == "verify":
            return self.verify_update(st, act, logits)
        idx = self.block(st)
        tokens = st.seq.gather(1, idx)
        masked = (tokens == self.mask_id) & (idx >= st.prompt_len[:, None]) & act[:, None]
        nfe = st.policy["nfe"]
        v, p = self.choose(logits, masked, self.noise_keys(st, idx, nfe))
        accept, left = self.transfer(p, masked, idx, st)
        done = act & (accept.sum(1) == left)
        stats = st.policy["stats"]
        mass = self.position_mass(fwd.attention.stats, fwd, T, st.capacity)
        new = marks(idx, accept, T)
        state = {"fresh": torch.where(act, torch.ones_like(nfe), st.policy["fresh"]), "nfe": nfe + act.long(),
                 "mass": torch.where(act[:, None], mass, st.policy["mass"]),
                 "new": torch.where(act[:, None], new, st.policy["new"]), "stats": torch.zeros_like(stats)}
        if self.config.verify:  # what the verify forward checks: the drafts the rule left
            search = self.search_state(p, masked, accept, v)
            state |= {"search_pos": torch.where(act[:, None], search["search_pos"], 0),
                      "search_tok": search["search_tok"]}
        return Update(torch.where(masked, idx, -1), torch.where(accept, v, tokens), done.long(), state)

    # --- host ----------------------------------------------------------------------------------------------------
    def schedule(self, step):
        from compiledllm.engine.hooks import PhaseRun  # the engine imports the policies: not at module level

        return [PhaseRun("refresh", step.admitted), *self.phases[1:]]

    def report(self, st, slot):
        out = {"nfe": int(st.policy["nfe"][slot])}
        if self.config.verify:
            out["verified"] = int(st.policy["verified"][slot])
        return out
