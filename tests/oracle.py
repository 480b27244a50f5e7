"""An independent, deliberately plain reference for the tests.

* `oracle_logits(ckpt_dir, input_ids, block_size)` reads config.json and the
  safetensors files itself and computes the forward of LLaDA2 MoE, SDAR or LLaDA
  in float64, one straightforward line of math at a time.
* `literal_decode(logits_fn, prompt, ...)` follows docs/design.md §4 literally,
  with no cache: each step forwards the whole prefix up to the current block end
  (block-causal models) or the whole working sequence (bidirectional models).

Nothing here imports compiledllm.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

F64 = torch.float64


# ----------------------------------------------------------------------------- loading


def load_checkpoint(ckpt_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    ckpt_dir = Path(ckpt_dir)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    w: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(ckpt_dir / f)).items():
            w[k] = v.to(F64)
    return cfg, w


def _arch(cfg: dict) -> str:
    a = (cfg.get("architectures") or [""])[0]
    mt = cfg.get("model_type", "")
    if a == "LLaDA2MoeModelLM" or mt == "llada2_moe":
        return "llada2"
    if a == "SDARForCausalLM" or mt == "sdar":
        return "sdar"
    if a == "LLaDAModelLM" or mt == "llada":
        return "llada"
    raise ValueError(f"oracle: unknown architecture {a!r} / {mt!r}")


# ----------------------------------------------------------------------------- math pieces


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def gated_mlp(x, w_gate, w_up, w_down):
    return linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def rope(x: torch.Tensor, rot: int, theta: float, start: int = 0) -> torch.Tensor:
    """NeoX rotate-half RoPE on the first `rot` dims of x [B, heads, L, hd]; positions start..start+L-1."""
    L = x.shape[-2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=F64) / rot))
    pos = torch.arange(start, start + L, dtype=F64)
    ang = pos[:, None] * inv_freq[None, :]  # [L, rot/2]
    emb = torch.cat([ang, ang], dim=-1)  # [L, rot]
    cos, sin = torch.cos(emb), torch.sin(emb)
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def visibility(L: int, block_size: int | None) -> torch.Tensor:
    """[L, L] bool: query i may attend to key j."""
    if block_size is None:
        return torch.ones(L, L, dtype=torch.bool)
    blk = torch.arange(L) // block_size
    return blk[None, :] <= blk[:, None]


def attention(q, k, v, vis, probs: list | None = None):
    """q [B,H,L,hd], k/v [B,KVH,L,hd] (GQA: q head h uses kv head h // (H/KVH)); vis [L, L] or per KV head
    [KVH, L, L]; `probs` collects the softmax [B, H, L, L] (and, in its `qk` list if it has one, the rotated q and
    the per-query-head k [B, H, L, hd])."""
    H, KVH, hd = q.shape[1], k.shape[1], q.shape[-1]
    rep = H // KVH
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    if vis.dim() == 3:
        vis = vis.repeat_interleave(rep, dim=0)
    s = (q @ k.transpose(-1, -2)) * hd**-0.5
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if probs is not None:
        probs.append(p)
        getattr(probs, "qk", []).append((q, k))
    return p @ v


def split_heads(x: torch.Tensor, n: int, hd: int) -> torch.Tensor:
    B, L, _ = x.shape
    return x.view(B, L, n, hd).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    B, n, L, hd = x.shape
    return x.transpose(1, 2).reshape(B, L, n * hd)


# ----------------------------------------------------------------------------- LLaDA2 MoE


def llada2_router_moe(cfg: dict, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    """x [T, d] -> [T, d]: group-limited sigmoid routing, shared expert."""
    E = cfg["num_experts"]
    k = cfg["num_experts_per_tok"]
    n_group, topk_group = cfg["n_group"], cfg["topk_group"]
    T = x.shape[0]
    s = torch.sigmoid(linear(x, w[p + "mlp.gate.weight"]))  # [T, E]
    b = s + w[p + "mlp.gate.expert_bias"][None, :]
    out = torch.zeros_like(x)
    for t in range(T):
        groups = b[t].view(n_group, E // n_group)
        gscore = torch.stack([g.topk(min(2, g.numel())).values.sum() for g in groups])
        keep_groups = set(gscore.topk(topk_group).indices.tolist())
        bb = b[t].clone()
        for e in range(E):
            if e // (E // n_group) not in keep_groups:
                bb[e] = 0.0
        chosen = bb.topk(k).indices
        ws = s[t, chosen]
        ws = ws / (ws.sum() + 1e-20) * cfg["routed_scaling_factor"]
        acc = torch.zeros_like(x[t])
        for wk, e in zip(ws, chosen.tolist()):
            q = f"{p}mlp.experts.{e}."
            acc = acc + wk * gated_mlp(
                x[t], w[q + "gate_proj.weight"], w[q + "up_proj.weight"], w[q + "down_proj.weight"]
            )
        out[t] = acc
    shared = gated_mlp(
        x,
        w[p + "mlp.shared_experts.gate_proj.weight"],
        w[p + "mlp.shared_experts.up_proj.weight"],
        w[p + "mlp.shared_experts.down_proj.weight"],
    )
    return out + shared


def llada2_block_moe(cfg: dict, w: dict, p: str, x: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """x [L, d] of one sequence -> [L, d]: LLaDA2.2 block routing, written from its description (tech report eq. 1;
    the released rule as SGLang PR #31768's review quotes it), one token and one expert at a time. blocks[t]: token
    t's block. A block admits the `expert_capacity` experts with the largest max over its tokens of the biased
    score; each token takes its top-k biased scores among them (ties: the lower expert id, both times); weights:
    the chosen unbiased scores over their sum + 1e-20, times routed_scaling_factor; no group-limited step."""
    E, k, C = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["expert_capacity"]
    s = torch.sigmoid(linear(x, w[p + "mlp.gate.weight"]))
    b = (s + w[p + "mlp.gate.expert_bias"][None, :]).tolist()
    out = torch.zeros_like(x)
    for blk in sorted(set(blocks)):
        members = [t for t, bt in enumerate(blocks) if bt == blk]
        agg = [max(b[t][e] for t in members) for e in range(E)]
        admitted = sorted(range(E), key=lambda e: (-agg[e], e))[:C]
        for t in members:
            chosen = sorted(admitted, key=lambda e: (-b[t][e], e))[:k]
            total = sum(s[t, e] for e in chosen)
            for e in chosen:
                q = f"{p}mlp.experts.{e}."
                y = gated_mlp(x[t], w[q + "gate_proj.weight"], w[q + "up_proj.weight"], w[q + "down_proj.weight"])
                out[t] += s[t, e] / (total + 1e-20) * cfg["routed_scaling_factor"] * y
    shared = gated_mlp(x, w[p + "mlp.shared_experts.gate_proj.weight"], w[p + "mlp.shared_experts.up_proj.weight"],
                       w[p + "mlp.shared_experts.down_proj.weight"])
    return out + shared


def llada2_forward(cfg: dict, w: dict, ids: torch.Tensor, block_size: int | None, layer_vis=None,
                   probs: list | None = None) -> torch.Tensor:
    """layer_vis(i): layer i's visibility ([L, L] or per KV head [KVH, L, L]) instead of the block-causal one;
    probs collects each layer's attention probabilities."""
    B, L = ids.shape
    H, KVH, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    rot = int(hd * cfg.get("partial_rotary_factor", 1.0))
    vis = visibility(L, block_size)
    x = w["model.word_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        qkv = linear(h, w[p + "attention.query_key_value.weight"])
        q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], dim=-1)
        q, k, v = split_heads(q, H, hd), split_heads(k, KVH, hd), split_heads(v, KVH, hd)
        q = rms_norm(q, w[p + "attention.query_layernorm.weight"], eps)
        k = rms_norm(k, w[p + "attention.key_layernorm.weight"], eps)
        q, k = rope(q, rot, cfg["rope_theta"]), rope(k, rot, cfg["rope_theta"])
        a = merge_heads(attention(q, k, v, vis if layer_vis is None else layer_vis(i), probs))
        x = x + linear(a, w[p + "attention.dense.weight"])
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            m = gated_mlp(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
        elif cfg.get("expert_capacity") is not None:  # block routing over the config's blocks of positions
            blocks = [t // cfg["block_size"] for t in range(L)]
            m = torch.stack([llada2_block_moe(cfg, w, p, h[r], blocks) for r in range(B)])
        else:
            m = llada2_router_moe(cfg, w, p, h.reshape(B * L, -1)).view(B, L, -1)
        x = x + m
    x = rms_norm(x, w["model.norm.weight"], eps)
    return linear(x, w["lm_head.weight"])


# ----------------------------------------------------------------------------- SDAR (Qwen3 layout)


def sdar_forward(cfg: dict, w: dict, ids: torch.Tensor, block_size: int | None, layer_vis=None,
                 probs: list | None = None) -> torch.Tensor:
    """layer_vis(i): layer i's visibility ([L, L] or per KV head [KVH, L, L]) instead of the block-causal one;
    probs collects each layer's attention probabilities."""
    L = ids.shape[1]
    H, KVH, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    vis = visibility(L, block_size)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = split_heads(linear(h, w[p + "self_attn.q_proj.weight"]), H, hd)
        k = split_heads(linear(h, w[p + "self_attn.k_proj.weight"]), KVH, hd)
        v = split_heads(linear(h, w[p + "self_attn.v_proj.weight"]), KVH, hd)
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q, hd, cfg["rope_theta"]), rope(k, hd, cfg["rope_theta"])
        a = attention(q, k, v, vis if layer_vis is None else layer_vis(i), probs)
        x = x + linear(merge_heads(a), w[p + "self_attn.o_proj.weight"])
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + gated_mlp(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return linear(x, head)


# ----------------------------------------------------------------------------- LLaDA (bidirectional)


def llada_forward(cfg: dict, w: dict, ids: torch.Tensor, block_size: int | None, start: int = 0,
                  past: list | None = None, fresh: list | None = None) -> torch.Tensor:
    """Tokens at positions start.. (the prompt from 0 by default); `past`: per layer the K/V [B, KVH, S, hd] of
    earlier positions, which every token also sees (a prefix cache); `fresh` collects these tokens' K/V per layer."""
    L = ids.shape[1]
    H, KVH, d = cfg["n_heads"], cfg.get("n_kv_heads", cfg["n_heads"]), cfg["d_model"]
    hd = d // H
    eps = cfg["rms_norm_eps"]
    vis = visibility(L, block_size)
    x = w["model.transformer.wte.weight"][ids]
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = split_heads(linear(h, w[p + "q_proj.weight"]), H, hd)
        k = split_heads(linear(h, w[p + "k_proj.weight"]), KVH, hd)
        v = split_heads(linear(h, w[p + "v_proj.weight"]), KVH, hd)
        q, k = rope(q, hd, cfg["rope_theta"], start), rope(k, hd, cfg["rope_theta"], start)
        if fresh is not None:
            fresh.append((k, v))
        if past is not None:
            k, v = torch.cat([past[i][0], k], dim=2), torch.cat([past[i][1], v], dim=2)
            vis = torch.cat([torch.ones(L, past[i][0].shape[2], dtype=torch.bool), visibility(L, block_size)], 1)
        x = x + linear(merge_heads(attention(q, k, v, vis)), w[p + "attn_out.weight"])
        h = rms_norm(x, w[p + "ff_norm.weight"], eps)
        x = x + gated_mlp(h, w[p + "ff_proj.weight"], w[p + "up_proj.weight"], w[p + "ff_out.weight"])
    x = rms_norm(x, w["model.transformer.ln_f.weight"], eps)
    return linear(x, w["model.transformer.ff_out.weight"])


_FORWARDS = {"llada2": llada2_forward, "sdar": sdar_forward, "llada": llada_forward}


def oracle_logits(ckpt_dir: str | Path, input_ids: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """[B, L] ids -> [B, L, V] float64 logits; block-causal from position 0, or bidirectional for None."""
    cfg, w = load_checkpoint(ckpt_dir)
    with torch.no_grad():
        return _FORWARDS[_arch(cfg)](cfg, w, input_ids.long(), block_size)


class OracleModel:
    """Caches the loaded weights; `__call__(ids, block_size)` is a logits_fn for literal_decode."""

    def __init__(self, ckpt_dir: str | Path):
        self.cfg, self.w = load_checkpoint(ckpt_dir)
        self.arch = _arch(self.cfg)

    def __call__(self, ids: torch.Tensor, block_size: int | None) -> torch.Tensor:
        with torch.no_grad():
            return _FORWARDS[self.arch](self.cfg, self.w, ids.long(), block_size)


# ----------------------------------------------------------------------------- literal decoder


def confidence(logits_row: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (v [n], p [n], gap [n]) with probs = softmax(float32) over the full vocab.

    v = argmax excluding MASK (ties -> lower id), p = probs[v], gap = p - best smaller value (diagnostic).
    """
    probs = torch.softmax(logits_row.float(), dim=-1)
    masked = probs.clone()
    masked[:, mask_id] = -1.0
    v = torch.argmax(masked, dim=-1)  # first maximal index == lower id on ties
    p = probs.gather(-1, v[:, None])[:, 0]
    # gap to the best *different* value: exact ties are deterministic (lower id), not near-ties
    top1 = masked.max(dim=-1, keepdim=True).values
    rest = masked.masked_fill(masked == top1, -1.0).max(dim=-1).values
    return v, p, top1[:, 0] - rest


def literal_decode(
    logits_fn: Callable[[torch.Tensor, int | None], torch.Tensor],
    prompt: list[int],
    *,
    policy: str,
    block_size: int,
    max_new_tokens: int,
    mask_id: int,
    eos_id: int,
    threshold: float,
    edit_threshold: float | None = None,
    max_post_steps: int | None = None,
    bidirectional: bool = False,
    stats: dict | None = None,
) -> list[int]:
    """docs/design.md §4, literally, with no cache.

    `logits_fn(ids[1, L], block_size) -> logits[1, L, V]`. Block-causal models forward the
    prefix up to the current block end with `block_size`; `bidirectional=True` forwards the
    whole working sequence with block_size None. `stats`, when given, receives "forwards",
    "accepted" (per forward with masks left, how many masks it filled) and "min_margin" (smallest |p - tau| over threshold tests and smallest top-1/top-2
    probability gap among decided positions: a tiny value flags a numerical near-tie).
    """
    assert policy in ("threshold", "t2t"), policy
    if policy == "t2t":
        assert edit_threshold is not None and max_post_steps is not None
    Bk, P, N = block_size, len(prompt), max_new_tokens
    total = ((P + N - 1) // Bk + 1) * Bk  # end of the block that contains position P+N-1
    x = list(prompt) + [mask_id] * (total - P)
    forwards = 0
    margin = math.inf
    accepted: list[int] = []  # per forward that had masks: how many masked positions were filled

    def forward(end: int) -> tuple[list[int], list[float], list[float]]:
        nonlocal forwards
        forwards += 1
        if bidirectional:
            logits = logits_fn(torch.tensor([x], dtype=torch.long), None)[0]
        else:
            logits = logits_fn(torch.tensor([x[:end]], dtype=torch.long), Bk)[0]
        v, p, gap = confidence(logits, mask_id)
        return v.tolist(), p.tolist(), gap.tolist()

    def most_confident(positions: list[int], p: list[float]) -> int:
        nonlocal margin
        best = positions[0]
        for j in positions[1:]:
            if p[j] > p[best]:  # strict: ties keep the lower position
                best = j
        for j in positions:
            if j != best:
                margin = min(margin, p[best] - p[j])
        return best

    for blk in range(P // Bk, total // Bk):
        s, e = blk * Bk, (blk + 1) * Bk
        if policy == "threshold":
            while True:
                v, p, gap = forward(e)
                masked = [j for j in range(s, e) if x[j] == mask_id]
                if not masked:
                    break
                acc = [j for j in masked if p[j] > threshold]
                for j in masked:
                    margin = min(margin, abs(p[j] - threshold))
                if not acc:
                    acc = [most_confident(masked, p)]
                accepted.append(len(acc))
                for j in acc:
                    x[j] = v[j]
                    margin = min(margin, gap[j])
        else:
            post = 0
            while True:
                old = x[s:e]
                no_mask = mask_id not in old
                if no_mask:
                    post += 1
                    if post > max_post_steps:
                        break
                v, p, gap = forward(e)
                masked = [j for j in range(s, e) if old[j - s] == mask_id]
                m2t = [j for j in masked if p[j] > threshold]
                for j in masked:
                    margin = min(margin, abs(p[j] - threshold))
                if masked and not m2t:
                    m2t = [most_confident(masked, p)]
                if masked:
                    accepted.append(len(m2t))
                t2t = []
                for j in range(max(s, P), e):
                    if old[j - s] != mask_id:
                        margin = min(margin, abs(p[j] - edit_threshold))
                        if p[j] > edit_threshold and v[j] != old[j - s]:
                            t2t.append(j)
                for j in m2t + t2t:
                    x[j] = v[j]
                    margin = min(margin, gap[j])
                if no_mask and not t2t:
                    break
        if eos_id in x[P:e]:
            break

    out = x[P : P + N]
    if eos_id in out:
        out = out[: out.index(eos_id) + 1]
    if stats is not None:
        stats["forwards"] = forwards
        stats["min_margin"] = margin
        stats["accepted"] = accepted
    return out
