"""The engine: request slots over static buffers, admission between steps, results.

Requests wait in a queue; a free slot takes the next one between steps (its prompt's full blocks are
prefilled into the slot's KV), every step decodes the smallest batch bucket holding all busy slots, and a
slot is freed as soon as its request ends. Each row's tokens depend on its own prompt only (batch
invariance, for a given KV capacity).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from compiledllm.attention.metadata import WindowAttention
from compiledllm.engine.memory import check_fits
from compiledllm.engine.state import SlotState
from compiledllm.engine.stepper import Stepper, default_buckets
from compiledllm.errors import UserError
from compiledllm.kv.cache import KVCache
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.policies import PolicyConfig, make_policy, policy_config
from compiledllm.profiling import phase


@dataclass
class GenerationResult:
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    steps: int                  # forwards made for this request (prefill not counted)
    blocks: int                 # blocks decoded
    latency_s: float            # admission to finish
    text: str | None = None
    extra: dict = field(default_factory=dict)


def working_length(prompt_len: int, max_new_tokens: int, block: int) -> int:
    """End of the block that holds position prompt_len + max_new_tokens - 1."""
    return -(-(prompt_len + max_new_tokens) // block) * block


class Engine:
    def __init__(self, model: BlockDiffusionLM, policy: dict | PolicyConfig, *, max_new_tokens: int,
                 batch_size: int = 8, max_seq_len: int | None = None, compile: bool = False,
                 cuda_graphs: bool = True, buckets: list[int] | None = None):
        if max_new_tokens < 1:
            raise UserError(f"generation.max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.policy = make_policy(policy_config(policy), model.mask_token_id)
        self.block = self.policy.block_size
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.exported = hasattr(model, "runners")  # an ExportedModel: fixed buckets and KV capacity, already compiled
        self.compile = compile and not self.exported
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda" and not self.exported
        self.buckets = model.buckets if self.exported else buckets
        if self.exported and self.block != model.block_size:
            raise UserError(f"policy.block_size {self.block} differs from the exported engine's {model.block_size}")
        self.startup_s = 0.0  # compile / capture time of the last generate()

    def capacity_for(self, prompts: list[list[int]]) -> int:
        need = max(working_length(len(p), self.max_new_tokens, self.block) for p in prompts)
        cap = getattr(self.model, "capacity", None) or (need if self.max_seq_len is None else self.max_seq_len)
        if cap < need:
            raise UserError(f"KV capacity {cap} (max_seq_len) is shorter than the longest working sequence ({need})")
        limit = self.model.config.max_position_embeddings
        if need > limit:
            longest = max(len(p) for p in prompts)
            raise UserError(f"a prompt of {longest} tokens plus max_new_tokens {self.max_new_tokens} needs {need} "
                            f"positions; the model's context is {limit}")
        return cap

    def validate(self, prompts: list[list[int]]) -> None:
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise UserError(f"prompt {i}: empty")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise UserError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab})")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], on_result: Callable[[GenerationResult], None] | None = None,
                 ) -> list[GenerationResult]:
        self.validate(prompts)
        model, device = self.model, self.model.device
        slots = min(self.batch_size, len(prompts))
        if self.exported:  # run on exported bucket sizes only
            slots = next((b for b in self.buckets if b >= slots), max(self.buckets))
        capacity = self.capacity_for(prompts)
        check_fits(model, slots, capacity, self.block)
        try:
            st = SlotState.allocate(slots, capacity, self.policy.init_state(slots, device), model.mask_token_id, device)
            kv = None if model.bidirectional else KVCache.allocate(
                model.config.num_layers, slots, capacity, model.config.num_kv_heads, model.config.head_dim,
                model.dtype, device)
        except torch.OutOfMemoryError:
            raise UserError(f"batch_size {slots} with {capacity} positions does not fit in {device} memory") from None

        buckets = self.buckets or (default_buckets(slots) if self.cuda_graphs or not self.compile else [slots])
        buckets = [b for b in buckets if b <= slots]
        if not buckets or max(buckets) < slots:
            buckets = [*buckets, slots]
        stepper = Stepper(model, self.policy, st, kv, buckets, self.compile, self.cuda_graphs)
        self.startup_s = stepper.startup_s

        queue = deque(enumerate(prompts))
        owner: list[tuple[int, float] | None] = [None] * slots
        results: list[GenerationResult | None] = [None] * len(prompts)
        for s in range(min(slots, len(prompts))):
            owner[s] = self._admit(st, kv, s, *queue.popleft())
        while any(o is not None for o in owner):
            stepper.run(1 + max(s for s, o in enumerate(owner) if o is not None))
            active = st.active.tolist()  # the one host sync per step
            for s, o in enumerate(owner):
                if o is None or active[s]:
                    continue
                res = self._collect(st, s, *o, prompts[o[0]])
                results[res.index] = res
                if on_result is not None:
                    on_result(res)
                owner[s] = self._admit(st, kv, s, *queue.popleft()) if queue else None
        return results

    def _admit(self, st: SlotState, kv: KVCache | None, s: int, index: int, prompt: list[int]):
        P = len(prompt)
        st.seq[s].fill_(self.model.mask_token_id)
        st.seq[s, :P] = torch.tensor(prompt, device=st.seq.device)
        start = P // self.block * self.block
        st.prompt_len[s], st.work_len[s], st.block_start[s] = P, working_length(P, self.max_new_tokens, self.block), start
        st.steps[s], st.active[s] = 0, True
        for v in st.policy.values():
            v[s] = 0
        if kv is not None and start > 0:
            with phase("prefill"):
                self._prefill(st, kv, s, start)
        return index, time.perf_counter()

    def _prefill(self, st: SlotState, kv: KVCache, s: int, end: int, chunk: int = 1024) -> None:
        """Write the KV of the prompt's full blocks [0, end) into slot s, in chunks of whole blocks: each chunk
        attends to the cached prefix and block-causally to itself (window slots of one block)."""
        chunk = max(chunk // self.block, 1) * self.block
        for c in range(0, end, chunk):
            n = min(chunk, end - c)
            pos = torch.arange(c, c + n, device=st.seq.device)[None]
            meta = WindowAttention(torch.full((1,), c, device=pos.device), self.block)
            last = torch.full((1, 1), n - 1, device=pos.device)  # logits are not needed: keep the head to one row
            self.model(st.seq[s : s + 1, c : c + n], pos, meta, kv=kv.rows(s, s + 1), logits_index=last)

    def _collect(self, st: SlotState, s: int, index: int, t0: float, prompt: list[int]) -> GenerationResult:
        P = len(prompt)
        out = st.seq[s, P : P + self.max_new_tokens].tolist()
        eos = self.model.eos_token_id
        if eos in out:
            out = out[: out.index(eos) + 1]
        tok = self.model.tokenizer
        blocks = (int(st.block_start[s]) - P // self.block * self.block) // self.block
        return GenerationResult(index=index, prompt_ids=list(prompt), output_ids=out, steps=int(st.steps[s]),
                                blocks=blocks,
                                latency_s=time.perf_counter() - t0, text=tok.decode(out) if tok else None)


def generate(model: BlockDiffusionLM, prompts: list[list[int]], policy: dict | PolicyConfig, *, max_new_tokens: int,
             batch_size: int = 8, max_seq_len: int | None = None, compile: bool = False,
             cuda_graphs: bool = True) -> list[GenerationResult]:
    """Decode every prompt (token ids) with the policy; one result per prompt, in order."""
    engine = Engine(model, policy, max_new_tokens=max_new_tokens, batch_size=batch_size, max_seq_len=max_seq_len,
                    compile=compile, cuda_graphs=cuda_graphs)
    return engine.generate(prompts)
