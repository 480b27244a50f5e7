"""The architecture-independent model configuration every model file builds from."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_dim: int            # width of one routed expert
    num_shared: int            # shared experts (width expert_dim * num_shared)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    norm_topk_prob: bool = True
    first_dense_layers: int = 0  # layers [0, first_dense_layers) use the dense MLP


@dataclass(frozen=True)
class ModelConfig:
    architecture: str           # registry name: llada2_moe | sdar | llada
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int      # dense MLP width
    rope_theta: float
    rotary_dim: int             # leading head dims that RoPE rotates (NeoX rotate-half)
    rms_eps: float
    qk_norm: bool
    tie_word_embeddings: bool
    bidirectional: bool         # True: always attends over the whole sequence (no block-causal mask)
    max_position_embeddings: int
    default_block_size: int
    mask_token_id: int | None = None
    eos_token_id: int | None = None
    moe: MoEConfig | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")


def hf_decoder_fields(c: dict, *, rope_theta: float, block_size: int) -> dict:
    """ModelConfig fields named the usual Hugging Face way (`hidden_size`, `num_attention_heads`, ...), shared by
    the LLaDA2 and Qwen3-layout (SDAR) configs; the architecture file adds what is its own."""
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"], num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=hd, intermediate_size=c["intermediate_size"], rope_theta=float(c.get("rope_theta", rope_theta)),
        rms_eps=c.get("rms_norm_eps", 1e-6), tie_word_embeddings=c.get("tie_word_embeddings", False),
        bidirectional=False, max_position_embeddings=c.get("max_position_embeddings", 32768),
        default_block_size=block_size, mask_token_id=c.get("mask_token_id"), eos_token_id=c.get("eos_token_id"),
    )


class ConfigFacts:
    """What the engine reads of any model kind (a live BlockDiffusionLM, an ExportedModel) from its `config`."""

    config: ModelConfig

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def eos_token_id(self) -> int:
        return self.config.eos_token_id

    @property
    def bidirectional(self) -> bool:
        return self.config.bidirectional
