"""What the bidirectional caches' tests share (test_flash_dllm, test_elastic_cache): random prompts and the engine
run at a fixed capacity (no EOS stops a request)."""
from __future__ import annotations

import torch

from compiledllm.engine import Engine, EngineConfig

BLOCK, CAPACITY = 4, 40


def prompts(lengths, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (k,), generator=g).tolist() for k in lengths]


def run(model, policy: dict, ps, batch: int, n: int = 16, **kw):
    engine = Engine(model, EngineConfig(policy, max_new_tokens=n, batch_size=batch, max_seq_len=CAPACITY,
                                        ignore_eos=True, **kw))
    return engine.generate(ps)


def no_cache_outputs(model, ps, batch: int, tau: float, **kw) -> list[list[int]]:
    """The tokens an exact setting of a cache must give: `threshold` with Fast-dLLM's rule, no cache."""
    policy = {"name": "threshold", "rule": "fast_dllm", "block_size": BLOCK, "threshold": tau} | kw
    return [r.output_ids for r in run(model, policy, ps, batch)]
