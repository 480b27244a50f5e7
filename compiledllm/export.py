"""`compiledllm export`: the model's step forward for each batch bucket as an AOTInductor package.

The exported forward is pure: block-causal models take the window tokens and the slot-major KV cache
and return the window's logits plus its fresh K/V (the engine writes them into the cache); bidirectional
models take the whole working sequence and its visibility mask. The policy step stays in Python. Shapes
are static per package (bucket, block size, KV capacity); `compiledllm_export.json` records them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from compiledllm.attention import packed
from compiledllm.attention.metadata import DenseAttention, WindowAttention
from compiledllm.errors import UserError
from compiledllm.kv.cache import KVCache
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.config import ModelConfig, MoEConfig
from compiledllm.models.layers import MoE
from compiledllm.tokenizer import TextTokenizer

EXPORT_FILE = "compiledllm_export.json"
FORMAT = 1


class WindowForward(nn.Module):
    def __init__(self, model: BlockDiffusionLM, block: int):
        super().__init__()
        self.model, self.block = model, block

    def forward(self, ids, positions, prefix_len, k_cache, v_cache):
        kv = KVCache(k_cache, v_cache, recording=True)
        logits = self.model(ids, positions, WindowAttention(prefix_len, self.block), kv=kv)
        return (logits, *kv.recorded())


class FullForward(nn.Module):
    def __init__(self, model: BlockDiffusionLM):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, visible, logits_index):
        return self.model(ids, positions, DenseAttention(visible), logits_index=logits_index)


def example_inputs(model: BlockDiffusionLM, bucket: int, block: int, capacity: int) -> tuple:
    c, dev = model.config, model.device
    if model.bidirectional:
        return (torch.zeros(bucket, capacity, dtype=torch.long, device=dev),
                torch.arange(capacity, device=dev).expand(bucket, capacity).contiguous(),
                torch.ones(bucket, 1, capacity, dtype=torch.bool, device=dev),
                torch.zeros(bucket, block, dtype=torch.long, device=dev))
    kv = (bucket, c.num_layers, capacity, c.num_kv_heads, c.head_dim)
    return (torch.zeros(bucket, block, dtype=torch.long, device=dev),
            torch.arange(block, device=dev).expand(bucket, block).contiguous(),
            torch.zeros(bucket, dtype=torch.long, device=dev),
            torch.zeros(kv, dtype=model.dtype, device=dev), torch.zeros(kv, dtype=model.dtype, device=dev))


@contextlib.contextmanager
def aten_only(model: BlockDiffusionLM):
    """Trace with torch's own ops: an AOTInductor package runs in its C++ runtime, which cannot call this package's
    kernels (Python custom ops over Triton and CuPy), so the exported forward takes the reference attention, the
    torch router and the grouped-GEMM experts, and Inductor generates and packages the kernels."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    saved = packed.CUDA_BACKENDS, [m.backend for m in moes]
    packed.CUDA_BACKENDS = ()
    for m in moes:
        m.backend = "grouped_mm"
    try:
        yield
    finally:
        packed.CUDA_BACKENDS = saved[0]
        for m, backend in zip(moes, saved[1]):
            m.backend = backend


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
        with torch.no_grad(), aten_only(model):
            program = torch.export.export(module, example_inputs(model, b, block, capacity), strict=False)
        name = f"step_b{b}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(out / name))
        files[str(b)] = name
        if on_bucket is not None:
            on_bucket(b)
    meta = {"format": FORMAT, "torch": torch.__version__, "config": dataclasses.asdict(model.config),
            "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device), "block_size": block,
            "capacity": capacity, "buckets": sorted(int(b) for b in files), "files": files,
            "mask_token_id": model.mask_token_id, "eos_token_id": model.eos_token_id}
    (out / EXPORT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if model.tokenizer is not None:
        model.tokenizer.save(out)
    return out


def is_exported(path) -> bool:
    return isinstance(path, (str, Path)) and (Path(path) / EXPORT_FILE).exists()


# run in a child process before a CUDA package is loaded here (see probe_load)
PROBE = "import sys, torch; torch._inductor.aoti_load_package(sys.argv[1])"


def probe_load(package: Path, code: str = PROBE) -> None:
    """Load `package` in a child process first: torch 2.11 + CUDA 13 on the H200 dies with a segmentation fault
    loading any CUDA AOTInductor package (a single nn.Linear too), which would end this process with no message."""
    try:
        res = subprocess.run([sys.executable, "-c", code, str(package)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise UserError(f"{package}: loading the exported package took over 10 minutes in a test process") from None
    if res.returncode < 0:
        name = signal.Signals(-res.returncode).name
        raise UserError(f"{package}: torch {torch.__version__} crashes ({name}) loading CUDA AOTInductor packages on "
                        "this machine; run the recipe's model directly (compile: true, cuda_graphs: true) instead "
                        "of the exported engine")
    if res.returncode:
        last = (res.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"{package}: the exported package does not load: {last}")


class ExportedModel:
    """Stands in for a BlockDiffusionLM in the engine, running the exported packages."""

    def __init__(self, path: Path, meta: dict, device: str):
        cfg = dict(meta["config"])
        moe = cfg.pop("moe")
        self.config = ModelConfig(**cfg, moe=MoEConfig(**moe) if moe else None)
        self.mask_token_id, self.eos_token_id = meta["mask_token_id"], meta["eos_token_id"]
        self.block_size, self.capacity, self.buckets = meta["block_size"], meta["capacity"], meta["buckets"]
        self.dtype = getattr(torch, meta["dtype"])
        self.device = torch.device(device)
        self.bidirectional = self.config.bidirectional
        self.tokenizer = TextTokenizer.from_dir(path)
        if self.device.type == "cuda":
            probe_load(path / meta["files"][str(meta["buckets"][0])])
        self.runners = {int(b): torch._inductor.aoti_load_package(str(path / f)) for b, f in meta["files"].items()}

    def _runner(self, batch: int):
        if batch not in self.runners:
            raise UserError(f"the exported engine has buckets {self.buckets}; batch {batch} was not exported")
        return self.runners[batch]

    def __call__(self, input_ids, positions, attn_meta, kv: KVCache | None = None, logits_index=None,
                 float_logits: bool = True, logits_rows=None, layers=None):  # float32 logits of every row
        if isinstance(attn_meta, DenseAttention):
            return self._runner(input_ids.shape[0])(input_ids, positions, attn_meta.mask, logits_index)
        bk = self.block_size
        if input_ids.shape[1] != bk:  # a prefill chunk: one block at a time through the same package
            for i in range(0, input_ids.shape[1], bk):
                logits = self(input_ids[:, i : i + bk], positions[:, i : i + bk],
                              WindowAttention(attn_meta.prefix_len + i, bk), kv)
            return logits if logits_index is None else logits[:, -1:]
        logits, k_new, v_new = self._runner(input_ids.shape[0])(input_ids, positions, attn_meta.prefix_len, kv.k, kv.v)
        for i, layer in enumerate(kv.layers):
            layer.write(positions, k_new[:, i], v_new[:, i])
        return logits


def same_device(asked: torch.device, exported: torch.device) -> bool:
    """`cuda` asks for the current CUDA device, which an export records with its index (`cuda:0`)."""
    return asked.type == exported.type and (asked.index is None or asked.index == exported.index)


def load_exported(path, device: str | None = None) -> ExportedModel:
    path = Path(path)
    try:
        meta = json.loads((path / EXPORT_FILE).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path / EXPORT_FILE}: malformed JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path / EXPORT_FILE}: export format {meta.get('format')!r}, this compiledllm reads {FORMAT}")
    if device is not None and not same_device(torch.device(device), torch.device(meta["device"])):
        raise UserError(f"{path}: exported for {meta['device']}, the recipe asks for {device}")
    return ExportedModel(path, meta, meta["device"])


def export_recipe(source, out: Path, backend: str = "aoti", overrides: list[str] | None = None,
                  on_start=None, on_bucket=None) -> dict:
    """Export the step forwards a recipe needs: its block size, batch buckets and KV capacity."""
    from compiledllm.engine.engine import Engine
    from compiledllm.engine.stepper import default_buckets
    from compiledllm.recipe import load_recipe
    from compiledllm.runner import encode_prompts, load_from_spec

    recipe = load_recipe(source, overrides)
    model = load_from_spec(recipe.model)
    if not isinstance(model, BlockDiffusionLM):
        raise UserError(f"model.path {recipe.model.path}: already an exported engine")
    engine = Engine(model, recipe.policy_config(), max_new_tokens=recipe.generation.max_new_tokens,
                    max_seq_len=recipe.generation.max_seq_len)
    capacity = engine.capacity_for(encode_prompts(model, recipe.load_prompts()))
    buckets = recipe.buckets or default_buckets(recipe.batch_size)
    if on_start is not None:
        on_start(len(set(buckets) | ({1} if not model.bidirectional else set())))
    export_model(model, out, block=engine.block, capacity=capacity, buckets=buckets, backend=backend,
                 on_bucket=on_bucket)
    return json.loads((out / EXPORT_FILE).read_text())
