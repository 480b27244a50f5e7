"""Running an exported engine: its metadata, the load probe, and ExportedModel - a model kind of its own with
fixed shapes (`static_shapes`) that runs the packaged forwards in place of a live BlockDiffusionLM.

An AOTInductor package is a shared library that runs in this process: loading one is a trust decision the caller
makes (loader.load_model's trust_exported). Before any package is loaded, `read_meta` checks the whole metadata
file: every key present with its type, the config consistent with distinct MASK / EOS ids, positive shapes, one
package per bucket and one weights file, each a regular file inside the export directory once links are resolved,
and each weight's dtype and shape. The packages hold no weights: every one is handed the same tensors of the
weights file (checked against the metadata first), so they are in memory once."""
from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from compiledllm.attention.spec import BlockCausal, Bidirectional
from compiledllm.devices import parse_device, parse_dtype
from compiledllm.errors import UserError
from compiledllm.kv.cache import KVCache
from compiledllm.models.config import ConfigFacts, InvalidConfig, ModelConfig, check_int, read_json, show
from compiledllm.policies.plan import Forward
from compiledllm.tokenizer import TextTokenizer, one_line

EXPORT_FILE = "compiledllm_export.json"
FORMAT = 3  # 2: KV caches with the spare position (kv/cache.py), bidirectional forwards take lengths; 3: weights
#              in one file that the bucket packages share
META_KEYS = ("format", "torch", "config", "dtype", "device", "block_size", "capacity", "buckets", "files", "weights")
WEIGHTS_FILE = "weights.safetensors"
TENSOR_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16,
                                                            torch.float64, torch.int64, torch.int32, torch.int16,
                                                            torch.int8, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class StaticShapes:
    """What an exported engine was traced for: the engine runs these and nothing else."""

    block: int
    capacity: int
    buckets: tuple[int, ...]


@dataclass(frozen=True)
class ExportMeta:
    """compiledllm_export.json, checked: what ExportedModel loads."""

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    shapes: StaticShapes
    files: dict[int, Path]  # bucket -> its package
    weights: Path           # the tensors every package is given
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # what the weights file must hold


def is_exported(path) -> bool:
    return isinstance(path, (str, Path)) and (Path(path) / EXPORT_FILE).exists()


def meta_config(file: Path, data) -> ModelConfig:
    try:
        config = ModelConfig.from_dict(data)
    except InvalidConfig as e:
        raise UserError(f"{file}: config: {e}") from None
    mask, eos = config.mask_token_id, config.eos_token_id
    if not all(isinstance(i, int) and i < config.vocab_size for i in (mask, eos)) or mask == eos:
        raise UserError(f"{file}: config: mask_token_id {show(mask)} and eos_token_id {show(eos)} must be two "
                        f"different ids in [0, {config.vocab_size})")
    return config


