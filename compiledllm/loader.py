"""load_model: config.json + safetensors (single or sharded) + tokenizer -> a ready model. Never unpickles. A
Hugging Face model name (ORG/NAME) is resolved to its snapshot in huggingface_hub's cache first (hub.py).

A checkpoint is hostile input: every JSON file is read with a size limit (models/config.py JSON_LIMIT, tokenizer.py
TOKENIZER_LIMIT), weight files must be regular files that lie inside the checkpoint directory once links are
resolved (or are blobs of the Hugging Face cache in use, or of the cache the checkpoint is a snapshot of:
hub.is_cache_blob), config values are checked where they are parsed (sizes within models/config.py LIMITS), the
tensors' names and shapes are checked against the config on the meta device and the weights' bytes against the
device's free memory before any memory is allocated, and every loaded tensor must be floating point and finite
(allow_nonfinite=True: a warning instead).
Exported engines run native code, so loading one is an explicit decision (trust_exported=True). Every problem is a
one-line UserError naming the file, key or value."""
from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from compiledllm import builtin
from compiledllm.builtin import init_random
from compiledllm.devices import DEVICE_TYPES, DTYPES, available_devices, parse_device, parse_dtype  # noqa: F401
from compiledllm.errors import UserError
from compiledllm.models import (KNOWN_ARCHITECTURES, BlockDiffusionLM, architecture_module, build_model,
                                resolve_architecture)
from compiledllm.models.config import InvalidConfig, ModelConfig, read_json, show
from compiledllm.tokenizer import TextTokenizer, one_line

if TYPE_CHECKING:
    from compiledllm.parallel.group import Mesh

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters save; recomputed here
# DTYPES, DEVICE_TYPES, parse_dtype, available_devices, parse_device: devices.py's, still importable from here


