"""The engine's side of the plan contract (docs/design.md §2, §5): applying an Update, skipped KV writes, the
model's own block size, bidirectional models' forwards, the per-tier memory check, one constructor."""
from __future__ import annotations

import pytest
import torch
import yaml
from checkpoints import write_checkpoint

import compiledllm
from compiledllm.engine import Engine, EngineConfig, generate
from compiledllm.engine.memory import available_bytes, check_fits
from compiledllm.engine.state import SlotState
from compiledllm.engine.step import apply_update
from compiledllm.errors import UserError
from compiledllm.kv.cache import KVCache, Tier
from compiledllm.policies.plan import Update
from compiledllm.recipe import load_recipe

MASK, EOS = 1, 9


def state(rows: int = 3, T: int = 16) -> SlotState:
    st = SlotState.allocate(rows, T, {"n": torch.zeros(rows, dtype=torch.long)}, MASK, "cpu")
    st.seq[:, :3] = torch.tensor([5, 6, 7])
    st.prompt_len.fill_(3)
    st.work_len.fill_(12)
    st.active.fill_(True)
    return st


def test_apply_update_writes_advances_and_stops():
    st = state()
    st.active[2] = False
    pos = torch.tensor([[3, 4, -1, -1], [4, 5, 6, 7], [3, 4, 5, 6]])
    tok = torch.tensor([[20, 21, 22, 23], [30, EOS, 32, 33], [40, 41, 42, 43]])
    apply_update(st, Update(pos, tok, torch.tensor([0, 2, 1]), {"n": torch.tensor([1, 2, 3])}), 4, EOS)
    assert st.seq[0, :6].tolist() == [5, 6, 7, 20, 21, MASK]  # -1 writes nothing (position 0 keeps its token)
    assert st.seq[1, 3:8].tolist() == [MASK, 30, EOS, 32, 33]
    assert st.seq[2, 3:7].tolist() == [MASK] * 4  # an inactive row is left alone
    assert st.block_start.tolist() == [0, 8, 0] and st.retired.tolist() == [0, 2, 0]
    assert st.active.tolist() == [True, False, False]  # row 1 retired an EOS; row 0 retired nothing
    # the policy's state reaches active rows only (row 2 keeps its own: a row waiting for its prefill, for one)
    assert st.steps.tolist() == [1, 1, 0] and st.policy["n"].tolist() == [1, 2, 0]


def test_place_writes_every_named_buffer_of_its_slots_and_nothing_else():
    """SlotState.place (admission, one write a buffer): prompts then the fill, the rows' values, policy state
    zeroed; the other slots keep theirs."""
    st = SlotState.allocate(4, 8, {"n": torch.zeros(4, 2, dtype=torch.long)}, MASK, "cpu",
                            params={"temperature": torch.zeros(4)})
    for t in st.tensors().values():
        t.fill_(7)
    st.place([1, 3], [[5, 6, 9], [4]], MASK, {"prompt_len": [3, 1], "active": [True, False], "key": [11, 12],
                                              "params.temperature": [0.5, 0.0]})
    assert st.seq[1].tolist() == [5, 6, 9] + [MASK] * 5 and st.seq[3].tolist() == [4] + [MASK] * 7
    assert st.prompt_len.tolist() == [7, 3, 7, 1] and st.active.tolist() == [True, True, True, False]
    assert st.key.tolist() == [7, 11, 7, 12] and st.params["temperature"].tolist() == [7.0, 0.5, 7.0, 0.0]
    assert st.policy["n"].tolist() == [[7, 7], [0, 0], [7, 7], [0, 0]]
    assert st.seq[0].tolist() == [7] * 8 and st.work_len.tolist() == [7] * 4  # not named: unchanged


def test_eos_stops_only_from_generated_tokens_of_retired_blocks():
    st = state(2)
    st.seq[0, 2] = EOS  # in the prompt: never stops
    st.seq[1, 6] = EOS  # generated, in the second block
    def retire(blocks):
        apply_update(st, Update(torch.full((2, 1), -1), torch.zeros(2, 1, dtype=torch.long), torch.tensor(blocks),
                                {}), 4, EOS)

    retire([1, 1])  # block [0, 4): holds the prompt's EOS only
    assert st.active.tolist() == [True, True]
    retire([1, 1])  # block [4, 8): row 1's EOS
    assert st.active.tolist() == [True, False] and st.block_start.tolist() == [8, 8]
    retire([3, 0])  # past the working length: clamped to it, and that ends the row
    assert st.block_start.tolist() == [12, 8] and st.active.tolist() == [False, False]


