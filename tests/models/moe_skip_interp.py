"""The Triton routed-expert op with skipped pairs (id >= E: a dead token's, MoE.route), run by the Triton interpreter
on the CPU (TRITON_INTERPRET=1, set by test_route_groups.py, which runs this file in a subprocess). fp16: the
interpreter has no bf16. Prints "ok" at the end."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from compiledllm.models import moe_triton


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for T, E, k, D, F_, bms in [(37, 8, 3, 64, 32, None), (21, 4, 2, 48, 16, (16, 32)), (64, 8, 2, 64, 32, None)]:
        x = torch.randn(T, D, generator=g).half()
        wgu = (torch.randn(E, 2 * F_, D, generator=g) * D ** -0.5).half()
        wd = (torch.randn(E, D, F_, generator=g) * F_ ** -0.5).half()
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        dead = torch.rand(T, generator=g) < 0.4
        dead[-1] = True  # the last pairs skipped (the sort's last block)
        skipped = ids.masked_fill(dead[:, None], E)
        skipped[1, 0] = E  # one skipped pair of a live token (a block-routed token with fewer experts)
        sw = w.masked_fill(skipped == E, 0.0)
        tiles = bms and (moe_triton.MoETile(bms[0], moe_triton._block(F_, 64), moe_triton._block(D, 64)),
                         moe_triton.MoETile(bms[1], moe_triton._block(D, 64), moe_triton._block(F_, 64)))
        held = skipped < E
        counts = torch.bincount(skipped[held], minlength=E).int()
        order, offs, tile_end = moe_triton.sort_pairs(skipped, E, (16, 32))
        assert torch.equal(offs, F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))), (T, E)
        n = int(held.sum())
        assert int(offs[E]) == n
        flat = skipped.flatten()
        assert torch.equal(order[:n].long().sort().values, held.flatten().nonzero()[:, 0]), (T, E)
        assert torch.equal(flat[order[:n].long()], flat[flat < E].sort().values), (T, E)
        for row, bm in zip(tile_end, (16, 32)):
            assert torch.equal(row, ((counts + bm - 1) // bm).cumsum(0, dtype=torch.int32))
        out = moe_triton.launch(x, wgu, wd, skipped, sw, tiles, scan=False)
        if T <= moe_triton.SCAN_MAX_TOKENS:  # the scan form skips the same pairs
            scan = moe_triton.launch(x, wgu, wd, skipped, sw, tiles, scan=True)
            assert (scan[dead] == 0).all()
            assert (scan.double() - out.double()).abs().max().item() <= 1e-3 * out.double().abs().max().item()
        # float64 over the held pairs, the activation rounded to fp16 as stored
        safe = skipped.clamp(max=E - 1)
        gate, up = torch.einsum("td,tkfd->tkf", x.double(), wgu.double()[safe]).chunk(2, dim=-1)
        act = (F.silu(gate) * up).half().double()
        ref = torch.einsum("tkf,tkdf,tk->td", act, wd.double()[safe], (sw * held).double())
        err = (out.double() - ref).abs().max().item()
        assert err <= 2e-3 * ref.abs().max().item(), (T, E, err)
        assert (out[dead] == 0).all()  # a token whose every pair is skipped sums nothing
        # the live tokens: bitwise their outputs when the dead ones routed to real experts (today's forward)
        today = moe_triton.launch(x, wgu, wd, torch.where(dead[:, None], ids, skipped),
                                  torch.where(dead[:, None], w, sw), tiles)
        assert torch.equal(out[~dead], today[~dead]), (T, E)
    print("ok")


if __name__ == "__main__":
    main()
