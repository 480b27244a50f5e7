"""`elastic_cache`: Elastic-Cache's adaptive KV cache for a bidirectional model (LLaDA-8B / 1.5; Nguyen-Tri et al.
2025, "Attention Is All You Need for KV Cache in Diffusion LLMs"), the baseline Flash-dLLM is measured against. Its
code is not public; this follows the paper's description, with the choices below where it leaves one open.

* phase "refresh", once, at a request's first step: one forward of the whole working sequence writes every
  position's K/V and every layer's input (the store keeps both, kv/pooled.py); its logits make the first transfer.
* phase "decode", every later step: the query set is the sliding window (the first `window` masked positions of
  the block, the ones decoded), the positions decoded in the previous step and the watched tokens (below), each
  recomputed (K/V and layer inputs written), attending to the cache everywhere else: the prompt, earlier tokens
  and the masked positions past the window as the last recompute left them (the paper's block-wise cached
  off-window MASK).
* the watched tokens: per layer, the `watch` (default 1: the paper's "most-attended token") positions the window's
  masked queries attended to most in the last step (softmax mass summed over heads and queries, AttentionSpec's
  per-layer statistics), united over the layers. They are recomputed each step, so their K/V drift shows in the
  attention they get; the paper's point is that theirs drifts least, a lower bound for every other token's.
* the drift test, per layer: the cosine between the last step's and this step's mass on the watched tokens, a
  vector over (KV head, watched token) (over the tokens alone one watched token would always give 1). The cache
  holds while it is > `gamma` at every layer; at the first layer where it is not, that layer and every
  deeper one are recomputed for every position (the paper's depth-aware schedule: shallow layers keep their
  cache; "from a chosen layer onward": here the failing layer's outputs are recomputed too, the layer whose inputs
  are the first to change).
* phase "recompute<g>" (deferred): the layers from the failing layer on need every position's input to it, which
  only the decode forward wrote for its queries. So the decode that fails accepts nothing and marks the row; at
  the next step the row's recompute forward resumes there (Forward.resume) over the whole working sequence, from
  the kept inputs (fresh ones at the query positions, the cached ones elsewhere), writes the deeper layers' K/V
  and inputs, and its logits make the transfer: the tokens the paper's same-step recompute gives, one engine step
  later for that row. A phase per group of start layers (`resume_groups`, starting at layers 0, L/G, 2L/G, ...),
  each captured apart; a row resumes at its own layer inside its group's forward (the layers before it run for
  it but write nothing), so only the layers before the group's first are skipped.

Acceptance: Fast-dLLM's rule over the window (the most confident always, plus every one with p >= threshold), or
with `steps` its fixed-step count (as `threshold` with `steps`). The block retires once it has no MASK. With
`gamma: 1` every decode fails at layer 0, so every step is a full forward of the current tokens: with `window` >=
the block that is exactly `threshold` with rule fast_dllm without a cache (tested).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from compiledllm.attention.spec import AttentionSpec, Bidirectional, QueryGroups
from compiledllm.kv.pooled import PooledLayout
from compiledllm.policies.base import PolicyConfig, check_probability
from compiledllm.policies.flash_verify import marks
from compiledllm.policies.peer_rules import check_steps, fixed_count, select
from compiledllm.policies.plan import Forward, Resume, Update, route_groups
from compiledllm.policies.selective import SelectiveCachePolicy

RECOMPUTE = "recompute"


@dataclass(frozen=True)
class ElasticCacheConfig(PolicyConfig):
    threshold: float = 0.9
    steps: int | None = None  # Fast-dLLM's fixed-step mode, a fixed count a step (policies/fast_dllm_cache.py)
    window: int = 16  # the sliding window: the first masked positions of the block, decoded and recomputed
    gamma: float = 0.9  # the cache holds while the watched keys' attention has cosine > gamma at every layer
    watch: int = 1  # the most-attended tokens per layer recomputed each step and compared by the drift test
    resume_groups: int = 4  # recompute phases (first layers 0, L/G, ...): fewer graphs, more layers run for nothing

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("threshold", self.threshold)
        check_probability("gamma", self.gamma)
        check_steps(self.steps, self.block_size)
        for key in ("window", "watch", "resume_groups"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")


class ElasticCachePolicy(SelectiveCachePolicy):
    name = "elastic_cache"
    cache = "Elastic-Cache"
    config: ElasticCacheConfig

    def __init__(self, config, mask_id, bidirectional=False):
        super().__init__(config, mask_id, bidirectional)
        groups = tuple(f"{RECOMPUTE}{g}" for g in range(config.resume_groups))
        self.phases = ("refresh", *groups, "decode")
        self.row_phases = ("refresh", *groups)

    # --- where KV lives ------------------------------------------------------------------------------------------
    def kv_layout(self, model, slots: int, capacity: int):
        super().kv_layout(model, slots, capacity)
        self.kv_heads = model.config.num_kv_heads
        return replace(PooledLayout.for_model(model, slots, capacity), hidden=model.config.hidden_size)

    def first_layer(self, group: int) -> int:
        return group * self.layers // self.config.resume_groups

    def phase_first(self, phase: str) -> int:
        """The first layer a recompute phase runs."""
        return self.first_layer(int(phase.removeprefix(RECOMPUTE)))

    def phase_last(self, phase: str) -> int:
        """The last layer a row of a recompute phase may resume at (the next group's first, less one)."""
        g = int(phase.removeprefix(RECOMPUTE)) + 1
        return self.first_layer(g) - 1 if g < self.config.resume_groups else self.layers - 1

    def group_of(self, layer: int) -> int:
        """The recompute phase of a row that resumes at `layer`: the last whose first layer is at or before it."""
        return max(g for g in range(self.config.resume_groups) if self.first_layer(g) <= layer)

    def init_state(self, batch, device):
        zeros = lambda: torch.zeros(batch, dtype=torch.long, device=device)  # noqa: E731
        # pending: the last decode failed the drift test at layer `at`; recomputes / recomputed: their count and
        # the layers they ran
        return {"fresh": zeros(), "nfe": zeros(), "pending": zeros(), "at": zeros(), "recomputes": zeros(),
                "recomputed": zeros()}

    def capacity_state(self, batch, capacity, device):
        # stats: the per-(layer, KV head) mass of a forward (its KV source, then its window); prev: per layer the
        # mass each position got in the last step (the drift test's reference); held: a failed decode's, kept for
        # the layers its recompute does not run; new: the positions decoded in the last step; watched: the tokens
        # the drift test compares
        L, KVH, Q = self.layers, self.kv_heads, self.queries(capacity)
        flags = lambda: torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # noqa: E731
        return {"stats": torch.zeros(batch, L, KVH, capacity + Q, device=device),
                "prev": torch.zeros(batch, L, KVH, capacity, device=device),
                "held": torch.zeros(batch, L, KVH, capacity, device=device), "new": flags(), "watched": flags()}

    def queries(self, capacity: int) -> int:
        """Q: the decode forward's query slots (window, previous step's tokens, watched tokens)."""
        return 2 * self.config.window + min(self.layers * self.config.watch, capacity)

    # --- the step ------------------------------------------------------------------------------------------------
    def acting(self, phase, st):
        if phase == "refresh":
            return super().acting(phase, st)
        fresh, pending = st.policy["fresh"] > 0, st.policy["pending"] > 0
        if phase == "decode":
            return st.active & fresh & ~pending
        at = st.policy["at"]
        return st.active & fresh & pending & (at >= self.phase_first(phase)) & (at <= self.phase_last(phase))

    def window(self, st) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [B, W], live [B, W], left [B]): the first `window` masked positions of the block (padding past
        them), and the block's masked positions in all."""
        pos, in_block, working = self.regions(st)
        masked = (st.seq == self.mask_id) & (pos >= st.prompt_len[:, None]) & in_block & working
        w_pos, w_live = self.compact(masked, self.config.window)
        return w_pos, w_live, masked.sum(1)

    def plan(self, phase, st):
        act = self.acting(phase, st)
        T = st.seq.shape[1]
        pos, _, working = self.regions(st)
        w_pos, w_live, _ = self.window(st)
        need = w_live & act[:, None]
        stats = st.policy["stats"].transpose(0, 1)  # [L, B, KVH, S + Q], as the attention fills it
        if phase == "decode":
            member = (marks(w_pos, need, T) | ((st.policy["new"] | st.policy["watched"]) & working)) & act[:, None]
            q_pos, q_live = self.compact(member, self.queries(T))
            prefix_len, kv_index = self.cache_around(st, q_pos, q_live, act)
            see = 1 << torch.arange(2, dtype=torch.int32, device=st.seq.device)  # padding sees only itself
            spec = AttentionSpec(QueryGroups((~q_live).int(), see), prefix_len=prefix_len, kv_index=kv_index,
                                 stats=stats[..., :T + q_pos.shape[1]],
                                 stats_queries=marks(w_pos, need, T).gather(1, q_pos) & q_live)
            logits_at = (member.long().cumsum(1) - 1).gather(1, w_pos).clamp(min=0)  # the window among the set
            return Forward(st.seq.gather(1, q_pos), q_pos, spec, kv_write=torch.where(q_live, q_pos, -1),
                           logits_at=logits_at, logits_rows=need, keep_hidden=True,
                           route_groups=route_groups(q_pos, self.block_size, q_live))
        # refresh, recompute: the whole working sequence, no KV source; the recompute from each row's layer on
        live = working & act[:, None]
        spec = AttentionSpec(Bidirectional(st.work_len), stats=stats[..., :T], stats_queries=marks(w_pos, need, T))
        resume = None if phase == "refresh" else Resume(self.phase_first(phase), st.policy["at"],
                                                        self.phase_last(phase))
        return Forward(st.seq, pos, spec, kv_write=torch.where(live, pos, -1), logits_at=w_pos, logits_rows=need,
                       keep_hidden=True, resume=resume, route_groups=route_groups(pos, self.block_size, live))

    def watch(self, mass: torch.Tensor, working: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: per layer the `watch` positions of largest mass [B, L, KVH, T] (its heads summed), united
        over the layers."""
        T = mass.shape[-1]
        top = torch.topk(mass.sum(2).masked_fill(~working[:, None], float("-inf")), min(self.config.watch, T), dim=2)
        return marks(top.indices.flatten(1), (top.values > float("-inf")).flatten(1), T)

    def drift_layer(self, prev: torch.Tensor, now: torch.Tensor, watched: torch.Tensor) -> torch.Tensor:
        """[B] long: the first layer whose watched tokens' attention moved (cosine <= gamma), the layer count if
        none. prev, now [B, L, KVH, T]: per (layer, KV head) the mass each position got in the last step and in this
        one; watched [B, T] bool."""
        B, L = prev.shape[:2]
        a, b = (torch.where(watched[:, None, None], m, 0.0).flatten(2) for m in (prev, now))
        norms = a.norm(dim=2) * b.norm(dim=2)
        cos = torch.where(norms > 0, (a * b).sum(2) / norms.clamp(min=1e-30), 1.0).clamp(max=1.0)
        layer = torch.arange(L, device=prev.device).expand(B, L)
        return torch.where(cos > self.config.gamma, L, layer).min(1).values

    def update(self, phase, st, fwd, logits):
        act = self.acting(phase, st)
        T, L = st.seq.shape[1], self.layers
        working = self.regions(st)[2]
        w_pos, w_live, left = self.window(st)
        need = w_live & act[:, None]
        mass = self.position_mass(fwd.attention.stats.transpose(0, 1), fwd, T, st.capacity)  # [B, L, KVH, T]
        at = st.policy["at"]
        failed = torch.zeros_like(act)
        if phase == "decode":
            drift = self.drift_layer(st.policy["prev"], mass, st.policy["watched"])
            failed = act & (drift < L)
            at = torch.where(failed, drift, at)
        elif phase != "refresh":  # the layers the recompute did not run keep the failed decode's mass
            ran = torch.arange(L, device=mass.device)[None, :, None, None] >= at[:, None, None, None]
            mass = torch.where(ran, mass, st.policy["held"])
        nfe = st.policy["nfe"]
        v, p = self.choose(logits, need, self.noise_keys(st, w_pos, nfe))
        accept = self.transfer(p, need, st, left) & ~failed[:, None]
        done = act & ~failed & (accept.sum(1) == left)
        kept = act & ~failed  # rows whose step ends here (a failed decode's ends with its recompute)
        recompute = act & (phase not in ("refresh", "decode"))
        tokens = st.seq.gather(1, w_pos)
        state = {"fresh": torch.where(act, torch.ones_like(nfe), st.policy["fresh"]), "nfe": nfe + kept.long(),
                 "pending": torch.where(act, failed.long(), st.policy["pending"]), "at": at,
                 "recomputes": st.policy["recomputes"] + recompute.long(),
                 "recomputed": st.policy["recomputed"] + torch.where(recompute, L - at, 0),
                 "prev": torch.where(kept[:, None, None, None], mass, st.policy["prev"]),
                 "held": torch.where(failed[:, None, None, None], mass, st.policy["held"]),
                 "new": torch.where(kept[:, None], marks(w_pos, accept, T), st.policy["new"]),
                 "watched": torch.where(kept[:, None], self.watch(mass, working), st.policy["watched"]),
                 "stats": torch.zeros_like(st.policy["stats"])}
        return Update(torch.where(need, w_pos, -1), torch.where(accept, v, tokens), done.long(), state)

    def transfer(self, p, need, st, left) -> torch.Tensor:
        """[B, W] bool: Fast-dLLM's rule over the window, or its fixed-step count for the block."""
        steps = self.config.steps
        if steps is None:
            k = torch.ones_like(left)
        else:  # the block's positions in the working sequence, less those still masked: decoded so far
            idx = st.block_start[:, None] + torch.arange(self.block_size, device=left.device)
            block = ((idx >= st.prompt_len[:, None]) & (idx < st.work_len[:, None])).sum(1)
            k = fixed_count(steps, self.block_size, block - left)
        return select("fast_dllm", p, need, torch.minimum(k, need.sum(1)), self.config.threshold, steps is not None)

    # --- host ----------------------------------------------------------------------------------------------------
    def schedule(self, step):
        from compiledllm.engine.hooks import PhaseRun  # the engine imports the policies: not at module level

        h, L = step.state, self.layers
        pending = {s: at for s, at in h.get("pending", {}).items() if s in step.rows}
        groups = {s: self.group_of(at) for s, at in pending.items()}
        for key, n in (("row_steps", len(step.rows)), ("recomputes", len(pending)),
                       ("layers_needed", sum(L - at for at in pending.values())),
                       ("layers_run", sum(L - self.first_layer(g) for g in groups.values()))):
            h[key] = h.get(key, 0) + n
        runs = [PhaseRun(f"{RECOMPUTE}{g}", tuple(s for s in step.rows if groups.get(s) == g))
                for g in range(self.config.resume_groups)]
        return [PhaseRun("refresh", step.admitted), *runs, "decode"]

    def after_step(self, host, report):
        pending, at = torch.stack([host.st.policy["pending"], host.st.policy["at"]]).tolist()
        host.state["pending"] = {s: a for s, (p, a, live) in enumerate(zip(pending, at, report.active)) if p and live}

    def host_stats(self, host) -> dict:
        """Row-steps, how many were recomputes, the layers a recompute needed on average, and the layers its group's
        forward ran for it but discarded (resume_groups' cost)."""
        h = host.state
        n = h.get("recomputes", 0)
        if not h.get("row_steps"):
            return {}
        return {"row_steps": h["row_steps"], "recomputes": n, "recompute_share": round(n / h["row_steps"], 4),
                "recompute_layers": round(h["layers_needed"] / n, 2) if n else 0.0,
                "discarded_layers": round((h["layers_run"] - h["layers_needed"]) / n, 2) if n else 0.0}

    def on_move(self, host, src, dst):
        super().on_move(host, src, dst)
        pending = host.state.get("pending", {})
        if src in pending:
            pending[dst] = pending.pop(src)

    def report(self, st, slot):
        """Forwards as the paper counts steps (a failed decode and its recompute: one), recomputes, and the layers
        they recomputed in all (counts, so that a run's sum over requests means something)."""
        return {"nfe": int(st.policy["nfe"][slot]), "recomputes": int(st.policy["recomputes"][slot]),
                "recomputed_layers": int(st.policy["recomputed"][slot])}
