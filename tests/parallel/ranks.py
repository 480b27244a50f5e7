"""The worker the parallel tests spawn (one process per rank, gloo on the CPU): for each case it loads its share
of the tiny checkpoint as `run` does (its slices only) and writes what the parent compares against one process: the
no-cache logits (safetensors), the engine's tokens, the rank-local shapes, the bytes it read and how its share
differs from the whole model loaded and then cut by shard_model (JSON)."""
from __future__ import annotations

import json
import re
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

# case -> (checkpoint folder, tensor, expert)
CASES = {"sdar_tp2": ("sdar", 2, 1), "llada2_tp2": ("llada2", 2, 1), "llada2_ep2": ("llada2", 1, 2)}
POLICY = {"name": "threshold", "block_size": 4, "threshold": 0.5}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # one with a full block to prefill, one without
LOGIT_IDS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
MAX_NEW = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoints(root: Path) -> Path:
    """The tiny SDAR and LLaDA2 MoE checkpoints every parallel test splits, under root."""
    from checkpoints import write_checkpoint

    write_checkpoint(root / "sdar", "sdar", seed=11)
    write_checkpoint(root / "llada2", "llada2", seed=12)
    return root


def engine_tokens(model) -> list[list[int]]:
    from compiledllm.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(POLICY, max_new_tokens=MAX_NEW, batch_size=2))
    return [r.output_ids for r in engine.generate(PROMPTS)]


def logits(model) -> torch.Tensor:
    return model.reference_forward(torch.tensor(LOGIT_IDS), block_size=4)


def structure(model) -> list:
    """What a rank's modules say of their share besides the weights: the config, sizes and `parallel` hooks."""
    out: list = [model.config]
    for layer in model.layers:
        a, m = layer.attn, layer.mlp
        hook = getattr(m, "parallel", None)
        out.append((a.h, a.kvh, a.qkv.out_features, a.o.in_features, getattr(a, "parallel", None) is not None,
                    getattr(m, "inner", None), getattr(m, "cfg", None),
                    None if hook is None else (hook.first_expert, hook.experts)))
    return out


def share_differences(model, cut) -> list[str]:
    """The weights (state_dict keys) where two rank models differ in dtype, shape or value, and "structure" if
    their modules' sizes or hooks differ; [] when they are the same share."""
    a, b = model.state_dict(), cut.state_dict()
    bad = sorted(set(a) ^ set(b))
    bad += [k for k in a if k in b and not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                             and torch.equal(a[k], b[k]))]
    return bad + (["structure"] if structure(model) != structure(cut) else [])


BENCH_KEYS = ("batch", "requests", "prompt_tokens", "generated_tokens", "prefill_tokens", "decode_steps",
              "touched_experts")


def bench_report(root: str, parallel: dict, rank: int = 0) -> dict:
    """`compiledllm bench`'s run of a small grid on the tiny LLaDA2 checkpoint: the report's parallel section and,
    per point, what must not depend on the split (the timings do)."""
    import yaml

    from compiledllm.bench import BenchSettings, run_bench

    recipe = Path(root) / f"bench{rank}.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": str(Path(root) / "llada2")}, "policy": POLICY,
                                      "parallel": parallel, "batch_size": 2, "prompts": [{"ids": [1]}]}))
    report = run_bench(recipe, [], BenchSettings(prompt_lens=(9,), output_lens=(MAX_NEW,), batches=(1, 2),
                                                 requests=3))
    return {"parallel": report["parallel"], "parameters": report["parameters"],
            "points": [{k: p[k] for k in BENCH_KEYS} for p in report["points"]]}


def worker(rank: int, port: int, root: str) -> None:
    from compiledllm.errors import UserError
    from compiledllm.loader import load_checkpoint, load_model
    from compiledllm.models.layers import MoE
    from compiledllm.parallel import init_mesh, shard_model

    torch.set_num_threads(1)
    # a bug that makes the ranks diverge leaves one waiting in a collective: fail in a minute, not gloo's 30
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    out: dict = {}
    for case, (arch, tensor, expert) in CASES.items():
        mesh = init_mesh(tensor, expert)
        model, read = load_checkpoint(Path(root) / arch, mesh=mesh)  # as `run` loads it: this rank's slices
        differs = share_differences(model, shard_model(load_model(Path(root) / arch), mesh))
        save_file({"logits": logits(model).contiguous()}, str(Path(root) / f"{case}.rank{rank}.safetensors"))
        moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
        out[case] = {"tokens": engine_tokens(model), "heads": model.config.num_heads,
                     "kv_heads": model.config.num_kv_heads, "qkv_rows": model.layers[0].attn.qkv.weight.shape[0],
                     "experts_held": [m.w_gate_up.shape[0] for m in moe], "bytes_read": read, "differs": differs}
    out["bench"] = bench_report(root, {"tensor": 2}, rank)
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


# a checkpoint tensor's share per rank, from its name alone (independent of compiledllm/parallel/shard.py): routed
# and shared experts over every tensor x expert rank, the other projections over the tensor ranks, the rest whole
_EXPERT_NAMES = re.compile(r"mlp\.(experts|shared_experts)\.")
_TENSOR_NAMES = re.compile(r"(_proj|query_key_value|attention\.dense|blocks\.\d+\.(attn_out|ff_out))\.weight$")


def checkpoint_bytes(folder: Path, tensor: int = 1, expert: int = 1) -> int:
    """The tensor bytes of a checkpoint, or what one rank of tensor x expert should read of them."""
    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        for name, t in load_file(str(file)).items():
            share = tensor * expert if _EXPERT_NAMES.search(name) else tensor if _TENSOR_NAMES.search(name) else 1
            total += t.numel() * t.element_size() // share
    return total
