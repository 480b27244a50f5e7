"""SDAR (`SDARForCausalLM`, Qwen3 layout): separate q/k/v, q/k norm before full RoPE, tied or untied head."""
from __future__ import annotations

from compiledllm.models import weights
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.config import ModelConfig

ARCHITECTURES = ("SDARForCausalLM",)
MODEL_TYPES = ("sdar",)
DEFAULTS = {"mask_token_id": 151669, "eos_token_id": 151645, "block_size": 4}


def parse_config(c: dict) -> ModelConfig:
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return ModelConfig(
        architecture="sdar",
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"], num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=hd, intermediate_size=c["intermediate_size"], rope_theta=float(c.get("rope_theta", 1e6)),
        rotary_dim=hd, rms_eps=c.get("rms_norm_eps", 1e-6), qk_norm=True,
        tie_word_embeddings=c.get("tie_word_embeddings", False), bidirectional=False,
        max_position_embeddings=c.get("max_position_embeddings", 32768), default_block_size=DEFAULTS["block_size"],
        mask_token_id=c.get("mask_token_id"), eos_token_id=c.get("eos_token_id"),
    )


class SDAR(BlockDiffusionLM):
    def hf_weight_map(self):
        out = {"model.embed_tokens.weight": self.embed.weight, "model.norm.weight": self.norm.weight}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            a = layer.attn
            out |= {f"{p}.input_layernorm.weight": layer.input_norm.weight,
                    f"{p}.post_attention_layernorm.weight": layer.post_norm.weight,
                    f"{p}.self_attn.o_proj.weight": a.o.weight,
                    f"{p}.self_attn.q_norm.weight": a.q_norm.weight,
                    f"{p}.self_attn.k_norm.weight": a.k_norm.weight}
            out |= weights.fused_qkv(f"{p}.self_attn", a, ("q_proj", "k_proj", "v_proj"))
            out |= weights.gated_mlp(f"{p}.mlp", layer.mlp)
        return out
