"""kv/offload.py's block copies to the host pool: issued at once, written into the pool by its next reader (the scan on
the host worker, a slot move, the retrieval forward's CPU attention), so the engine thread never waits for them; a
slot move swaps host-pool rows; a scan stages (and a placement copies to the device) the rows it scanned only."""
from __future__ import annotations

import torch

from compiledllm.kv.offload import OffloadLayout
from compiledllm.kv.store import DeviceKV

B = 4  # block


def store(keys_on_device: bool = False):
    full = DeviceKV(3, 3, 16, 2, 4, torch.float32, torch.device("cpu"))
    return OffloadLayout(full, dense_layers=1, per_row=8, block=B, scratch=1, keys_on_device=keys_on_device).allocate()


def fill_block_buffers(kv) -> None:
    """Every selecting layer's block buffers: a distinct value per (layer, K/V, slot, position % B, head, channel)."""
    first = kv.size.block_rows
    for t in (*kv.k[1:], *kv.v[1:]):
        t[first:] = torch.randn_like(t[first:])


def block_of(kv, t: torch.Tensor, slot: int, start: int) -> torch.Tensor:
    """[KVH, B, D]: slot's block buffer, positions start..start + B, as the host pool holds them."""
    rows = kv.size.block_rows + slot * (B + 1) + (start + torch.arange(B)) % B
    return t[rows].transpose(0, 1)


def test_block_copies_wait_for_the_pools_next_reader():
    kv = store()
    fill_block_buffers(kv)
    kv.offload_block([0, 2], [4, 8])
    assert not any(h.any() for h in (*kv.host_k, *kv.host_v))  # issued, not yet written
    kv.shared.flush()
    for j, layer in enumerate(kv.selecting_layers):
        for t, host in ((kv.k[layer], kv.host_k[j]), (kv.v[layer], kv.host_v[j])):
            assert torch.equal(host[0, :, 4:8], block_of(kv, t, 0, 4))
            assert torch.equal(host[2, :, 8:12], block_of(kv, t, 2, 8))
            assert not host[1].any() and not host[0, :, :4].any()
    assert not kv.shared.writes


def test_a_move_and_a_scan_see_the_blocks_issued_before_them():
    kv = store()
    fill_block_buffers(kv)
    kv.offload_block([2], [0])
    kv.move(2, 0, B)  # the block written before slot 2's pool row passes to slot 0 (a swap of rows, no copy)
    assert kv.shared.host_row[0] == 2 and kv.shared.host_row[2] == 0
    for j, layer in enumerate(kv.selecting_layers):
        assert torch.equal(kv.host_v[j][kv.shared.host_row[0], :, :B], block_of(kv, kv.v[layer], 2, 0))
    kv.offload_block([1], [0])
    q = torch.randn(2, len(kv.selecting_layers), 2, 4)
    scanned = kv.scan([1], q, torch.tensor([0, 4]), torch.tensor([0, 4]), torch.tensor([0, 4]))
    assert scanned.slots == [1] and scanned.staged.shape[2] == 1  # only the row scanned
    want = block_of(kv, kv.v[kv.selecting_layers[0]], 1, 0)  # keep all 4 of [0, 4): every position, in order
    assert torch.equal(scanned.staged[1, 0, 0].sort(dim=1).values, want.sort(dim=1).values)  # V, layer 0, row 0


def test_device_keys_copy_only_the_values():
    kv = store(keys_on_device=True)
    fill_block_buffers(kv)
    kv.offload_block([1], [0])
    kv.shared.flush()
    for j, layer in enumerate(kv.selecting_layers):
        assert torch.equal(kv.host_v[j][1, :, :B], block_of(kv, kv.v[layer], 1, 0))
    assert kv.host_k is None


class FakeCopy:
    """A prefix copy to the host pool in flight until someone waits for it."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_release_waits_for_the_prefix_copy_so_the_cache_is_lent_at_once():
    """A scratch cache comes back whole when its row releases it, its copy ended: the next admission takes it at once
    (lending it only once the copy ended on its own spread HERALD's admissions out, each group then taking select and
    draft steps of its own: docs/results.md, HERALD at 32K, twenty-third session)."""
    kv = store()  # one scratch cache
    assert kv.admit(0) and not kv.admit(1)
    copy = FakeCopy()
    kv.shared.pending[0] = copy
    kv.release(0)
    assert copy.done and 0 not in kv.shared.pending
    assert kv.admit(1) and kv.holds_scratch(1)
