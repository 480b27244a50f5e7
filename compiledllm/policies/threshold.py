"""`threshold`: confidence-threshold parallel decoding (LLaDA2.0 / Fast-dLLM), docs/design.md §4.

Accept every masked position with p > tau; if fewer than k_min are accepted, accept the k_min most
confident masked ones instead (k_min = 1, or with `steps` the LLaDA2 reference schedule: block/steps
tokens per step, the remainder spread over the first steps, so that tau = 1.0 gives exactly `steps`
accepting forwards per block). `rule` picks a peer decoder's rule instead (policies/peer_rules.py).

Committing a block (block-causal models, whose KV is cached): a block's KV must come from a forward that saw it
final (docs/design.md §4). `commit: separate` retires a block in the forward after its last MASK was
filled, which only writes that KV; a block then costs its accepting steps + 1 forwards, the last block and the EOS
block included. `commit: fused` retires the block in the step that fills its last MASK and writes its KV in the
next block's first forward: phase "commit" forwards [block n final; block n+1] as two query groups (block n sees the
prefix and itself, block n+1 the prefix, block n and itself: exactly what the separate commit and the next block's
first forward see), written for both, logits for block n+1 only. No forward is made for a block whose KV nobody
reads: a request that ends with it ends there. The tokens are the separate commit's; the forwards fewer by one a
block. The step runs "commit" (2 blocks of queries for every row of the batch) when some row begins a block, else
"decode": at small, weight-bound batches the wider forward costs about what one block does; at large,
compute-bound ones it costs more, and still paid where measured (SDAR-4B at batch 128 on an H100: +9 % output tok/s).
Sampling keys count the block's deciding steps (`block_step`), not forwards, so both commits draw alike.
`commit: auto` (the default) is fused where the engine runs on CUDA (decode measured 6-10 % faster there, batch 1 to
128: docs/results.md, issue 31 item 1) and separate on the CPU, with verify, for a policy that fills its own KV after
a block's retiring forward (`kv_hook`: mage, herald) and in an exported engine (ThresholdConfig.for_engine); a
policy built without an engine (make_policy) takes auto as separate.

`verify: true` (block-causal models, separate commit; past Flash-dLLM, which verifies a bidirectional model): each
decode step is followed by Flash-Verify's forward over the drafts the rule left (policies/flash_verify.py,
BlockVerify), phase "verify"; at gamma 1 it accepts nothing and the tokens are threshold's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from compiledllm.attention.spec import AttentionSpec, QueryGroups
from compiledllm.errors import UserError
from compiledllm.policies.base import BlockPolicy, PolicyConfig, State, check_probability
from compiledllm.policies.flash_verify import BlockVerify, VerifySettings
from compiledllm.policies.peer_rules import SDAR_RULES, Rule, check_rule, check_steps, sdar_confidence, select
from compiledllm.policies.plan import Forward, route_groups


@dataclass(frozen=True)
class ThresholdConfig(VerifySettings, PolicyConfig):  # + Flash-Verify's keys (module docstring)
    threshold: float = 0.95
    steps: int | None = None
    rule: Rule = "engine"  # or sdar_static, sdar_dynamic, fast_dllm: a peer decoder's tokens (peer_rules.py)
    commit: Literal["auto", "separate", "fused"] = "auto"  # how a finished block's KV is written (module docstring)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_probability("threshold", self.threshold)
        check_steps(self.steps, self.block_size)
        check_rule(self.rule)
        self.check_verify()
        if self.verify and self.commit == "fused":
            raise ValueError("verify: checks drafts between a block's steps; it needs commit: separate")

    def for_engine(self, kv_hook: bool, device: torch.device, exported: bool) -> ThresholdConfig:
        """`commit: auto` for an engine on `device`: fused on CUDA unless verify needs the separate commit, the
        policy fills KV of its own after the forward that retires a block (`kv_hook`: mage, herald, a sparse pool;
        with the fused commit that forward has not written the block yet) or the engine is exported (its package runs
        single-window plans); separate elsewhere (module docstring)."""
        if self.commit != "auto":
            return self
        fused = device.type == "cuda" and not exported and not self.verify and not kv_hook
        return replace(self, commit="fused" if fused else "separate")


class ThresholdPolicy(BlockVerify, BlockPolicy):
    name = "threshold"
    config: ThresholdConfig

    def __init__(self, config, mask_id, bidirectional=False):
        if config.rule == "fast_dllm" and not bidirectional:
            raise UserError("policy.rule: fast_dllm is Fast-dLLM's decode of a bidirectional model (LLaDA); this "
                            "model is block-causal: use sdar_static, sdar_dynamic or engine")
        super().__init__(config, mask_id, bidirectional)
        # bidirectional models cache nothing: their blocks already retire in the step that fills them
        self.fused = config.commit == "fused" and not bidirectional
        if self.fused and self.kv_hook:
            raise UserError(f"policy.commit: fused: {self.name} fills its own KV after the forward that retires a "
                            "block, which the fused commit writes a forward later; use separate (or auto)")
        if self.fused:
            self.phases = ("decode", "commit")
            self.lockstep = True
        if config.verify:
            if self.name != "threshold":
                raise UserError(f"policy.verify: a setting of threshold (and flash_dllm), not of {self.name}")
            if bidirectional:
                raise UserError("policy.verify: threshold verifies block-causal models (LLaDA2, SDAR); for a "
                                "bidirectional model use flash_dllm with verify: true")
            self.phases = ("decode", "verify")

    def first_block(self, prompt_len: int) -> int:
        # Fast-dLLM's blocks start where the prompt ends (nothing is cached, so no block needs to align)
        return prompt_len if self.config.rule == "fast_dllm" else super().first_block(prompt_len)

    def choose(self, logits, need, keys):
        if keys is not None and self.config.rule in SDAR_RULES:
            return sdar_confidence(logits, self.mask_id, need, self.sampling, keys)
        return super().choose(logits, need, keys)

    def min_accept(self, block_step: torch.Tensor) -> torch.Tensor:
        """Tokens to accept at least at this step of the block: 1, or with `steps` block // steps, one more in the
        first block % steps steps (1 once past `steps`). Arithmetic only, so it needs no constant tensors."""
        steps = self.config.steps
        if steps is None:
            return torch.ones_like(block_step)
        base, extra = divmod(self.block_size, steps)
        return torch.where(block_step < steps, base + (block_step < extra).long(), torch.ones_like(block_step))

    def init_state(self, batch: int, device) -> State:
        state = {"block_step": torch.zeros(batch, dtype=torch.long, device=device)}
        if self.config.verify:  # the search set (block offsets + 1), its drafts, and the drafts accepted so far
            S = self.config.search
            state |= {"search_pos": torch.zeros(batch, S, dtype=torch.long, device=device),
                      "search_tok": torch.zeros(batch, S, dtype=torch.long, device=device),
                      "verified": torch.zeros(batch, dtype=torch.long, device=device)}
        if self.fused:  # the row's previous block is retired and its KV not yet written
            state["pending"] = torch.zeros(batch, dtype=torch.bool, device=device)
        return state

    def draws(self, st) -> torch.Tensor:
        return st.policy["block_step"]

    def schedule(self, step):
        """One phase a step: "commit" when a row begins a block (its previous block's KV is due, unless it was just
        admitted: then its previous-block queries are dead), else "decode"."""
        if not self.fused:
            return super().schedule(step)
        commit = bool(set(step.begun) & set(step.rows))
        step.state["commit_steps"] = step.state.get("commit_steps", 0) + commit
        return ("commit",) if commit else ("decode",)

    def host_stats(self, host):
        """The fused commit's steps that ran two blocks of queries for the whole batch (one a block while the rows
        begin blocks in step)."""
        return {"commit_steps": host.state.get("commit_steps", 0)} if self.fused else {}

    def plan(self, phase: str, st) -> Forward:
        if phase == "verify":
            return self.block_verify_plan(st)
        if phase != "commit":
            return super().plan(phase, st)
        idx, tokens, gen = self.block_window(st)
        B, Bk = idx.shape
        pending = st.policy["pending"] & st.active
        prev = (idx - Bk).clamp(min=0)
        positions = torch.cat([prev, idx], 1)
        live = torch.cat([pending[:, None].expand(B, Bk), st.active[:, None].expand(B, Bk)], 1)
        # groups: 0 block n+1 (sees 0 and 1), 1 block n when due (sees itself), 2 dead queries (see only themselves)
        group = torch.cat([torch.where(pending, 1, 2)[:, None].expand(B, Bk), torch.zeros_like(idx)], 1).int()
        g = torch.arange(3, device=idx.device, dtype=torch.int32)
        see = (1 << g) | torch.where(g == 0, 2, 0).int()
        prefix = st.block_start - Bk * pending.long()
        return Forward(torch.cat([st.seq.gather(1, prev), tokens], 1), positions,
                       AttentionSpec(QueryGroups(group, see), prefix_len=prefix),
                       kv_write=torch.where(live, positions, -1), logits_at=Bk + torch.arange(Bk, device=idx.device)
                       .expand(B, Bk), logits_rows=self.needed(tokens, gen, st.policy),
                       route_groups=route_groups(positions, Bk, live))

    def prefill_step(self) -> str | None:
        """"decode" (block-causal models; not with verify, whose first step is two forwards, nor for a policy that
        fills KV of its own after a forward: mage, herald)."""
        return None if self.bidirectional or self.kv_hook or self.config.verify else "decode"

    def update(self, phase, st, fwd, logits):
        if phase == "verify":
            return self.block_verify_update(st, logits)
        return super().update(phase, st, fwd, logits)

    def report(self, st, slot):
        return {"verified": int(st.policy["verified"][slot])} if self.config.verify else {}

    def row_params(self) -> dict[str, float]:
        return {"threshold": self.config.threshold}  # a request may ask for its own tau (the same shapes)

    def needed(self, tokens, gen, state):
        return (tokens == self.mask_id) & gen

    def decide(self, tokens, logits, gen, state, keys):
        masked = self.needed(tokens, gen, state)
        v, p = self.choose(logits, masked, keys)
        return self.accept(tokens, masked, v, p, state)

    def accept(self, tokens, masked, v, p, state):
        """The rule on the chosen tokens v and their probabilities p ([B, Bk]) -> decide's result."""
        n_masked = masked.sum(1)
        k_min = torch.minimum(self.min_accept(state["block_step"]), n_masked)
        tau = state["threshold"][:, None] if "threshold" in state else self.config.threshold
        accept = select(self.config.rule, p, masked, k_min, tau, self.config.steps is not None)
        # Done when this forward saw the block final (its KV is the block's). Nothing is cached for bidirectional
        # models, and a fused commit writes the KV in the next block's first forward: there the block is done as
        # soon as its last MASK is filled, with no forward only to look at it.
        done = n_masked == 0
        if self.bidirectional or self.fused:
            done = done | (accept.sum(1) == n_masked)
        block_step = torch.where(done, 0, state["block_step"] + 1)
        new = {"block_step": block_step} | ({"pending": done} if self.fused else {})
        if self.config.verify:
            new |= self.search_state(p, masked, accept, v)
        return torch.where(accept, v, tokens), done, new