def member_file(path: Path, file: Path, key: str, name) -> Path:
    """meta[key]: a file inside the export directory (no absolute name, `..` or link out of it)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        raise UserError(f"{file}: {key} must be a file name inside {path}, got {show(name)}")
    member = path / name
    try:
        inside = member.resolve().is_relative_to(path.resolve())
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL byte
        inside = False
    if not inside:
        raise UserError(f"{file}: {key} = {name!r} lies outside the export directory {path}")
    if not member.is_file():
        raise UserError(f"{file}: {key} = {name!r} is not a file in {path}")
    return member


def package_file(path: Path, file: Path, bucket: str, name) -> Path:
    return member_file(path, file, f"files[{bucket!r}]", name)


def weight_specs(file: Path, tensors) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """weights.tensors: name -> {"dtype": one of TENSOR_DTYPES, "shape": a list of sizes >= 0}."""
    if not isinstance(tensors, dict) or not tensors:
        raise UserError(f"{file}: weights.tensors must map each weight's name to its dtype and shape")
    out = {}
    for name, spec in tensors.items():
        ok = isinstance(spec, dict) and set(spec) == {"dtype", "shape"} and spec["dtype"] in TENSOR_DTYPES
        shape = spec.get("shape") if ok else None
        if not ok or not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise UserError(f"{file}: weights.tensors[{name!r}] must be {{dtype, shape}}, got {show(spec)}")
        out[name] = (TENSOR_DTYPES[spec["dtype"]], tuple(shape))
    return out


def read_meta(path: Path) -> ExportMeta:
    """compiledllm_export.json, every key checked; nothing here loads a package."""
    file = path / EXPORT_FILE
    meta = read_json(file)
    if meta.get("format") != FORMAT:
        raise UserError(f"{file}: export format {meta.get('format')!r}, this compiledllm reads {FORMAT} "
                        "(export the recipe again)")
    missing, unknown = [k for k in META_KEYS if k not in meta], sorted(set(meta) - set(META_KEYS))
    if missing:
        raise UserError(f"{file}: missing key {missing[0]!r}")
    if unknown:
        raise UserError(f"{file}: unknown key {unknown[0]!r}")
    if not isinstance(meta["torch"], str):
        raise UserError(f"{file}: torch must be a version string, got {show(meta['torch'])}")
    try:
        block, capacity = check_int("block_size", meta["block_size"]), check_int("capacity", meta["capacity"])
        buckets = meta["buckets"]
        if not isinstance(buckets, list) or not buckets:
            raise InvalidConfig(f"{{buckets}} must be a non-empty list of batch sizes, got {show(buckets)}")
        buckets = tuple(sorted({check_int("buckets", b) for b in buckets}))
    except InvalidConfig as e:
        raise UserError(f"{file}: {e}") from None
    files, weights = meta["files"], meta["weights"]
    if not isinstance(files, dict) or set(files) != {str(b) for b in buckets}:
        raise UserError(f"{file}: files must map each bucket of {list(buckets)} to its package, got {show(files)}")
    if not isinstance(weights, dict) or set(weights) != {"file", "tensors"}:
        raise UserError(f"{file}: weights must be {{file, tensors}}, got {show(weights)}")
    return ExportMeta(config=meta_config(file, meta["config"]), dtype=parse_dtype(meta["dtype"], f"{file}: dtype"),
                      device=parse_device(meta["device"], f"{file}: device"),
                      shapes=StaticShapes(block, capacity, buckets),
                      files={b: package_file(path, file, str(b), files[str(b)]) for b in buckets},
                      weights=member_file(path, file, "weights.file", weights["file"]),
                      tensors=weight_specs(file, weights["tensors"]))


# run in a child process before a CUDA package is loaded here (see probe_load)
PROBE = "import sys, torch; torch._inductor.aoti_load_package(sys.argv[1])"


def probe_load(package: Path, code: str = PROBE) -> None:
    """Load `package` in a child process first: a CUDA AOTInductor package built by a toolchain that links libstdc++
    statically died with a segmentation fault on load (torch 2.11 + CUDA 13 on the device, until exports linked those
    symbols privately: toolchain.py), which would end this process with no message."""
    try:
        res = subprocess.run([sys.executable, "-c", code, str(package)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise UserError(f"{package}: loading the exported package took over 10 minutes in a test process") from None
    if res.returncode < 0:
        name = signal.Signals(-res.returncode).name
        raise UserError(f"{package}: torch {torch.__version__} crashes ({name}) loading this CUDA AOTInductor package "
                        "on this machine (tools/bench/aoti_probe.py says why); run the recipe's model directly "
                        "(compile: true, cuda_graphs: true) instead of the exported engine")
    if res.returncode:
        last = (res.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"{package}: the exported package does not load: {last}")


class ExportedModel(ConfigFacts):
    """Stands in for a BlockDiffusionLM in the engine, running the exported packages. It runs the plans of
    single-window policies: a block-causal forward of one block against the cache (prefill chunks one block at a
    time), or a bidirectional model's whole sequence."""

    def __init__(self, path: Path, meta: ExportMeta):
        self.config = meta.config
        self.static_shapes = meta.shapes
        self.dtype = meta.dtype
        self.device = meta.device
        self.tokenizer = TextTokenizer.from_dir(path)
        self.weights = load_weights(meta)  # checked before any package loads; the runners use them in place
        if self.device.type == "cuda":
            probe_load(meta.files[meta.shapes.buckets[0]])
        self.runners = {b: with_weights(load_package(f), f, self.weights) for b, f in meta.files.items()}

    def parameters(self) -> Iterator[torch.Tensor]:
        """The weights the packages run on, as nn.Module.parameters() would give them (counted by bench's report)."""
        return iter(self.weights.values())

    def _runner(self, batch: int):
        if batch not in self.runners:
            raise UserError(f"the exported engine has buckets {list(self.static_shapes.buckets)}; batch {batch} "
                            "was not exported")
        return self.runners[batch]

    def __call__(self, fwd: Forward, kv: KVCache | None = None, layers=None) -> torch.Tensor:
        """float32 logits of fwd.logits_at (every row computed: the package has no row-selective head)."""
        rule, B = fwd.attention.rule, fwd.tokens.shape[0]
        if isinstance(rule, Bidirectional) and fwd.attention.prefix_len is None:
            tokens, positions, pad = fwd.tokens, fwd.positions, self.static_shapes.capacity - fwd.tokens.shape[1]
            if pad > 0:  # a narrowed phase (policies/windows.py): the package takes the whole capacity
                tokens = torch.cat([tokens, tokens.new_zeros(B, pad)], 1)
                more = positions[:, -1:] + 1 + torch.arange(pad, device=positions.device)
                positions = torch.cat([positions, more], 1)
            return self._runner(B)(tokens, positions, rule.length, fwd.logits_at)
        bk = self.static_shapes.block
        if not (isinstance(rule, BlockCausal) and rule.block == bk and fwd.attention.prefix_len is not None
                and fwd.attention.kv_index is None and fwd.attention.stats is None):
            raise UserError("an exported engine runs block-causal single-window plans only (threshold with commit: "
                            "separate, t2t); run the recipe's model directly for this policy")
        prefix, logits = fwd.attention.prefix_len, None
        for i in range(0, fwd.tokens.shape[1], bk):  # a prefill chunk: one block at a time through the same package
            cols = slice(i, i + bk)
            logits, k_new, v_new = self._runner(B)(fwd.tokens[:, cols], fwd.positions[:, cols], prefix + i,
                                                   kv.k_full, kv.v_full)
            if fwd.kv_write is not None:
                for n, layer in enumerate(kv.layers):
                    layer.write(fwd.kv_write[:, cols], k_new[:, n], v_new[:, n])
        if fwd.logits_at is not None and fwd.tokens.shape[1] == bk:
            logits = logits.gather(1, fwd.logits_at[..., None].expand(-1, -1, logits.shape[-1]))
        return logits


