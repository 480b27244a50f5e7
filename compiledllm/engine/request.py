"""What a request brings to a session and what it gets back: per-request settings, results and step events."""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from compiledllm.errors import UserError
from compiledllm.policies.sampling import SEED_LIMIT

FinishReason = Literal["eos", "length", "stop", "cancelled"]


@dataclass
class GenerationResult:
    index: int                  # the request's id (generate(): the prompt's index, or its request_ids entry)
    prompt_ids: list[int]
    output_ids: list[int]
    steps: int                  # forwards made for this request (prefill not counted)
    blocks: int                 # blocks decoded
    latency_s: float = 0.0      # arrival to finish
    text: str | None = None
    extra: dict = field(default_factory=dict)
    arrival_s: float = 0.0      # when it arrived, seconds after the session's start
    first_block_s: float = 0.0  # arrival to its first retired block
    finish_reason: FinishReason = "length"
    stop_reason: str | None = None   # the stop string that ended it (finish_reason "stop")


@dataclass(frozen=True)
class RequestParams:
    """One request's settings in a session; None keeps the engine's. None of them changes a shape: the session's
    KV capacity must hold the request's working sequence."""

    max_new_tokens: int | None = None
    seed: int | None = None                # sampling noise key, with the request id (policies/sampling.py)
    stop: tuple[str, ...] = ()             # finish once the text holds one of these (checked per retired block)
    policy: Mapping[str, float] = field(default_factory=dict)  # overrides of the policy's row_params
    noise_index: int | None = None         # keys its noise with seed in place of the request id (a server: so
                                           # that a request's seed reproduces it whatever id the session gave it)

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
            raise UserError(f"max_new_tokens: an integer >= 1, got {n!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s < SEED_LIMIT):
            raise UserError(f"seed: an integer in [0, 2**32), got {s!r}")
        k = self.noise_index
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0):
            raise UserError(f"noise_index: an integer >= 0, got {k!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(x, str) or not x for x in stop):
            raise UserError(f"stop: non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        for k, v in dict(self.policy).items():
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise UserError(f"policy.{k}: a number, got {v!r}")
        object.__setattr__(self, "policy", dict(self.policy))


@dataclass(frozen=True)
class BlockEvent:
    """Blocks of a request were retired by the last step: their final tokens (capped at its max_new_tokens, up to
    and including an EOS)."""

    request_id: int
    tokens: list[int]


@dataclass(frozen=True)
class FinishEvent:
    """A request ended (result.finish_reason says why); its slot is free for the next step."""

    request_id: int
    result: GenerationResult


Event = BlockEvent | FinishEvent


def working_length(prompt_len: int, max_new_tokens: int, block: int, start: int | None = None) -> int:
    """End of the block that holds position prompt_len + max_new_tokens - 1, blocks counted from `start` (the first
    block's start, Policy.first_block; default: blocks aligned to position 0)."""
    start = prompt_len // block * block if start is None else start
    return start + -(-(prompt_len + max_new_tokens - start) // block) * block
