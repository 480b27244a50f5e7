"""`compiledllm export`: the model's step forward for each batch bucket as an AOTInductor package.

The exported forward is pure: block-causal models take one block's tokens and the slot-major KV cache and return
the block's logits plus its fresh K/V (the engine writes them into the cache); bidirectional models take the whole
working sequence and each row's length. The policy step stays in Python. Shapes are static per package (bucket,
block size, KV capacity); `compiledllm_export.json` records them (runtime.py reads it).

The weights are one safetensors file that every bucket's package shares: the packages are compiled without their
constants (aot_inductor.package_constants_in_so=False) and the runtime hands each the same tensors
(load_constants, user-managed), so they are stored and held in memory once, not once per bucket.

The traced forwards run torch's own ops (Kernels("torch", "grouped_mm")): an AOTInductor package runs in its C++
runtime, which cannot call this package's kernels (Python custom ops over Triton and CuPy), so Inductor generates
and packages the kernels.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from compiledllm.attention.spec import AttentionSpec, BlockCausal, Bidirectional, Kernels
from compiledllm.errors import UserError
from compiledllm.export.runtime import EXPORT_FILE, FORMAT, WEIGHTS_FILE
from compiledllm.export.toolchain import private_static_libs
from compiledllm.kv.cache import KVCache
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.block_routing import block_routed
from compiledllm.policies.plan import Forward, route_groups

TORCH_OPS = Kernels(attention="torch", moe="grouped_mm")


class WindowForward(nn.Module):
    def __init__(self, model: BlockDiffusionLM, block: int):
        super().__init__()
        self.model, self.block = model, block

    def forward(self, ids, positions, prefix_len, k_cache, v_cache):
        kv = KVCache(k_cache, v_cache, recording=True)
        spec = AttentionSpec(BlockCausal(self.block), prefix_len=prefix_len)
        # a block-routed MoE needs its groups; every row counts (a finished row's are its own groups)
        groups = route_groups(positions, self.block) if block_routed(self.model) else None
        logits = self.model(Forward(ids, positions, spec, kv_write=positions, float_logits=True, kernels=TORCH_OPS,
                                    route_groups=groups), kv)
        return (logits, *kv.recorded())


class FullForward(nn.Module):
    def __init__(self, model: BlockDiffusionLM):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, length, logits_at):
        spec = AttentionSpec(Bidirectional(length))
        return self.model(Forward(ids, positions, spec, logits_at=logits_at, float_logits=True, kernels=TORCH_OPS))


@contextmanager
def torch_internal_warnings_off():
    """Around our torch.export / AOTInductor calls: torch 2.13's own deprecation of LeafSpec, which no argument of
    ours avoids. Inductor's repro wrapper (torch/_dynamo/repro/after_aot.py debug_wrapper) deep-copies the exported
    graph, whose pytree codegen holds torch's own LeafSpec (utils/_pytree.py treespec_leaf), and the copy calls the
    deprecated LeafSpec.__new__: one FutureWarning per bucket, from copyreg.py, on every export. Only that message
    is silenced, only here; anything else torch warns about still shows. Drop this once torch stops warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


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


def add_constants(program, into: dict[str, torch.Tensor]) -> None:
    """Add a program's parameters, buffers and lifted constants (everything its package can ask for by name) to
    `into`. Every bucket's program holds the same module, so a name seen before must hold the same tensor."""
    for name, t in {**program.state_dict, **program.constants}.items():
        t = t.detach()
        if not t.is_contiguous():  # the package was compiled for these strides; safetensors stores dense tensors
            raise RuntimeError(f"export: constant {name} is not contiguous")
        if name in into and into[name].data_ptr() != t.data_ptr() and not torch.equal(into[name], t):
            raise RuntimeError(f"export: constant {name} differs between bucket programs")
        into.setdefault(name, t)


def save_weights(tensors: dict[str, torch.Tensor], file: Path) -> dict[str, dict]:
    """One safetensors file; returns each tensor's dtype and shape for the metadata. A tensor that shares its
    storage (a view, an alias) is stored as a copy: safetensors refuses shared storage."""
    from safetensors.torch import save_file

    seen, out = set(), {}
    for name, t in sorted(tensors.items()):
        ptr = t.untyped_storage().data_ptr()
        out[name] = (t.clone() if ptr in seen or t.untyped_storage().nbytes() != t.nbytes else t).cpu()
        seen.add(ptr)
    save_file(out, str(file))
    return {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in out.items()}


def export_model(model: BlockDiffusionLM, out: Path, *, block: int, capacity: int, buckets: list[int],
                 backend: str = "aoti", on_bucket=None) -> Path:
    """Write one package per bucket, the weights they share and the metadata into `out`: into a temporary folder
    beside it (`.<out>.<pid>.tmp`), moved into `out` only once whole. A failure (a full disk included) or an
    interruption leaves an earlier export in `out` as it was and no temporary (a one-line error for a failed
    write, naming --out)."""
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
    from compiledllm import signals
    from compiledllm.outputs import temporary

    out = Path(out)
    tmp = temporary(out)

    def remove() -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    with signals.on_exit_now(remove):
        try:
            remove()  # a killed export's, of a process with this id
            tmp.mkdir(parents=True)
            files = _write_export(model, tmp, block=block, capacity=capacity, buckets=buckets, on_bucket=on_bucket)
            out.mkdir(parents=True, exist_ok=True)
            with signals.atomic():  # a few renames: the earlier export's files, then the metadata, replaced
                for old in [out / WEIGHTS_FILE, *out.glob("step_b*.pt2")]:  # none of an earlier export's buckets
                    if old.name not in files:                               # lingers
                        old.unlink(missing_ok=True)
                for name in sorted(files, key=lambda n: n == EXPORT_FILE):
                    os.replace(tmp / name, out / name)
        except OSError as e:
            if e.errno not in _WRITE_ERRORS:
                raise
            raise UserError(f"--out: cannot write {out} ({e.strerror or e})") from None
        finally:
            remove()
    return out


