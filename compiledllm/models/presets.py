"""Named model shapes (config.json contents) for building real-size models without a checkpoint."""
from __future__ import annotations

LLADA2_MINI = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": 157184, "hidden_size": 2048,
    "intermediate_size": 5120, "moe_intermediate_size": 512, "num_hidden_layers": 20, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 256, "num_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 600000.0, "partial_rotary_factor": 0.5,
    "max_position_embeddings": 32768, "tie_word_embeddings": False, "mask_token_id": 156895, "eos_token_id": 156892,
}

# LLaDA2.2's block routing (models/block_routing.py) at the report's capacity, 48 of 256 experts per 32-token block,
# on the LLaDA2.0-mini shape: a proxy (LLaDA2.2 ships only as the ~100B flash model, and no mini config is public)
LLADA2_MINI_BLOCK48 = {**LLADA2_MINI, "expert_capacity": 48, "block_size": 32}

SDAR_8B = {
    "architectures": ["SDARForCausalLM"], "model_type": "sdar", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "mask_token_id": 151669, "eos_token_id": 151645,
}

# SDAR-4B-Chat: the Qwen3-4B layout (36 layers, hidden 2560, GQA 32 / 8, tied embeddings; ~4.0B parameters, 8 GB
# in bf16), SDAR's block 4; JetEngine's published H200 figure is for this model (issue 31)
SDAR_4B = {**SDAR_8B, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True}

LLADA_8B = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32,
    "n_kv_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464, "embedding_size": 126464,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_sequence_length": 4096, "weight_tying": False,
    "mask_token_id": 126336, "eos_token_id": 126081,
}

# A small LLaDA2-layout model exercising every LLaDA2 code path (dense first layer, grouped MoE routing with
# a shared expert, q/k norm, partial RoPE); random weights say nothing about quality.
TINY_LLADA2 = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": 1024, "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-6, "rope_theta": 600000.0, "partial_rotary_factor": 0.5, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "mask_token_id": 1023, "eos_token_id": 1022,
}

PRESETS = {"llada2.0-mini": LLADA2_MINI, "llada2.1-mini": LLADA2_MINI, "llada2-mini-block48": LLADA2_MINI_BLOCK48,
           "sdar-8b": SDAR_8B, "sdar-4b": SDAR_4B, "llada-8b": LLADA_8B,
           "tiny-random-llada2": TINY_LLADA2}
