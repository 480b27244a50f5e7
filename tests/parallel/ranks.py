"""The worker the parallel tests spawn (one process per rank, gloo on the CPU): for each case it loads the tiny
checkpoint in full, splits it with compiledllm.parallel and writes what the parent compares against one process:
the no-cache logits (safetensors), the engine's tokens and the rank-local shapes (JSON)."""
from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

# case -> (checkpoint folder, tensor, expert)
CASES = {"sdar_tp2": ("sdar", 2, 1), "llada2_tp2": ("llada2", 2, 1), "llada2_ep2": ("llada2", 1, 2)}
POLICY = {"name": "threshold", "block_size": 4, "threshold": 0.5}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # one with a full block to prefill, one without
LOGIT_IDS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
MAX_NEW = 8


def engine_tokens(model) -> list[list[int]]:
    from compiledllm.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(POLICY, max_new_tokens=MAX_NEW, batch_size=2))
    return [r.output_ids for r in engine.generate(PROMPTS)]


def logits(model) -> torch.Tensor:
    return model.reference_forward(torch.tensor(LOGIT_IDS), block_size=4)


def worker(rank: int, port: int, root: str) -> None:
    from compiledllm.errors import UserError
    from compiledllm.loader import load_model
    from compiledllm.models.layers import MoE
    from compiledllm.parallel import init_mesh, shard_model

    torch.set_num_threads(1)
    # a bug that makes the ranks diverge leaves one waiting in a collective: fail in a minute, not gloo's 30
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    out: dict = {}
    for case, (arch, tensor, expert) in CASES.items():
        model = shard_model(load_model(Path(root) / arch), init_mesh(tensor, expert))
        save_file({"logits": logits(model).contiguous()}, str(Path(root) / f"{case}.rank{rank}.safetensors"))
        moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
        out[case] = {"tokens": engine_tokens(model), "heads": model.config.num_heads,
                     "kv_heads": model.config.num_kv_heads, "qkv_rows": model.layers[0].attn.qkv.weight.shape[0],
                     "experts_held": [m.w_gate_up.shape[0] for m in moe]}
    try:
        init_mesh(2, 2)
    except UserError as e:
        out["world_error"] = str(e)
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# data-parallel cases: (checkpoint folder, parallel section, policy); every case's world is the spawn's
DP_CASES = {
    2: {"sdar_dp2": ("sdar", {"data": 2}, POLICY),
        "llada2_dp2_sampled": ("llada2", {"data": 2}, {**POLICY, "temperature": 1.0, "seed": 3})},
    4: {"sdar_dp2_tp2": ("sdar", {"data": 2, "tensor": 2}, POLICY),
        "llada2_dp2_ep2": ("llada2", {"data": 2, "expert": 2}, {**POLICY, "temperature": 1.0, "seed": 3})},
}
# uneven lengths: costs (+ MAX_NEW) 17, 10, 11, 22, 13 -> least loaded [0, 1, 1, 0, 1], round robin [0, 1, 0, 1, 0]
DP_PROMPTS = [list(range(3, 12)), [12, 13], [20, 21, 22], list(range(30, 44)), [50, 51, 52, 53, 54]]


def dp_recipe(root: str, case: str, world: int) -> dict:
    arch, parallel, policy = DP_CASES[world][case]
    return {"model": {"path": str(Path(root) / arch)}, "policy": policy, "parallel": parallel, "batch_size": 2,
            "generation": {"max_new_tokens": MAX_NEW}, "prompts": [{"ids": p} for p in DP_PROMPTS]}


def dp_worker(rank: int, port: int, root: str, world: int) -> None:
    """Each case through runner.execute, as `compiledllm run` under torchrun does it; rank 0 writes the output file.
    rank{r}.dp.json: per case, the results execute returned, the summary's counts and on_result's indices."""
    from compiledllm.recipe import load_recipe
    from compiledllm.runner import execute

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    out: dict = {}
    for case in DP_CASES[world]:
        seen: list[int] = []
        results, summary = execute(load_recipe(dp_recipe(root, case, world)), on_result=lambda r: seen.append(r.index),
                                   output=Path(root) / f"{case}.jsonl")
        out[case] = {"results": [[r.index, r.output_ids, r.steps] for r in results], "seen": seen,
                     "summary": [summary.prompts, summary.tokens, summary.forwards]}
    (Path(root) / f"rank{rank}.dp.json").write_text(json.dumps(out))
    dist.destroy_process_group()
