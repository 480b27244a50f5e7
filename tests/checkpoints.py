"""Tiny random checkpoints in Hugging Face layout, for tests.

`write_checkpoint(dir, arch, seed)` writes config.json and safetensors weights
(one file, or shards plus `model.safetensors.index.json`) for one of:

* ``"llada2"``  LLaDA2 MoE (`LLaDA2MoeModelLM`), group-limited sigmoid router;
* ``"sdar"``    SDAR (`SDARForCausalLM`, Qwen3 layout), tied or untied head;
* ``"llada"``   LLaDA (`LLaDAModelLM`), fully bidirectional.

The weights are random but scaled so that the models are *not* flat: the
embedding and output head are large, so per-position softmax maxima spread over
(0, 1) and confidence thresholds of 0.3-0.95 sometimes accept several tokens at
once and sometimes a single one. `write_tokenizer(dir)` writes a small byte-level
BPE tokenizer.json with the special tokens ``<|endoftext|>`` (id 0) and
``<|mask|>`` (id 1) plus a tokenizer_config.json with a chat template.

This module is independent of compiledllm: it imports nothing from it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ARCHS = ("llada2", "sdar", "llada")

# Special ids shared by the checkpoints and write_tokenizer().
EOS_ID = 0
MASK_ID = 1

_DEFAULTS: dict[str, dict] = {
    "llada2": {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "vocab_size": 96,
        "hidden_size": 48,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "num_experts": 8,
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000.0,
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "use_qkv_bias": False,
        "use_bias": False,
        "use_qk_norm": True,
        "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    },
    "sdar": {
        "architectures": ["SDARForCausalLM"],
        "model_type": "sdar",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    },
    "llada": {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 4,
        "mlp_hidden_size": 64,
        "vocab_size": 96,
        "embedding_size": 96,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": 512,
        "weight_tying": False,
        "include_bias": False,
        "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    },
}

# Standard deviations: small projections, large embedding / head (varied confidences).
_STD_LINEAR = 0.15
_STD_EMBED = 1.0
_STD_HEAD = 0.8


def default_config(arch: str, **overrides) -> dict:
    if arch not in _DEFAULTS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    cfg = dict(_DEFAULTS[arch])
    cfg.update(overrides)
    return cfg


class _Gen:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, *shape, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g, dtype=torch.float64).mul(std).float()

    def norm_weight(self, n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=self.g, dtype=torch.float64)).float()


def _llada2_tensors(cfg: dict, g: _Gen) -> dict[str, torch.Tensor]:
    d, V = cfg["hidden_size"], cfg["vocab_size"]
    H, KVH, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter, im = cfg["intermediate_size"], cfg["moe_intermediate_size"]
    E, ns = cfg["num_experts"], cfg["num_shared_experts"]
    t: dict[str, torch.Tensor] = {"model.word_embeddings.weight": g.normal(V, d, std=_STD_EMBED)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = g.norm_weight(d)
        t[p + "post_attention_layernorm.weight"] = g.norm_weight(d)
        t[p + "attention.query_key_value.weight"] = g.normal((H + 2 * KVH) * hd, d, std=_STD_LINEAR * 2)
        t[p + "attention.query_layernorm.weight"] = g.norm_weight(hd)
        t[p + "attention.key_layernorm.weight"] = g.norm_weight(hd)
        t[p + "attention.dense.weight"] = g.normal(d, H * hd, std=_STD_LINEAR)
        if i < cfg["first_k_dense_replace"]:
            t[p + "mlp.gate_proj.weight"] = g.normal(inter, d, std=_STD_LINEAR)
            t[p + "mlp.up_proj.weight"] = g.normal(inter, d, std=_STD_LINEAR)
            t[p + "mlp.down_proj.weight"] = g.normal(d, inter, std=_STD_LINEAR)
        else:
            t[p + "mlp.gate.weight"] = g.normal(E, d, std=_STD_LINEAR * 2)
            t[p + "mlp.gate.expert_bias"] = g.normal(E, std=0.1).float()
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                t[q + "gate_proj.weight"] = g.normal(im, d, std=_STD_LINEAR * 2)
                t[q + "up_proj.weight"] = g.normal(im, d, std=_STD_LINEAR * 2)
                t[q + "down_proj.weight"] = g.normal(d, im, std=_STD_LINEAR * 2)
            t[p + "mlp.shared_experts.gate_proj.weight"] = g.normal(im * ns, d, std=_STD_LINEAR)
            t[p + "mlp.shared_experts.up_proj.weight"] = g.normal(im * ns, d, std=_STD_LINEAR)
            t[p + "mlp.shared_experts.down_proj.weight"] = g.normal(d, im * ns, std=_STD_LINEAR)
    t["model.norm.weight"] = g.norm_weight(d)
    t["lm_head.weight"] = g.normal(V, d, std=_STD_HEAD)
    return t


def _sdar_tensors(cfg: dict, g: _Gen) -> dict[str, torch.Tensor]:
    d, V = cfg["hidden_size"], cfg["vocab_size"]
    H, KVH, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter = cfg["intermediate_size"]
    tied = bool(cfg["tie_word_embeddings"])
    # A tied head is the embedding: keep its scale between the two so logits stay varied.
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": g.normal(V, d, std=_STD_EMBED)
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = g.norm_weight(d)
        t[p + "post_attention_layernorm.weight"] = g.norm_weight(d)
        t[p + "self_attn.q_proj.weight"] = g.normal(H * hd, d, std=_STD_LINEAR * 2)
        t[p + "self_attn.k_proj.weight"] = g.normal(KVH * hd, d, std=_STD_LINEAR * 2)
        t[p + "self_attn.v_proj.weight"] = g.normal(KVH * hd, d, std=_STD_LINEAR * 2)
        t[p + "self_attn.o_proj.weight"] = g.normal(d, H * hd, std=_STD_LINEAR)
        t[p + "self_attn.q_norm.weight"] = g.norm_weight(hd)
        t[p + "self_attn.k_norm.weight"] = g.norm_weight(hd)
        t[p + "mlp.gate_proj.weight"] = g.normal(inter, d, std=_STD_LINEAR)
        t[p + "mlp.up_proj.weight"] = g.normal(inter, d, std=_STD_LINEAR)
        t[p + "mlp.down_proj.weight"] = g.normal(d, inter, std=_STD_LINEAR)
    t["model.norm.weight"] = g.norm_weight(d)
    if not tied:
        t["lm_head.weight"] = g.normal(V, d, std=_STD_HEAD)
    return t


def _llada_tensors(cfg: dict, g: _Gen) -> dict[str, torch.Tensor]:
    d, V, mlp = cfg["d_model"], cfg["vocab_size"], cfg["mlp_hidden_size"]
    t: dict[str, torch.Tensor] = {"model.transformer.wte.weight": g.normal(V, d, std=_STD_EMBED)}
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        t[p + "attn_norm.weight"] = g.norm_weight(d)
        t[p + "ff_norm.weight"] = g.norm_weight(d)
        t[p + "q_proj.weight"] = g.normal(d, d, std=_STD_LINEAR * 2)
        t[p + "k_proj.weight"] = g.normal(d, d, std=_STD_LINEAR * 2)
        t[p + "v_proj.weight"] = g.normal(d, d, std=_STD_LINEAR * 2)
        t[p + "attn_out.weight"] = g.normal(d, d, std=_STD_LINEAR)
        t[p + "ff_proj.weight"] = g.normal(mlp, d, std=_STD_LINEAR)
        t[p + "up_proj.weight"] = g.normal(mlp, d, std=_STD_LINEAR)
        t[p + "ff_out.weight"] = g.normal(d, mlp, std=_STD_LINEAR)
    t["model.transformer.ln_f.weight"] = g.norm_weight(d)
    t["model.transformer.ff_out.weight"] = g.normal(V, d, std=_STD_HEAD)
    return t


_BUILDERS = {"llada2": _llada2_tensors, "sdar": _sdar_tensors, "llada": _llada_tensors}


def make_tensors(arch: str, seed: int, cfg: dict) -> dict[str, torch.Tensor]:
    return _BUILDERS[arch](cfg, _Gen(seed))


def write_checkpoint(
    dir: str | Path,
    arch: str,
    seed: int,
    *,
    sharded: bool = False,
    tied: bool = False,
    duplicate_head_rows: bool = False,
    **overrides,
) -> Path:
    """Write a tiny random checkpoint of `arch` into `dir` and return the directory.

    `tied` (SDAR only) drops `lm_head.weight` and sets tie_word_embeddings.
    `sharded` splits the tensors over 3 files with a `model.safetensors.index.json`.
    `duplicate_head_rows` copies output-head row 2j into row 2j+1 for every j >= 1, so
    tokens 2j and 2j+1 always get exactly equal logits (ties must go to the lower id).
    `overrides` replace config keys (e.g. n_group=1, topk_group=1).
    """
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    if tied:
        if arch != "sdar":
            raise ValueError("tied heads are only written for arch='sdar'")
        overrides.setdefault("tie_word_embeddings", True)
    cfg = default_config(arch, **overrides)
    tensors = make_tensors(arch, seed, cfg)
    if duplicate_head_rows:
        head = {"llada2": "lm_head.weight", "sdar": "lm_head.weight",
                "llada": "model.transformer.ff_out.weight"}[arch]
        if head not in tensors:
            raise ValueError("duplicate_head_rows needs an untied head")
        w = tensors[head].clone()
        w[3::2] = w[2:-1:2][: w[3::2].shape[0]]
        tensors[head] = w
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if not sharded:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    names = list(tensors)
    n = 3
    chunks = [names[k::n] for k in range(n)]  # interleave so layers span shards
    weight_map: dict[str, str] = {}
    total = 0
    for k, chunk in enumerate(chunks):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file({name: tensors[name] for name in chunk}, str(out / fname), metadata={"format": "pt"})
        for name in chunk:
            weight_map[name] = fname
            total += tensors[name].numel() * tensors[name].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


_TOKENIZER_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a block diffusion model fills masked tokens in parallel",
    "hello world, hello model; the cache keeps keys and values",
    "one two three four five six seven eight nine ten",
    "decode the block, accept the confident tokens, repeat",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<role>{{ m['role'] }}</role>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<role>assistant</role>{% endif %}"
)


def write_tokenizer(dir: str | Path, vocab_size: int = 96) -> Path:
    """Write tokenizer.json (byte-level BPE, <= vocab_size tokens) and tokenizer_config.json.

    Special tokens: "<|endoftext|>" -> EOS_ID (0), "<|mask|>" -> MASK_ID (1).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|mask|>"],
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_TEXT, trainer=trainer)
    assert tok.token_to_id("<|endoftext|>") == EOS_ID and tok.token_to_id("<|mask|>") == MASK_ID
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(out / "tokenizer.json"))
    tcfg = {
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    return out
