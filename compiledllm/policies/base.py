"""What every decoding policy shares: the per-step contract and the confidence rule of DESIGN.md §4.

A policy sees one block-sized window per row and decides which tokens change. It never touches the
model: the engine forwards, hands it the logits of the window, and applies what it returns.
Everything here is a pure tensor function over static shapes (no host syncs): it runs inside the
compiled / captured step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from compiledllm.triton_support import triton_on_cuda

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PolicyConfig:
    block_size: int = 32

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")


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


class Policy(ABC):
    """One decoding algorithm. `update` runs once per forward for every slot (inactive rows are masked by the engine)."""

    name: str

    def __init__(self, config: PolicyConfig, mask_id: int):
        self.config = config
        self.mask_id = mask_id

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def init_state(self, batch: int, device: torch.device) -> State:
        """Per-row state buffers (zeros = the state at the start of a block)."""
        return {}

    def needed(self, window: torch.Tensor, gen: torch.Tensor, state: State) -> torch.Tensor:
        """[B, Bk] bool: the window positions whose logits `update` reads (the head may skip the others)."""
        return gen

    @abstractmethod
    def update(self, window: torch.Tensor, logits: torch.Tensor, gen: torch.Tensor, state: State):
        """window [B, Bk] tokens, logits [B, Bk, V] (the model's dtype; policies compute in float32; defined at the
        `needed` positions), gen [B, Bk] bool (generated, changeable positions).
        Returns (new_window [B, Bk], block_done [B] bool, new_state). A block is done when the forward just
        made saw its final tokens (so that forward's KV is the block's KV)."""

    def reset(self, state: State, rows: torch.Tensor) -> State:
        """Zero the per-block state of `rows` ([B] bool): they start a new block next step."""
        return {k: torch.where(rows, torch.zeros_like(v), v) for k, v in state.items()}
