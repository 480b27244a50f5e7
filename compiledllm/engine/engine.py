"""The engine: request slots over static buffers, admission, results (the schedule itself: scheduler.py).

Requests wait until they arrive and a slot is free; a slot's prompt's full blocks are prefilled into its KV in
chunks (prefill.py), then every step runs the policy's phases on the smallest batch bucket holding all decoding
slots, and a slot is freed as soon as its request ends. Each row's tokens depend on its own prompt only (batch
invariance, for a given KV capacity).
"""
from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from compiledllm.engine.config import EngineConfig
from compiledllm.engine.memory import activation_tier, check_fits
from compiledllm.engine.prefill import Prefiller, Progress
from compiledllm.engine.scheduler import RunStats, Scheduler
from compiledllm.engine.state import SlotState
from compiledllm.engine.stepper import Stepper, default_buckets
from compiledllm.errors import UserError
from compiledllm.kv.cache import KVCache
from compiledllm.policies import PolicyConfig, make_policy, resolve_block
from compiledllm.policies.sampling import request_key


@dataclass
class GenerationResult:
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    steps: int                  # forwards made for this request (prefill not counted)
    blocks: int                 # blocks decoded
    latency_s: float = 0.0      # arrival to finish
    text: str | None = None
    extra: dict = field(default_factory=dict)
    arrival_s: float = 0.0      # when it arrived, seconds after the run's start
    first_block_s: float = 0.0  # arrival to its first retired block


