"""Attention on the CPU over a host KV pool (kv/offload.py): ext/'s fused attention + top-k where the pool is bf16 and
the extension built, the same contract in torch otherwise (`host_attention`); `HostLayer`, a layer view the attention
backend hands its own attention (attention/backend.attend: `on_host`), for HERALD's retrieval forward, which attends
layer by layer over the pool on the CPU and over its own key on the device."""
from __future__ import annotations

import torch

from compiledllm.kv import cpu_select
from compiledllm.kv.sparse import top_positions


def host_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, lengths: torch.Tensor,
                   keep: torch.Tensor, rank: torch.Tensor) -> tuple:
    """cpu_select.select's contract in torch (float32 pools): q [n, H, Q, D], k / v [n, KVH, S, D] -> (out [n, H, Q,
    D] float32 or None, lse [n, H, Q], positions [n, KVH, max keep] int32 in order, -1 past a row's keep): the
    softmax over keys [0, lengths), the mass per key summed over each KV head's query rows, the keep[b] positions
    before rank[b] of largest mass (ties: the lower position)."""
    n, H, Q, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    s = torch.einsum("bkrd,bksd->bkrs", q.reshape(n, KVH, H // KVH * Q, D).float(), k.float()) * D ** -0.5
    s = s.masked_fill(torch.arange(S) >= lengths[:, None, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [n, KVH, R]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = None if v is None else torch.einsum("bkrs,bksd->bkrd", p, v.float()).reshape(n, H, Q, D)
    width = int(keep.max()) if n else 0
    chosen = top_positions(p.sum(2), rank, keep, max(width, 1), S)[..., :width]
    return out, lse.reshape(n, H, Q), torch.where(chosen >= S, -1, chosen).int()


class HostLayer:
    """A selecting layer of a HostAttendView: attention on the CPU over the host pool (fused with the choice of
    positions, which lands in `chosen`), the forward's own tokens on the device, the two merged by their
    log-sum-exps. Writes nothing."""

    on_host = True

    def __init__(self, view: "HostAttendView", j: int):
        self.view, self.j = view, j

    def attend(self, q: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, rule) -> torch.Tensor:
        from compiledllm.attention.launch import PackedArgs
        from compiledllm.attention.reference import reference

        kv, view = self.view.kv, self.view
        B, Q, H, D = q.shape
        rows = kv.host_rows(torch.arange(B))  # the view's rows in the host pools
        hk, hv = kv.host_k[self.j], kv.host_v[self.j]
        qc = q.transpose(1, 2).cpu()
        if kv.fused:  # ext/ reads the rows in place
            r = cpu_select.select(qc, hk, hv, view.lengths, view.keep, rank_lengths=view.rank, rows=rows)
            out_c, lse_c, chosen = r.out, r.lse, r.topk_idx
        else:
            out_c, lse_c, chosen = host_attention(qc, hk[rows], hv[rows], view.lengths, view.keep, view.rank)
        view.chosen[self.j] = chosen
        empty = k_win.new_zeros(B, 0, *k_win.shape[2:])
        none = torch.zeros(B, dtype=torch.long, device=q.device)
        out_w, lse_w, _ = reference(PackedArgs(q, empty, empty, none, k_win, v_win, rule), return_lse=True)
        lse_c, out_c = lse_c.to(q.device), out_c.to(q.device).transpose(1, 2)  # [B, H, Q], [B, Q, H, D]
        m = torch.maximum(lse_c, lse_w)
        w_c = torch.exp(lse_c - m).nan_to_num(0.0).transpose(1, 2)[..., None]  # [B, Q, H, 1]
        w_w = torch.exp(lse_w - m).nan_to_num(0.0).transpose(1, 2)[..., None]
        return ((out_c * w_c + out_w.float() * w_w) / (w_c + w_w)).to(q.dtype)

    def write(self, index, k, v) -> None:
        pass


class HostAttendView:
    """OffloadKV.host_attend's view; `chosen[j]`: selecting layer j's positions once the forward ran."""

    def __init__(self, kv, lengths: torch.Tensor, keep: torch.Tensor, rank: torch.Tensor):
        self.kv, self.lengths, self.keep, self.rank = kv, lengths, keep, rank
        self.chosen: list[torch.Tensor | None] = [None] * len(kv.selecting_layers)

    def layer(self, i: int):
        kv = self.kv
        return kv.layer(i) if i < kv.dense_layers else HostLayer(self, i - kv.dense_layers)
