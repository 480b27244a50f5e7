"""A step: each phase of the policy's plan is forward -> update -> apply, as pure tensor functions over SlotState's
static buffers (per-row progress, acceptance, block ends and EOS are masks, never host branches), so the same
functions run eagerly, under torch.compile, or captured as CUDA graphs (docs/design.md §2, §6).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from compiledllm.attention.spec import Kernels
from compiledllm.engine.state import SlotState
from compiledllm.policies.base import Policy
from compiledllm.policies.plan import Forward, Update
from compiledllm.policies.windows import split
from compiledllm.profiling import phase as profile_range


@dataclass(frozen=True)
class Regions:
    """Compiled forms of a phase's pieces (compile.compiled_regions): the decoder layers and finish_phase."""

    layers: tuple
    finish: Callable


def run_phase(model, policy: Policy, phase: str, st: SlotState, kv, regions: Regions | None = None,
              kernels: Kernels | None = None, eos_id: int | None = None, subset: bool = False) -> None:
    """One phase for every slot; `regions`: compiled forms of the layers and the finish (default: eager);
    `kernels`: the implementations every forward uses instead of the policy's choice (benchmarks' A/B);
    `eos_id`: the token that ends a request (default the model's; -1: none); `subset`: only the rows in
    st.selected take part (hooks.PhaseRun): the others are inactive for this phase and keep their state. A name
    "<phase>@<W>" runs the phase on the state narrowed to positions [0, W) (policies/windows.py)."""
    phase, width = split(phase)
    if width is not None:
        st = st.narrow(width)
    whole = st
    if subset:
        st = replace(st, active=st.active & st.selected)
    fwd = policy.plan(phase, st)
    if kernels is not None:
        fwd = replace(fwd, kernels=kernels)
    logits = model(fwd, kv, layers=None if regions is None else regions.layers)
    with profile_range("acceptance"):
        (finish_phase if regions is None else regions.finish)(policy, phase, st, fwd, logits,
                                                              model.eos_token_id if eos_id is None else eos_id,
                                                              kv if policy.kv_hook else None)
    if subset:  # st.active is a new tensor: the selected rows' end of decoding goes back to the slots' own
        whole.active.copy_(torch.where(whole.selected, st.active, whole.active))


def run_step(model, policy: Policy, st: SlotState, kv, phases: Sequence[str] | None = None) -> None:
    """One step's phases, eagerly (the engine's Stepper runs them compiled or captured); default
    Policy.phases_for(capacity, capacity): a step's at the whole capacity (fast_dllm_cache, whose host schedule
    picks one of its windows even then, would run them all: give it `phases`)."""
    for ph in phases or policy.phases_for(st.capacity, st.capacity):
        run_phase(model, policy, ph, st, kv)


def finish_phase(policy: Policy, phase: str, st: SlotState, fwd: Forward, logits: torch.Tensor, eos_id: int,
                 kv=None) -> None:
    """The update, the policy's post-forward KV hook (given `kv`: Policy.after_forward, captured with the step),
    then the engine's bookkeeping."""
    upd = policy.update(phase, st, fwd, logits)
    if kv is not None:
        policy.after_forward(phase, st, fwd, upd, kv)
    apply_update(st, upd, policy.block_size, eos_id)


def apply_update(st: SlotState, upd: Update, block: int, eos_id: int) -> None:
    """The engine's bookkeeping of an Update, for active rows: tokens, retired blocks, EOS stop, forward counts."""
    act = st.active
    # -1 entries rewrite position 0 (a prompt token, which no policy changes) with its own value: no branch needed
    safe = upd.write_pos.clamp(min=0)
    keep = st.seq.gather(1, safe)
    st.seq.scatter_(1, safe, torch.where((upd.write_pos >= 0) & act[:, None], upd.tokens, keep))
    adv = torch.where(act, upd.advance, 0)
    new_start = torch.minimum(st.block_start + block * adv, st.work_len)
    # stop at an EOS among the generated tokens of the blocks retired now (earlier blocks were checked before)
    pos = torch.arange(st.seq.shape[1], device=st.seq.device)
    retiring = (pos >= st.block_start[:, None]) & (pos < new_start[:, None]) & (pos >= st.prompt_len[:, None])
    eos_hit = ((st.seq == eos_id) & retiring).any(1)
    finished = (adv > 0) & (eos_hit | (new_start >= st.work_len))
    for k, v in upd.state.items():  # a row waiting for its prefill keeps its state (the zeros it was admitted with)
        st.policy[k].copy_(torch.where(act.view(-1, *[1] * (v.dim() - 1)), v, st.policy[k]))
    st.block_start.copy_(new_start)
    st.steps.add_(act.long())  # act is st.active: read before it changes below
    st.active.copy_(act & ~finished)
    st.retired.add_(adv)