def working_length(prompt_len: int, max_new_tokens: int, block: int, start: int | None = None) -> int:
    """End of the block that holds position prompt_len + max_new_tokens - 1, blocks counted from `start` (the first
    block's start, Policy.first_block; default: blocks aligned to position 0)."""
    start = prompt_len // block * block if start is None else start
    return start + -(-(prompt_len + max_new_tokens - start) // block) * block


class Engine:
    """Engine(model, EngineConfig(...)), Engine(model, policy, max_new_tokens=..., ...) or
    Engine.from_recipe(model, recipe)."""

    def __init__(self, model, config: EngineConfig | dict | PolicyConfig, **settings):
        if not isinstance(config, EngineConfig):
            config = EngineConfig(config, **settings)
        elif settings:
            raise TypeError("pass settings inside the EngineConfig")
        self.model, self.config = model, config
        static = model.static_shapes  # an exported engine: fixed block, KV capacity and buckets, already compiled
        pcfg = resolve_block(config.policy, static.block if static else model.config.default_block_size)
        self.policy = make_policy(pcfg, model.mask_token_id, model.bidirectional)
        self.block = self.policy.block_size
        if static is not None and self.block != static.block:
            raise UserError(f"policy.block_size {self.block} differs from the exported engine's {static.block}")
        self.static = static
        self.compile = config.compile and static is None
        self.cuda_graphs = config.cuda_graphs and model.device.type == "cuda" and static is None
        self.buckets = list(static.buckets) if static else (list(config.buckets) if config.buckets else None)
        self.side_stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
        self.startup_s = 0.0  # compile / capture time of the last generate()
        self.stats: RunStats | None = None  # where the last generate()'s time went

    @classmethod
    def from_recipe(cls, model, recipe) -> "Engine":
        return cls(model, EngineConfig.from_recipe(recipe))

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_new_tokens

    def capacity_for(self, prompts: list[list[int]]) -> int:
        need = max(working_length(len(p), self.max_new_tokens, self.block, self.policy.first_block(len(p)))
                   for p in prompts)
        cap = self.static.capacity if self.static else (self.config.max_seq_len or need)
        if self.static and cap < need <= self.model.config.max_position_embeddings:  # fixed when it was exported
            raise UserError(f"the exported engine's KV capacity is {cap} positions and this run needs {need} (the "
                            f"longest prompt plus max_new_tokens {self.max_new_tokens}, rounded up to a block): "
                            f"export the recipe again with --max-seq-len {need} or more")
        if cap < need and not self.static:
            raise UserError(f"KV capacity {cap} (max_seq_len) is shorter than the longest working sequence ({need})")
        limit = self.model.config.max_position_embeddings
        if need > limit:
            longest = max(len(p) for p in prompts)
            raise UserError(f"a prompt of {longest} tokens plus max_new_tokens {self.max_new_tokens} needs {need} "
                            f"positions; the model's context is {limit}")
        return cap

    def validate(self, prompts: list[list[int]]) -> None:
        """Prompts are a non-empty list of non-empty token-id lists (ints inside the vocabulary)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise UserError(f"prompts: a list of token-id lists, got {type(prompts).__name__}"
                            + (" (call .tolist() on a tensor)" if isinstance(prompts, torch.Tensor) else ""))
        if not prompts:
            raise UserError("prompts: the list is empty")
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                raise UserError(f"prompt {i}: text; generate() takes token ids (model.tokenizer.encode, or a "
                                "recipe's text prompts)")
            if not isinstance(p, (list, tuple)):
                raise UserError(f"prompt {i}: a list of token ids, got {type(p).__name__} (prompts is a list of "
                                "lists: [[1, 2, 3]], not [1, 2, 3])")
            if not p:
                raise UserError(f"prompt {i}: empty")
            bad = [t for t in p if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
            if bad:
                raise UserError(f"prompt {i}: token id {bad[0]!r} is not an integer")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise UserError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def _allocate(self, slots: int, capacity: int) -> tuple[SlotState, KVCache | None]:
        model, device, c = self.model, self.model.device, self.model.config
        kv_shape = (c.num_layers, slots, capacity, c.num_kv_heads, c.head_dim)
        tiers = [activation_tier(model, slots, capacity, self.block, self.config.prefill_tokens)]
        if not model.bidirectional:
            tiers += KVCache.tiers(*kv_shape, model.dtype, device)
        check_fits(tiers, slots, capacity)
        try:
            st = SlotState.allocate(slots, capacity, self.policy.init_state(slots, device), model.mask_token_id, device)
            kv = None if model.bidirectional else KVCache.allocate(*kv_shape, model.dtype, device)
        except torch.OutOfMemoryError:
            raise UserError(f"batch_size {slots} with {capacity} positions does not fit in {device} memory") from None
        return st, kv

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], on_result: Callable[[GenerationResult], None] | None = None,
                 arrivals: Sequence[float] | None = None,
                 request_ids: Sequence[int] | None = None) -> list[GenerationResult]:
        """Decode every prompt; results in prompt order. arrivals[i]: seconds after the start (once compiled and
        captured) at which prompt i arrives (default: all at once). request_ids[i]: prompt i's id, its result's
        index and its sampling key (default i): a share of a larger run decodes each request as the run would."""
        self.validate(prompts)
        prompts = [[int(t) for t in p] for p in prompts]
        arrivals = self._arrivals(arrivals, len(prompts))
        self._ids = list(range(len(prompts))) if request_ids is None else [int(i) for i in request_ids]
        if len(self._ids) != len(prompts):
            raise UserError(f"request_ids: {len(self._ids)} ids for {len(prompts)} prompts")
        slots = min(self.config.batch_size, len(prompts))
        if self.static:  # run on exported bucket sizes only
            slots = next((b for b in self.buckets if b >= slots), max(self.buckets))
        capacity = self.capacity_for(prompts)
        st, kv = self._allocate(slots, capacity)

        buckets = self.buckets or (default_buckets(slots) if self.cuda_graphs or not self.compile else [slots])
        buckets = [b for b in buckets if b <= slots]
        if not buckets or max(buckets) < slots:
            buckets = [*buckets, slots]
        eos = -1 if self.config.ignore_eos else self.model.eos_token_id
        stepper = Stepper(self.model, self.policy, st, kv, buckets, self.compile, self.cuda_graphs, eos_id=eos)
        prefiller = None if kv is None else Prefiller(self.model, self.block, self.config.prefill_chunk,
                                                      self.config.prefill_tokens, self.static.buckets if self.static else None)
        self.startup_s = stepper.startup_s
        run = Scheduler(self, st, kv, stepper, prefiller, prompts, arrivals, on_result)
        results = run.loop()
        self.stats = run.stats()
        return results

    @staticmethod
    def _arrivals(arrivals: Sequence[float] | None, n: int) -> list[float]:
        if arrivals is None:
            return [0.0] * n
        if len(arrivals) != n:
            raise UserError(f"arrivals: {len(arrivals)} times for {n} prompts")
        bad = [a for a in arrivals if not isinstance(a, numbers.Real) or not 0 <= a < float("inf")]
        if bad:
            raise UserError(f"arrivals: {bad[0]!r} is not a time in seconds >= 0")
        return [float(a) for a in arrivals]

    def _admit(self, st: SlotState, s: int, index: int, prompt: list[int]) -> Progress:
        """Put a request in slot s; it decodes once its prompt's full blocks are prefilled (Progress)."""
        P = len(prompt)
        st.seq[s].fill_(self.model.mask_token_id)
        st.seq[s, :P] = torch.tensor(prompt, device=st.seq.device)
        start = self.policy.first_block(P)
        cached = 0 if self.model.bidirectional else start  # a bidirectional model caches nothing: no prefill
        end = working_length(P, self.max_new_tokens, self.block, start)
        st.prompt_len[s], st.work_len[s], st.block_start[s] = P, end, start
        st.steps[s], st.active[s], st.retired[s] = 0, cached == 0, 0
        st.key[s] = request_key(self.policy.sampling.seed, self._ids[index])  # its own noise: batch invariant
        for v in st.policy.values():
            v[s] = 0
        return Progress(0, cached)

    def _collect(self, st: SlotState, s: int, index: int, prompt: list[int]) -> GenerationResult:
        P = len(prompt)
        out = st.seq[s, P : P + self.max_new_tokens].tolist()
        eos = self.model.eos_token_id
        if eos in out and not self.config.ignore_eos:
            out = out[: out.index(eos) + 1]
        tok = self.model.tokenizer
        blocks = (int(st.block_start[s]) - self.policy.first_block(P)) // self.block
        return GenerationResult(index=self._ids[index], prompt_ids=list(prompt), output_ids=out, steps=int(st.steps[s]),
                                blocks=blocks, text=tok.decode(out) if tok else None, extra=self.policy.report(st, s))


def generate(model, prompts: list[list[int]], policy: dict | PolicyConfig, *, max_new_tokens: int,
             batch_size: int = 8, max_seq_len: int | None = None, compile: bool = False,
             cuda_graphs: bool = True) -> list[GenerationResult]:
    """Decode every prompt (token ids) with the policy; one result per prompt, in order."""
    config = EngineConfig(policy, max_new_tokens=max_new_tokens, batch_size=batch_size, max_seq_len=max_seq_len,
                          compile=compile, cuda_graphs=cuda_graphs)
    return Engine(model, config).generate(prompts)
