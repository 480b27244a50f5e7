"""The architecture-independent model configuration every model file builds from, and how its values are checked.

Contract: a ModelConfig / MoEConfig that exists is consistent (types, positive sizes within LIMITS, head and rotary
shapes, MoE routing groups); anything else raises InvalidConfig. Architecture files read config.json through `get_int` /
`get_float` / `get_bool`, which check each key's type before any arithmetic, and name in `KEYS` how config.json
spells each field, so that the loader's one-line error names the checkpoint's own key. `read_json` is the bounded
read every JSON file of a checkpoint or export goes through."""
from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from compiledllm.errors import UserError

JSON_LIMIT = 16 << 20  # bytes: config.json, tokenizer_config.json, the shard index, the export metadata
REQUIRED = object()     # get_int's default: the key must be present

# The largest size each field may have: generous (several times any published model's), so that a hostile or
# mistyped config.json (10^9 layers, 10^15 positions) is a one-line error before anything is built from it; what
# fits these bounds is then held against the device's memory (loader.place, engine/memory.py).
LIMITS = {
    "num_layers": 1024, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_heads": 1024,
    "num_kv_heads": 1024, "head_dim": 1024, "vocab_size": 1 << 22, "max_position_embeddings": 1 << 24,
    "default_block_size": 1 << 24, "num_experts": 1 << 12, "expert_dim": 1 << 18, "num_shared": 1 << 12,
}


class InvalidConfig(ValueError):
    """A configuration value of the wrong type, or an impossible one. The message names fields as `{field}`;
    `describe` spells them as the config's source does (e.g. `{num_heads}` -> `num_attention_heads`)."""

    def describe(self, keys: Mapping[str, str] | None = None) -> str:
        return re.sub(r"\{(\w+)\}", lambda m: (keys or {}).get(m[1], m[1]), self.args[0])

    def __str__(self) -> str:
        return self.describe()


