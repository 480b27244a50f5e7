"""The engine's settings: one frozen config, built from a recipe or from keyword arguments."""
from __future__ import annotations

from dataclasses import dataclass

from compiledllm.errors import UserError
from compiledllm.policies import PolicyConfig, policy_config


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name}: an integer >= 1, got {value!r}")


def _compile_mode(name: str, value, auto: str) -> None:
    if not (isinstance(value, bool) or (isinstance(value, str) and value == "auto")):
        raise UserError(f"{name}: true or false, or auto ({auto}), got {value!r}")


PREFILL_PRIORITIES = ("throughput", "first_block")


@dataclass(frozen=True)
class EngineConfig:
    policy: PolicyConfig                # a dict of policy parameters is accepted and validated
    max_new_tokens: int
    batch_size: int = 8                 # request slots decoded together
    max_seq_len: int | None = None      # KV capacity per slot (default: what the longest request needs)
    compile: bool | str = False         # True, False or "auto" (compiled on CUDA only): Engine resolves it
    cuda_graphs: bool = True
    buckets: tuple[int, ...] | None = None  # batch-size buckets (default: powers of two up to batch_size)
    prefill_chunk: int = 4096           # prompt positions per row in one prefill forward (measured: docs/results.md)
    prefill_tokens: int = 16384         # tokens in one prefill forward (rows x chunk): the longest decode stall
    prefill_compile: bool | str = "auto"  # large prefill forwards compiled; auto: where `compile` is, on CUDA
    prefill_priority: str = "throughput"  # or "first_block": no prefill while a decoding row is in its first block
    prefill_first_step: bool = True     # a prompt's last prefill forward also makes its first decode step (where the
                                        # policy allows it: Policy.prefill_step)
    prefill_compile_small: bool = False  # with prefill.compile, the small forwards too (Prefiller, recipe.py)
    ignore_eos: bool = False            # decode max_new_tokens for every request (benchmarks)
    phase_times: bool = False           # time each decode phase on the device (RunStats.phases; engine/phase_times.py)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, (dict, PolicyConfig)):
            raise UserError(f"policy: a mapping such as {{'name': 'threshold'}} or a PolicyConfig, got {self.policy!r}")
        object.__setattr__(self, "policy", policy_config(self.policy))
        _positive_int("max_new_tokens", self.max_new_tokens)
        _positive_int("batch_size", self.batch_size)
        if self.max_seq_len is not None:
            _positive_int("max_seq_len", self.max_seq_len)
        _positive_int("prefill_chunk", self.prefill_chunk)
        _positive_int("prefill_tokens", self.prefill_tokens)
        _compile_mode("compile", self.compile, "compiled on CUDA only")
        _compile_mode("prefill.compile", self.prefill_compile, "with `compile`, on CUDA")
        if self.prefill_priority not in PREFILL_PRIORITIES:
            raise UserError(f"prefill.priority: one of {', '.join(PREFILL_PRIORITIES)}, got {self.prefill_priority!r}")
        for name in ("cuda_graphs", "ignore_eos", "phase_times", "prefill_first_step", "prefill_compile_small"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name}: true or false, got {getattr(self, name)!r}")
        if self.buckets is not None:
            if isinstance(self.buckets, (str, bytes)) or not hasattr(self.buckets, "__iter__"):
                raise UserError(f"buckets: a list of batch sizes, got {self.buckets!r}")
            object.__setattr__(self, "buckets", tuple(self.buckets))
            for b in self.buckets:
                _positive_int("buckets", b)

    @classmethod
    def from_recipe(cls, recipe) -> "EngineConfig":
        return cls(recipe.policy_config(), max_new_tokens=recipe.generation.max_new_tokens,
                   batch_size=recipe.batch_size, max_seq_len=recipe.generation.max_seq_len, compile=recipe.compile,
                   cuda_graphs=recipe.cuda_graphs, buckets=recipe.buckets, prefill_chunk=recipe.prefill.chunk,
                   prefill_tokens=recipe.prefill.tokens, prefill_compile=recipe.prefill.compile,
                   prefill_priority=recipe.prefill.priority, prefill_first_step=recipe.prefill.first_step,
                   prefill_compile_small=recipe.prefill.compile_small,
                   ignore_eos=recipe.generation.ignore_eos, phase_times=recipe.phase_times)
