"""The engine: a model, a policy and settings; `generate` is a loop over an EngineSession (session.py).

Requests wait until they arrive and a slot is free; a slot's prompt's full blocks are prefilled into its KV in
chunks (prefill.py), then every step runs the policy's phases on the smallest batch bucket holding all decoding
slots, and a slot is freed as soon as its request ends. Each row's tokens depend on its own prompt only (batch
invariance, for a given KV capacity).
"""
from __future__ import annotations

import numbers
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

from compiledllm.engine.compile import resolve_compile
from compiledllm.engine.config import EngineConfig
from compiledllm.engine.request import Event, FinishEvent, GenerationResult, RequestParams, working_length
from compiledllm.engine.scheduler import RunStats
from compiledllm.engine.session import EngineSession
from compiledllm.errors import UserError
from compiledllm.kv.cache import KVCache
from compiledllm.policies import PolicyConfig, make_policy, policy_class, resolve_block
from compiledllm.signals import shielded


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
        pcfg = pcfg.for_engine(policy_class(pcfg).kv_hook, model.device, exported=static is not None)
        self.policy = make_policy(pcfg, model.mask_token_id, model.bidirectional)
        self.block = self.policy.block_size
        if static is not None and self.block != static.block:
            raise UserError(f"policy.block_size {self.block} differs from the exported engine's {static.block}")
        moe = getattr(model.config, "moe", None)
        if moe is not None and moe.route_block is not None and self.block != moe.route_block:
            # the forwards' route groups are the policy's blocks: another size would route other token sets
            raise UserError(f"policy.block_size {self.block} differs from the model's routing block "
                            f"{moe.route_block} (block routing, expert_capacity {moe.expert_capacity}: config.json "
                            "block_size)")
        self.static = static
        self.compile = resolve_compile(config.compile, model.device) and static is None  # auto: CUDA only
        pc = config.prefill_compile  # auto: with the decode step, on CUDA (the CPU's prefill unchanged: not measured)
        self.prefill_compile = (self.compile and model.device.type == "cuda" if pc == "auto" else pc) and static is None
        self.cuda_graphs = config.cuda_graphs and model.device.type == "cuda" and static is None
        self.buckets = list(static.buckets) if static else (list(config.buckets) if config.buckets else None)
        self.side_stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
        self.startup_s = 0.0  # compile / capture time of the last generate()
        self.compile_cache = None  # what the last generate()'s compile found in Inductor's cache (compile_cache.py)
        self.stats: RunStats | None = None  # where the last generate()'s time went

    @classmethod
    def from_recipe(cls, model, recipe=None, overrides: list[str] | None = None) -> "Engine":
        """Engine.from_recipe(model, recipe) with a loaded model, or Engine.from_recipe(recipe) alone, which loads
        the recipe's model (model.path, device, dtype, ...) as `compiledllm run` does. `recipe`: a Recipe, the path
        of a recipe YAML file or its mapping; `overrides`: `--set`-style "key.path=value" strings for a path or a
        mapping. The recipe's prompts and output are not used (pass prompts to generate); nor is its `threads`
        (torch's thread count is the caller's)."""
        from compiledllm.recipe import Recipe, load_recipe

        if recipe is None:
            if isinstance(model, torch.nn.Module) or hasattr(model, "static_shapes"):
                raise UserError("Engine.from_recipe(model): give the recipe too (Engine.from_recipe(model, recipe)), "
                                "or the recipe alone to load its model")
            model, recipe = None, model
        if not isinstance(recipe, Recipe) or overrides:
            recipe = load_recipe(recipe, overrides)
        if model is None:
            from compiledllm.runner import load_from_spec

            p = recipe.parallel
            if p.tensor * p.expert * p.data > 1:
                raise UserError(f"Engine.from_recipe: the recipe splits the model (parallel tensor={p.tensor}, "
                                f"expert={p.expert}, data={p.data}); load this rank's share with load_from_spec and a "
                                "mesh, then call Engine.from_recipe(model, recipe)")
            model = load_from_spec(recipe.model)
        return cls(model, EngineConfig.from_recipe(recipe))

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_new_tokens

    def capacity_for(self, prompts: list[list[int]], max_new: Sequence[int] | None = None) -> int:
        """The KV capacity a run of these prompts needs (max_new[i]: prompt i's max_new_tokens, default the
        engine's), checked against the model's context and an exported engine's fixed capacity."""
        max_new = max_new or [self.max_new_tokens] * len(prompts)
        need, longest = max((working_length(len(p), n, self.block, self.policy.first_block(len(p))), n)
                            for p, n in zip(prompts, max_new))
        cap = self.static.capacity if self.static else (self.config.max_seq_len or need)
        if self.static and cap < need <= self.model.config.max_position_embeddings:  # fixed when it was exported
            raise UserError(f"the exported engine's KV capacity is {cap} positions and this run needs {need} (the "
                            f"longest prompt plus max_new_tokens {longest}, rounded up to a block): "
                            f"export the recipe again with --max-seq-len {need} or more")
        if cap < need and not self.static:
            raise UserError(f"KV capacity {cap} (max_seq_len) is shorter than the longest working sequence ({need})")
        limit = self.model.config.max_position_embeddings
        if need > limit:
            n_prompt = max(len(p) for p in prompts)
            raise UserError(f"a prompt of {n_prompt} tokens plus max_new_tokens {longest} needs {need} "
                            f"positions; the model's context is {limit}")
        return cap

    def validate(self, prompts: list[list[int]]) -> None:
        """Prompts are a non-empty list of non-empty token-id lists (ints inside the vocabulary)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise UserError(f"prompts: a list of token-id lists, got {type(prompts).__name__}"
                            + (" (call .tolist() on a tensor)" if isinstance(prompts, torch.Tensor) else ""))
        if not prompts:
            raise UserError("prompts: the list is empty")
        for i, p in enumerate(prompts):
            self.check_prompt(i, p)

    def check_prompt(self, i: int, p) -> list[int]:
        """Prompt i is a non-empty list of token ids inside the vocabulary; returns it as a list of ints."""
        vocab = self.model.config.vocab_size
        if type(p) is list and p and all(type(t) is int for t in p) and 0 <= min(p) and max(p) < vocab:
            return p  # the common case, in C loops: a 32K-token prompt in ~1 ms (the checks below take ~20 ms)
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
        return [int(t) for t in p]

    def slots_for(self, requests: int) -> int:
        """Request slots for a run of this many requests: batch_size at most (an exported engine: a bucket)."""
        slots = min(self.config.batch_size, requests)
        if self.static:  # run on exported bucket sizes only
            slots = next((b for b in self.buckets if b >= slots), max(self.buckets))
        return slots

    def compiles_prefill(self, kv) -> bool:
        """Whether a session's prefill through store `kv` compiles: `auto` through the plain device cache only (the
        one measured); `true` through every store (the selection policies' sparse and host-pool stores: equal to
        eager on the CPU, not yet measured on a GPU)."""
        return self.prefill_compile and (self.config.prefill_compile is True or type(kv) is KVCache)

    def session(self, slots: int | None = None, capacity: int | None = None, block_events: bool = True,
                on_startup: Callable[[int, int, str], None] | None = None,
                shortest: int | None = None) -> EngineSession:
        """A session of `slots` request slots (default batch_size) with `capacity` KV positions each (default
        max_seq_len, else what a prompt of one block and max_new_tokens needs): allocated and captured now.
        on_startup(done, total, what): the compile / capture's progress, per (phase, bucket); shortest: the fewest
        positions a request of this session will need, where known (EngineSession)."""
        slots = self.slots_for(self.config.batch_size) if slots is None else slots
        if capacity is None:
            capacity = self.static.capacity if self.static else (
                self.config.max_seq_len or working_length(self.block, self.max_new_tokens, self.block))
        return EngineSession(self, slots, capacity, block_events, on_startup, shortest)

    def generate(self, prompts: list[list[int]], on_result: Callable[[GenerationResult], None] | None = None,
                 arrivals: Sequence[float] | None = None, request_ids: Sequence[int] | None = None,
                 params: RequestParams | Sequence[RequestParams] | None = None,
                 on_startup: Callable[[int, int, str], None] | None = None) -> list[GenerationResult]:
        """Decode every prompt; results in prompt order. arrivals[i]: seconds after the start (once compiled and
        captured) at which prompt i arrives (default: all at once). request_ids[i]: prompt i's id, its result's
        index and its sampling key (default i): a share of a larger run decodes each request as the run would.
        params: every request's settings, or one per prompt (default: the engine's). on_startup: see session()."""
        ids = list(range(len(prompts))) if request_ids is None and isinstance(prompts, (list, tuple)) else request_ids
        results: dict[int, GenerationResult] = {}
        for ev in self.events(prompts, arrivals, request_ids, params, block_events=False, on_startup=on_startup):
            if isinstance(ev, FinishEvent):
                results[ev.request_id] = ev.result
                if on_result is not None:
                    on_result(ev.result)
        return [results[int(i)] for i in ids]

    def events(self, prompts: list[list[int]], arrivals: Sequence[float] | None = None,
               request_ids: Sequence[int] | None = None,
               params: RequestParams | Sequence[RequestParams] | None = None,
               block_events: bool = True, on_startup: Callable[[int, int, str], None] | None = None
               ) -> Iterator[Event]:
        """generate() as the session's events, as they happen: each request's BlockEvents (its newly final tokens,
        with block_events) and its FinishEvent. Arguments as generate()'s; checked before the session starts."""
        self.validate(prompts)
        prompts = [[int(t) for t in p] for p in prompts]
        arrivals = self._arrivals(arrivals, len(prompts))
        ids = list(range(len(prompts))) if request_ids is None else [int(i) for i in request_ids]
        if len(ids) != len(prompts):
            raise UserError(f"request_ids: {len(ids)} ids for {len(prompts)} prompts")
        if len(set(ids)) != len(ids):
            raise UserError(f"request_ids: {next(i for i in ids if ids.count(i) > 1)} appears more than once")
        if params is None or isinstance(params, RequestParams):
            params = [params or RequestParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise UserError(f"params: {len(params)} settings for {len(prompts)} prompts")
        max_new = [p.max_new_tokens or self.max_new_tokens for p in params]
        capacity = self.capacity_for(prompts, max_new)
        shortest = min(working_length(len(p), n, self.block, self.policy.first_block(len(p)))
                       for p, n in zip(prompts, max_new))
        return self._loop(prompts, arrivals, ids, params, capacity, shortest,
                          block_events or any(p.stop for p in params), on_startup)

    @torch.no_grad()
    def _loop(self, prompts, arrivals, ids, params, capacity, shortest, block_events, on_startup) -> Iterator[Event]:
        session = self.session(self.slots_for(len(prompts)), capacity, block_events=block_events,
                               on_startup=on_startup, shortest=shortest)
        self.startup_s, self.compile_cache = session.startup_s, session.compile_cache
        pending = deque(sorted(range(len(prompts)), key=arrivals.__getitem__))
        try:
            while pending or session.has_work():
                while pending and arrivals[pending[0]] <= session.now():
                    i = pending.popleft()
                    session.add(ids[i], prompts[i], params[i], arrival=arrivals[i])
                if not session.has_work():  # idle until the next request arrives
                    time.sleep(max(0.0, arrivals[pending[0]] - session.now()))
                    continue
                events, stopped = [], None
                try:
                    with shielded():  # a command's stop signal lands between steps, never inside one
                        events = session.step()
                except KeyboardInterrupt as e:  # signals.Stopped at the step's end: its events still count
                    stopped = e
                yield from events
                if stopped is not None:
                    raise stopped
        finally:
            session.close()
            self.stats = session.stats()

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


def generate(model, prompts: list[list[int]], policy: dict | PolicyConfig, *, max_new_tokens: int,
             batch_size: int = 8, max_seq_len: int | None = None, compile: bool | str = False,
             cuda_graphs: bool = True) -> list[GenerationResult]:
    """Decode every prompt (token ids) with the policy; one result per prompt, in order."""
    config = EngineConfig(policy, max_new_tokens=max_new_tokens, batch_size=batch_size, max_seq_len=max_seq_len,
                          compile=compile, cuda_graphs=cuda_graphs)
    return Engine(model, config).generate(prompts)