# what a failed write of the export's files is (the compiler's own failures stay what they are)
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
                 errno.ENAMETOOLONG}


def _write_export(model: BlockDiffusionLM, out: Path, *, block: int, capacity: int, buckets: list[int],
                  on_bucket=None) -> list[str]:
    """The export's files in the (new, empty) folder `out`; returns their names."""
    module = FullForward(model) if model.bidirectional else WindowForward(model, block)
    if not model.bidirectional:
        buckets = [1, *buckets]  # prefill runs one slot at a time
    files, constants = {}, {}
    for b in sorted(set(buckets)):
        with torch_internal_warnings_off():
            with torch.no_grad():
                program = torch.export.export(module, example_inputs(model, b, block, capacity), strict=False)
            name = f"step_b{b}.pt2"
            configs = {"aot_inductor.package_constants_in_so": False}
            with private_static_libs():  # toolchain.py: what makes CUDA packages load on the device
                torch._inductor.aoti_compile_and_package(program, package_path=str(out / name),
                                                         inductor_configs=configs)
        add_constants(program, constants)
        files[str(b)] = name
        if on_bucket is not None:
            on_bucket(b)
    tensors = save_weights(constants, out / WEIGHTS_FILE)
    meta = {"format": FORMAT, "torch": torch.__version__, "config": dataclasses.asdict(model.config),
            "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device), "block_size": block,
            "capacity": capacity, "buckets": sorted(int(b) for b in files), "files": files,
            "weights": {"file": WEIGHTS_FILE, "tensors": tensors}}
    (out / EXPORT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    (out / WEIGHTS_FILE).chmod((out / EXPORT_FILE).stat().st_mode)  # safetensors writes 0600; match the rest
    if model.tokenizer is not None:
        try:
            model.tokenizer.save(out)
        except OSError:
            raise
        except Exception as e:  # tokenizers reports a failed write as a plain Exception ("... (os error 28)")
            code = next((c for c in _WRITE_ERRORS if f"(os error {c})" in str(e)), None)
            if code is None:
                raise
            raise OSError(code, os.strerror(code)) from None
    return sorted(p.name for p in out.iterdir())


def export_recipe(source, out: Path, backend: str = "aoti", overrides: list[str] | None = None,
                  max_seq_len: int | None = None, on_start=None, on_bucket=None) -> dict:
    """Export the step forwards a recipe needs: its block size and batch buckets, and a KV capacity of
    `max_seq_len` (default: the recipe's generation.max_seq_len, else what its prompts need). The metadata it
    returns has `capacity_from`, saying which."""
    from compiledllm.engine import Engine
    from compiledllm.engine.stepper import default_buckets
    from compiledllm.parallel.group import check_one_process
    from compiledllm.recipe import load_recipe
    from compiledllm.runner import encode_prompts, load_from_spec

    recipe = load_recipe(source, overrides)
    p = recipe.parallel
    check_one_process(p.tensor, p.expert, p.data, "export")  # it traces one whole model
    model = load_from_spec(recipe.model)
    if not isinstance(model, BlockDiffusionLM):
        raise UserError(f"model.path {recipe.model.path}: already an exported engine")
    asked = recipe.generation.max_seq_len
    unset = recipe.model_copy(update={"generation": recipe.generation.model_copy(update={"max_seq_len": None})})
    engine = Engine.from_recipe(model, unset)
    need = engine.capacity_for(encode_prompts(model, recipe.load_prompts()))  # also checks the model's context
    if max_seq_len is not None:
        capacity, source_of = max_seq_len, "--max-seq-len"
    elif asked is not None:
        capacity, source_of = asked, "the recipe's generation.max_seq_len"
    else:
        capacity, source_of = need, "what the recipe's prompts need"
    if capacity < need:
        raise UserError(f"{source_of} {capacity} is shorter than the recipe's longest working sequence ({need} "
                        "positions: prompt plus max_new_tokens, rounded up to a block)")
    limit = model.config.max_position_embeddings
    if capacity > limit:
        raise UserError(f"{source_of} {capacity} exceeds the model's context ({limit} positions)")
    buckets = recipe.buckets or default_buckets(recipe.batch_size)
    if on_start is not None:
        on_start(len(set(buckets) | ({1} if not model.bidirectional else set())))
    export_model(model, out, block=engine.block, capacity=capacity, buckets=buckets, backend=backend,
                 on_bucket=on_bucket)
    return json.loads((out / EXPORT_FILE).read_text()) | {"capacity_from": source_of}
