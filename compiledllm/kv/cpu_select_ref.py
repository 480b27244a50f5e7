"""Float32 torch reference of the CPU selection contract (see compiledllm.kv.cpu_select)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from compiledllm.kv.cpu_select import SelectResult


def importance_ref(
    q: torch.Tensor, k_cache: torch.Tensor, lengths: Sequence[int] | torch.Tensor, scale: float | None = None
) -> list[torch.Tensor]:
    """Per request b: importance [KVH, lengths[b]] float32, sum over rows of softmax(score)."""
    return [imp for imp, _, _ in _per_request(q, k_cache, None, lengths, scale)]


def _per_request(q, k_cache, v_cache, lengths, scale):
    B, KVH, S, D = k_cache.shape
    Hq, n_q = q.shape[1], q.shape[2]
    G = Hq // KVH
    scale = D ** -0.5 if scale is None else float(scale)
    for b in range(B):
        L = int(lengths[b])
        keys = k_cache[b, :, :L].float()  # [KVH, L, D]
        qf = q[b].to(torch.bfloat16).float().reshape(KVH, G * n_q, D)
        scores = torch.einsum("hrd,hld->hrl", qf, keys) * scale  # [KVH, R, L]
        lse = torch.logsumexp(scores, dim=-1) if L else torch.full((KVH, G * n_q), float("-inf"))
        probs = torch.exp(scores - lse[..., None]) if L else scores
        out = None
        if v_cache is not None:
            out = torch.einsum("hrl,hld->hrd", probs, v_cache[b, :, :L].float()) if L \
                else torch.zeros(KVH, G * n_q, D)
        yield probs.sum(dim=1), lse.reshape(Hq, n_q), out


def rank_topk(importance: torch.Tensor, topk: int) -> torch.Tensor:
    """[KVH, L] -> [KVH, topk] int32: largest first with ties to the lower position, then ascending."""
    KVH, L = importance.shape
    n = min(topk, L)
    order = torch.sort(importance, dim=-1, descending=True, stable=True).indices[:, :n]
    out = torch.full((KVH, topk), -1, dtype=torch.int32)
    out[:, :n] = order.sort(dim=-1).values.to(torch.int32)
    return out


def select_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    lengths: Sequence[int] | torch.Tensor,
    topk: int | Sequence[int] | torch.Tensor | None,
    *,
    rank_lengths: Sequence[int] | torch.Tensor | None = None,
    scale: float | None = None,
    want_output: bool = True,
) -> SelectResult:
    B, KVH, S, D = k_cache.shape
    Hq, n_q = q.shape[1], q.shape[2]
    ks = None if topk is None else [int(topk)] * B if isinstance(topk, int) else [int(x) for x in topk]
    width = max(ks, default=0) if ks is not None else 0
    idx = torch.empty((B, KVH, width), dtype=torch.int32) if ks is not None else None
    out = torch.empty((B, Hq, n_q, D)) if want_output else None
    lse = torch.empty((B, Hq, n_q))
    for b, (imp, lse_b, out_b) in enumerate(_per_request(q, k_cache, v_cache if want_output else None, lengths, scale)):
        lse[b] = lse_b
        if out is not None:
            out[b] = out_b.reshape(Hq, n_q, D)
        if idx is not None:
            rank = imp.shape[1] if rank_lengths is None else int(rank_lengths[b])
            idx[b] = torch.nn.functional.pad(rank_topk(imp[:, :rank], ks[b]), (0, width - ks[b]), value=-1)
    return SelectResult(idx, out, lse, "torch")


def gather_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """[2, B, KVH, topk, D] bf16: rows topk_idx of each (request, kv head); -1 gives zeros."""
    B, KVH, S, D = k_cache.shape
    k = topk_idx.shape[2]
    out = torch.zeros((2, B, KVH, k, D), dtype=k_cache.dtype)
    for b in range(B):
        for h in range(KVH):
            sel = topk_idx[b, h].long()
            ok = sel >= 0
            out[0, b, h, ok] = k_cache[b, h, sel[ok]]
            out[1, b, h, ok] = v_cache[b, h, sel[ok]]
    return out
