"""Routing of random MoE models: an init whose routing is spread like a load-balanced trained router's, and a count
of the distinct experts each MoE layer touches in real forwards (benchmarks report it: the routed experts' weight
reads, so decode speed, follow it).

Why the router alone cannot do it: in a random model a block of MASK tokens has nearly the same hidden state at
every position (the MASK embedding dominates the residual; attention with unit-scale q/k is near-uniform, so it
adds almost the same mix to every query). What varies between the block's tokens spans one or two directions, and
a linear router's top-k over one or two directions reaches only a few dozen experts whatever its weights (on the
LLaDA2.0-mini shape, 32 MASK tokens after a 512-token random prefix: 8-20 of 256 experts per layer with the plain
random init, 11-19 with the common directions projected out of the router alone; uniform routing: 163). A
trained model's MASK tokens differ because each position reads different context. `balance` gives the random
model that, and leaves a dense model as it is:

* attention: q/k norm weights (without q/k norm: the q/k rows of the fused projection) keep only the rotary pairs
  that turn fast (> FAST_TURN radians per position, so they differ across a block), scaled so that attention
  logits have std ~ATTN_LOGIT_STD: each query position attends sharply to its own few keys; value rows are
  orthogonal to the MASK embedding (attending to MASK keys adds nothing shared) and the output projection gives
  one attended value unit-RMS entries, as the embedding part of the residual has;
* router: every gate row orthogonal to the MASK embedding, the part all masked tokens share.

Measured on the H200 (LLaDA2.0-mini shape, bf16, `touched_after`): 32 MASK tokens after 1,024 / 8,192 random
prompt tokens touch 153 / 158 of 256 experts per layer (mean; 141-169 over layers), 4 such rows 245.5 (uniform
routing: 163.3 and 251.6); the plain init 14 and 31. 32 random prompt tokens: 146 (plain init: 112).
tests/models/test_routing.py checks the count on a tiny config against `expected_touched`.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

from compiledllm.errors import UserError
from compiledllm.kv.cache import KVCache
from compiledllm.models.layers import MoE
from compiledllm.policies.plan import window_forward

ROUTINGS = ("balanced", "random")  # random: the plain normal init (a random router: few experts per block)
FAST_TURN = 0.1        # rad / position: rotary pairs turning faster differ by > 3 rad across a 32-token block
ATTN_LOGIT_STD = 32.0  # std of q.k / sqrt(head_dim) for unit-RMS inputs: sharp, position-dependent attention


def check_routing(routing) -> str:
    if routing not in ROUTINGS:
        raise UserError(f"model.routing: {routing!r} is not one of {', '.join(ROUTINGS)}")
    return routing


def moe_layers(model) -> list[MoE]:
    """The model's MoE modules in layer order ([] for a dense model or an exported engine)."""
    return [layer.mlp for layer in getattr(model, "layers", ()) if isinstance(getattr(layer, "mlp", None), MoE)]


@torch.no_grad()
def balance(model) -> None:
    """Make a freshly initialised random model route like a load-balanced trained router (module docstring). A
    dense model is left as it is: it has no router."""
    if not moe_layers(model):
        return
    c = model.config
    fast = (model.rotary.inv_freq > FAST_TURN).repeat(2)  # NeoX pairs (i, i + rot/2) share a frequency
    dims = torch.zeros(c.head_dim, dtype=torch.bool, device=model.device)
    dims[: c.rotary_dim] = fast.to(model.device)
    # q.k over n unit-RMS dims scaled by g each side: std g^2 sqrt(n); divided by sqrt(head_dim) in attention
    gain = math.sqrt(ATTN_LOGIT_STD * math.sqrt(c.head_dim / int(dims.sum())))
    mask = model.embed.weight[c.mask_token_id].float()
    mask = mask / mask.norm()
    for layer in model.layers:
        _sharpen(layer.attn, dims, gain)
        values = layer.attn.qkv.weight[(layer.attn.h + layer.attn.kvh) * layer.attn.hd:]
        _orthogonal(values, mask)  # a query that attends to MASK keys reads nothing shared from them
        _unit_output(layer.attn)
    for moe in moe_layers(model):
        _orthogonal(moe.gate, mask)


def _orthogonal(rows: torch.Tensor, u: torch.Tensor) -> None:
    """Remove the unit vector u's component from every row, in place."""
    w = rows.float()
    rows.copy_(w - (w @ u)[:, None] * u)


