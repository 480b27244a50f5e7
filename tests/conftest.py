"""Shared by every test folder: tests/ itself is on sys.path (pytest puts a rootdir conftest's folder there), so
`checkpoints` (tiny HF checkpoints), `oracle` (the independent float64 forward and the literal decoder of
docs/design.md §4) and `triton_launches` (Triton kernels compiled for sm_90 without a GPU) import from any
subfolder."""

import pytest


@pytest.fixture(scope="session")
def compile_kw() -> dict:
    """The engine shapes of the CPU torch.compile tests (batch 4, KV capacity 32). A compiled decoder layer depends
    on the model config, these shapes and the forward's width (4 tokens in most of them), not on the weights or the
    policy: in one pytest process the tests on the default tiny llada2 / sdar configs (tests/checkpoints.py) reuse
    each other's compiled layers and kernels, where each distinct shape costs ~20-40 s of a cold compile on 2 cores."""
    return {"batch_size": 4, "max_seq_len": 32, "cuda_graphs": False}