def show(value) -> str:
    """A value as config.json would spell it, cut short (a hostile value may be huge)."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):  # bool is an int subclass: `true` is no size
        raise InvalidConfig(f"{{{name}}} must be an integer, got {show(value)}")
    if value < minimum:
        raise InvalidConfig(f"{{{name}}} must be >= {minimum}, got {show(value)}")
    if maximum is not None and value > maximum:
        raise InvalidConfig(f"{{{name}}} must be <= {maximum} (compiledllm's limit, above any real model's), got "
                            f"{show(value)}")
    return value


def check_size(name: str, value, minimum: int = 1) -> int:
    """A size field of ModelConfig / MoEConfig, within its LIMITS."""
    return check_int(name, value, minimum, LIMITS.get(name))


def check_float(name: str, value, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfig(f"{{{name}}} must be a number, got {show(value)}")
    try:
        number = float(value)  # an integer past float's range is no finite number either
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or (positive and number <= 0):
        raise InvalidConfig(f"{{{name}}} must be a finite number{' > 0' if positive else ''}, got {show(value)}")
    return number


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InvalidConfig(f"{{{name}}} must be true or false, got {show(value)}")
    return value


def check_token_ids(name: str, value, many: bool = False):
    """None, a token id, or (EOS: `many`) a list of ids, as configs give them."""
    if value is None:
        return None
    if many and isinstance(value, list):
        return [check_int(name, v, 0) for v in value]
    return check_int(name, value, 0)


def _given(c: Mapping, key: str, default):
    value = c.get(key)
    if value is not None:  # JSON null means "not set", as in Hugging Face configs
        return value
    if default is REQUIRED:
        raise KeyError(key)
    return default


def get_int(c: Mapping, key: str, default=REQUIRED, minimum: int = 1):
    value = _given(c, key, default)
    return None if value is None else check_int(key, value, minimum)  # None: absent, and the default is None


def get_float(c: Mapping, key: str, default: float, positive: bool = True) -> float:
    return check_float(key, _given(c, key, default), positive)


def get_bool(c: Mapping, key: str, default: bool) -> bool:
    return check_bool(key, _given(c, key, default))


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_dim: int            # width of one routed expert
    num_shared: int            # shared experts (width expert_dim * num_shared)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    norm_topk_prob: bool = True
    first_dense_layers: int = 0  # layers [0, first_dense_layers) use the dense MLP
    # block routing (LLaDA2.2; models/block_routing.py): each route group (a block of route_block positions)
    # admits expert_capacity experts and its tokens pick their top_k among them. None: every token routes alone.
    expert_capacity: int | None = None
    route_block: int | None = None

    def __post_init__(self) -> None:
        E = check_size("num_experts", self.num_experts)
        k = check_int("top_k", self.top_k)  # <= the experts the groups keep (below)
        check_size("expert_dim", self.expert_dim)
        check_size("num_shared", self.num_shared, 0)
        groups, kept = check_int("n_group", self.n_group), check_int("topk_group", self.topk_group)
        check_float("routed_scaling", self.routed_scaling)
        check_bool("norm_topk_prob", self.norm_topk_prob)
        check_int("first_dense_layers", self.first_dense_layers, 0)
        if E % groups:
            raise InvalidConfig(f"{{num_experts}}={E} is not a multiple of {{n_group}}={groups}")
        if groups > 1 and E // groups < 2:  # a group's score is the sum of its two best experts
            raise InvalidConfig(f"{{n_group}}={groups} leaves fewer than 2 experts per group ({{num_experts}}={E})")
        if kept > groups:
            raise InvalidConfig(f"{{topk_group}}={kept} exceeds {{n_group}}={groups}")
        if k > kept * (E // groups):
            raise InvalidConfig(f"{{top_k}}={k} exceeds the {kept * (E // groups)} experts that {{topk_group}}="
                                f"{kept} of {{n_group}}={groups} groups keep")
        if self.expert_capacity is not None:
            C = check_int("expert_capacity", self.expert_capacity, k)  # a block admits at least a token's top_k
            if C > E:
                raise InvalidConfig(f"{{expert_capacity}}={C} exceeds {{num_experts}}={E}")
            if self.route_block is None:
                raise InvalidConfig("{expert_capacity} needs the routing block's size ({route_block})")
            check_int("route_block", self.route_block, 1, LIMITS["default_block_size"])
        elif self.route_block is not None:
            raise InvalidConfig("{route_block} is set without {expert_capacity}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str           # registry name: llada2_moe | sdar | llada
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int      # dense MLP width
    rope_theta: float
    rotary_dim: int             # leading head dims that RoPE rotates (NeoX rotate-half)
    rms_eps: float
    qk_norm: bool
    tie_word_embeddings: bool
    bidirectional: bool         # True: always attends over the whole sequence (no block-causal mask)
    max_position_embeddings: int
    default_block_size: int
    mask_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # some configs list several EOS ids (the loader takes the first)
    moe: MoEConfig | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str):
            raise InvalidConfig(f"{{architecture}} must be a string, got {show(self.architecture)}")
        check_size("vocab_size", self.vocab_size, 2)  # MASK and EOS are two different tokens
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings", "default_block_size"):
            check_size(name, getattr(self, name))
        check_float("rope_theta", self.rope_theta)
        check_float("rms_eps", self.rms_eps)
        for name in ("qk_norm", "tie_word_embeddings", "bidirectional"):
            check_bool(name, getattr(self, name))
        check_token_ids("mask_token_id", self.mask_token_id)
        check_token_ids("eos_token_id", self.eos_token_id, many=True)
        if self.num_heads % self.num_kv_heads:
            raise InvalidConfig(f"{{num_heads}}={self.num_heads} is not a multiple of "
                                f"{{num_kv_heads}}={self.num_kv_heads}")
        rot = check_int("rotary_dim", self.rotary_dim)
        if rot % 2:
            raise InvalidConfig(f"{{rotary_dim}}={rot} must be even (RoPE rotates pairs of dimensions)")
        if rot > self.head_dim:
            raise InvalidConfig(f"{{rotary_dim}}={rot} exceeds {{head_dim}}={self.head_dim}")
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                raise InvalidConfig(f"{{moe}} must be an MoE configuration, got {show(self.moe)}")
            if self.moe.first_dense_layers > self.num_layers:
                raise InvalidConfig(f"{{first_dense_layers}}={self.moe.first_dense_layers} exceeds "
                                    f"{{num_layers}}={self.num_layers}")
        if not isinstance(self.extra, dict):
            raise InvalidConfig(f"{{extra}} must be a mapping, got {show(self.extra)}")

    @classmethod
    def from_dict(cls, data) -> "ModelConfig":
        """The inverse of `dataclasses.asdict` (an export's metadata); a wrong or missing key is InvalidConfig."""
        if not isinstance(data, dict) or not isinstance(data.get("moe") or {}, dict):
            raise InvalidConfig(f"expected a mapping with moe a mapping or null, got {show(data)}")
        try:
            moe = MoEConfig(**data["moe"]) if data.get("moe") else None
            return cls(**{**data, "moe": moe})
        except TypeError as e:  # "ModelConfig.__init__() got an unexpected keyword argument 'x'", or a missing one
            raise InvalidConfig(str(e).partition("() ")[2] or str(e)) from None


def hf_decoder_fields(c: dict, *, rope_theta: float, block_size: int) -> dict:
    """ModelConfig fields named the usual Hugging Face way (`hidden_size`, `num_attention_heads`, ...), shared by
    the LLaDA2 and Qwen3-layout (SDAR) configs; the architecture file adds what is its own."""
    hidden, heads = get_int(c, "hidden_size"), get_int(c, "num_attention_heads")
    hd = get_int(c, "head_dim", None)
    if hd is None:  # derived: the heads must split the hidden size exactly
        if hidden % heads:
            raise InvalidConfig(f"{{hidden_size}}={hidden} is not a multiple of {{num_attention_heads}}={heads} "
                                "(and config.json gives no head_dim)")
        hd = hidden // heads
    check_size("head_dim", hd)  # bounded now: the architecture files compute with it (a float product overflows)
    return dict(
        vocab_size=get_int(c, "vocab_size"), hidden_size=hidden, num_layers=get_int(c, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=get_int(c, "num_key_value_heads", heads), head_dim=hd,
        intermediate_size=get_int(c, "intermediate_size"), rope_theta=get_float(c, "rope_theta", rope_theta),
        rms_eps=get_float(c, "rms_norm_eps", 1e-6), tie_word_embeddings=get_bool(c, "tie_word_embeddings", False),
        bidirectional=False, max_position_embeddings=get_int(c, "max_position_embeddings", 32768),
        default_block_size=block_size, mask_token_id=c.get("mask_token_id"), eos_token_id=c.get("eos_token_id"),
    )


# how the Hugging Face-style configs spell ModelConfig's fields (InvalidConfig.describe), and MoEConfig's where
# they have them (LLaDA2's, Qwen-MoE's spellings)
HF_DECODER_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                   "num_kv_heads": "num_key_value_heads", "rms_eps": "rms_norm_eps", "default_block_size": "block_size",
                   "expert_dim": "moe_intermediate_size", "num_shared": "num_shared_experts",
                   "routed_scaling": "routed_scaling_factor"}


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def read_limited(file: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. The file is opened without blocking (a FIFO would
    hang a plain open) and checked through its descriptor; at most limit + 1 bytes are read, so a huge or
    endless file fails fast whatever its reported size."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UserError(f"{file}: not found") from None
    except OSError as e:
        raise UserError(f"{file}: cannot be read ({e.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UserError(f"{file}: {_file_kind(info.st_mode)}, expected a regular file (of at most {mib(limit)})")
    with os.fdopen(fd, "rb") as f:
        try:
            data = b"" if info.st_size > limit else f.read(limit + 1)
        except OSError as e:
            raise UserError(f"{file}: cannot be read ({e.strerror})") from None
    if info.st_size > limit or len(data) > limit:
        raise UserError(f"{file}: larger than the {mib(limit)} limit for this file")
    return data


def read_json(file: Path, limit: int = JSON_LIMIT) -> dict:
    """A JSON object file, read with read_limited; malformed JSON is a UserError naming the file."""
    try:
        value = json.loads(read_limited(file, limit))
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer too long to convert
        raise UserError(f"{file}: malformed JSON ({' '.join(str(e).split())[:200]})") from None
    except RecursionError:
        raise UserError(f"{file}: malformed JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise UserError(f"{file}: expected a JSON object")
    return value


class ConfigFacts:
    """What the engine reads of any model kind (a live BlockDiffusionLM, an ExportedModel) from its `config`."""

    config: ModelConfig

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def eos_token_id(self) -> int:
        return self.config.eos_token_id

    @property
    def bidirectional(self) -> bool:
        return self.config.bidirectional