def parse_path(path) -> str:
    """A checkpoint directory, export directory, built-in name or Hugging Face name; `""` would silently mean the
    current folder."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip():
        raise UserError(f"model.path: expected a checkpoint directory, a built-in model name or a Hugging Face model "
                        f"name (ORG/NAME), got {path!r}")
    return path


def checkpoint_dir(path: str, revision: str | None) -> Path:
    """The checkpoint directory `path` names: a local one (it wins over a Hub name of the same spelling), else the
    cache snapshot of the Hugging Face model ORG/NAME; a name that is neither says which forms a model takes."""
    from compiledllm import hub

    if Path(path).exists():
        return Path(path)
    if hub.is_repo_id(path):
        return hub.snapshot(path, revision)
    raise UserError(f"{path}: not a model directory (nor a built-in model: {', '.join(builtin.BUILTINS)}; for a "
                    f"Hugging Face model give ORG/NAME, e.g. {hub.EXAMPLE})")


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not path.is_dir():
        raise UserError(f"{path}: not a model directory")
    if not file.exists():
        raise UserError(f"{file}: not found (a model directory needs config.json)")
    return read_json(file)


def parse_model_config(hf_config: dict, source: str) -> ModelConfig:
    archs, model_type = hf_config.get("architectures"), hf_config.get("model_type")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise UserError(f"{source}: architectures must be a list of strings, got {show(archs)}")
    if model_type is not None and not isinstance(model_type, str):
        raise UserError(f"{source}: model_type must be a string, got {show(model_type)}")
    arch = resolve_architecture(hf_config)
    if arch is None:
        got = hf_config.get("architectures") or hf_config.get("model_type")
        raise UserError(f"{source}: unknown architecture {got!r} (supported: {', '.join(KNOWN_ARCHITECTURES)})")
    module = architecture_module(arch)
    try:
        return module.parse_config(hf_config)
    except KeyError as e:
        raise UserError(f"{source}: missing key {e.args[0]!r} for architecture {arch}") from None
    except InvalidConfig as e:
        raise UserError(f"{source}: {e.describe(module.KEYS)}") from None


def inside_checkpoint(path: Path, file: Path) -> bool:
    """Whether `file`, links resolved, lies in the checkpoint directory `path`, or is a blob of the Hugging Face
    cache in use or of the cache `path` is a snapshot of (hub.is_cache_blob: the cache's snapshots and older
    `--local-dir` downloads link their files there)."""
    from compiledllm import hub

    real = file.resolve()
    return real.is_relative_to(path.resolve()) or hub.is_cache_blob(real, path)


def weight_file(path: Path, name: str, source: Path) -> Path:
    """The weight file `name` of checkpoint `path` (named by `source`), refused unless it is a regular file inside
    the checkpoint (absolute names, `..` and links out of it are refused)."""
    file = path / name
    try:
        inside = not Path(name).is_absolute() and inside_checkpoint(path, file)
    except (OSError, RuntimeError, ValueError) as e:  # a link loop, a NUL byte
        raise UserError(f"{source}: weight file {name!r} cannot be resolved ({e})") from None
    if not inside:
        raise UserError(f"{source}: weight file {name!r} lies outside the checkpoint directory {path}")
    if file.exists() and not file.is_file():
        raise UserError(f"{source}: weight file {name!r} is not a regular file")
    return file


def index_files(path: Path, index: Path) -> list[Path]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index}: weight_map must be a non-empty mapping of tensor name -> shard file, "
                        f"got {show(weight_map)}")
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise UserError(f"{index}: weight_map[{bad[0]!r}] must be a shard file name, got {show(bad[1])}")
    files = [weight_file(path, name, index) for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise UserError(f"{index}: names shard files that do not exist: {', '.join(missing)}")
    return files


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return index_files(path, index)
    files = [weight_file(path, f.name, path) for f in sorted(path.glob("*.safetensors"))]
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UserError(f"{path}: only pickle checkpoints found ({', '.join(pickles)}); compiledllm loads safetensors "
                        "only and never unpickles (convert with safetensors first)")
    raise UserError(f"{path}: no *.safetensors weights found")


def copy_tensor(target: torch.Tensor, tensor: torch.Tensor, name: str, file: Path, allow_nonfinite: bool) -> bool:
    """Copy one checkpoint tensor into its parameter; True if it holds NaN / inf (refused unless allowed). The
    check runs on the parameter after the cast, so float32 values beyond float16's range count too."""
    if not tensor.is_floating_point():  # an integer or bool weight would be cast silently
        raise UserError(f"{file}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}; weights must be "
                        "floating point")
    with torch.no_grad():
        target.copy_(tensor)
    finite = torch.isfinite(target)
    if bool(finite.all()):
        return False
    if not allow_nonfinite:
        bad = finite.numel() - int(finite.sum())
        raise UserError(f"{file}: tensor {name} has {bad} NaN/inf values as {str(target.dtype).removeprefix('torch.')}"
                        " (allow_nonfinite=True loads it anyway)")
    return True


def open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise UserError(f"{file}: not a readable safetensors file ({e})") from None


def skeleton(config: ModelConfig, dtype: torch.dtype = torch.float32, source: str = "model config") -> BlockDiffusionLM:
    """The model on the meta device (shapes, no memory); sizes torch cannot represent are a UserError."""
    try:
        with torch.device("meta"):
            return build_model(config).to(dtype)
    except (RuntimeError, TypeError) as e:  # a size past int64, or a tensor whose bytes overflow it
        raise UserError(f"{source}: its sizes make no model (vocab_size {show(config.vocab_size)}, hidden_size "
                        f"{show(config.hidden_size)}, intermediate_size {show(config.intermediate_size)}): "
                        f"{one_line(e, 120)}") from None


