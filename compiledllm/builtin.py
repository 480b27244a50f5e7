"""Built-in models: usable by name without a checkpoint directory (the quickstart's default)."""
from __future__ import annotations

import torch

from compiledllm.errors import UserError

# A small LLaDA2-layout model (dense first layer, MoE with shared expert, q/k norm, partial RoPE), randomly
# initialised from a fixed seed: deterministic everywhere, exercises every LLaDA2 code path, says nothing
# about quality. Prompts are token ids (it has no tokenizer).
TINY_LLADA2_RANDOM = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": 1024, "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-6, "rope_theta": 600000.0, "partial_rotary_factor": 0.5, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "mask_token_id": 1023, "eos_token_id": 1022,
}

BUILTINS = {"tiny-llada2-random": {"config": TINY_LLADA2_RANDOM, "seed": 0}}


def is_builtin(name) -> bool:
    return isinstance(name, str) and name in BUILTINS


@torch.no_grad()
def init_random(model, seed: int, std: float = 0.02, embed_std: float = 1.0) -> None:
    """Deterministic normal init on the model's device (norm weights 1, router bias 0)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            scale = embed_std if name.startswith(("embed", "lm_head")) else std
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * scale)


def load(name: str, device="cpu", dtype=torch.float32, mask_token_id=None, eos_token_id=None):
    from compiledllm.loader import materialize, parse_dtype, parse_model_config, resolve_special_ids

    if name not in BUILTINS:
        raise UserError(f"unknown built-in model {name!r} (built-ins: {', '.join(BUILTINS)})")
    spec = BUILTINS[name]
    model = materialize(parse_model_config(spec["config"], f"built-in {name}"), device, parse_dtype(dtype))
    init_random(model, spec["seed"])
    resolve_special_ids(model, None, mask_token_id, eos_token_id, f"built-in {name}")
    return model
