"""Data parallelism: `parallel.data` engine replicas, each a whole model (or a tensor x expert split of one, group.py)
on its own ranks, decoding its share of a run's requests.

Every rank encodes every prompt and computes the same assignment (assign_replicas: deterministic, so no rank needs
to hear from another before decoding). A replica's engine runs only its requests, each with its prompt index in
the whole run as its request id (its sampling noise and its result's index) and with the KV capacity the whole
run would have, so each request decodes the tokens one engine gives it (the engine is batch invariant). Global
rank 0 then gathers every replica's results (gather_results)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace

import torch.distributed as dist

from compiledllm.engine import Engine, GenerationResult
from compiledllm.parallel.group import Mesh


def assign_replicas(costs: list[int], replicas: int) -> list[int]:
    """The replica of each request, in request order: the one with the least cost assigned so far (ties: the
    lowest index). Every request is there from the start, so what is assigned is what is outstanding."""
    load = [0] * replicas
    out = []
    for cost in costs:
        r = min(range(replicas), key=load.__getitem__)  # min keeps the first of equal loads
        load[r] += cost
        out.append(r)
    return out


def request_costs(prompts: list[list[int]], max_new_tokens: int) -> list[int]:
    """A request's cost: its prompt tokens plus the tokens it may generate."""
    return [len(p) + max_new_tokens for p in prompts]


def replica_share(engine: Engine, prompts: list[list[int]], mesh: Mesh) -> tuple[Engine, list[int]]:
    """This rank's replica's engine and the prompt indices of its requests (in prompt order; possibly none), from
    the run's engine and all of its (validated) prompts."""
    assignment = assign_replicas(request_costs(prompts, engine.max_new_tokens), mesh.data)
    mine = [i for i, r in enumerate(assignment) if r == mesh.replica]
    # the whole run's KV capacity: a row's tokens are invariant to the batch, for a given capacity
    config = replace(engine.config, max_seq_len=engine.capacity_for(prompts))
    return Engine(engine.model, config), mine


def generate_share(engine: Engine, mine: list[int], prompts: list[list[int]], mesh: Mesh,
                   on_result: Callable[[GenerationResult], None] | None = None,
                   on_startup: Callable[[int, int, str], None] | None = None) -> list[GenerationResult]:
    """The replica decodes its requests (on_result as each ends; on_startup: its compile / capture's progress),
    then global rank 0 gathers every replica's: rank 0 returns all of the run's results in prompt order (on_result
    then called for the other replicas'), the other ranks []. Collective: every rank calls it."""
    own = engine.generate([prompts[i] for i in mine], on_result=on_result, request_ids=mine,
                          on_startup=on_startup) if mine else []
    results = gather_results(own, mesh)
    if on_result is not None:
        ours = set(mine)
        for res in results:
            if res.index not in ours:
                on_result(res)
    return results


def gather_results(results: list[GenerationResult], mesh: Mesh) -> list[GenerationResult]:
    """On global rank 0: every replica's results (each leader's `results`, their indices the run's), in prompt
    order; [] on the other ranks. Collective: every rank calls it. The results travel as JSON (plain data)."""
    # object collectives need a CPU group; NCCL's default group is not one
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    sent = json.dumps([asdict(r) for r in results] if mesh.leader else [])
    received = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sent, received, dst=0, group=group)
    if received is None:
        return []
    gathered = [GenerationResult(**d) for text in received for d in json.loads(text)]
    return sorted(gathered, key=lambda r: r.index)
