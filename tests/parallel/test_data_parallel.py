"""Data-parallel engine replicas (parallel.data, compiledllm/parallel/data.py) on CPU processes over gloo: runner.execute
under data 2 (2 processes), data 2 x tensor 2 and data 2 x expert 2 (4 processes) gives rank 0 the results, output
file and summary counts of one process (same tokens per prompt, prompt order; with sampling too: a request's noise is
keyed by its prompt index in the run), each replica decoding only the requests the least-loaded assignment gives it;
assign_replicas itself in plain Python."""
from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from ranks import DP_CASES, DP_PROMPTS, MAX_NEW, dp_recipe, dp_worker, free_port, write_checkpoints

from compiledllm.errors import UserError
from compiledllm.parallel import assign_replicas
from compiledllm.recipe import load_recipe
from compiledllm.runner import execute, prepare

LEAST_LOADED = [0, 1, 1, 0, 1]  # DP_PROMPTS' costs 17, 10, 11, 22, 13 over 2 replicas


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = write_checkpoints(tmp_path_factory.mktemp("data_parallel"))
    return root


@pytest.fixture(scope="module", params=sorted(DP_CASES))
def spawned(request, root):
    """(world, every rank's report): one spawn of `world` processes runs that world's cases."""
    world = request.param
    mp.start_processes(dp_worker, args=(free_port(), str(root), world), nprocs=world, join=True, start_method="spawn")
    return world, [json.loads((root / f"rank{r}.dp.json").read_text()) for r in range(world)]


def one_process(root, case: str, world: int):
    recipe = dp_recipe(str(root), case, world) | {"parallel": {}}
    return execute(load_recipe(recipe), output=root / f"{case}.one.jsonl")


def test_rank0_gets_one_process_results(root, spawned):
    world, ranks = spawned
    for case in DP_CASES[world]:
        want, summary = one_process(root, case, world)
        got = ranks[0][case]
        assert got["results"] == [[r.index, r.output_ids, r.steps] for r in want], case
        assert got["summary"] == [summary.prompts, summary.tokens, summary.forwards] == [5, summary.tokens,
                                                                                         summary.forwards]
        assert sorted(got["seen"]) == list(range(len(DP_PROMPTS)))  # progress covers every prompt
        written = [json.loads(line) for line in (root / f"{case}.jsonl").read_text().splitlines()]
        one = [json.loads(line) for line in (root / f"{case}.one.jsonl").read_text().splitlines()]
        assert [(r["index"], r["output_ids"]) for r in written] == [(r["index"], r["output_ids"]) for r in one]
        assert len({tuple(r.output_ids) for r in want}) >= 4  # a result under another prompt's index would show


def test_each_replica_decodes_its_share(spawned):
    world, ranks = spawned
    per_replica = world // 2
    for case in DP_CASES[world]:
        for r, got in enumerate(ranks):
            replica = r // per_replica
            share = [i for i, a in enumerate(LEAST_LOADED) if a == replica]
            if r == 0:  # its own as they end, then the other replica's at the gather
                assert got[case]["seen"][:len(share)] == sorted(got[case]["seen"][:len(share)])
                assert set(got[case]["seen"][:len(share)]) == set(share), case
            else:
                assert sorted(got[case]["seen"]) == share, (case, r)
                assert got[case]["results"] == [] and got[case]["summary"][0] == 0


@pytest.mark.parametrize("costs, replicas, want", [
    ([5, 5, 5, 5], 2, [0, 1, 0, 1]),               # equal costs: round robin
    ([3, 3, 3], 3, [0, 1, 2]),                     # ties go to the lowest index
    ([10, 1, 1, 1, 1], 2, [0, 1, 1, 1, 1]),       # least loaded, not round robin ([0, 1, 0, 1, 0])
    ([17, 10, 11, 22, 13], 2, LEAST_LOADED),
    ([4, 4], 3, [0, 1]),                           # fewer requests than replicas
    ([7], 1, [0]),
])
def test_assign_replicas(costs, replicas, want):
    assert assign_replicas(costs, replicas) == want


def test_assignment_uses_prompt_and_output_tokens():
    from compiledllm.parallel.data import request_costs

    assert request_costs(DP_PROMPTS, MAX_NEW) == [17, 10, 11, 22, 13]


def test_data_parallel_recipes_load_and_other_commands_refuse(root):
    recipe = load_recipe(dp_recipe(str(root), "sdar_dp2", 2))
    assert recipe.parallel.data == 2
    with pytest.raises(UserError, match=r"parallel\.data=2: only `run` spreads requests") as e:
        prepare(recipe)  # profile's entry: one engine
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"parallel\.data: .*greater than or equal to 1"):
        load_recipe(dp_recipe(str(root), "sdar_dp2", 2) | {"parallel": {"data": 0}})


def test_data_parallel_outside_torchrun_says_how_to_start_it(root, monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError) as e:
        execute(load_recipe(dp_recipe(str(root), "sdar_dp2_tp2", 4)))
    msg = str(e.value)
    assert "data 2 x tensor 2 x expert 1 needs 4 processes" in msg and "torchrun --nproc-per-node 4" in msg
    assert "\n" not in msg