def test_kv_write_minus_one_is_skipped():
    kv = KVCache.allocate(2, 3, 10, 2, 4, torch.float32, "cpu")
    kv.k.normal_()
    kv.v.normal_()
    before_k, before_v = kv.k.clone(), kv.v.clone()
    index = torch.tensor([[0, -1, 5], [-1, -1, -1], [9, 3, -1]])
    k, v = torch.randn(3, 3, 2, 4), torch.randn(3, 3, 2, 4)
    kv.layer(1).write(index, k, v)
    for b in range(3):
        for j in range(3):
            p = int(index[b, j])
            if p >= 0:
                before_k[b, 1, p], before_v[b, 1, p] = k[b, j], v[b, j]
    assert torch.equal(kv.k, before_k) and torch.equal(kv.v, before_v)
    assert kv.capacity == 10 and kv.layer(0).k.shape == (3, 10, 2, 4)


def test_a_recipe_without_block_size_takes_the_models(tmp_path):
    """SDAR's block is 4 (its config's default): a recipe that names no block size must decode with it."""
    model = compiledllm.load_model(write_checkpoint(tmp_path / "s", "sdar", 5), eos_token_id=0)
    assert model.config.default_block_size == 4
    engine = Engine(model, EngineConfig({"name": "threshold", "threshold": 0.5}, max_new_tokens=9))
    assert engine.block == 4
    ps = [[5, 6, 7, 8, 9], [3, 4]]
    implicit = engine.generate(ps)
    explicit = generate(model, ps, {"name": "threshold", "threshold": 0.5, "block_size": 4}, max_new_tokens=9)
    assert [r.output_ids for r in implicit] == [r.output_ids for r in explicit]
    with pytest.raises(UserError, match="steps"):  # range checks run once the block is known
        Engine(model, EngineConfig({"name": "threshold", "steps": 8}, max_new_tokens=9))


def test_bidirectional_models_make_no_forward_only_to_see_a_finished_block(tmp_path):
    """Nothing is cached for LLaDA, so a block is done once its last MASK is filled: with tau 1.0 and `steps` S,
    exactly S forwards per block (Fast-dLLM's count), not S + 1; block-causal models keep the KV forward."""
    pol = {"name": "threshold", "block_size": 8, "threshold": 1.0, "steps": 4}
    for arch, per_block in (("llada", 4), ("llada2", 5)):
        model = compiledllm.load_model(write_checkpoint(tmp_path / arch, arch, 6), eos_token_id=95)
        out = generate(model, [list(range(2, 10))], pol, max_new_tokens=24)[0]
        assert len(out.output_ids) == 24 and out.blocks == 3
        assert out.steps == 3 * per_block, arch


def test_memory_check_counts_each_tier_on_its_device():
    big = Tier("pinned CPU KV pool", torch.device("cpu"), 1 << 60)
    with pytest.raises(UserError, match=r"on cpu \(activations 0\.0, pinned CPU KV pool 1073741824\.0\)"):
        check_fits([Tier("activations", torch.device("cpu"), 1), big], 4, 128)
    check_fits([Tier("activations", torch.device("cpu"), 1 << 20)], 4, 128)


def test_one_constructor_from_a_recipe(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "tiny-llada2-random"},
                                    "policy": {"name": "t2t", "block_size": 4}, "generation": {"max_new_tokens": 5},
                                    "batch_size": 3, "buckets": [1, 3], "prompts": [{"ids": [2, 3]}]}))
    recipe = load_recipe(path)
    model = compiledllm.load_model("tiny-llada2-random")
    engine = Engine.from_recipe(model, recipe)
    assert engine.config == EngineConfig(recipe.policy_config(), max_new_tokens=5, batch_size=3, buckets=(1, 3),
                                         compile="auto")
    assert not engine.compile  # auto, on the CPU
    assert engine.block == 4 and engine.policy.name == "t2t"


def test_available_bytes_of_cuda_without_an_index(monkeypatch):
    """"cuda" (no index, what a recipe says) is the current device: torch 2.11's fraction getter refuses an
    index-less device (every GPU model load failed with it, seen on an H100)."""
    def fraction(device):
        if torch.device(device).index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return 0.5

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 << 30)
    assert available_bytes(torch.device("cuda")) == 30 << 30


def test_available_bytes_count_the_allocators_unused_blocks(monkeypatch):
    """Memory a finished engine left in torch's caching allocator is free to the next engine of the process, though
    the driver counts it as used (an H100 refused a profile's Dense run at 32K after its warm-up: 21.9 GiB needed,
    22.1 "free", the warm-up's 19.6 GiB cache most likely held by the allocator)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (22 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 52 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 32 << 30)
    assert available_bytes(torch.device("cuda", 0)) == 42 << 30
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5)  # a 40 GiB share
    assert available_bytes(torch.device("cuda", 0)) == 8 << 30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a per-process memory fraction is a CUDA setting")
def test_available_bytes_honours_the_memory_fraction():
    dev = torch.device("cuda")
    whole = available_bytes(dev)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.02)
    try:
        part = available_bytes(dev)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert part <= 0.02 * torch.cuda.mem_get_info(dev)[1] < whole
