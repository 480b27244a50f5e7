"""The largest batch that really runs (`compiledllm bench --batch max`): probed by running the engine at a point's KV
capacity at growing batch sizes, bisected, never estimated."""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace

import torch

from compiledllm.engine import Engine, EngineConfig
from compiledllm.engine.memory import available_bytes
from compiledllm.errors import UserError

Prompts = Callable[[int, int], list[list[int]]]  # (rows, length) -> that many prompts of that many token ids


def free_memory(model) -> None:
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def fits(model, config: EngineConfig, block: int, batch: int, prompt_len: int, capacity: int,
         prompts: Prompts) -> bool:
    """Whether `batch` rows at KV capacity `capacity` run: every slot allocated, one full-size prefill forward
    (rows x prompt tokens ~ config.prefill_tokens) and one block of decode steps, with the recipe's compile / CUDA
    graph settings (one bucket: the batch). A refusal of the engine's memory check counts as not fitting."""
    length = max(block, min(prompt_len, config.prefill_tokens // batch // block * block))
    cfg = replace(config, batch_size=batch, max_seq_len=capacity, max_new_tokens=block, buckets=(batch,))
    try:
        Engine(model, cfg).generate(prompts(batch, length))
        return True
    except (torch.OutOfMemoryError, UserError) as e:
        if batch == 1:
            raise UserError(f"batch 1 at {capacity} KV positions does not run: {e}") from None
        return False
    finally:
        free_memory(model)


def largest_batch(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest b in [lo, hi) with ok(b), given ok(lo) holds and ok(hi) does not (monotone): bisection."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


class MaxProbe:
    """Largest batch per KV capacity, each probe narrowed by the ones before (a batch that fits a longer capacity
    fits a shorter one) and by the memory the KV cache alone would need."""

    def __init__(self, model, config: EngineConfig, block: int, prompts: Prompts):
        self.model, self.config, self.block, self.prompts = model, config, block, prompts
        self.found: dict[int, int] = {}

    def __call__(self, prompt_len: int, capacity: int) -> int:
        if capacity not in self.found:
            lo = max([b for c, b in self.found.items() if c >= capacity] + [1])
            hi = min([b + 1 for c, b in self.found.items() if c <= capacity] + [self._kv_bound(capacity)])
            ok = lambda b: fits(self.model, self.config, self.block, b, prompt_len, capacity, self.prompts)  # noqa: E731
            if lo == 1:
                ok(1)  # raises, saying why, when not even one row runs
            self.found[capacity] = largest_batch(ok, lo, max(hi, lo + 1))
        return self.found[capacity]

    def _kv_bound(self, capacity: int) -> int:
        """One more than the rows whose KV alone fills the free memory (no batch at or above it can fit)."""
        c = self.model.config
        row = 2 * c.num_layers * capacity * c.num_kv_heads * c.head_dim * self.model.dtype.itemsize
        free = available_bytes(self.model.device) or 1 << 40
        return max(2, free // row + 1)
