"""The engine's settings: one frozen config, built from a recipe or from keyword arguments."""
from __future__ import annotations

from dataclasses import dataclass

from compiledllm.errors import UserError
from compiledllm.policies import PolicyConfig, policy_config


@dataclass(frozen=True)
class EngineConfig:
    policy: PolicyConfig                # a dict of policy parameters is accepted and validated
    max_new_tokens: int
    batch_size: int = 8                 # request slots decoded together
    max_seq_len: int | None = None      # KV capacity per slot (default: what the longest request needs)
    compile: bool = False
    cuda_graphs: bool = True
    buckets: tuple[int, ...] | None = None  # batch-size buckets (default: powers of two up to batch_size)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", policy_config(self.policy))
        if self.buckets is not None:
            object.__setattr__(self, "buckets", tuple(self.buckets))
        if self.max_new_tokens < 1:
            raise UserError(f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.batch_size}")

    @classmethod
    def from_recipe(cls, recipe) -> "EngineConfig":
        return cls(recipe.policy_config(), max_new_tokens=recipe.generation.max_new_tokens,
                   batch_size=recipe.batch_size, max_seq_len=recipe.generation.max_seq_len, compile=recipe.compile,
                   cuda_graphs=recipe.cuda_graphs, buckets=recipe.buckets)
