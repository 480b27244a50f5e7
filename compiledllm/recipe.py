"""Recipe files: a validated, immutable description of one run (model, policy, prompts, output)."""
from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      ValidationInfo, model_validator)

from compiledllm.builtin_names import BUILTIN_NAMES as BUILTINS
from compiledllm.errors import UserError
# every input file is read (and its YAML / JSON parsed) through compiledllm.inputs; the CLI and evaluate.py import
# these names from here
from compiledllm.inputs import MAX_RECIPE_BYTES, YAML12_FLOAT, parse_json, parse_yaml, read_text

# Nothing here imports torch: the policies (and the device check of anything but "cpu") are imported when a recipe
# is validated, so that a missing file, a bad key or a wrong path fails before torch is imported (issue 32 item 4).
# load_recipe(..., check_policy=False) defers even that: the CLI checks the model's path first (check_policy later).
_LAZY = {"POLICIES": "compiledllm.policies", "PolicyConfig": "compiledllm.policies"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def policy_config(params):
    from compiledllm.policies import policy_config as make

    return make(params)


def _device(value: str) -> str:
    if value == "cpu":  # the default, always there: no torch needed to say so
        return value
    from compiledllm.devices import parse_device

    parse_device(value, "model.device")  # a UserError naming the devices there are, before any model is built
    return value


def _encodable(value: Any) -> Any:
    """A lone surrogate (e.g. from the JSON escape "\\ud800") is refused: no tokenizer encodes it. Runs before the
    str check, which refuses it less clearly wherever a length constraint applies."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"not valid Unicode (lone surrogate {value[e.start]!r} at character {e.start})") from None
    return value


def _compile_mode(value: Any) -> Any:
    if value is True or value is False or (isinstance(value, str) and value == "auto"):
        return value
    raise ValueError("a boolean (true or false) or auto")


Text = Annotated[str, BeforeValidator(_encodable)]
# compile: auto (the default) compiles the decode step on CUDA and not on the CPU; the Engine resolves it for the
# model's device (engine/compile.py resolve_compile), so a recipe says what was asked, the run what it did
CompileMode = Annotated[bool | Literal["auto"], BeforeValidator(_compile_mode)]
TokenId = Annotated[int, Field(ge=0)]
NO_MODEL = ("no model given: set model.path to a checkpoint directory or a built-in name ("
            + ", ".join(BUILTINS) + "), or model.init: random with model.config (a preset name or a config.json mapping)")


class _Strict(BaseModel):
    # strict: a bool field takes only true/false, an int field no float or bool, a float field no bool (ints are fine)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSpec(_Strict):
    path: str | None = Field(default=None, min_length=1)  # checkpoint directory, built-in name or Hub ORG/NAME
    revision: str | None = Field(default=None, min_length=1)  # path ORG/NAME: the Hub branch, tag or commit
    init: Literal["checkpoint", "random"] = "checkpoint"
    config: str | dict[str, Any] | None = None  # init: random -> a preset name or an inline config.json mapping
    architecture: str | None = None     # optional check of the config's architecture (init: random)
    seed: int = 0
    routing: Literal["balanced", "random"] | None = None  # init: random (default balanced): models/routing.py
    # LLaDA2.2-style block routing for an MoE model (models/block_routing.py): each block admits this many experts
    expert_capacity: int | None = Field(default=None, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Annotated[str, AfterValidator(_device)] = "cpu"  # cpu, cuda or cuda:N
    mask_token_id: int | None = Field(default=None, ge=0)
    eos_token_id: int | None = Field(default=None, ge=0)
    trust_exported: bool = False   # load an exported engine (model.path: an export folder): that runs its native code
    allow_nonfinite: bool = False  # NaN / inf weights load with a warning instead of being refused

    @model_validator(mode="before")
    @classmethod
    def _default_routing(cls, data):
        if isinstance(data, dict) and data.get("init") == "random" and data.get("routing") is None:
            return {**data, "routing": "balanced"}  # written out, so the resolved recipe shows it
        return data

    @model_validator(mode="after")
    def _source(self):
        if self.init == "checkpoint" and self.path is None:
            raise ValueError(NO_MODEL)
        if self.init == "random" and self.config is None:
            raise ValueError("init: random needs config (a preset name or an inline config.json mapping)")
        if self.init == "random" and (self.path is not None or self.revision is not None):
            raise ValueError("path/revision are for init: checkpoint; init: random builds the model from config")
        if self.init == "checkpoint" and (self.config is not None or self.architecture is not None):
            raise ValueError("config/architecture are for init: random; a checkpoint brings its own config.json")
        if self.init == "checkpoint" and self.routing is not None:
            raise ValueError("routing is for init: random; a checkpoint brings its own router")
        return self

    @property
    def name(self) -> str:
        return self.path if self.init == "checkpoint" else f"random:{self.config if isinstance(self.config, str) else 'inline'}"


class GenerationSpec(_Strict):
    max_new_tokens: int = Field(default=256, ge=1)
    max_seq_len: int | None = Field(default=None, ge=1)
    ignore_eos: bool = False  # every request decodes max_new_tokens (benchmarks)


class PrefillSpec(_Strict):
    chunk: int = Field(default=4096, ge=1)    # prompt positions per row in one prefill forward
    tokens: int = Field(default=16384, ge=1)  # tokens in one prefill forward: the longest stall of decoding rows
    compile: CompileMode = "auto"             # forwards >= 4096 tokens compiled; auto: with `compile`, CUDA, plain cache
    # throughput: a prefill forward before every decode step while prompts wait; first_block: none while a decoding
    # row is still in its first block, one piece at a time (the first block sooner for the first piece's requests)
    priority: Literal["throughput", "first_block"] = "throughput"
    # the first decode step of a request rides in its last prefill forward (its block's queries after the prompt's):
    # one forward fewer before its first block, the same tokens (policies that allow it: threshold)
    first_step: bool = True
    # with compile: also the small forwards, which eagerly cost ~7K ops of host work whatever their rows: every row
    # count of the smallest chunk (short prompts, a first_block burst's later pieces) and one row of every chunk (a
    # request that arrives alone); more shapes to build at start-up
    compile_small: bool = False


class ParallelSpec(_Strict):
    """Ranks one model is split over (compiledllm/parallel/): attention heads and dense MLPs over `tensor`, routed
    experts over `expert`; `data` engine replicas of that model share the requests (least loaded first). The run
    needs data x tensor x expert processes (torchrun)."""

    tensor: int = Field(default=1, ge=1)
    expert: int = Field(default=1, ge=1)
    data: int = Field(default=1, ge=1)


class PromptSpec(_Strict):
    text: Annotated[str, Field(min_length=1), BeforeValidator(_encodable)] | None = None
    ids: list[TokenId] | None = Field(default=None, min_length=1)
    messages: list[dict[str, Text]] | None = Field(default=None, min_length=1)  # rendered with the chat template

    @model_validator(mode="after")
    def _one_kind(self):
        given = [k for k in ("text", "ids", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a prompt needs exactly one of text, ids, messages")
        return self


class Recipe(_Strict):
    model: ModelSpec = Field(default={}, validate_default=True)  # required: {} fails, saying what to give
    policy: dict[str, Any] = Field(default_factory=lambda: {"name": "threshold"})
    generation: GenerationSpec = GenerationSpec()
    prefill: PrefillSpec = PrefillSpec()
    parallel: ParallelSpec = ParallelSpec()
    prompts: list[PromptSpec] = Field(default_factory=list)
    prompts_file: str | None = Field(default=None, min_length=1)
    batch_size: int = Field(default=8, ge=1)
    compile: CompileMode = "auto"                   # auto: compile on CUDA only; true; false
    cuda_graphs: bool = True                        # on CUDA: capture the step per batch-size bucket
    buckets: list[int] | None = None                # batch-size buckets (default: powers of two up to batch_size)
    phase_times: bool = False                       # each decode phase's device time (bench's phase table)
    output: str | None = Field(default="results.jsonl", min_length=1)
    threads: int | None = Field(default=None, ge=1)  # torch's CPU threads (default: the idle cores, threads.py)
    base_dir: str = Field(default=".", exclude=True)  # where relative paths in the recipe resolve

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo):
        if not self.prompts and self.prompts_file is None:
            raise ValueError("give prompts or prompts_file")
        if (info.context or {}).get("check_policy", True):
            check_policy_params(self.policy)  # raises a UserError naming the bad policy key
        return self

    def policy_config(self) -> "PolicyConfig":
        return policy_config(self.policy)

    def resolve(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p

    def load_prompts(self) -> list[PromptSpec]:
        prompts = list(self.prompts)
        if self.prompts_file is not None:
            file = self.resolve(self.prompts_file)
            given = len(prompts)
            for n, line in enumerate(read_text(file, "prompts_file").split("\n"), 1):  # JSON strings may hold U+2028
                if not line.strip():
                    continue
                raw = parse_json(line, f"{file}:{n}")  # depth and integer length bounded
                try:
                    prompts.append(PromptSpec.model_validate(raw))
                except ValidationError as e:
                    raise UserError(f"{file}:{n}: {first_error(e)}") from None
            if len(prompts) == given:
                raise UserError(f"{file}: prompts_file holds no prompts (one JSON object a line)")
        return prompts


def did_you_mean(key: str, allowed) -> str:
    """ "; did you mean X?" for the allowed key closest to an unknown `key` (difflib), else ""."""
    close = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _allowed_keys(cls: type[BaseModel] | None, loc: tuple) -> list[str]:
    """The keys a schema section takes, for the section at loc[:-1] of `cls` (empty where it cannot tell)."""
    import typing

    node = cls
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = node.model_fields.get(part) if node is not None else None
        if field is None:
            return []
        stack, node = [field.annotation], None
        while stack:  # unwrap Optional / list / Annotated to the nested schema class
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                node = t
                break
            stack.extend(typing.get_args(t))
    if node is None:
        return []
    return [name for name, f in node.model_fields.items() if not f.exclude]


def first_error(e: ValidationError, cls: type[BaseModel] | None = None) -> str:
    """A pydantic error as one line: the dotted key, the message and the value given (shortened); an unknown key
    of schema `cls` also names the closest allowed key."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    shown = f" (got {_short(repr(got))})" if err["type"] != "missing" and not isinstance(got, (dict, list)) else ""
    if err["type"] == "extra_forbidden" and err["loc"]:
        shown += did_you_mean(err["loc"][-1], _allowed_keys(cls, tuple(err["loc"])))
    return f"{loc}: {msg}{shown}" if loc else msg


_UNKNOWN_POLICY_KEY = re.compile(r"policy\.(?P<key>[^:]+): unknown parameter for policy \S+ \(allowed: (?P<allowed>[^)]*)\)")


def check_policy_params(params: dict) -> None:
    """The policy mapping checked (policies.policy_config: this imports the policies, and so torch); an unknown
    parameter's UserError also names the closest allowed one."""
    try:
        policy_config(params)
    except UserError as e:
        m = _UNKNOWN_POLICY_KEY.fullmatch(str(e))
        if m is None:
            raise
        raise UserError(f"{e}{did_you_mean(m['key'], m['allowed'].split(', '))}") from None


def check_policy(recipe: "Recipe", name: str = "recipe") -> None:
    """The check that load_recipe(..., check_policy=False) left out; a UserError names `name` as load_recipe's do."""
    try:
        check_policy_params(recipe.policy)
    except UserError as e:
        raise UserError(f"{name}: {e}") from None


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def set_path(data: dict, dotted: str, value: Any) -> None:
    """Apply one `--set a.b.c=value` override (value parsed as YAML) to the raw recipe mapping."""
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        if not isinstance(node.get(k, {}), dict):
            raise UserError(f"--set {dotted}: {k} is not a mapping")
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set {item!r}: expected key.path=value")
        out.append((key.strip(), parse_yaml(raw, f"--set {_short(item)}")))  # a 5000-digit value: not echoed
    return out


def load_validated(cls: type[BaseModel], source, overrides: list[str] | None = None, kind: str = "recipe",
                   context: dict | None = None):
    """An instance of `cls` (a recipe schema with a `base_dir` field) from a YAML file, a mapping or an
    instance, with `--set` overrides applied; every problem is a one-line UserError naming file and key.
    `context`: pydantic's validation context (Recipe: {"check_policy": False} defers the policy's check)."""
    if isinstance(source, cls) and not overrides:
        return source
    name, base = kind, "."
    if isinstance(source, cls):
        data, base = source.model_dump(exclude_unset=True), source.base_dir
    elif isinstance(source, dict):
        data = copy.deepcopy(source)  # --set overrides must not change the caller's mapping
        base = str(data.pop("base_dir", "."))
    else:
        path = Path(source)
        name, base = str(path), str(path.parent)
        data = parse_yaml(read_text(path, kind, MAX_RECIPE_BYTES), str(path))
        if not isinstance(data, dict):
            raise UserError(f"{path}: a {kind} is a YAML mapping")
    for key, value in parse_overrides(overrides or []):
        set_path(data, key, value)
    try:
        return cls.model_validate({**data, "base_dir": base}, context=context)
    except ValidationError as e:
        raise UserError(f"{name}: {first_error(e, cls)}") from None
    except UserError as e:
        raise UserError(f"{name}: {e}") from None


def load_recipe(source: str | Path | dict | Recipe, overrides: list[str] | None = None,
                check_policy: bool = True) -> Recipe:
    """A Recipe from a YAML file, a mapping or a Recipe, with `--set` overrides applied. check_policy=False: the
    policy's parameters are not checked yet (that imports torch); call check_policy(recipe) before using it."""
    return load_validated(Recipe, source, overrides, context={"check_policy": check_policy})


__all__ = ["Recipe", "ModelSpec", "GenerationSpec", "PromptSpec", "load_recipe", "check_policy", "POLICIES"]


class _Dumper(yaml.SafeDumper):
    """Quotes every string that parse_yaml would read as something else (1e-3 is a float there, not in YAML 1.1)."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", YAML12_FLOAT, list("-+0123456789"))


def resolved_policy(params: dict) -> dict:
    """A policy mapping with every parameter of its config, defaults filled in (name first)."""
    from dataclasses import asdict, fields

    check_policy_params(params)
    config = policy_config(params)
    given = asdict(config)
    return {"name": params["name"], **{f.name: given[f.name] for f in fields(config) if f.init}}


def resolved_recipe(recipe: Recipe) -> dict:
    """The recipe as `load_recipe` sees it: every default written out, the policy's included."""
    data = recipe.model_dump(mode="json")
    data["prompts"] = [p.model_dump(mode="json", exclude_none=True) for p in recipe.prompts]
    data["policy"] = resolved_policy(recipe.policy)
    return data


def dump_recipe(data: dict) -> str:
    """YAML text that parse_yaml reads back as `data`."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1 << 20)
