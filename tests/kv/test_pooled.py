"""kv/pooled.py: per-layer pools read through an index (Fast-dLLM's dual cache reads a row's positions around a
hole). Writes land at slot * (capacity + 1) + position from any view, -1 on the spare row; moves copy a slot's rows;
the memory check's bytes are what allocate takes; the attention through pool_index reads the positions it names; the
layer-input pools (hidden > 0) are written, read, moved and counted the same way."""
from __future__ import annotations

import torch

from compiledllm.attention.launch import PackedArgs
from compiledllm.attention.reference import reference
from compiledllm.attention.spec import Bidirectional
from compiledllm.kv.pooled import PooledLayout, pool_index


def layout(slots: int = 3, capacity: int = 8) -> PooledLayout:
    return PooledLayout(2, slots, capacity, 1, 4, torch.float32, torch.device("cpu"))


def test_writes_land_at_their_slot_and_position_from_any_view():
    kv = layout().allocate()
    view = kv.rows(1, 3).layer(1)
    view.write(torch.tensor([[0, -1], [7, 2]]), torch.ones(2, 2, 1, 4), torch.full((2, 2, 1, 4), 2.0))
    k = kv.k[1][:, 0, 0].view(3, 9)  # slot x (capacity + 1)
    want = torch.zeros(3, 9)
    want[1, 0] = want[1, 8] = want[2, 7] = want[2, 2] = 1  # row 0 of the view is slot 1; -1 went to its spare
    assert torch.equal(k, want) and torch.equal(kv.v[1][:, 0, 0].view(3, 9), 2 * want)
    assert not kv.k[0].any()  # layer 0 untouched


def test_move_copies_a_slots_first_positions_in_every_layer():
    kv = layout().allocate()
    for pool in (*kv.k, *kv.v):
        pool.copy_(torch.randn_like(pool))
    before = [p.clone() for p in (*kv.k, *kv.v)]
    kv.move(2, 0, 5)
    for p, b in zip((*kv.k, *kv.v), before):
        assert torch.equal(p[:5], b[18:23]) and torch.equal(p[5:], b[5:])


def test_tiers_are_what_allocate_takes():
    lay = layout()
    kv = lay.allocate()
    assert lay.tiers()[0].nbytes == sum(p.numel() * p.element_size() for p in (*kv.k, *kv.v))


def test_attention_through_pool_index_reads_the_positions_named():
    """A pool read through pool_index(positions) == the dense row cache of those positions (the reference)."""
    g = torch.Generator().manual_seed(0)
    B, S, KVH, D, H, Q = 2, 6, 1, 4, 2, 3
    pool = torch.randn(B * (S + 1), KVH, D, generator=g)
    vpool = torch.randn(B * (S + 1), KVH, D, generator=g)
    positions = torch.tensor([[0, 1, 4, 5], [2, 3, 5, 0]])  # a hole at 2-3, and an order the prefix cannot say
    q, kw, vw = (torch.randn(B, Q, n, D, generator=g) for n in (H, KVH, KVH))
    length = torch.tensor([4, 3])
    rule = Bidirectional(torch.full((B,), Q))
    paged, _, _ = reference(PackedArgs(q, pool, vpool, length, kw, vw, rule, kv_index=pool_index(positions, S)))
    rows = pool_index(positions, S)
    dense, _, _ = reference(PackedArgs(q, pool[rows], vpool[rows], length, kw, vw, rule))
    torch.testing.assert_close(paged, dense, rtol=0, atol=0)


def test_layer_inputs_are_written_read_moved_and_counted_like_the_kv():
    lay = PooledLayout(2, 3, 8, 1, 4, torch.float32, torch.device("cpu"), hidden=5)
    kv = lay.allocate()
    assert lay.tiers()[0].nbytes == sum(p.numel() * p.element_size() for p in (*kv.k, *kv.v, *kv.hidden))
    view = kv.rows(1, 3).layer(1)
    h = torch.arange(2 * 2 * 5, dtype=torch.float32).view(2, 2, 5)
    view.write_hidden(torch.tensor([[3, -1], [7, 2]]), h)
    assert torch.equal(view.read_hidden(torch.tensor([[3], [2]])), h[[0, 1], [0, 1]][:, None])
    assert torch.equal(kv.hidden[1][9 + 3], h[0, 0]) and not kv.hidden[0].any()  # slot 1, layer 1 only
    kv.move(1, 0, 4)
    assert torch.equal(kv.hidden[1][3], h[0, 0])
