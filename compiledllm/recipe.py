"""Recipe files: a validated, immutable description of one run (model, policy, prompts, output)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compiledllm.errors import UserError
from compiledllm.policies import POLICIES, PolicyConfig, policy_config


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    path: str = "tiny-llada2-random"   # checkpoint directory or built-in name (init: checkpoint)
    init: Literal["checkpoint", "random"] = "checkpoint"
    config: str | dict[str, Any] | None = None  # init: random -> a preset name or an inline config.json mapping
    architecture: str | None = None     # optional check of the config's architecture (init: random)
    seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    mask_token_id: int | None = Field(default=None, ge=0)
    eos_token_id: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _source(self):
        if self.init == "random" and self.config is None:
            raise ValueError("init: random needs config (a preset name or an inline config.json mapping)")
        if self.init == "checkpoint" and (self.config is not None or self.architecture is not None):
            raise ValueError("config/architecture are for init: random; a checkpoint brings its own config.json")
        return self

    @property
    def name(self) -> str:
        return self.path if self.init == "checkpoint" else f"random:{self.config if isinstance(self.config, str) else 'inline'}"


class GenerationSpec(_Strict):
    max_new_tokens: int = Field(default=256, ge=1)
    max_seq_len: int | None = Field(default=None, ge=1)


class PromptSpec(_Strict):
    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None  # chat turns, rendered with the checkpoint's chat template

    @model_validator(mode="after")
    def _one_kind(self):
        given = [k for k in ("text", "ids", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a prompt needs exactly one of text, ids, messages")
        return self


class Recipe(_Strict):
    model: ModelSpec = ModelSpec()
    policy: dict[str, Any] = Field(default_factory=lambda: {"name": "threshold"})
    generation: GenerationSpec = GenerationSpec()
    prompts: list[PromptSpec] = Field(default_factory=list)
    prompts_file: str | None = None
    batch_size: int = Field(default=8, ge=1)
    compile: bool = False
    cuda_graphs: bool = True                        # on CUDA: capture the step per batch-size bucket
    buckets: list[int] | None = None                # batch-size buckets (default: powers of two up to batch_size)
    output: str | None = "results.jsonl"
    base_dir: str = Field(default=".", exclude=True)  # where relative paths in the recipe resolve

    @model_validator(mode="after")
    def _check(self):
        if not self.prompts and self.prompts_file is None:
            raise ValueError("give prompts or prompts_file")
        policy_config(self.policy)  # raises a UserError naming the bad policy key
        return self

    def policy_config(self) -> PolicyConfig:
        return policy_config(self.policy)

    def resolve(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p

    def load_prompts(self) -> list[PromptSpec]:
        prompts = list(self.prompts)
        if self.prompts_file is not None:
            file = self.resolve(self.prompts_file)
            if not file.exists():
                raise UserError(f"prompts_file: {file} not found")
            for n, line in enumerate(file.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    prompts.append(PromptSpec.model_validate(json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UserError(f"{file}:{n}: malformed JSON ({e.msg})") from None
                except ValidationError as e:
                    raise UserError(f"{file}:{n}: {_first_error(e)}") from None
        return prompts


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    shown = f" (got {got!r})" if err["type"] != "missing" and not isinstance(got, (dict, list)) else ""
    return f"{loc}: {msg}{shown}" if loc else msg


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
        out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return out


def load_validated(cls: type[BaseModel], source, overrides: list[str] | None = None, kind: str = "recipe"):
    """An instance of `cls` (a recipe schema with a `base_dir` field) from a YAML file, a mapping or an
    instance, with `--set` overrides applied; every problem is a one-line UserError naming file and key."""
    if isinstance(source, cls) and not overrides:
        return source
    name, base = kind, "."
    if isinstance(source, cls):
        data, base = source.model_dump(exclude_unset=True), source.base_dir
    elif isinstance(source, dict):
        data = dict(source)
        base = data.pop("base_dir", ".")
    else:
        path = Path(source)
        name, base = str(path), str(path.parent)
        if not path.exists():
            raise UserError(f"{path}: {kind} not found")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise UserError(f"{path}: malformed YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}: a {kind} is a YAML mapping")
    for key, value in parse_overrides(overrides or []):
        set_path(data, key, value)
    try:
        return cls.model_validate({**data, "base_dir": base})
    except ValidationError as e:
        raise UserError(f"{name}: {_first_error(e)}") from None
    except UserError as e:
        raise UserError(f"{name}: {e}") from None


def load_recipe(source: str | Path | dict | Recipe, overrides: list[str] | None = None) -> Recipe:
    """A Recipe from a YAML file, a mapping or a Recipe, with `--set` overrides applied."""
    return load_validated(Recipe, source, overrides)


__all__ = ["Recipe", "ModelSpec", "GenerationSpec", "PromptSpec", "load_recipe", "POLICIES"]
