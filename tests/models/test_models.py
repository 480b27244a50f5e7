"""reference_forward of every architecture against the independent oracle (tests/oracle.py).

Tiny random HF-layout checkpoints (tests/checkpoints.py): LLaDA2 MoE with grouped
routing (n_group 4) and without (n_group 1), SDAR untied and tied, LLaDA; each
written as a single file and as shards. Also self-checks of the oracle itself.
"""
from __future__ import annotations

import json

import pytest
import torch

from checkpoints import EOS_ID, MASK_ID, write_checkpoint, write_tokenizer
from oracle import OracleModel, load_checkpoint, oracle_logits, visibility

import compiledllm

MODELS = {
    "llada2_g4": ("llada2", {}),
    "llada2_g1": ("llada2", {"n_group": 1, "topk_group": 1}),
    "llada2_e16": ("llada2", {"num_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                              "first_k_dense_replace": 2, "num_hidden_layers": 3}),
    "sdar": ("sdar", {}),
    "sdar_tied": ("sdar", {"tied": True}),
    "llada": ("llada", {}),
}


def load_model(*args, **kwargs):
    return compiledllm.load_model(*args, **kwargs)


def _ids(seed: int, B: int, L: int, V: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, V, (B, L), generator=g)
    # sprinkle MASK tokens like a decoding step would
    ids[torch.rand(B, L, generator=g) < 0.3] = MASK_ID
    return ids


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for name, (arch, kw) in MODELS.items():
        for sharded in (False, True):
            d = tmp_path_factory.mktemp(f"{name}_{'sh' if sharded else 'one'}")
            out[name, sharded] = write_checkpoint(d, arch, seed=7, sharded=sharded, **kw)
    return out


# ----------------------------------------------------------------------------- oracle self-checks


@pytest.mark.parametrize("name", list(MODELS))
def test_oracle_block_causal_prefix_invariance(ckpts, name):
    """Block-causal: logits of blocks <= i ignore tokens in later blocks; bidirectional do not."""
    m = OracleModel(ckpts[name, False])
    ids = _ids(1, 1, 14)
    other = ids.clone()
    other[0, 8:] = torch.randint(2, 96, (6,), generator=torch.Generator().manual_seed(3))
    a, b = m(ids, 4), m(other, 4)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-12, rtol=0)
    assert not torch.allclose(a[:, 8:], b[:, 8:])
    a, b = m(ids, None), m(other, None)
    assert not torch.allclose(a[:, :8], b[:, :8])
    # block size >= L is the same as fully bidirectional
    assert torch.allclose(m(ids, 16), m(ids, None), atol=1e-12, rtol=0)
    # block size 1 is causal: prefix logits equal those of the truncated input
    assert torch.allclose(m(ids, 1)[:, :5], m(ids[:, :5], 1), atol=1e-12, rtol=0)


def test_oracle_visibility():
    v = visibility(6, 2)
    assert v.tolist() == [
        [1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1],
    ]


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_equals_single_file(ckpts, name):
    ids = _ids(2, 2, 9)
    a = oracle_logits(ckpts[name, False], ids, 4)
    b = oracle_logits(ckpts[name, True], ids, 4)
    assert torch.equal(a, b)
    index = json.loads((ckpts[name, True] / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)}
    assert not (ckpts[name, True] / "model.safetensors").exists()


def test_tied_checkpoint_has_no_head(ckpts):
    cfg, w = load_checkpoint(ckpts["sdar_tied", False])
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in w
    cfg, w = load_checkpoint(ckpts["sdar", False])
    assert cfg["tie_word_embeddings"] is False and "lm_head.weight" in w


def test_oracle_router_single_expert_groups_equal_no_groups(tmp_path):
    """n_group == num_experts with every group kept is the same routing as n_group 1."""
    a = write_checkpoint(tmp_path / "a", "llada2", 3, n_group=1, topk_group=1)
    b = write_checkpoint(tmp_path / "b", "llada2", 3, n_group=8, topk_group=8)
    ids = _ids(4, 1, 11)
    assert torch.equal(oracle_logits(a, ids, 4), oracle_logits(b, ids, 4))
    # ...and dropping groups changes the result
    c = write_checkpoint(tmp_path / "c", "llada2", 3, n_group=4, topk_group=1)
    assert not torch.allclose(oracle_logits(a, ids, 4), oracle_logits(c, ids, 4))


def test_tokenizer_files(tmp_path):
    from tokenizers import Tokenizer

    write_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == EOS_ID and tok.token_to_id("<|mask|>") == MASK_ID
    ids = tok.encode("the quick brown fox").ids
    assert ids and max(ids) < 96
    assert tok.decode(ids) == "the quick brown fox"
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg


# ----------------------------------------------------------------------------- engine vs oracle


def _check(got: torch.Tensor, want: torch.Tensor):
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, want.abs().max().item())
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-4 * scale, f"max abs err {err:.3g} (logit scale {scale:.3g})"


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("name", list(MODELS))
def test_reference_forward_matches_oracle(ckpts, name, sharded):
    d = ckpts[name, sharded]
    model = load_model(d, device="cpu", dtype=torch.float32)
    bidir = MODELS[name][0] == "llada"
    assert bool(model.bidirectional) == bidir
    assert model.mask_token_id == MASK_ID and model.eos_token_id == EOS_ID
    for B, L in ((1, 7), (2, 13), (3, 4)):
        ids = _ids(L, B, L)
        for bs in (4, None):
            with torch.no_grad():
                got = model.reference_forward(ids, bs)
            _check(got, oracle_logits(d, ids, bs))
    # block size 3 (not a power of two), and 8 > some lengths
    ids = _ids(5, 2, 11)
    for bs in (3, 8):
        with torch.no_grad():
            _check(model.reference_forward(ids, bs), oracle_logits(d, ids, bs))


@pytest.mark.parametrize("name", ["llada2_g4", "sdar_tied", "llada"])
def test_load_with_tokenizer_and_id_overrides(tmp_path, name):
    arch, kw = MODELS[name]
    d = write_checkpoint(tmp_path, arch, seed=11, **kw)
    write_tokenizer(d)
    model = load_model(d, device="cpu", dtype="float32")
    assert model.mask_token_id == MASK_ID and model.eos_token_id == EOS_ID
    ids = _ids(6, 1, 9)
    with torch.no_grad():
        _check(model.reference_forward(ids, 4), oracle_logits(d, ids, 4))
    model = load_model(d, device="cpu", dtype=torch.float32, mask_token_id=5, eos_token_id=7)
    assert model.mask_token_id == 5 and model.eos_token_id == 7
