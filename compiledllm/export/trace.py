"""`compiledllm export`: the model's step forward for each batch bucket as an AOTInductor package.

The exported forward is pure: block-causal models take one block's tokens and the slot-major KV cache and return
the block's logits plus its fresh K/V (the engine writes them into the cache); bidirectional models take the whole
working sequence and each row's length. The policy step stays in Python. Shapes are static per package (bucket,
block size, KV capacity); `compiledllm_export.json` records them (runtime.py reads it).

The traced forwards run torch's own ops (Kernels("torch", "grouped_mm")): an AOTInductor package runs in its C++
runtime, which cannot call this package's kernels (Python custom ops over Triton and CuPy), so Inductor generates
and packages the kernels.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from compiledllm.attention.spec import AttentionSpec, BlockCausal, Bidirectional, Kernels
from compiledllm.errors import UserError
from compiledllm.export.runtime import EXPORT_FILE, FORMAT
from compiledllm.kv.cache import KVCache
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.policies.plan import Forward

TORCH_OPS = Kernels(attention="torch", moe="grouped_mm")


class WindowForward(nn.Module):
    def __init__(self, model: BlockDiffusionLM, block: int):
        super().__init__()
        self.model, self.block = model, block

    def forward(self, ids, positions, prefix_len, k_cache, v_cache):
        kv = KVCache(k_cache, v_cache, recording=True)
        spec = AttentionSpec(BlockCausal(self.block), prefix_len=prefix_len)
        logits = self.model(Forward(ids, positions, spec, kv_write=positions, float_logits=True, kernels=TORCH_OPS),
                            kv)
        return (logits, *kv.recorded())


class FullForward(nn.Module):
    def __init__(self, model: BlockDiffusionLM):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, length, logits_at):
        spec = AttentionSpec(Bidirectional(length))
        return self.model(Forward(ids, positions, spec, logits_at=logits_at, float_logits=True, kernels=TORCH_OPS))


def example_inputs(model: BlockDiffusionLM, bucket: int, block: int, capacity: int) -> tuple:
    c, dev = model.config, model.device
    if model.bidirectional:
        return (torch.zeros(bucket, capacity, dtype=torch.long, device=dev),
                torch.arange(capacity, device=dev).expand(bucket, capacity).contiguous(),
                torch.full((bucket,), capacity, dtype=torch.long, device=dev),
                torch.zeros(bucket, block, dtype=torch.long, device=dev))
    kv = KVCache.shape(c.num_layers, bucket, capacity, c.num_kv_heads, c.head_dim)
    return (torch.zeros(bucket, block, dtype=torch.long, device=dev),
            torch.arange(block, device=dev).expand(bucket, block).contiguous(),
            torch.zeros(bucket, dtype=torch.long, device=dev),
            torch.zeros(kv, dtype=model.dtype, device=dev), torch.zeros(kv, dtype=model.dtype, device=dev))


def export_model(model: BlockDiffusionLM, out: Path, *, block: int, capacity: int, buckets: list[int],
                 backend: str = "aoti", on_bucket=None) -> Path:
    """Write one package per bucket plus the metadata into `out`."""
    if backend == "tensorrt":
        try:
            import torch_tensorrt  # noqa: F401
        except ImportError:
            raise UserError("--backend tensorrt needs torch_tensorrt, which is not installed "
                            "(pip install 'compiledllm[tensorrt]' on a CUDA machine); --backend aoti works everywhere"
                            ) from None
        raise UserError("--backend tensorrt: packaging the step through torch_tensorrt is not built yet; "
                        "use --backend aoti")
    if backend != "aoti":
        raise UserError(f"--backend {backend!r}: expected aoti or tensorrt")
    out.mkdir(parents=True, exist_ok=True)
    module = FullForward(model) if model.bidirectional else WindowForward(model, block)
    if not model.bidirectional:
        buckets = [1, *buckets]  # prefill runs one slot at a time
    files = {}
    for b in sorted(set(buckets)):
        with torch.no_grad():
            program = torch.export.export(module, example_inputs(model, b, block, capacity), strict=False)
        name = f"step_b{b}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(out / name))
        files[str(b)] = name
        if on_bucket is not None:
            on_bucket(b)
    meta = {"format": FORMAT, "torch": torch.__version__, "config": dataclasses.asdict(model.config),
            "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device), "block_size": block,
            "capacity": capacity, "buckets": sorted(int(b) for b in files), "files": files}
    (out / EXPORT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if model.tokenizer is not None:
        model.tokenizer.save(out)
    return out


def export_recipe(source, out: Path, backend: str = "aoti", overrides: list[str] | None = None,
                  on_start=None, on_bucket=None) -> dict:
    """Export the step forwards a recipe needs: its block size, batch buckets and KV capacity."""
    from compiledllm.engine import Engine
    from compiledllm.engine.stepper import default_buckets
    from compiledllm.recipe import load_recipe
    from compiledllm.runner import encode_prompts, load_from_spec

    recipe = load_recipe(source, overrides)
    model = load_from_spec(recipe.model)
    if not isinstance(model, BlockDiffusionLM):
        raise UserError(f"model.path {recipe.model.path}: already an exported engine")
    engine = Engine.from_recipe(model, recipe)
    capacity = engine.capacity_for(encode_prompts(model, recipe.load_prompts()))
    buckets = recipe.buckets or default_buckets(recipe.batch_size)
    if on_start is not None:
        on_start(len(set(buckets) | ({1} if not model.bidirectional else set())))
    export_model(model, out, block=engine.block, capacity=capacity, buckets=buckets, backend=backend,
                 on_bucket=on_bucket)
    return json.loads((out / EXPORT_FILE).read_text())
