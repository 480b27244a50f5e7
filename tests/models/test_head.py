"""The row-selective head (models/head.py) against the full head GEMM (GPU only)."""
from __future__ import annotations

import pytest
import torch

from compiledllm.models import head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and head.triton_on_cuda()),
                                                  reason="needs a CUDA device with Triton (run on the GPU machine)")]

D, V = 2048, 157184  # LLaDA2.0-mini's head


def inputs(T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(V, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16)
    return h, w, g


@pytest.mark.parametrize("T,fraction", [(32, 1.0), (32, 0.3), (1024, 1.0), (1024, 0.5), (1024, 0.01), (2048, 0.7)])
def test_wanted_rows_equal_the_full_head(T, fraction):
    h, w, g = inputs(T)
    rows = torch.rand(T, device="cuda", generator=g) < fraction
    rows[T // 2] = True
    out = head.head_logits(h, w, rows)
    full = (h @ w.t()).float()
    got = out[rows].float()
    # both round a float32 sum to bf16; the sums differ only in order: at most one bf16 step apart
    torch.testing.assert_close(got, full[rows], rtol=2 ** -7, atol=1e-3)


def test_a_rows_logits_do_not_depend_on_the_other_rows():
    """Bitwise: a row alone (small tile), among a few, among all 1024 (large tile): the batch-invariance contract."""
    h, w, _ = inputs(1024, seed=1)
    all_rows = head.head_logits(h, w, torch.ones(1024, dtype=torch.bool, device="cuda"))
    some = torch.zeros(1024, dtype=torch.bool, device="cuda")
    some[::7] = True
    assert torch.equal(head.head_logits(h, w, some)[some], all_rows[some])
    for start in (0, 992):
        window = h[start : start + 32]  # one decode row's block: the small tile
        one = torch.zeros(32, dtype=torch.bool, device="cuda")
        one[5] = True
        assert torch.equal(head.head_logits(window, w, one)[5], all_rows[start + 5])
        assert torch.equal(head.head_logits(window, w, torch.ones_like(one)), all_rows[start : start + 32])


def test_no_row_wanted_and_capture():
    """Zero wanted rows launches nothing that fails; the op captures in a CUDA graph and replays with new masks."""
    h, w, _ = inputs(256, seed=2)
    rows = torch.zeros(256, dtype=torch.bool, device="cuda")
    head.head_logits(h, w, rows)
    out = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        head.head_logits(h, w, rows)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out["logits"] = head.head_logits(h, w, rows)
    rows[3] = rows[200] = True
    graph.replay()
    torch.testing.assert_close(out["logits"][rows].float(), (h[rows] @ w.t()).float(), rtol=2 ** -7, atol=1e-3)
