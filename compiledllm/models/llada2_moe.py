"""LLaDA2.0 / LLaDA2.1 (`LLaDA2MoeModelLM`): fused QKV, q/k norm before partial RoPE, dense first layer, MoE."""
from __future__ import annotations

from compiledllm.models import weights
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.config import ModelConfig, MoEConfig
from compiledllm.models.layers import MoE

ARCHITECTURES = ("LLaDA2MoeModelLM",)
MODEL_TYPES = ("llada2_moe",)
DEFAULTS = {"mask_token_id": 156895, "eos_token_id": 156892, "block_size": 32}


def parse_config(c: dict) -> ModelConfig:
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return ModelConfig(
        architecture="llada2_moe",
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"], num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=hd, intermediate_size=c["intermediate_size"], rope_theta=float(c.get("rope_theta", 600000.0)),
        rotary_dim=int(hd * c.get("partial_rotary_factor", 0.5)), rms_eps=c.get("rms_norm_eps", 1e-6),
        qk_norm=c.get("use_qk_norm", True), tie_word_embeddings=c.get("tie_word_embeddings", False),
        bidirectional=False, max_position_embeddings=c.get("max_position_embeddings", 32768),
        default_block_size=DEFAULTS["block_size"],
        mask_token_id=c.get("mask_token_id"), eos_token_id=c.get("eos_token_id"),
        moe=MoEConfig(
            num_experts=c["num_experts"], top_k=c["num_experts_per_tok"], expert_dim=c["moe_intermediate_size"],
            num_shared=c.get("num_shared_experts") or 0, n_group=c.get("n_group") or 1,
            topk_group=c.get("topk_group") or 1, routed_scaling=c.get("routed_scaling_factor", 1.0),
            norm_topk_prob=c.get("norm_topk_prob", True), first_dense_layers=c.get("first_k_dense_replace", 0),
        ),
    )


class LLaDA2MoE(BlockDiffusionLM):
    def hf_weight_map(self):
        out = {"model.word_embeddings.weight": self.embed.weight, "model.norm.weight": self.norm.weight}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            a = layer.attn
            out |= {f"{p}.input_layernorm.weight": layer.input_norm.weight,
                    f"{p}.post_attention_layernorm.weight": layer.post_norm.weight,
                    f"{p}.attention.query_key_value.weight": a.qkv.weight,
                    f"{p}.attention.dense.weight": a.o.weight}
            if a.q_norm is not None:
                out[f"{p}.attention.query_layernorm.weight"] = a.q_norm.weight
                out[f"{p}.attention.key_layernorm.weight"] = a.k_norm.weight
            mlp = layer.mlp
            out |= weights.moe(f"{p}.mlp", mlp) if isinstance(mlp, MoE) else weights.gated_mlp(f"{p}.mlp", mlp)
        return out
