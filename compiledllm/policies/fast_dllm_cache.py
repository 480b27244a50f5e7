"""`fast_dllm_cache`: Fast-dLLM v1's prefix cache for a bidirectional model (LLaDA-8B / 1.5), the approximate KV cache
that Flash-dLLM is measured against (NVlabs/Fast-dLLM, llada/generate.py: generate_with_prefix_cache; read there, not
copied). `threshold` with `rule: fast_dllm` is the same decoder without a cache.

Blocks start at the prompt's end (`first_block(P) = P`, as threshold's rule fast_dllm) and the working sequence
ends a whole number of blocks after it. Per block:

* phase "refresh", once, when the block begins: one forward over the whole working sequence (Bidirectional(work
  length), no KV source) writes the KV of every position, and its logits at the block make the block's first
  transfer;
* phase "decode", every later step until the block has no MASK: the window [block_start, block_start + Q) (the
  block and everything after it, bidirectional among themselves, padding hidden) against the cached prefix
  [0, block_start) as the refresh wrote it; nothing is written to the cache. Q shrinks as blocks go by, as Fast-dLLM's
  window does, within static shapes: a phase per window ("decode" Q = the KV capacity T, "decode1", "decode2", ..
  T / 2, T / 4, .. in whole blocks, down to one block), and a step runs the narrowest one that holds its rows'
  longest suffix (the host keeps each row's suffix, read when its block begins, after the step's own sync). With
  `dual: true` (generate_with_dual_cache) the window is the block alone, and it sees the cached prefix and the
  cached suffix [block_end, work length) as the refresh wrote them: a KV source with a hole at the block, so the
  store is one pool per layer read through an index (kv/pooled.py).

The refresh (and with `dual` the decode) runs narrowed to the rows' working sequences (Policy.narrow_phases).

So the prefix's KV (and with `dual` the suffix's) is the one of the block's start (approximate: what the block's
steps change reaches it only at the next refresh, as in Fast-dLLM); the block (and without `dual` the suffix) is
recomputed every step.

Transfer rule (Fast-dLLM's): the most confident masked position of the block always, plus every masked block
position with p >= tau; with `steps` its fixed-step mode instead (threshold not used): exactly the schedule's count
of most confident ones (block // steps, one more in the first block % steps steps), as `threshold` with `steps`. A
block retires as soon as it has no MASK (nothing is cached from a decode forward, so no forward only to look at the
finished block), in either phase.

A step is [PhaseRun("refresh", the rows that begin a block), "decode"]: the refresh runs on the rows that need it
only. The per-row flag `fresh` (the cache holds this block's refresh) keeps correctness independent of that host
schedule: refresh acts on stale rows only, decode on fresh rows only, and a block that completes clears it. `nfe`
counts the forwards each row really made (the engine's `steps` counts one per phase for every active row, so a
decode phase that only follows a refresh which retired the row's block counts there too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiledllm.attention.spec import AttentionSpec, Bidirectional
from compiledllm.errors import UserError
from compiledllm.kv.pooled import PooledLayout, pool_index
from compiledllm.policies.base import Policy, PolicyConfig, check_probability
from compiledllm.policies.peer_rules import check_steps, fixed_count, select
from compiledllm.policies.plan import Forward, Update, route_groups
from compiledllm.policies.windows import expand, fit, report, tally, widths


@dataclass(frozen=True)
class FastDLLMCacheConfig(PolicyConfig):
    threshold: float = 0.9
    steps: int | None = None  # Fast-dLLM's fixed-step mode: a fixed count a step (module docstring)
    dual: bool = False  # the suffix's KV cached too (Fast-dLLM's dual cache); else recomputed (its prefix cache)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("threshold", self.threshold)
        check_steps(self.steps, self.block_size)


class RefreshCachePolicy(Policy):
    """What the approximate caches of a bidirectional model share (Fast-dLLM's here, Flash-dLLM's flash_dllm.py): a
    "refresh" forward of a row's whole working sequence writes every position's KV (so nothing is prefilled), then
    "decode" forwards read it; blocks start where the prompt ends. `cache` names the cache in the refusal of a
    block-causal model."""

    phases = ("refresh", "decode")
    row_phases = ("refresh",)
    prefills = False
    cache = ""

    def __init__(self, config, mask_id, bidirectional=False):
        if not bidirectional:
            raise UserError(f"policy {self.name}: {self.cache} of a bidirectional model (LLaDA); a block-causal "
                            "model's own KV cache is exact: use threshold")
        super().__init__(config, mask_id, bidirectional)

    @property
    def caches_kv(self) -> bool:
        return True  # the refresh's KV, read by the decode forwards

    @property
    def narrow_phases(self) -> tuple[str, ...]:
        return self.phases  # each reads and writes its rows' working sequences only

    def first_block(self, prompt_len: int) -> int:
        return prompt_len

    def acting(self, phase: str, st) -> torch.Tensor:
        """[B] bool: the rows this phase forwards for (refresh: stale rows; every other phase: fresh ones)."""
        fresh = st.policy["fresh"] > 0
        return st.active & (~fresh if phase == "refresh" else fresh)

    def transfer(self, p, masked, idx, st) -> tuple[torch.Tensor, torch.Tensor]:
        """(accept [B, Bk], left [B]): Fast-dLLM's rule on the block's confidences, or its fixed-step count."""
        left, steps = masked.sum(1), self.config.steps
        if steps is None:
            k = torch.ones_like(left)
        else:  # the block's positions in the working sequence, less those still masked: decoded so far
            k = fixed_count(steps, self.block_size,
                            ((idx >= st.prompt_len[:, None]) & (idx < st.work_len[:, None])).sum(1) - left)
        return select("fast_dllm", p, masked, torch.minimum(k, left), self.config.threshold, steps is not None), left


class FastDLLMCachePolicy(RefreshCachePolicy):
    name = "fast_dllm_cache"
    cache = "Fast-dLLM's prefix cache"
    config: FastDLLMCacheConfig

    @property
    def narrow_phases(self) -> tuple[str, ...]:
        return self.phases if self.config.dual else ("refresh",)  # the prefix cache's windows are its own

    def phases_for(self, capacity, shortest):  # every decode window: a row's suffix shrinks to one block
        if self.config.dual:
            return super().phases_for(capacity, shortest)
        return expand(("refresh", *query_windows(capacity, self.block_size)), self.narrow_phases, capacity,
                      self.block_size, shortest)

    # --- where KV lives ------------------------------------------------------------------------------------------
    def kv_layout(self, model, slots: int, capacity: int):
        if not self.config.dual:
            return super().kv_layout(model, slots, capacity)
        return PooledLayout.for_model(model, slots, capacity)

    def init_state(self, batch, device):
        zeros = lambda: torch.zeros(batch, dtype=torch.long, device=device)  # noqa: E731
        return {"fresh": zeros(), "nfe": zeros()}

    # --- the step ------------------------------------------------------------------------------------------------
    def block(self, st) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, tokens) [B, Bk]: the block's positions and tokens."""
        T = st.seq.shape[1]
        idx = (st.block_start[:, None] + torch.arange(self.block_size, device=st.seq.device)).clamp(max=T - 1)
        return idx, st.seq.gather(1, idx)

    def masked(self, phase: str, st) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx, tokens = self.block(st)
        act = self.acting(phase, st)
        return idx, tokens, (tokens == self.mask_id) & (idx >= st.prompt_len[:, None]) & act[:, None]

    def plan(self, phase, st):
        B, T = st.seq.shape
        dev = st.seq.device
        act = self.acting(phase, st)
        idx, _, need = self.masked(phase, st)
        if phase == "refresh":  # the whole working sequence, no KV source; writes the KV of every position
            pos = torch.arange(T, device=dev).expand(B, T)
            live = (pos < st.work_len[:, None]) & act[:, None]
            return Forward(st.seq, pos, AttentionSpec(Bidirectional(st.work_len)), kv_write=torch.where(live, pos, -1),
                           logits_at=idx, logits_rows=need, route_groups=route_groups(pos, self.block_size, live))
        if self.config.dual:  # the block against the cached positions around it; no KV written
            Bk = self.block_size
            around = torch.arange(T - Bk, device=dev)
            around = torch.where(around < st.block_start[:, None], around, around + Bk)
            spec = AttentionSpec(Bidirectional(torch.full_like(st.work_len, Bk)),
                                 prefix_len=(st.work_len - Bk).clamp(min=0), kv_index=pool_index(around, st.capacity))
            return Forward(st.seq.gather(1, idx), idx, spec, logits_rows=need,
                           route_groups=route_groups(idx, Bk, act[:, None].expand_as(idx)))
        # decode: [block_start, block_start + Q) against the cached prefix [0, block_start); no KV written
        length = (st.work_len - st.block_start).clamp(min=0)
        window = torch.arange(query_windows(T, self.block_size)[phase], device=dev)
        pos = (st.block_start[:, None] + window).clamp(max=T - 1)
        live = (window < length[:, None]) & act[:, None]
        first = window[: self.block_size].expand(B, self.block_size)  # the block: the window's first Bk queries
        spec = AttentionSpec(Bidirectional(length), prefix_len=st.block_start)
        return Forward(st.seq.gather(1, pos), pos, spec, kv_write=None, logits_at=first, logits_rows=need,
                       route_groups=route_groups(pos, self.block_size, live))

    def update(self, phase, st, fwd, logits):
        act = self.acting(phase, st)
        idx, tokens, masked = self.masked(phase, st)
        nfe = st.policy["nfe"]
        v, p = self.choose(logits, masked, self.noise_keys(st, idx, nfe))
        accept, left = self.transfer(p, masked, idx, st)
        done = act & (accept.sum(1) == left)  # no MASK left in the block after this update: it retires now
        fresh = torch.where(act, (~done).long(), st.policy["fresh"])
        return Update(torch.where(masked, idx, -1), torch.where(accept, v, tokens), done.long(),
                      {"fresh": fresh, "nfe": nfe + act.long()})

    # --- host ----------------------------------------------------------------------------------------------------
    def schedule(self, step):
        from compiledllm.engine.hooks import PhaseRun  # the engine imports the policies: not at module level

        h, T = step.state, step.capacity
        if self.config.dual:
            return [PhaseRun("refresh", step.begun), "decode"]
        Bk = self.block_size
        Q = fit(T, Bk, max(h.get("suffix", {}).get(s, T) for s in step.rows), query_halvings(T, Bk))
        tally(h, "decode_windows", Q)
        return [PhaseRun("refresh", step.begun), {q: ph for ph, q in query_windows(T, Bk).items()}[Q]]

    def on_blocks(self, host, rows):
        if self.config.dual:
            return
        st = host.st  # a row's longest window from now on: its suffix from this block's start
        host.state.setdefault("suffix", {}).update(zip(rows, (st.work_len[rows] - st.block_start[rows]).tolist()))

    def on_move(self, host, src, dst):
        suffix = host.state.get("suffix", {})
        if src in suffix:
            suffix[dst] = suffix.pop(src)

    def host_stats(self, host) -> dict:
        """The prefix cache's decode steps per window size (query positions): how far the window shrank."""
        return report(host.state, "decode_windows")

    def report(self, st, slot):
        return {"nfe": int(st.policy["nfe"][slot])}


def query_windows(T: int, block: int) -> dict[str, int]:
    """The prefix cache's decode phases at capacity T -> their query positions, widest first: "decode" T, then
    "decode1", "decode2", .. halving in whole blocks down to one block (the last block's window)."""
    return {f"decode{k or ''}": w for k, w in enumerate(widths(T, block, query_halvings(T, block)))}


def query_halvings(T: int, block: int) -> int:
    """Halvings of T that reach one block."""
    return (-(-T // block) - 1).bit_length() + 1
