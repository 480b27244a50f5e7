"""The decoder every architecture shares; architecture files only parse configs and name weights."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from compiledllm.attention.metadata import DenseAttention, block_causal_mask
from compiledllm.models.config import ModelConfig
from compiledllm.models.head import head_logits
from compiledllm.models.layers import DecoderLayer, RMSNorm, Rotary
from compiledllm.profiling import phase


class BlockDiffusionLM(nn.Module, ABC):
    """Embedding -> pre-norm decoder layers -> final norm -> head. Logits are not shifted."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)
        self.tokenizer = None  # set by the loader when tokenizer files exist
        self.mask_token_id: int = config.mask_token_id
        self.eos_token_id: int = config.eos_token_id

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty` from the meta device)."""
        self.rotary = Rotary(self.config.rotary_dim, self.config.rope_theta).to(self.device)
        for layer in self.layers:
            if hasattr(layer.mlp, "expert_bias"):  # router bias stays float32 whatever the model dtype
                layer.mlp.expert_bias = torch.zeros_like(layer.mlp.expert_bias, dtype=torch.float32)

    @property
    def bidirectional(self) -> bool:
        return self.config.bidirectional

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, input_ids, positions, attn_meta, kv=None, logits_index=None, float_logits=True,
                logits_rows=None, layers=None) -> torch.Tensor:
        """input_ids/positions [B, L]; kv: a KVCache (or None); logits_index [B, K] picks the positions
        whose logits are wanted (all when None). Returns logits [B, L or K, V]: float32, or with
        float_logits=False in the model's dtype (the decode step: its confidence reads them as they are, which
        spares writing and reading a float32 copy of the vocabulary-wide logits). logits_rows [B, L or K] bool:
        the rows whose logits are read; others may hold anything (the head may skip them, head.py). layers: what
        runs as the decoder layers (default self.layers; the decode step passes compiled regions of them)."""
        h = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        for i, layer in enumerate(self.layers if layers is None else layers):
            h = layer(h, self.rotary, cos, sin, positions, attn_meta, None if kv is None else kv.layer(i))
        if logits_index is not None:
            h = h.gather(1, logits_index[..., None].expand(-1, -1, h.shape[-1]))
        h = self.norm(h)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        with phase("head"):
            logits = head_logits(h, head, logits_rows)
            return logits.float() if float_logits else logits

    @torch.no_grad()
    def reference_forward(self, input_ids: torch.Tensor, block_size: int | None = 32) -> torch.Tensor:
        """No-cache logits [B, L, V]: block-causal from position 0 with an int block_size, bidirectional with None."""
        input_ids = input_ids.to(self.device)
        B, L = input_ids.shape
        positions = torch.arange(L, device=self.device).expand(B, L)
        return self(input_ids, positions, DenseAttention(block_causal_mask(L, block_size, self.device)))

    @abstractmethod
    def hf_weight_map(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the parameter (or view of one) it loads into."""
