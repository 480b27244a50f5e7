"""What every decoding policy shares: the plan/update contract, the confidence rule of docs/design.md §4, and the
single-block window that `threshold` and `t2t` forward.

A policy never calls the model: for each phase of a step it describes the forward as data (Policy.plan -> a
Forward) and, given that forward's logits, what changes (Policy.update -> an Update). Both are pure tensor
functions over the engine's static slot buffers (no host syncs): they run inside the compiled / captured step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from compiledllm.attention.spec import AttentionSpec, Bidirectional
from compiledllm.kv.store import DeviceKV
from compiledllm.policies.plan import Forward, State, Update, route_groups, window_forward
from compiledllm.policies.sampling import Sampling, noise_key, sampled_confidence
from compiledllm.policies.windows import expand
from compiledllm.triton_support import triton_on_cuda

if TYPE_CHECKING:
    from compiledllm.engine.hooks import HostContext, Schedule, StepReport, StepView
    from compiledllm.engine.state import SlotState
    from compiledllm.kv.store import KVLayout


@dataclass(frozen=True)
class PolicyConfig:
    block_size: int | None = None  # None: the model's own (config.json's block size, e.g. SDAR's 4)
    temperature: float = 0.0       # sampling (policies/sampling.py); 0: greedy, the exact decode
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        self.sampling  # noqa: B018  (validates the sampling keys)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.seed)

    def with_block(self, default: int) -> "PolicyConfig":
        """The config with block_size resolved (the model's default where the recipe gives none)."""
        return self if self.block_size is not None else replace(self, block_size=default)

    def for_engine(self, kv_hook: bool, device: torch.device, exported: bool) -> "PolicyConfig":
        """The config with its engine-dependent settings resolved (default: none; threshold's `commit: auto`).
        kv_hook: the policy's class fills KV of its own after a forward; exported: the engine runs an export."""
        return self


def check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: must be within [0, 1], got {value}")


@torch.compiler.assume_constant_result  # a constant to torch.compile: not traced
def fused_confidence_available() -> bool:
    """Registers the one-kernel form (confidence_kernel.py) where Triton and CUDA exist."""
    if not triton_on_cuda():
        return False
    from compiledllm.policies import confidence_kernel  # noqa: F401  (registers the op)

    return True


def confidence(logits: torch.Tensor, mask_id: int, need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v, p): argmax token with MASK excluded (ties -> lower id) and its softmax probability over the full
    vocabulary, computed in float32. logits [B, L, V] (any float dtype), need [B, L] bool -> [B, L] each;
    where need is False, v = MASK and p = -1 (the fused kernel skips those rows)."""
    if logits.is_cuda and logits.is_contiguous() and fused_confidence_available():
        return torch.ops.compiledllm.confidence(logits, need, mask_id)
    probs = torch.softmax(logits.float(), dim=-1)
    probs[..., mask_id] = -1.0  # a scalar fill: no host-to-device copy, so it captures in a CUDA graph
    p, v = probs.max(dim=-1)  # max returns the first (lowest) index among ties
    return torch.where(need, v, mask_id), torch.where(need, p, -1.0)


def top_confident(conf: torch.Tensor, candidates: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: the k[b] most confident candidate positions of each row (ties -> lower position)."""
    score = torch.where(candidates, conf, torch.full_like(conf, -2.0))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(conf.shape[1], device=conf.device).expand_as(order))
    return candidates & (rank < k[:, None])