def same_device(asked: torch.device, exported: torch.device) -> bool:
    """`cuda` asks for the current CUDA device, which an export records with its index (`cuda:0`)."""
    return asked.type == exported.type and (asked.index is None or asked.index == exported.index)


def load_package(package: Path):
    try:
        return torch._inductor.aoti_load_package(str(package))
    except Exception as e:  # a damaged archive; torch raises RuntimeError and others
        raise UserError(f"{package}: the exported package does not load ({one_line(e)})") from None


def load_weights(meta: ExportMeta) -> dict[str, torch.Tensor]:
    """The weights file on the export's device, each tensor as the metadata says (name, dtype, shape)."""
    from safetensors.torch import load_file

    try:
        weights = load_file(str(meta.weights), device=str(meta.device))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise UserError(f"{meta.weights}: not a readable safetensors file ({one_line(e)})") from None
    if set(weights) != set(meta.tensors):
        odd = sorted(set(weights) ^ set(meta.tensors))[0]
        raise UserError(f"{meta.weights}: {odd!r} is {'missing' if odd in meta.tensors else 'unexpected'} "
                        f"(the metadata lists {len(meta.tensors)} tensors; export the recipe again)")
    for name, (dtype, shape) in meta.tensors.items():
        t = weights[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise UserError(f"{meta.weights}: {name} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, the "
                            f"metadata says {str(dtype).removeprefix('torch.')} {list(shape)}")
    return weights


def with_weights(runner, package: Path, weights: dict[str, torch.Tensor]):
    """Hand a package the shared tensors it names (user-managed: no copy; a package run without them would read
    unset constants)."""
    names = runner.get_constant_fqns()
    missing = [n for n in names if n not in weights]
    if missing:
        raise UserError(f"{package}: needs weight {missing[0]!r}, which the export's weights file lacks (export the "
                        "recipe again)")
    try:
        runner.load_constants({n: weights[n] for n in names}, check_full_update=True, user_managed=True)
    except Exception as e:
        raise UserError(f"{package}: the weights do not load into the package ({one_line(e)})") from None
    return runner


def load_exported(path, device: str | torch.device | None = None,
                  dtype: str | torch.dtype | None = None) -> ExportedModel:
    """The exported engine in `path` (on `device`, as `dtype`: each must be the one it was exported for, as its
    packages and weights are compiled for them; None: the export's). This loads and runs native code: the caller
    has decided to trust the export (loader.load_model asks for trust_exported=True)."""
    path = Path(path)
    meta = read_meta(path)
    if device is not None and not same_device(parse_device(device), meta.device):
        raise UserError(f"{path}: exported for {meta.device}, the recipe asks for {device}")
    if dtype is not None and parse_dtype(dtype) != meta.dtype:
        name = str(meta.dtype).removeprefix("torch.")
        raise UserError(f"model.dtype: {str(parse_dtype(dtype)).removeprefix('torch.')}, but the exported engine "
                        f"{path} was exported as {name}, which it cannot change (set model.dtype: {name}, or export "
                        "again)")
    return ExportedModel(path, meta)
