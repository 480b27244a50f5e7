"""LLaDA2.0 / 2.1 / 2.2 (`LLaDA2MoeModelLM`): fused QKV, q/k norm before partial RoPE, dense first layer, MoE (block-routed
where config.json sets expert_capacity: models/block_routing.py)."""
from __future__ import annotations

from compiledllm.models import weights
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.config import (HF_DECODER_KEYS, InvalidConfig, ModelConfig, MoEConfig, get_bool, get_float,
                                       get_int, hf_decoder_fields)
from compiledllm.models.layers import MoE

ARCHITECTURES = ("LLaDA2MoeModelLM",)
MODEL_TYPES = ("llada2_moe",)
DEFAULTS = {"mask_token_id": 156895, "eos_token_id": 156892, "block_size": 32}
# how config.json spells ModelConfig's and MoEConfig's fields (error messages)
KEYS = {**HF_DECODER_KEYS, "rotary_dim": "rotary_dim (head_dim * partial_rotary_factor)",
        "top_k": "num_experts_per_tok", "first_dense_layers": "first_k_dense_replace", "route_block": "block_size"}


def parse_config(c: dict) -> ModelConfig:
    # LLaDA2.2's block routing: on exactly when config.json has expert_capacity (as SGLang's PR #31768 reads it),
    # over blocks of config.json's block_size, which is then also the policies' default block
    capacity = get_int(c, "expert_capacity", None)
    block = DEFAULTS["block_size"] if capacity is None else get_int(c, "block_size", DEFAULTS["block_size"])
    fields = hf_decoder_fields(c, rope_theta=600000.0, block_size=block)
    rotary = get_float(c, "partial_rotary_factor", 0.5)
    if rotary > 1:
        raise InvalidConfig(f"{{partial_rotary_factor}} must be in (0, 1], got {rotary:g}")
    return ModelConfig(
        architecture="llada2_moe", rotary_dim=int(fields["head_dim"] * rotary),
        qk_norm=get_bool(c, "use_qk_norm", True), **fields,
        moe=MoEConfig(
            num_experts=get_int(c, "num_experts"), top_k=get_int(c, "num_experts_per_tok"),
            expert_dim=get_int(c, "moe_intermediate_size"), num_shared=get_int(c, "num_shared_experts", 0, minimum=0),
            n_group=get_int(c, "n_group", 1), topk_group=get_int(c, "topk_group", 1),
            routed_scaling=get_float(c, "routed_scaling_factor", 1.0),
            norm_topk_prob=get_bool(c, "norm_topk_prob", True),
            first_dense_layers=get_int(c, "first_k_dense_replace", 0, minimum=0),
            expert_capacity=capacity, route_block=None if capacity is None else fields["default_block_size"],
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
