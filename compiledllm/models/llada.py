"""LLaDA-8B / LLaDA-1.5 (`LLaDAModelLM`): fully bidirectional MHA, `model.transformer.*` names."""
from __future__ import annotations

from compiledllm.models import weights
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.config import ModelConfig

ARCHITECTURES = ("LLaDAModelLM",)
MODEL_TYPES = ("llada",)
DEFAULTS = {"mask_token_id": 126336, "eos_token_id": 126081, "block_size": 32}


def parse_config(c: dict) -> ModelConfig:
    hd = c["d_model"] // c["n_heads"]
    return ModelConfig(
        architecture="llada",
        vocab_size=c.get("embedding_size") or c["vocab_size"], hidden_size=c["d_model"], num_layers=c["n_layers"],
        num_heads=c["n_heads"], num_kv_heads=c.get("n_kv_heads") or c["n_heads"], head_dim=hd,
        intermediate_size=c.get("mlp_hidden_size") or c["d_model"] * c.get("mlp_ratio", 4),
        rope_theta=float(c.get("rope_theta", 500000.0)), rotary_dim=hd, rms_eps=c.get("rms_norm_eps", 1e-5),
        qk_norm=False, tie_word_embeddings=c.get("weight_tying", False), bidirectional=True,
        max_position_embeddings=c.get("max_sequence_length", 4096), default_block_size=DEFAULTS["block_size"],
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
