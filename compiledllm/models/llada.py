"""LLaDA-8B / LLaDA-1.5 (`LLaDAModelLM`): fully bidirectional MHA, `model.transformer.*` names."""
from __future__ import annotations

from compiledllm.models import weights
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.config import InvalidConfig, ModelConfig, get_bool, get_float, get_int

ARCHITECTURES = ("LLaDAModelLM",)
MODEL_TYPES = ("llada",)
DEFAULTS = {"mask_token_id": 126336, "eos_token_id": 126081, "block_size": 32}
# how config.json spells ModelConfig's fields (error messages)
KEYS = {"vocab_size": "embedding_size (or vocab_size)", "hidden_size": "d_model", "num_layers": "n_layers",
        "num_heads": "n_heads", "num_kv_heads": "n_kv_heads", "head_dim": "head_dim (d_model / n_heads)",
        "rotary_dim": "head_dim (d_model / n_heads)", "intermediate_size": "mlp_hidden_size",
        "rms_eps": "rms_norm_eps", "max_position_embeddings": "max_sequence_length",
        "tie_word_embeddings": "weight_tying"}


def parse_config(c: dict) -> ModelConfig:
    d, heads = get_int(c, "d_model"), get_int(c, "n_heads")
    if d % heads:  # LLaDA derives the head width: the heads must split d_model exactly
        raise InvalidConfig(f"{{d_model}}={d} is not a multiple of {{n_heads}}={heads}")
    hd = d // heads
    return ModelConfig(
        architecture="llada",
        vocab_size=get_int(c, "embedding_size", None) or get_int(c, "vocab_size"), hidden_size=d,
        num_layers=get_int(c, "n_layers"), num_heads=heads, num_kv_heads=get_int(c, "n_kv_heads", heads),
        head_dim=hd, intermediate_size=get_int(c, "mlp_hidden_size", None) or d * get_int(c, "mlp_ratio", 4),
        rope_theta=get_float(c, "rope_theta", 500000.0), rotary_dim=hd, rms_eps=get_float(c, "rms_norm_eps", 1e-5),
        qk_norm=False, tie_word_embeddings=get_bool(c, "weight_tying", False), bidirectional=True,
        max_position_embeddings=get_int(c, "max_sequence_length", 4096), default_block_size=DEFAULTS["block_size"],
        mask_token_id=c.get("mask_token_id"), eos_token_id=c.get("eos_token_id"),
    )


class LLaDA(BlockDiffusionLM):
    def hf_weight_map(self):
        t = "model.transformer"
        out = {f"{t}.wte.weight": self.embed.weight, f"{t}.ln_f.weight": self.norm.weight}
        if self.lm_head is not None:
            out[f"{t}.ff_out.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            p = f"{t}.blocks.{i}"
            out |= {f"{p}.attn_norm.weight": layer.input_norm.weight, f"{p}.ff_norm.weight": layer.post_norm.weight,
                    f"{p}.attn_out.weight": layer.attn.o.weight}
            out |= weights.fused_qkv(p, layer.attn, ("q_proj", "k_proj", "v_proj"))
            out |= weights.gated_mlp(p, layer.mlp, ("ff_proj", "up_proj", "ff_out"))
        return out
