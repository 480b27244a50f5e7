"""The decoder every architecture shares; architecture files only parse configs and name weights."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace

import torch
from torch import nn

from compiledllm.attention.spec import AttentionSpec, BlockCausal
from compiledllm.models.block_routing import block_routed, route_index
from compiledllm.models.config import ConfigFacts, ModelConfig
from compiledllm.models.head import head_logits
from compiledllm.models.layers import DecoderLayer, RMSNorm, Rotary
from compiledllm.policies.plan import Forward, route_groups
from compiledllm.profiling import phase


class BlockDiffusionLM(ConfigFacts, nn.Module, ABC):
    """Embedding -> pre-norm decoder layers -> final norm -> head. Logits are not shifted."""

    static_shapes = None  # a live model runs any shape; an exported engine has fixed ones (export/runtime.py)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config.rotary_dim, config.rope_theta)
        self.tokenizer = None  # set by the loader when tokenizer files exist

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty` from the meta device)."""
        self.rotary = Rotary(self.config.rotary_dim, self.config.rope_theta).to(self.device)
        for layer in self.layers:
            if hasattr(layer.mlp, "expert_bias"):  # router bias stays float32 whatever the model dtype
                layer.mlp.expert_bias = torch.zeros_like(layer.mlp.expert_bias, dtype=torch.float32)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, fwd: Forward, kv=None, layers=None) -> torch.Tensor:
        """Run one planned forward (policies/plan.py): logits [B, K, V] of fwd.logits_at (all Q when None),
        float32 with fwd.float_logits, else in the model's dtype (the decode step: its confidence reads them as
        they are, which spares writing and reading a float32 copy of the vocabulary-wide logits); rows outside
        fwd.logits_rows may hold anything (the head may skip them, head.py). kv: the KV store whose layer views
        the attention reads and writes (None: nothing cached). layers: what runs as the decoder layers (default
        self.layers; the decode step passes compiled regions of them)."""
        if fwd.route_groups is not None and fwd.route_index is None and block_routed(self):
            fwd = replace(fwd, route_index=route_index(fwd.route_groups))  # once, not per MoE layer
        h = self.embed(fwd.tokens) if fwd.resume is None else None
        cos, sin = self.rotary.cos_sin(fwd.positions)
        for i, layer in enumerate(self.layers if layers is None else layers):
            view, here = None if kv is None else kv.layer(i), fwd
            if fwd.resume is not None:
                if i < fwd.resume.first:
                    continue
                if fwd.resume.last is None or i <= fwd.resume.last:
                    h, here = resumed(fwd, i, h, view)
            if fwd.keep_hidden:
                view.write_hidden(here.kv_write, h)
            h = layer(h, self.rotary, cos, sin, here, view)
        if fwd.logits_at is not None:
            h = h.gather(1, fwd.logits_at[..., None].expand(-1, -1, h.shape[-1]))
        h = self.norm(h)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        with phase("head"):
            logits = head_logits(h, head, fwd.logits_rows)
            return logits.float() if fwd.float_logits else logits

    @torch.no_grad()
    def reference_forward(self, input_ids: torch.Tensor, block_size: int | None = 32) -> torch.Tensor:
        """No-cache logits [B, L, V]: block-causal from position 0 with an int block_size, bidirectional with None;
        a block-routed MoE routes over the model's own routing blocks."""
        input_ids = input_ids.to(self.device)
        B, L = input_ids.shape
        positions = torch.arange(L, device=self.device).expand(B, L)
        rule = BlockCausal(block_size if block_size is not None else L)
        moe = self.config.moe
        groups = None if moe is None or moe.route_block is None else route_groups(positions, moe.route_block)
        return self(Forward(input_ids, positions, AttentionSpec(rule), float_logits=True, route_groups=groups))

    @abstractmethod
    def hf_weight_map(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the parameter (or view of one) it loads into."""


def resumed(fwd: Forward, i: int, h: torch.Tensor | None, view) -> tuple[torch.Tensor, Forward]:
    """Layer i of a forward that resumes inside the model (Forward.resume): its input (the kept one for the rows
    resuming here, else what the layers before computed) and the forward as layer i sees it (no K/V or input
    written for a row that resumes at a later layer)."""
    at = fwd.resume.at
    kept = view.read_hidden(fwd.positions)
    h = kept if h is None else torch.where((at == i)[:, None, None], kept, h)
    return h, replace(fwd, kv_write=torch.where(at[:, None] <= i, fwd.kv_write, -1))