def _sharpen(attn, dims: torch.Tensor, gain: float) -> None:
    """Query / key channels: `gain` on `dims` of every head, 0 elsewhere."""
    scale = dims.to(attn.qkv.weight.dtype) * gain
    if attn.q_norm is not None:
        attn.q_norm.weight.copy_(scale)
        attn.k_norm.weight.copy_(scale)
        return
    # no q/k norm: rows of the q and k projections set to norm `gain` (unit-RMS input -> entries of std gain)
    rows = attn.qkv.weight[: (attn.h + attn.kvh) * attn.hd].view(attn.h + attn.kvh, attn.hd, -1)
    rows.mul_((scale / rows.float().norm(dim=-1).clamp(min=1e-12)).to(rows.dtype)[..., None])


def _unit_output(attn) -> None:
    """Scale the output projection so that one attended token's value comes out with unit RMS entries, as the
    embedding's part of the residual has: the attention's per-position reads then move the hidden state."""
    v = attn.qkv.weight[(attn.h + attn.kvh) * attn.hd:].float()
    o = attn.o.weight.float()
    rms = o.norm() / math.sqrt(o.shape[0]) * v.norm() / math.sqrt(v.shape[0])
    attn.o.weight.mul_(1 / float(rms))


def expected_touched(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens touch when each picks its top_k uniformly and independently:
    E * (1 - (1 - k/E)^n) (an expert is missed by one token with probability 1 - k/E)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


@dataclass
class TouchedExperts:
    """per_layer[i][f]: distinct experts MoE layer i chose in the f-th forward inside `count_touched`."""

    per_layer: list[list[int]] = field(default_factory=list)

    def mean_per_layer(self) -> list[float]:
        return [sum(c) / len(c) for c in self.per_layer if c]


@contextmanager
def count_touched(model) -> Iterator[TouchedExperts]:
    """Count the distinct experts every MoE layer's routing picks (MoE.route: dead tokens' pairs excluded) in each
    eager forward run inside the block: a forward pre-hook on each MoE (torch's hook API; removed on leaving,
    nothing else about the model changes) routes the layer's input once more and counts it (one host sync per
    layer and forward). For eager forwards (touched_after's, the benchmark's): a replayed CUDA graph runs no Python
    hook, so it counts nothing."""
    found = TouchedExperts()
    handles = []
    try:
        for moe in moe_layers(model):
            counts: list[int] = []
            found.per_layer.append(counts)
            handles.append(moe.register_forward_pre_hook(partial(_count, counts=counts), with_kwargs=True))
        yield found
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def _count(moe: MoE, args: tuple, kwargs: dict, counts: list[int]) -> None:
    """The pre-hook: MoE.forward's arguments (x, backend, groups), routed as forward routes them; inputs unchanged."""
    given = dict(zip(("x", "backend", "groups"), args)) | kwargs
    x, groups = given["x"], given.get("groups")
    rows = None if groups is None else groups.reshape(-1, x.shape[-2])
    ids, _ = moe.route(x.reshape(-1, x.shape[-1]), given.get("backend", "auto"), rows)
    counts.append(int(torch.unique(ids[ids < moe.cfg.num_experts]).numel()))


@torch.no_grad()
def touched_after(model, prompts: Sequence[Sequence[int]], block: int, context: int = 1024) -> list[float]:
    """Distinct experts per MoE layer in a decode forward of one all-MASK block per prompt (the step of a block
    whose tokens are most alike), after the prompt's last whole blocks, at most `context` tokens, are cached; []
    for a model without MoE layers. Eager: real window forwards of the model (plan.window_forward)."""
    if not moe_layers(model) or not prompts:
        return []
    c, dev = model.config, model.device
    ctx = min(context, *(len(p) for p in prompts)) // block * block
    rows = len(prompts)
    kv = KVCache.allocate(c.num_layers, rows, ctx + block, c.num_kv_heads, c.head_dim, model.dtype, dev)
    last = torch.zeros((1, 1), dtype=torch.long, device=dev)  # logits are not needed: the head runs on one row
    if ctx:
        pos = torch.arange(ctx, device=dev)[None]
        live = torch.ones_like(pos, dtype=torch.bool)
        for r, p in enumerate(prompts):
            tokens = torch.tensor([list(p[len(p) - ctx:])], device=dev)
            start = torch.zeros(1, dtype=torch.long, device=dev)
            model(window_forward(tokens, pos, start, block, live, logits_at=last), kv.rows(r, r + 1))
    tokens = torch.full((rows, block), c.mask_token_id, device=dev)
    pos = (ctx + torch.arange(block, device=dev))[None].expand(rows, -1)
    start = torch.full((rows,), ctx, device=dev)
    fwd = window_forward(tokens, pos, start, block, torch.ones_like(pos, dtype=torch.bool),
                         logits_at=last.expand(rows, 1))
    with count_touched(model) as found:
        model(fwd, kv)
    return found.mean_per_layer()