def logits_view(fwd: Forward) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, tokens) [B, K] of the rows the forward returned logits for."""
    if fwd.logits_at is None:
        return fwd.positions, fwd.tokens
    return fwd.positions.gather(1, fwd.logits_at), fwd.tokens.gather(1, fwd.logits_at)


class Policy(ABC):
    """One decoding algorithm: a step is `phases` in order, each one plan + one update."""

    name: str
    phases: tuple[str, ...] = ("decode",)

    def __init__(self, config: PolicyConfig, mask_id: int, bidirectional: bool = False):
        if config.block_size is None:
            raise ValueError("resolve block_size first (PolicyConfig.with_block)")
        self.config = config
        self.mask_id = mask_id
        self.bidirectional = bidirectional  # True: nothing is cached, every forward reads the whole sequence
        self.sampling = config.sampling

    def noise_keys(self, st: SlotState, positions: torch.Tensor, draws: torch.Tensor | None = None):
        """[B, K] the sampling keys of the logits rows at `positions` (None when greedy); draws: the rows' count of
        kept updates (default: their forwards, st.steps)."""
        if self.sampling.greedy:
            return None
        return noise_key(st.key, st.steps if draws is None else draws, positions)

    def choose(self, logits: torch.Tensor, need: torch.Tensor,
               keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(v, p): the confidence rule, or with sampling v drawn (keys from noise_keys) and p its probability."""
        if keys is None:
            return confidence(logits, self.mask_id, need)
        return sampled_confidence(logits, self.mask_id, need, self.sampling, keys)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def first_block(self, prompt_len: int) -> int:
        """Where a request's first block starts (on the host): blocks align to position 0, so a partial prompt
        block decodes with the first generated tokens (docs/design.md §4)."""
        return prompt_len // self.block_size * self.block_size

    def init_state(self, batch: int, device: torch.device) -> State:
        """Per-row state buffers (zeros = the state at the start of a request's first block)."""
        return {}

    def capacity_state(self, batch: int, capacity: int, device: torch.device) -> State:
        """Per-row state buffers whose size follows the session's KV capacity (an attention-mass accumulator over
        every cached position, for one), zeros at admission like init_state's; the session adds them to it."""
        return {}

    @abstractmethod
    def plan(self, phase: str, st: SlotState) -> Forward:
        """The forward of `phase` for every slot (inactive rows included: their results are discarded)."""

    @abstractmethod
    def update(self, phase: str, st: SlotState, fwd: Forward, logits: torch.Tensor) -> Update:
        """What `phase` changes, from the logits [B, K, V] (the model's dtype; defined where fwd.logits_rows)."""

    # --- where KV lives (kv/store.py) -------------------------------------------------------------------------
    @property
    def caches_kv(self) -> bool:
        """Whether this policy keeps KV between forwards (default: block-causal models do; a policy may cache for a
        bidirectional model too, approximately, as Fast-dLLM's prefix cache does)."""
        return not self.bidirectional

    def kv_layout(self, model, slots: int, capacity: int) -> KVLayout | None:
        """The KV store this policy decodes against, sized before anything is allocated (None: nothing cached).
        Default: every layer of every slot in one device cache."""
        return DeviceKV.for_model(model, slots, capacity) if self.caches_kv else None

    @property
    def prefills(self) -> bool:
        """Whether the engine prefills requests into the KV (default: whenever KV is cached; False for a policy whose
        first forward writes every position itself)."""
        return self.caches_kv

    def prefill_end(self, prompt_len: int) -> int:
        """Positions [0, end) the engine prefills into the KV before a request's first step (0: none)."""
        return self.first_block(prompt_len) if self.prefills else 0

    def prefill_step(self) -> str | None:
        """The phase whose update a prompt's last prefill forward also makes, its block's queries placed after the
        prompt's (the request's first step, one forward fewer before its first block), or None: the first step is a
        step of its own. Only a phase whose forward is the block against the cached prefix and whose update reads
        nothing but that forward, its logits and the rows' state qualifies."""
        return None

    # True: rows that begin blocks on different steps cost this policy forwards (threshold's fused commit runs two
    # blocks of queries for the whole batch on every step where some row begins one), so the engine keeps rows that
    # join in step with the decoding ones where it can (engine/session.py, first_block prefill turns)
    lockstep = False

    kv_hook = False  # True: after_forward runs inside every phase (captured with it), with the step's KV store

    def after_forward(self, phase: str, st: SlotState, fwd: Forward, upd: Update, kv) -> None:
        """Device work on the KV store after a phase's forward and update, before the engine applies the update
        (st as the forward saw it): gather a selection into a pool, stage a draft's KV. Pure tensor work, captured
        with the phase; only called when `kv_hook` is True."""

    # --- per request ---------------------------------------------------------------------------------------------
    def row_params(self) -> dict[str, float]:
        """Settings a request may override without changing shapes (name -> this config's value): the engine keeps
        one [B] float32 buffer each in st.params, filled per request at admission (EngineSession.add(policy=...))."""
        return {}

    # --- host hooks (engine/hooks.py) ----------------------------------------------------------------------------
    row_phases: tuple[str, ...] = ()  # phases that `schedule` may run on a subset of rows (hooks.PhaseRun)
    # phases that read and write only positions [0, W) of every per-slot buffer where W holds the working sequence of
    # each row they act on: the engine runs them narrowed to the rows' need (policies/windows.py). Such a phase sizes
    # everything from st.seq.shape[1] and addresses a KV pool with st.capacity, and its capacity_state buffers keep
    # capacity + a fixed count on their last axis
    narrow_phases: tuple[str, ...] = ()

    def schedule(self, step: StepView) -> Schedule:
        """The phases of the next step, chosen on the host (default: all, on every decoding row); a phase listed in
        `row_phases` may come as PhaseRun(phase, rows), and a phase left out does not run."""
        return self.phases

    def phases_for(self, capacity: int, shortest: int) -> tuple[str, ...]:
        """The phases a session of this KV capacity, whose requests each need at least `shortest` positions, can
        run: those its start-up compiles and captures (default: all, those in `narrow_phases` at each width such
        requests can get). With shortest = capacity, one step's phases where no host hook chose among them
        (run_step)."""
        return expand(self.phases, self.narrow_phases, capacity, self.block_size, shortest)

    def on_blocks(self, host: HostContext, rows: list[int]) -> None:
        """Host work when rows begin a block (after admission and after a step that retired blocks); may queue
        device work on host.side_stream. Default: none."""

    def before_step(self, host: HostContext, step: StepView) -> None:
        """Host work right before the step is launched (wait for an event, hand work to host.worker)."""

    def after_step(self, host: HostContext, report: StepReport) -> None:
        """Host work right after the step's one sync (collect what host.worker computed meanwhile)."""

    def on_move(self, host: HostContext, src: int, dst: int) -> None:
        """A request moved from slot src to dst (compaction); its buffers and KV moved already: move host state."""

    def report(self, st: SlotState, slot: int) -> dict:
        """Per-request statistics of the policy, read once the request in `slot` ended (GenerationResult.extra)."""
        return {}

    def host_stats(self, host: HostContext) -> dict:
        """The policy's counters for the session so far (RunStats.policy; `compiledllm bench` records them)."""
        return {}


