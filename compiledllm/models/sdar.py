"""SDAR (`SDARForCausalLM`, Qwen3 layout): separate q/k/v, q/k norm before full RoPE, tied or untied head."""
from __future__ import annotations

from compiledllm.models import weights
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.config import HF_DECODER_KEYS, ModelConfig, get_int, hf_decoder_fields

ARCHITECTURES = ("SDARForCausalLM",)
MODEL_TYPES = ("sdar",)
DEFAULTS = {"mask_token_id": 151669, "eos_token_id": 151645, "block_size": 4}
KEYS = {**HF_DECODER_KEYS, "rotary_dim": "head_dim"}  # how config.json spells ModelConfig's fields (error messages)


def parse_config(c: dict) -> ModelConfig:
    # the -b8 ... -b64 variants state their block in config.json where they do; else SDAR's 4
    fields = hf_decoder_fields(c, rope_theta=1e6, block_size=get_int(c, "block_size", DEFAULTS["block_size"]))
    return ModelConfig(architecture="sdar", rotary_dim=fields["head_dim"], qk_norm=True, **fields)


class SDAR(BlockDiffusionLM):
    def hf_weight_map(self):
        out = weights.hf_decoder_frame(self, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            a = layer.attn
            out |= {f"{p}.self_attn.o_proj.weight": a.o.weight,
                    f"{p}.self_attn.q_norm.weight": a.q_norm.weight,
                    f"{p}.self_attn.k_norm.weight": a.k_norm.weight}
            out |= weights.fused_qkv(f"{p}.self_attn", a, ("q_proj", "k_proj", "v_proj"))
            out |= weights.gated_mlp(f"{p}.mlp", layer.mlp)
        return out
