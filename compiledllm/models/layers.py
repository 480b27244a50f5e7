"""Shared layers every architecture is built from (pre-norm decoder with GQA and gated MLP/MoE)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compiledllm.attention.backend import attend
from compiledllm.models import moe_triton, qkv_kernel
from compiledllm.models.config import ModelConfig, MoEConfig
from compiledllm.profiling import phase


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """NeoX rotate-half RoPE on the first `rotary_dim` dims of each head (partial rotary)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angle = positions.float()[..., None] * self.inv_freq  # [B, L, rot/2], float32 as the references do
        angle = torch.cat([angle, angle], dim=-1)
        return angle.cos(), angle.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, L, heads, hd]; cos/sin [B, L, rot]."""
        rot = self.rotary_dim
        xr, xp = x[..., :rot].float(), x[..., rot:]
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
        rotated = torch.cat([-x2, x1], dim=-1)
        out = xr * cos[:, :, None] + rotated * sin[:, :, None]
        return torch.cat([out.to(x.dtype), xp], dim=-1)


class Attention(nn.Module):
    """Fused QKV projection, optional per-head q/k RMSNorm before RoPE, GQA, output projection."""

    parallel = None  # a tensor-parallel rank's heads: compiledllm.parallel.Shard, whose all-reduce sums o's partials

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.index = index  # the layer's index: an AttentionSpec may ask some layers only for statistics
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.hd, bias=False)
        self.o = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_eps) if cfg.qk_norm else None

    def project(self, x, rotary: Rotary, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, hidden] -> q [B, L, H, hd], k, v [B, L, KVH, hd]: normed and rotated as the attention sees them."""
        B, L, _ = x.shape
        with phase("projections"):
            qkv = self.qkv(x)
        q, k, v = qkv.view(B, L, self.h + 2 * self.kvh, self.hd).split([self.h, self.kvh, self.kvh], dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotary.apply(q, cos, sin), rotary.apply(k, cos, sin), v

    def forward(self, x, rotary: Rotary, cos, sin, fwd, kv_layer):
        B, L, _ = x.shape
        if fwd.fused_cache:  # the K/V written by the projection itself (Flash-Cache), before the attention reads
            with phase("projections"):
                q, k, v = qkv_kernel.project_write(self, rotary, x, cos, sin, kv_layer, fwd.kv_write)
        else:
            q, k, v = self.project(x, rotary, cos, sin)
        with phase("attention"):
            out = attend(q, k, v.contiguous(), fwd, kv_layer, self.index, written=fwd.fused_cache)
        with phase("projections"):
            out = self.o(out.reshape(B, L, self.h * self.hd))
        return out if self.parallel is None else self.parallel.all_reduce(out)


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x) with gate and up fused into one projection."""

    parallel = None  # a tensor-parallel rank's share of the inner dim: its all-reduce sums down's partials

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.inner = inner
        self.gate_up = nn.Linear(dim, 2 * inner, bias=False)
        self.down = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inner, dim=-1)
        out = self.down(F.silu(gate) * up)
        return out if self.parallel is None else self.parallel.all_reduce(out)


class MoE(nn.Module):
    """Sigmoid router with expert bias (selection only) and group-limited top-k, routed experts + shared expert."""

    # a rank's experts (compiledllm.parallel.Shard): the router is replicated, so every rank routes every token;
    # its routed and shared-expert partials are summed by one all-reduce
    parallel = None

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        E, F_ = cfg.num_experts, cfg.expert_dim
        self.gate = nn.Parameter(torch.zeros(E, dim))
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        self.w_gate_up = nn.Parameter(torch.zeros(E, 2 * F_, dim))
        self.w_down = nn.Parameter(torch.zeros(E, dim, F_))
        self.shared = GatedMLP(dim, F_ * cfg.num_shared) if cfg.num_shared else None

    # backend (a forward's Kernels.moe): "auto": the Triton routing and expert kernels where they apply
    # (moe_triton.py; the experts below moe_triton.GROUPED_MM_FROM_PAIRS_PER_EXPERT), else torch; "triton": the
    # Triton experts; "grouped_mm": always the torch routing and grouped GEMM (the benchmarks' A/B baseline, and
    # what an exported engine runs).

    def route(self, x: torch.Tensor, backend: str = "auto", groups: torch.Tensor | None = None,
              index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (expert ids [T, k], weights [T, k] float32). Router math in float32.

        groups: the forward's Forward.route_groups as [rows, Q] (x's tokens are its rows' tokens in order, T = rows
        * Q), or None. groups[r, q] is the route group (the block) of row r's token q, -1 for a dead token; equal
        values in different rows are different groups. This router routes every token alone and ignores them
        except that a dead token's pairs get the id num_experts (no expert) and weight 0. The extension point: a
        subclass may choose each group's experts together (models/block_routing.py restricts a block's tokens to
        the experts admitted per block). index: Forward.route_index (a dense key of the groups the model made once
        per forward), or None. Static shapes, no host sync."""
        c = self.cfg
        logits = router_logits(x, self.gate)
        if backend != "grouped_mm" and moe_triton.route_supported(x, c.num_experts, c.n_group):
            return torch.ops.compiledllm.moe_route(logits, self.expert_bias, None if groups is None else
                                                   groups.reshape(-1), c.n_group, c.topk_group, c.top_k,
                                                   c.norm_topk_prob, c.routed_scaling)
        scores = torch.sigmoid(logits)
        biased = scores + self.expert_bias
        if c.n_group > 1:
            grouped = biased.view(-1, c.n_group, c.num_experts // c.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, True)
            # dropped groups' experts can never be picked, as in the published LLaDA2MoeGate.group_limited_topk
            # (-inf; a 0.0 fill would beat kept experts whose biased score is negative)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(biased)
        ids = biased.topk(c.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        if c.norm_topk_prob and c.top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * c.routed_scaling
        if groups is None:
            return ids, w
        dead = (groups.reshape(-1) < 0)[:, None]
        return ids.masked_fill(dead, c.num_experts), w.masked_fill(dead, 0.0)

    def forward(self, x: torch.Tensor, backend: str = "auto", groups: torch.Tensor | None = None,
                index: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., D]; groups (Forward.route_groups): x.shape[:-1] long, -1 = a dead token (route()), or None: every
        token routes (exactly the path without groups). A dead token takes no expert pair; the shared expert still
        runs on it, so its output is finite but meaningless (nothing reads it)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if groups is not None and groups.shape != shape[:-1]:
            raise ValueError(f"MoE: route groups of shape {tuple(groups.shape)} for tokens {tuple(shape[:-1])}")
        rows = None if groups is None else groups.reshape(-1, shape[-2])  # [rows, Q]; x [T, D]: one row
        ids, w = self.route(x, backend, rows, index)
        fuse = (moe_triton.fuses_shared(self.shared, x, self.cfg.expert_dim) and self.parallel is None
                and self._triton(x, ids, backend))  # the setting first: off, nothing else is asked
        out = self._routed(x, ids, w, backend, skip=rows is not None, shared=fuse)
        if self.shared is not None and not fuse:
            out = out + self.shared(x)
        if self.parallel is not None:
            out = self.parallel.all_reduce(out)
        return out.view(shape)

    def _triton(self, x: torch.Tensor, ids: torch.Tensor, backend: str) -> bool:
        """Whether the routed experts run as the Triton op (else torch's grouped GEMMs)."""
        return backend == "triton" or (backend == "auto" and moe_triton.supports(x, self.w_gate_up, self.w_down)
                                       and moe_triton.auto_uses_triton(ids.numel(), self.cfg.num_experts))

    def _routed(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, backend: str = "auto",
                skip: bool = False, shared: bool = False) -> torch.Tensor:
        """The T*k (token, expert) pairs through the experts, each token's k outputs summed: the Triton op (sort,
        expert kernels and sum inside it), or sorted by expert in torch and two grouped GEMMs. Static shapes and
        no host sync, so it compiles and captures. A pair with id num_experts goes to no expert and adds 0: the
        Triton op and expert parallelism always allow it, the torch grouped GEMMs where `skip` is set (one more
        sort bin and a select; without it the path is the one of a forward without route groups). shared: the
        shared expert inside the Triton op (forward decides: moe_triton.fuses_shared)."""
        if self.parallel is not None and self.parallel.experts is not None:
            return self._routed_here(x, ids, w)
        if self._triton(x, ids, backend):
            ws = (self.shared.gate_up.weight, self.shared.down.weight) if shared else (None, None)
            return torch.ops.compiledllm.moe_routed(x, self.w_gate_up, self.w_down, ids, w.float(), *ws)
        T, k = ids.shape
        E = self.cfg.num_experts
        y = self._pairs(x, ids.flatten(), E + 1 if skip else E, k).view(T, k, -1)
        if skip:  # a skipped pair's row was never computed (any bits, NaN included): 0 instead
            y = torch.where((ids < E)[..., None], y, 0)
        return (y * w[..., None].to(y.dtype)).sum(1)

    def _pairs(self, x: torch.Tensor, flat: torch.Tensor, bins: int, k: int) -> torch.Tensor:
        """[T*k, D]: pair p (token p // k) through expert flat[p], in pair order; ids >= the experts held sort
        last and no GEMM reads them (their rows are unspecified)."""
        experts = self.w_gate_up.shape[0]
        # a narrow key dtype: the radix sort then makes 2 passes instead of 8
        order = (flat.to(torch.int16) if bins < 2**15 else flat).argsort(stable=True)
        counts = torch.zeros(bins, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts[:experts].cumsum(0, dtype=torch.int32)
        xs = x[order // k]
        gate, up = grouped_mm(xs, self.w_gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
        ys = grouped_mm(F.silu(gate) * up, self.w_down.transpose(1, 2), offs)
        return torch.empty_like(ys).index_copy_(0, order, ys)  # back to (token, rank) order

    def _routed_here(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Expert parallel: the pairs whose expert this rank holds; the others give 0 here and are added by the
        ranks holding them (MoE.forward's all-reduce over replicated routing: an all-gather-style dispatch, every
        rank reading every token). All-to-all dispatch (each token sent only to its experts' ranks) moves less
        at large batches; which is faster must be measured on a multi-GPU machine. Torch grouped GEMMs only:
        the Triton experts take global expert ids."""
        T, k = ids.shape
        held = self.parallel.experts
        local = ids - self.parallel.first_expert
        mine = (local >= 0) & (local < held)
        y = self._pairs(x, torch.where(mine, local, held).flatten(), held + 1, k).view(T, k, -1)
        y = torch.where(mine[..., None], y, 0)  # rows of other ranks' pairs were never computed
        return (y * w[..., None].to(y.dtype)).sum(1)


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """float32 router logits x @ gate^T. With bf16 x and gate on CUDA, one tensor-core GEMM with float32 output:
    bf16 x bf16 products are exact in float32, so this differs from upcasting both (the reference form) only in
    the order of the float32 sums, which any GEMM algorithm choice changes anyway; the upcast form runs the
    float32 FMA GEMM, ~30 us per layer at batch 32 on the H200."""
    if x.is_cuda and x.dtype == gate.dtype == torch.bfloat16:
        return torch.mm(x, gate.t(), out_dtype=torch.float32)
    return x.float() @ gate.float().t()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows [offs[e-1], offs[e]) of x times w[e]: torch._grouped_mm for bf16 (its supported dtype), else a
    static masked loop (every expert over every row: fine for small models in float32)."""
    if x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, w, offs=offs)
    group = torch.bucketize(torch.arange(x.shape[0], device=x.device), offs, right=True)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for e in range(w.shape[0]):  # static-shape fallback: every expert over every row
        out = torch.where((group == e)[:, None], x @ w[e], out)
    return out


def moe_layer(dim: int, cfg: MoEConfig) -> MoE:
    """The MoE a config asks for: block-routed where it sets expert_capacity (LLaDA2.2), else per-token routing."""
    if cfg.expert_capacity is None:
        return MoE(dim, cfg)
    from compiledllm.models.block_routing import BlockRoutedMoE  # it subclasses MoE: imported once MoE exists

    return BlockRoutedMoE(dim, cfg)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg, index)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        use_moe = cfg.moe is not None and index >= cfg.moe.first_dense_layers
        self.mlp = moe_layer(cfg.hidden_size, cfg.moe) if use_moe else GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rotary, cos, sin, fwd, kv_layer):
        h = x + self.attn(self.input_norm(x), rotary, cos, sin, fwd, kv_layer)
        normed = self.post_norm(h)
        if isinstance(self.mlp, MoE):
            with phase("moe"):
                return h + self.mlp(normed, fwd.kernels.moe, fwd.route_groups, fwd.route_index)
        with phase("mlp"):
            return h + self.mlp(normed)
