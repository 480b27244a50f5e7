"""kv/sparse.top_positions, the selection every selecting policy makes (MAGE's select step, HERALD's prepared
selections, the host pool's CPU attention): the same positions as the plain definition — a stable descending sort of
the prefix's importance, the first keep, back in position order — on inputs full of ties, keep 0 and short prefixes."""
from __future__ import annotations

import pytest
import torch

from compiledllm.kv.sparse import top_positions


def by_sorting(importance, prefix, keep, per_row, pad):
    pos = torch.arange(importance.shape[-1])
    score = importance.masked_fill(pos >= prefix[:, None, None], float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    out = torch.full((*score.shape[:-1], per_row), pad, dtype=torch.long)
    for idx in torch.cartesian_prod(*[torch.arange(d) for d in score.shape[:-1]]).view(-1, score.dim() - 1).tolist():
        row = idx[-2]  # (..., n, KVH): the request
        k = min(int(keep[row]), per_row)
        out[tuple(idx)][:k] = order[tuple(idx)][:k].sort().values
    return out


@pytest.mark.parametrize("seed", range(6))
def test_top_positions_is_the_stable_sort_of_the_prefix(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        L, n, H = (int(torch.randint(1, 4, (1,), generator=g)) for _ in range(3))
        S, per_row = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 50, (1,), generator=g))
        ties = seed % 2 == 0  # few distinct values: most choices are made among equals
        imp = torch.randint(0, 4, (L, n, H, S), generator=g).float() if ties else torch.rand(L, n, H, S, generator=g)
        imp = imp[0] if seed == 5 else imp  # no leading layer dimension (the host pool's CPU attention)
        prefix = torch.randint(0, S + 1, (n,), generator=g)
        keep = torch.minimum(torch.randint(0, per_row + 1, (n,), generator=g), prefix)
        assert torch.equal(top_positions(imp, prefix, keep, per_row, S), by_sorting(imp, prefix, keep, per_row, S))
