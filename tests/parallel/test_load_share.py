"""A rank's share read straight from a checkpoint (loader.load_checkpoint with a mesh: only its slices of the files)
against the whole model loaded and then cut by shard_model, and the one split description both follow
(parallel/shard.py SPLITS), in this process: loading needs no process group (only the forward's all-reduce does), so
meshes of stand-in ranks load every rank's share here, 4-rank tensor x expert meshes too. The tokens and logits of
shares loaded this way on 2 real ranks: test_tensor_expert.py."""
from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from checkpoints import default_config, write_checkpoint
from ranks import checkpoint_bytes, share_differences
from user_errors import assert_user_error

from compiledllm.cli import app
from compiledllm.errors import UserError
from compiledllm.llm import LLM
from compiledllm.loader import load_checkpoint, load_model, parse_model_config, skeleton
from compiledllm.parallel import SINGLE, Mesh, shard_model
from compiledllm.parallel.shard import held, take
from compiledllm.recipe import load_recipe
from compiledllm.runner import load_from_spec

MESHES = [(2, 1), (1, 2), (2, 2)]


def stand_in(tensor: int, expert: int, rank: int) -> Mesh:
    return Mesh(tensor, expert, rank, None, None)


def expected_parts(name: str, tensor: int, expert: int) -> int:
    """How many distinct shares a model weight has over tensor x expert ranks (from its name alone)."""
    if ".mlp.w_" in name or ".mlp.shared." in name:
        return tensor * expert
    if any(s in name for s in (".attn.qkv.", ".attn.o.", ".mlp.gate_up.", ".mlp.down.")):
        return tensor
    return 1


@pytest.mark.parametrize("arch", ["sdar", "llada2", "llada"])
@pytest.mark.parametrize("tensor, expert", MESHES)
def test_shares_of_every_weight_tile_it(arch, tensor, expert):
    """Over the ranks, the distinct shares of each weight cover each of its elements exactly once, and each rank's
    share has the shape of that rank's weight in the cut model."""
    config = parse_model_config(default_config(arch), "config.json")
    whole = skeleton(config).state_dict()
    for rank in range(tensor * expert):
        mesh = stand_in(tensor, expert, rank)
        cut = shard_model(skeleton(config), mesh).state_dict()
        for name, w in whole.items():
            assert tuple(take(torch.empty(w.shape), held(name, tuple(w.shape), config, mesh)).shape) == \
                tuple(cut[name].shape), (name, rank)
    for name, w in whole.items():
        index = torch.arange(w.numel()).view(w.shape)
        shares = {held(name, tuple(w.shape), config, stand_in(tensor, expert, r)) for r in range(tensor * expert)}
        assert len(shares) == expected_parts(name, tensor, expert), name
        count = torch.zeros(w.numel(), dtype=torch.int64)
        for ranges in shares:
            count[take(index, ranges).flatten()] += 1
        assert bool((count == 1).all()), name


def test_shares_are_the_ranks_heads_and_experts():
    sdar = parse_model_config(default_config("sdar"), "config.json")  # 4 query heads, 2 KV heads of 16
    assert held("layers.0.attn.qkv.weight", (128, 32), sdar, stand_in(2, 1, 1)) == (
        (range(32, 64), range(80, 96), range(112, 128)), (range(32),))
    llada2 = parse_model_config(default_config("llada2"), "config.json")  # 8 experts of width 16
    # rank 3 of tensor 2 x expert 2: experts 4-7, the second half of each one's inner dim
    assert held("layers.1.mlp.w_down", (8, 48, 16), llada2, stand_in(2, 2, 3)) == (
        (range(4, 8),), (range(48),), (range(8, 16),))


@pytest.mark.parametrize("arch, tensor, expert, sharded, dtype", [
    ("sdar", 2, 1, True, "float32"), ("llada2", 2, 1, False, "float32"), ("llada2", 1, 2, True, "float32"),
    ("llada2", 2, 2, False, "bfloat16"), ("llada", 2, 1, False, "float32")])
def test_share_read_from_the_files_is_the_whole_model_cut(tmp_path, arch, tensor, expert, sharded, dtype):
    folder = write_checkpoint(tmp_path / arch, arch, seed=5, sharded=sharded)
    whole = checkpoint_bytes(folder)
    assert load_checkpoint(folder)[1] == load_checkpoint(folder, mesh=SINGLE)[1] == whole  # one process: all
    for rank in range(tensor * expert):
        mesh = stand_in(tensor, expert, rank)
        model, read = load_checkpoint(folder, dtype=dtype, mesh=mesh)
        assert share_differences(model, shard_model(load_model(folder, dtype=dtype), mesh)) == [], rank
        assert read == checkpoint_bytes(folder, tensor, expert) < whole, rank
        assert model.mesh is mesh


