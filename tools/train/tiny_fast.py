"""Training-only paths of tools/train/train_tiny.py: the attention layouts of the training forwards and the MoE's
routed experts with gradients, swapped in around the training steps (the engine's own paths are inference-only:
its Triton kernels have no backward, and its grouped GEMM only takes bf16).

Attention rules a training Forward may carry (the model's layers call `attend`, patched by `training_attention`):
  FullRule  every token sees every token (tiny-llada's masked diffusion): SDPA without a mask, so the flash kernel.
  BDRule    the block-diffusion layout of tiny_mix.bd_noise over [x0 ; x_t] (bids per token, the first n_clean
            tokens clean). On CUDA FlexAttention with a block mask (compiled once per shape; only the tiles the
            mask keeps are computed: a long window's clean part is block-causal, so about half); on the CPU, or if
            FlexAttention fails, SDPA with the dense boolean mask.
MoE: routing always takes the torch path (its weights carry the router's gradient; a block-routed MoE's own, with
the forward's route groups) and counts each expert's load for the bias balancing; on CUDA the experts run as bf16
torch._grouped_mm over expert groups padded to 16 rows (static shapes, no host sync), checked against a plain loop
at start-up (a per-expert loop if the check fails).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compiledllm.models import layers as model_layers
from compiledllm.models.layers import MoE

_engine_attend = model_layers.attend


@dataclass(frozen=True)
class FullRule:
    pass


@dataclass(frozen=True)
class BDRule:
    bids: torch.Tensor                  # [B, N] int32 block id per token (dummies: unique negative ids)
    n_clean: int                        # tokens [0, n_clean) are x0, the rest x_t
    block_mask: object | None = None    # FlexAttention BlockMask (CUDA)
    dense: torch.Tensor | None = None   # [B, 1, N, N] bool (CPU / fallback)


def bd_dense_mask(bids: torch.Tensor, n_clean: int) -> torch.Tensor:
    """[B, 1, N, N] bool: noisy q sees clean k of earlier blocks and noisy k of its block; clean q sees clean k of
    its block and earlier ones."""
    N = bids.shape[1]
    q, k = bids[:, :, None], bids[:, None, :]
    idx = torch.arange(N, device=bids.device)
    k_noisy = (idx >= n_clean)[None, None, :]
    q_noisy = (idx >= n_clean)[None, :, None]
    noisy_row = (~k_noisy & (k < q)) | (k_noisy & (k == q))
    clean_row = ~k_noisy & (k <= q)
    return torch.where(q_noisy, noisy_row, clean_row)[:, None]


def _heads(q, k, v):
    """[B, N, heads, D] -> [B, heads, N, D], the KV heads repeated up to the query heads (no kernel's GQA path
    needed: flash for FullRule, memory-efficient for dense masks, FlexAttention's compile on the H200)."""
    H, KVH = q.shape[2], k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if KVH != H:
        k, v = k.repeat_interleave(H // KVH, dim=1), v.repeat_interleave(H // KVH, dim=1)
    return q, k, v


def _sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(*_heads(q, k, v), attn_mask=mask).transpose(1, 2)


class Flex:
    """FlexAttention for BDRule on CUDA: one persistent bids buffer and mask function per shape, so the compiled
    kernels and the compiled block-mask builder are reused every step."""

    def __init__(self):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.flex = torch.compile(flex_attention, dynamic=False)
        self.create = create_block_mask
        self.shapes: dict = {}

    def rule(self, bids: torch.Tensor, n_clean: int) -> BDRule:
        B, N = bids.shape
        key = (B, N, n_clean)
        if key not in self.shapes:
            buf = bids.clone()

            def mod(b, h, q, kv):
                qb, kb = buf[b, q], buf[b, kv]
                k_noisy = kv >= n_clean
                noisy_row = (~k_noisy & (kb < qb)) | (k_noisy & (kb == qb))
                return torch.where(q >= n_clean, noisy_row, ~k_noisy & (kb <= qb))
            self.shapes[key] = (buf, mod)
        buf, mod = self.shapes[key]
        buf.copy_(bids)
        return BDRule(buf, n_clean, block_mask=self.create(mod, B, None, N, N, device=bids.device, _compile=True))

    def attend(self, q, k, v, block_mask):
        return self.flex(*_heads(q, k, v), block_mask=block_mask).transpose(1, 2)


_flex: Flex | None = None


def bd_rule(bids: torch.Tensor, n_clean: int, use_flex: bool) -> BDRule:
    global _flex
    if use_flex:
        _flex = _flex or Flex()
        return _flex.rule(bids, n_clean)
    return BDRule(bids, n_clean, dense=bd_dense_mask(bids, n_clean))


def _attend(q, k, v, fwd, kv_layer, layer, written=False):
    rule = fwd.attention.rule
    if isinstance(rule, FullRule):
        return _sdpa(q, k, v)
    if isinstance(rule, BDRule):
        if rule.block_mask is not None:
            return _flex.attend(q, k, v, rule.block_mask)
        return _sdpa(q, k, v, rule.dense)
    return _engine_attend(q, k, v, fwd, kv_layer, layer, written)


@contextlib.contextmanager
def training_attention():
    model_layers.attend = _attend
    try:
        yield
    finally:
        model_layers.attend = _engine_attend


# -------------------------------------------------------------------------------------------------- MoE

def attach_load_counters(model, backend: str | None = None) -> list[MoE]:
    """Record each MoE layer's expert choices (eager sparse path) for the bias balancing; `backend` forces the
    routing path (None: the forward's). The layer's own router runs (a BlockRoutedMoE's: the loads are those of
    the block-routed assignment), and dead tokens (route group -1: dummy slots) count for no expert: their pairs
    never run (MoE.assign), so balancing towards them would skew the bias."""
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    for m in moes:
        def route(x, fwd_backend="auto", groups=None, index=None, m=m):
            ids, w = type(m).route(m, x, backend or fwd_backend, groups, index)
            flat = ids.flatten().clamp(max=m.cfg.num_experts - 1)  # a block router's dead pairs: id E, counted 0
            # scatter_add rather than bincount: no host sync
            live = torch.ones_like(flat) if groups is None else \
                (groups.reshape(-1, 1) >= 0).expand_as(ids).flatten().long()
            m._load = torch.zeros(m.cfg.num_experts, dtype=torch.long, device=x.device).scatter_add_(0, flat, live)
            return ids, w
        m.route = route
    return moes


def detach_load_counters(moes) -> None:
    for m in moes:
        for name in ("route", "_routed", "_load"):
            m.__dict__.pop(name, None)


@torch.no_grad()
def balance_experts(moes, rate: float) -> None:
    for m in moes:
        load = m._load.float()
        m.expert_bias.add_(rate * torch.sign(load.mean() - load))


def padded_grouped(m: MoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, align: int = 16) -> torch.Tensor:
    """The routed experts in bf16 through torch._grouped_mm, every expert's rows padded to `align` (the grouped
    GEMM's backward wants aligned group offsets); same result as MoE._routed."""
    T, k = ids.shape
    E, D = m.cfg.num_experts, x.shape[-1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + align - 1) // align * align
    pend = padded.cumsum(0)
    first = counts.cumsum(0) - counts
    sorted_e = flat[order]
    dest = (pend - padded)[sorted_e] + torch.arange(T * k, device=x.device) - first[sorted_e]
    rows = T * k + E * align
    buf = x.new_zeros(rows, D, dtype=torch.bfloat16).index_copy(0, dest, x.to(torch.bfloat16)[order // k])
    offs = pend.to(torch.int32)
    offs[-1] = rows  # the spare zero rows join the last group: no row lies outside a group
    gate, up = torch._grouped_mm(buf, m.w_gate_up.to(torch.bfloat16).transpose(1, 2), offs=offs).chunk(2, dim=-1)
    ys = torch._grouped_mm(F.silu(gate) * up, m.w_down.to(torch.bfloat16).transpose(1, 2), offs=offs)[dest]
    y = torch.empty_like(ys).index_copy(0, order, ys).view(T, k, D)
    return (y * w[..., None].to(y.dtype)).sum(1)


def looped(m: MoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The routed experts one expert at a time (one host sync per layer): the fallback."""
    T, k = ids.shape
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=m.cfg.num_experts).tolist()
    xs = x[order // k]
    outs, at = [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(xs[at : at + n], m.w_gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, m.w_down[e]))
        at += n
    ys = torch.cat(outs)
    y = torch.empty_like(ys).index_copy(0, order, ys).view(T, k, -1)
    return (y * w[..., None].to(y.dtype)).sum(1)


def _check(fn, m: MoE) -> bool:
    """fn against the plain loop in float32, forward and gradients, on a small random batch."""
    g = torch.Generator(device=m.w_down.device).manual_seed(0)
    dev = m.w_down.device
    x = torch.randn(96, m.w_down.shape[1], generator=g, device=dev).requires_grad_(True)
    ids = torch.stack([torch.randperm(m.cfg.num_experts, generator=g, device=dev)[: m.cfg.top_k] for _ in range(96)])
    w = torch.rand(96, m.cfg.top_k, generator=g, device=dev)
    outs, grads = [], []
    for f in (fn, looped):
        m.zero_grad(set_to_none=True)
        x.grad = None
        y = f(m, x, ids, w)
        (y.float() * torch.linspace(-1, 1, y.numel(), device=dev).view_as(y)).sum().backward()
        outs.append(y.float().detach())
        grads.append([x.grad.clone(), m.w_gate_up.grad.clone(), m.w_down.grad.clone()])
    m.zero_grad(set_to_none=True)
    close = lambda a, b: ((a - b).norm() / b.norm().clamp(min=1e-12)).item() < 0.05  # noqa: E731  bf16 vs fp32
    return close(*outs) and all(close(a, b) for a, b in zip(*grads))


def attach_moe_training(model, log=print) -> list[MoE]:
    """Load counters with the torch routing; on CUDA the routed experts through padded_grouped (or `looped`)."""
    moes = attach_load_counters(model, backend="grouped_mm")
    if not moes or model.device.type != "cuda":
        return moes
    fn = padded_grouped
    try:
        ok = _check(padded_grouped, moes[0])
    except Exception as e:  # noqa: BLE001  any failure of the fast path: use the loop
        log(f"MoE: padded grouped GEMM failed ({type(e).__name__}: {str(e)[:120]}); using the per-expert loop")
        ok, fn = True, looped
    if not ok:
        log("MoE: padded grouped GEMM disagrees with the loop; using the per-expert loop")
        fn = looped
    for m in moes:
        m._routed = routed_with(fn, m)
    return moes


def routed_with(fn, m: MoE):
    """m._routed through fn. A forward with route groups sends a dead token's pairs to the id num_experts with
    weight 0 (MoE.assign), which fn's expert counts have no bin for: they go to the last expert instead, where
    their weight 0 makes them add nothing (the dummy tokens' states are finite) and take no gradient. `shared`
    (MoE.forward hands the shared expert to the routed op where the Triton op could take it): added here."""
    last = m.cfg.num_experts - 1

    def routed(x, ids, w, backend="auto", skip=False, shared=False):
        out = fn(m, x, ids.clamp(max=last) if skip else ids, w)
        return out + m.shared(x) if shared else out
    return routed