def check_tensors(config: ModelConfig, files: list[Path], source: str) -> None:
    """The checkpoint's tensor names and shapes (safetensors headers only) against the model's: every expected
    tensor present with its shape, nothing unexpected. Runs on the meta device before any memory is allocated, so
    a config.json (`source`) that lies about sizes cannot make this process allocate them; layer and expert
    counts are held against the number of tensors first, as building that many layers would itself take long."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        with open_safetensors(file) as f:
            found.update((name, (file, tuple(f.get_slice(name).get_shape()))) for name in f.keys())
    keys = architecture_module(config.architecture).KEYS
    counts = {"num_layers": (config.num_layers, 2)}  # a layer has at least its two norms
    if config.moe is not None:
        counts["num_experts"] = (config.moe.num_experts, 3)  # a routed expert its three projections
    for field, (n, tensors) in counts.items():
        if n * tensors > len(found):
            raise UserError(f"{source}: {keys.get(field, field)}={n} needs at least {n * tensors} tensors, "
                            f"the checkpoint has {len(found)}")
    expected = {name: tuple(t.shape) for name, t in skeleton(config, source=source).hf_weight_map().items()}
    for name, (file, shape) in found.items():
        if name in expected and shape != expected[name]:
            raise UserError(f"{file.name}: tensor {name} has shape {list(shape)}, "
                            f"the config implies {list(expected[name])}")
    unexpected = [n for n in found if n not in expected and not n.endswith(IGNORED_SUFFIXES)]
    if unexpected:
        more = f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise UserError(f"{files[0].parent}: checkpoint tensors the model does not use: "
                        f"{', '.join(unexpected[:3])}{more}")
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise UserError(f"{files[0].parent}: checkpoint lacks tensors the model needs: {', '.join(missing[:3])}{more}")


def load_weights(model: BlockDiffusionLM, files: list[Path], allow_nonfinite: bool = False) -> int:
    """Copy every checkpoint tensor into its parameter, one tensor at a time (check_tensors has run); values must
    be finite floats (allow_nonfinite: one warning counting the tensors that are not). Returns the bytes read."""
    targets = model.hf_weight_map()
    nonfinite = read = 0
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if name in targets:
                    tensor = f.get_tensor(name)
                    read += tensor.numel() * tensor.element_size()
                    nonfinite += copy_tensor(targets[name], tensor, name, file, allow_nonfinite)
    warn_nonfinite(files, nonfinite, stacklevel=5)  # load_model's caller
    return read


def warn_nonfinite(files: list[Path], nonfinite: int, stacklevel: int) -> None:
    if nonfinite:
        warnings.warn(f"{files[0].parent}: {nonfinite} tensors hold NaN/inf values (loaded: allow_nonfinite=True)",
                      stacklevel=stacklevel)


def view_regions(model: BlockDiffusionLM) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Checkpoint tensor name -> where hf_weight_map's view of it lies in its weight: (the weight's name in the
    model, its indices along the weight's leading dims, the view's first index along the next dim); the view spans
    the weight's remaining dims whole (a fused weight's row block, or one expert of a stacked weight)."""
    weights = itertools.chain(model.named_parameters(), model.named_buffers())
    owners = {t.untyped_storage()._cdata: (n, t) for n, t in weights}  # a view shares its weight's storage
    out = {}
    for ckpt, view in model.hf_weight_map().items():
        name, w = owners[view.untyped_storage()._cdata]
        lead = w.dim() - view.dim()
        offset, index = view.storage_offset() - w.storage_offset(), []
        for stride in w.stride()[:lead + 1]:
            index.append(offset // stride)
            offset %= stride
        assert w.is_contiguous() and offset == 0 and view.stride() == w.stride()[lead:] and \
            view.shape[1:] == w.shape[lead + 1:], f"{ckpt}: a view this loader cannot place"
        out[ckpt] = (name, tuple(index[:lead]), index[lead])
    return out


def _position(kept: tuple[range, ...], i: int) -> int | None:
    """Where full index i lies in a rank's weight whose dim holds the ranges `kept`; None if it is not held."""
    pos = 0
    for r in kept:
        if i in r:
            return pos + i - r.start
        pos += len(r)
    return None


def slice_pieces(ranges: tuple[tuple[range, ...], ...], lead: tuple[int, ...], start: int,
                 shape: tuple[int, ...]) -> list[tuple[tuple[slice, ...], tuple]]:
    """(index into the checkpoint tensor, index into the rank's weight) of each contiguous piece this rank holds of
    a checkpoint tensor of `shape` at `lead` / `start` in its full weight (view_regions), the weight's held
    `ranges` per dim (parallel.shard.held); [] when it holds none of it (another expert rank's expert)."""
    dest = [_position(kept, i) for kept, i in zip(ranges, lead)]
    if None in dest:
        return []
    per_dim = []
    for j, n in enumerate(shape):
        first, options, pos = start if j == 0 else 0, [], 0
        for r in ranges[len(lead) + j]:
            lo, hi = max(r.start, first), min(r.stop, first + n)
            if lo < hi:
                options.append((slice(lo - first, hi - first), slice(pos + lo - r.start, pos + hi - r.start)))
            pos += len(r)
        per_dim.append(options)
    return [(tuple(s for s, _ in pick), (*dest, *(d for _, d in pick))) for pick in itertools.product(*per_dim)]


def load_weight_slices(model: BlockDiffusionLM, files: list[Path], regions: dict, allow_nonfinite: bool = False) -> int:
    """Copy this rank's pieces of the checkpoint tensors into the rank's `model`, reading only their bytes
    (safetensors get_slice; check_tensors has run on the full config); regions: checkpoint name -> (weight name,
    lead, start, held ranges). A tensor this rank holds nothing of is not read (the rank that holds it checks it);
    the pieces read are checked as load_weights checks whole tensors. Returns the bytes read."""
    targets = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    nonfinite, read = set(), 0
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if name not in regions:
                    continue  # IGNORED_SUFFIXES
                weight, lead, start, ranges = regions[name]
                part = f.get_slice(name)
                for src, dst in slice_pieces(ranges, lead, start, tuple(part.get_shape())):
                    piece = part[src]
                    read += piece.numel() * piece.element_size()
                    if copy_tensor(targets[weight][dst], piece, name, file, allow_nonfinite):
                        nonfinite.add(name)
    warn_nonfinite(files, len(nonfinite), stacklevel=6)  # load_model's caller
    return read


def materialize(config: ModelConfig, device, dtype: torch.dtype, source: str = "the model") -> BlockDiffusionLM:
    """Build the model without initialising weights (they are loaded or initialised next)."""
    return place(skeleton(config, dtype, source), device, dtype, source)


def place(model: BlockDiffusionLM, device, dtype: torch.dtype, source: str = "the model") -> BlockDiffusionLM:
    """A meta-device model's memory on `device`, its buffers recomputed, ready for its weights; the bytes it needs
    are held against the device's free memory first (`source` names the config in the error)."""
    from compiledllm.engine.memory import check_weights_fit  # lazily: the engine package imports the policies

    n = sum(p.numel() for p in model.parameters())
    size = f"{n:.3g} parameters as {str(dtype).removeprefix('torch.')}"
    tensors = itertools.chain(model.parameters(), model.buffers())
    check_weights_fit(sum(t.numel() * t.element_size() for t in tensors), device, f"{source}: {size}")
    try:
        model = model.to_empty(device=device)
    except RuntimeError as e:  # torch.OutOfMemoryError, or the CPU allocator's refusal
        raise UserError(f"{source}: the model ({size}) does not fit in the memory of {device}: "
                        f"{one_line(e, 120)}") from None
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def token_id_argument(value, kind: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise UserError(f"model.{kind}_token_id: expected a token id (an integer >= 0), got {value!r}")
    return value


def resolve_special_ids(config: ModelConfig, tokenizer: TextTokenizer | None, mask_token_id, eos_token_id,
                        source: str) -> ModelConfig:
    """The config with its MASK / EOS ids resolved: the given value, else config.json, else the tokenizer's
    special tokens, else the architecture's known default. They must differ: decoding stops at EOS and never
    produces MASK."""
    defaults = architecture_module(config.architecture).DEFAULTS
    from_tok = {"mask": tokenizer.mask_id() if tokenizer else None,
                "eos": tokenizer.special_id("eos_token") if tokenizer else None}
    ids, origins = {}, {}
    for kind, override, from_cfg in (("mask", mask_token_id, config.mask_token_id),
                                     ("eos", eos_token_id, config.eos_token_id)):
        if isinstance(from_cfg, list):  # some configs list several EOS ids; the first is the primary one
            from_cfg = from_cfg[0] if from_cfg else None
        candidates = ((f"model.{kind}_token_id", token_id_argument(override, kind)), ("config.json", from_cfg),
                      ("the tokenizer", from_tok[kind]), ("the architecture's default", defaults[f"{kind}_token_id"]))
        origins[kind], value = next((o, v) for o, v in candidates if v is not None)
        if not 0 <= value < config.vocab_size:
            raise UserError(f"{source}: {kind}_token_id {value} is outside the vocabulary [0, {config.vocab_size})")
        ids[f"{kind}_token_id"] = value
    if ids["mask_token_id"] == ids["eos_token_id"]:
        raise UserError(f"{source}: mask_token_id and eos_token_id are both {ids['mask_token_id']} (mask from "
                        f"{origins['mask']}, eos from {origins['eos']}); decoding could never stop at EOS")
    return dataclasses.replace(config, **ids)


def build_random(config: str | dict, device="cpu", dtype=torch.float32, seed: int = 0,
                 mask_token_id: int | None = None, eos_token_id: int | None = None,
                 routing: str = "balanced") -> BlockDiffusionLM:
    """A model with deterministic random weights, built directly on `device`, from a preset name
    (models/presets.py) or an inline config.json mapping: real-size shapes for benchmarks without checkpoints.
    routing: "balanced" (MoE routing spread like a trained load-balanced router's, models/routing.py) or "random"
    (the plain normal init, whose router touches few experts per block)."""
    from compiledllm.models.presets import PRESETS
    from compiledllm.models.routing import check_routing

    check_routing(routing)  # before the model is built

    device, dtype = parse_device(device), parse_dtype(dtype)
    if isinstance(config, str):
        if config not in PRESETS:
            raise UserError(f"model.config: unknown preset {config!r} (presets: {', '.join(PRESETS)})")
        source, config = f"preset {config}", PRESETS[config]
    elif isinstance(config, dict):
        source = "model.config"
    else:
        raise UserError(f"model.config: expected a preset name or a config.json mapping, got {show(config)}")
    config = resolve_special_ids(parse_model_config(config, source), None, mask_token_id, eos_token_id, source)
    model = materialize(config, device, dtype, source)
    init_random(model, seed, routing=routing)
    return model


def load_model(path, device="cpu", dtype=None, mask_token_id: int | None = None,
               eos_token_id: int | None = None, *, allow_nonfinite: bool = False,
               trust_exported: bool = False, revision: str | None = None,
               mesh: Mesh | None = None) -> BlockDiffusionLM:
    """Load a Hugging Face-layout checkpoint directory (or a built-in model name, an exported engine, or a Hugging
    Face model name ORG/NAME through huggingface_hub's cache: compiledllm/hub.py) onto `device`, as `dtype` (None:
    float32, or an exported engine's own; an exported engine runs only the dtype it was exported as, and takes
    mask_token_id / eos_token_id overrides, which the engine, not its packages, uses). allow_nonfinite:
    load NaN / inf weights with a warning instead of refusing them. trust_exported: load an exported engine, whose
    packages are native code that runs in this process. revision: the Hub model's branch, tag or commit. mesh:
    this rank's share of a model split over several ranks (parallel/): a checkpoint's share is read alone
    (load_checkpoint), a random built-in's is cut from the whole."""
    from compiledllm import hub
    from compiledllm.export.runtime import is_exported, load_exported  # lazily: it pulls in the KV cache and plans
    from compiledllm.parallel.shard import shard_model

    split = mesh is not None and mesh.world > 1

    path, device = parse_path(path), parse_device(device)
    asked, dtype = dtype, torch.float32 if dtype is None else parse_dtype(dtype)
    revision = hub.parse_revision(revision)
    if revision is not None and (builtin.is_builtin(path) or Path(path).exists()):  # a silent ignore would mislead
        what = "a built-in model" if builtin.is_builtin(path) else "a local path"
        raise UserError(f"model.revision: {path} is {what}, not a Hugging Face model name (ORG/NAME); a revision "
                        "names a branch, tag or commit of a Hub repository")
    if is_exported(path):
        if not trust_exported:
            raise UserError(f"{path}: an exported engine runs native code (its .pt2 packages are shared libraries); "
                            "load it only from a source you trust: trust_exported=True (recipe: model.trust_exported:"
                            " true, CLI: --trust-exported)")
        model = load_exported(path, device, asked)
        if mask_token_id is not None or eos_token_id is not None:  # checked as a checkpoint's: in vocab, distinct
            model.config = resolve_special_ids(model.config, None, mask_token_id, eos_token_id, path)
        return shard_model(model, mesh) if split else model  # which refuses it
    if builtin.is_builtin(path):
        if split and "path" in builtin.BUILTINS[path]:  # a shipped checkpoint: read per slice like any other
            return load_model(str(builtin.BUILTINS[path]["path"]), device, dtype, mask_token_id, eos_token_id,
                              mesh=mesh)
        model = load_builtin(path, device=device, dtype=dtype, mask_token_id=mask_token_id,
                             eos_token_id=eos_token_id)
        return shard_model(model, mesh) if split else model
    return load_checkpoint(checkpoint_dir(path, revision), device, dtype, mask_token_id, eos_token_id,
                           allow_nonfinite=allow_nonfinite, mesh=mesh)[0]


def load_builtin(name: str, device="cpu", dtype=torch.float32, mask_token_id=None,
                 eos_token_id=None) -> BlockDiffusionLM:
    """A built-in model by name (builtin.BUILTINS): its shipped checkpoint, or its deterministic random weights."""
    if not builtin.is_builtin(name):
        raise UserError(f"unknown built-in model {name!r} (built-ins: {', '.join(builtin.BUILTINS)})")
    spec = builtin.BUILTINS[name]
    if "path" in spec:
        return load_model(str(spec["path"]), device=device, dtype=dtype, mask_token_id=mask_token_id,
                          eos_token_id=eos_token_id)
    return build_random(spec["preset"], device=device, dtype=dtype, seed=spec["seed"], mask_token_id=mask_token_id,
                        eos_token_id=eos_token_id, routing=spec["routing"])


def load_checkpoint(path: Path, device="cpu", dtype=torch.float32, mask_token_id: int | None = None,
                    eos_token_id: int | None = None, *, allow_nonfinite: bool = False,
                    mesh: Mesh | None = None) -> tuple[BlockDiffusionLM, int]:
    """A checkpoint directory's model and the tensor bytes this process read from its files. With a mesh of
    several ranks, only this rank's share (parallel/shard.py's SPLITS) is built and read: the full model is never
    in memory, nor any split weight whole."""
    device, dtype = parse_device(device), parse_dtype(dtype)
    config = parse_model_config(read_config(path), str(path / "config.json"))
    files = checkpoint_files(path)
    tokenizer = TextTokenizer.from_dir(path)
    config = resolve_special_ids(config, tokenizer, mask_token_id, eos_token_id, str(path))
    check_tensors(config, files, str(path / "config.json"))
    if mesh is None or mesh.world == 1:
        model = materialize(config, device, dtype, str(path / "config.json"))
        read = load_weights(model, files, allow_nonfinite)
    else:
        model, read = _load_share(config, files, mesh, device, dtype, allow_nonfinite)
    model.tokenizer = tokenizer
    return model, read


def _load_share(config: ModelConfig, files: list[Path], mesh: Mesh, device, dtype: torch.dtype,
                allow_nonfinite: bool) -> tuple[BlockDiffusionLM, int]:
    from compiledllm.parallel.shard import held, shard_model

    full = skeleton(config, dtype)  # the meta device: where each checkpoint tensor lies in the full weights
    shapes = {n: tuple(t.shape) for n, t in itertools.chain(full.named_parameters(), full.named_buffers())}
    regions = {ckpt: (w, lead, start, held(w, shapes[w], config, mesh))
               for ckpt, (w, lead, start) in view_regions(full).items()}
    source = str(files[0].parent / "config.json")
    model = place(shard_model(full, mesh), device, dtype, source)  # cut on the meta device: the rank's shapes only
    return model, load_weight_slices(model, files, regions, allow_nonfinite)