class _Handle:
    """A safetensors file whose get_tensor fails and whose slices record the elements they return (read[name])."""

    def __init__(self, f, read: dict[str, int]):
        self.f, self.read = f, read

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name: str):
        raise AssertionError(f"{name} read whole")

    def get_slice(self, name: str):
        part, read = self.f.get_slice(name), self.read

        class Part:
            get_shape = part.get_shape

            def __getitem__(self, index):
                t = part[index]
                read[name] = read.get(name, 0) + t.numel()
                return t
        return Part()


def test_a_share_reads_split_tensors_in_part_only(tmp_path, monkeypatch):
    from compiledllm import loader

    folder = write_checkpoint(tmp_path / "llada2", "llada2", seed=5)
    whole = {n: t.numel() for f in folder.glob("*.safetensors") for n, t in load_file(str(f)).items()}
    read: dict[str, int] = {}
    real = loader.open_safetensors
    monkeypatch.setattr(loader, "open_safetensors", lambda file: _Handle(real(file), read))
    load_checkpoint(folder, mesh=stand_in(2, 1, 1))
    assert read.keys() == whole.keys()  # tensor 2: every tensor in part or whole
    split = {n for n in whole if n.endswith(("_proj.weight", "query_key_value.weight", "attention.dense.weight"))}
    assert len(split) == 3 * 2 + 3 + 2 * (8 * 3 + 3)  # attention of 3 layers, 1 dense MLP, 2 MoE layers
    assert {n for n in whole if read[n] == whole[n] // 2} == split and all(read[n] == whole[n] for n in
                                                                            whole.keys() - split)


def test_a_bad_value_fails_the_rank_that_reads_it(tmp_path):
    """A NaN in a row of q_proj that rank 1 holds: rank 1's load refuses it (one line naming the file and tensor),
    rank 0 never reads it; allow_nonfinite loads it with a warning."""
    folder = write_checkpoint(tmp_path / "sdar", "sdar", seed=5)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    tensors["model.layers.0.self_attn.q_proj.weight"][40, 3] = float("nan")  # rows 32-63: rank 1's heads
    save_file(tensors, str(file))
    load_checkpoint(folder, mesh=stand_in(2, 1, 0))
    with pytest.raises(UserError) as e:
        load_checkpoint(folder, mesh=stand_in(2, 1, 1))
    msg = str(e.value)
    assert f"{file}: tensor model.layers.0.self_attn.q_proj.weight has 1 NaN/inf values" in msg and "\n" not in msg
    with pytest.warns(UserWarning, match="1 tensors hold NaN/inf"):
        load_model(folder, allow_nonfinite=True, mesh=stand_in(2, 1, 1))


def test_built_in_and_random_models_load_their_share():
    mesh = stand_in(1, 2, 1)
    shipped = load_model("tiny-llada2", mesh=mesh)  # a shipped checkpoint: read per slice
    assert shipped.mesh is mesh and shipped.layers[1].mlp.w_gate_up.shape[0] == 4
    spec = load_recipe({"model": {"init": "random", "config": "tiny-random-llada2"}, "prompts": [{"ids": [1]}]}).model
    mesh = stand_in(2, 1, 0)
    random = load_from_spec(spec, mesh)  # random weights: built whole, then cut
    assert random.mesh is mesh and random.config.num_heads == 2
    assert random.layers[0].attn.qkv.weight.shape[0] == (2 + 2 * 1) * 32  # 2 query and 1 KV head of 32


def test_llm_refuses_and_bench_outside_torchrun_says_how_to_start_a_split_model(tmp_path):
    base = {"model": {"path": "tiny-llada2"}, "prompts": [{"ids": [5, 6]}], "generation": {"max_new_tokens": 4}}
    with pytest.raises(UserError) as e:
        LLM(load_recipe(base | {"parallel": {"tensor": 2}}))
    assert ("parallel.tensor=2 x parallel.expert=1: LLM runs the whole model in one process" in str(e.value)
            and "torchrun --nproc-per-node 2 -m compiledllm run" in str(e.value) and "\n" not in str(e.value))
    with pytest.raises(UserError, match=r"parallel\.data=2: LLM runs one engine in this process"):
        LLM(load_recipe(base | {"parallel": {"data": 2}}))
    recipe = tmp_path / "ep.yaml"
    recipe.write_text(yaml.safe_dump(base | {"parallel": {"expert": 2}}))
    res = CliRunner().invoke(app, ["bench", str(recipe), "--prompt-len", "8", "--requests", "1"])
    assert_user_error(res, "data 1 x tensor 1 x expert 2 needs 2 processes", "torchrun --nproc-per-node 2")
    res = CliRunner().invoke(app, ["bench", str(recipe), "--prompt-len", "8", "--batch", "1,max"])
    assert_user_error(res, "--batch max with a split model", "give batch sizes")