class BlockPolicy(Policy):
    """A policy that decodes one block per row at a time (`threshold`, `t2t`): its forward is the current block
    against the cached prefix (block-causal models) or the whole working sequence (bidirectional models), the
    latter narrowed to the step's longest working sequence (policies/windows.py: a session sized for long requests
    computes about its requests' lengths)."""

    def __init__(self, config: PolicyConfig, mask_id: int, bidirectional: bool = False):
        super().__init__(config, mask_id, bidirectional)
        if bidirectional:
            self.narrow_phases = ("decode",)

    def block_window(self, st: SlotState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(idx, tokens, gen) [B, Bk]: the block's positions, its tokens, and which are generated (changeable)."""
        T = st.seq.shape[1]
        idx = (st.block_start[:, None] + torch.arange(self.block_size, device=st.seq.device)).clamp(max=T - 1)
        return idx, st.seq.gather(1, idx), idx >= st.prompt_len[:, None]

    def block_forward(self, st: SlotState, idx: torch.Tensor, tokens: torch.Tensor, need: torch.Tensor) -> Forward:
        if self.bidirectional:  # every position (of the narrowed state: the engine's width holds each work_len)
            B, T = st.seq.shape
            pos = torch.arange(T, device=st.seq.device).expand(B, T)
            live = (pos < st.work_len[:, None]) & st.active[:, None]  # past the working sequence: padding
            return Forward(st.seq, pos, AttentionSpec(Bidirectional(st.work_len)), logits_at=idx, logits_rows=need,
                           route_groups=route_groups(pos, self.block_size, live))
        # the block against the cached prefix; a finished row writes nothing and routes nowhere
        return window_forward(tokens, idx, st.block_start, self.block_size, st.active[:, None], logits_rows=need)

    def needed(self, tokens: torch.Tensor, gen: torch.Tensor, state: State) -> torch.Tensor:
        """[B, Bk] bool: the block positions whose logits `update` reads (the head may skip the others)."""
        return gen

    def plan(self, phase: str, st: SlotState) -> Forward:
        idx, tokens, gen = self.block_window(st)
        return self.block_forward(st, idx, tokens, self.needed(tokens, gen, st.policy))

    def update(self, phase: str, st: SlotState, fwd: Forward, logits: torch.Tensor) -> Update:
        pos, tokens = logits_view(fwd)
        gen = pos >= st.prompt_len[:, None]
        keys = self.noise_keys(st, pos, self.draws(st))
        new, done, state = self.decide(tokens, logits, gen, st.policy | st.params, keys)
        return Update(torch.where(gen, pos, -1), new, done.long(), state)

    def draws(self, st: SlotState) -> torch.Tensor | None:
        """[B] the draw counter the sampling keys use with the positions (None: the rows' forwards, st.steps)."""
        return None

    @abstractmethod
    def decide(self, tokens: torch.Tensor, logits: torch.Tensor, gen: torch.Tensor, state: State,
               keys: torch.Tensor | None):
        """tokens / gen [B, Bk], logits [B, Bk, V], state: the policy's state and the rows' params (row_params),
        keys: for `choose` -> (new tokens [B, Bk], block done [B] bool, new state (the policy's keys only), already
        reset for the rows whose block is done)."""
