"""LLaDA2.0 / LLaDA2.1 (`LLaDA2MoeModelLM`): fused QKV, q/k norm before partial RoPE, dense first layer, MoE."""
from __future__ import annotations

from compiledllm.models import weights
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.config import ModelConfig, MoEConfig, hf_decoder_fields
from compiledllm.models.layers import MoE

ARCHITECTURES = ("LLaDA2MoeModelLM",)
MODEL_TYPES = ("llada2_moe",)
DEFAULTS = {"mask_token_id": 156895, "eos_token_id": 156892, "block_size": 32}


def parse_config(c: dict) -> ModelConfig:
    fields = hf_decoder_fields(c, rope_theta=600000.0, block_size=DEFAULTS["block_size"])
    return ModelConfig(
        architecture="llada2_moe", rotary_dim=int(fields["head_dim"] * c.get("partial_rotary_factor", 0.5)),
        qk_norm=c.get("use_qk_norm", True), **fields,
        moe=MoEConfig(
            num_experts=c["num_experts"], top_k=c["num_experts_per_tok"], expert_dim=c["moe_intermediate_size"],
            num_shared=c.get("num_shared_experts") or 0, n_group=c.get("n_group") or 1,
            topk_group=c.get("topk_group") or 1, routed_scaling=c.get("routed_scaling_factor", 1.0),
            norm_topk_prob=c.get("norm_topk_prob", True), first_dense_layers=c.get("first_k_dense_replace", 0),
        ),
    )


class LLaDA2MoE(BlockDiffusionLM):
    def hf_weight_map(self):
        out = weights.hf_decoder_frame(self, "model.word_embeddings.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            a = layer.attn
            out |= {f"{p}.attention.query_key_value.weight": a.qkv.weight,
                    f"{p}.attention.dense.weight": a.o.weight}
            if a.q_norm is not None:
                out[f"{p}.attention.query_layernorm.weight"] = a.q_norm.weight
                out[f"{p}.attention.key_layernorm.weight"] = a.k_norm.weight
            mlp = layer.mlp
            out |= weights.moe(f"{p}.mlp", mlp) if isinstance(mlp, MoE) else weights.gated_mlp(f"{p}.mlp", mlp)
        return out
