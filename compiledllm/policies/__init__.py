"""Decoding policies, one algorithm per file; `make_policy` builds one from its name and parameters.

A new algorithm is a new file with a PolicyConfig and a Policy subclass, registered here (or, from outside the
package, with `register_policy`): the engine runs any policy's plans without changes (docs/design.md §2).
"""
from __future__ import annotations

from dataclasses import fields, replace
from functools import cache
from typing import get_type_hints

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from compiledllm.errors import UserError
from compiledllm.policies.base import Policy, PolicyConfig
from compiledllm.policies.edits import EditRecord
from compiledllm.policies.elastic_cache import ElasticCacheConfig, ElasticCachePolicy
from compiledllm.policies.fast_dllm_cache import FastDLLMCacheConfig, FastDLLMCachePolicy
from compiledllm.policies.flash_dllm import FlashDLLMConfig, FlashDLLMPolicy
from compiledllm.policies.flowblock import FlowBlockConfig, FlowBlockPolicy
from compiledllm.policies.flowblock_sync import FlowBlockSyncConfig, FlowBlockSyncPolicy
from compiledllm.policies.herald import HeraldConfig, HeraldPolicy
from compiledllm.policies.infinigen import InfiniGenConfig, InfiniGenPolicy
from compiledllm.policies.mage import MageConfig, MagePolicy
from compiledllm.policies.t2t import T2TConfig, T2TPolicy
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy

POLICIES: dict[str, tuple[type[PolicyConfig], type[Policy]]] = {
    "threshold": (ThresholdConfig, ThresholdPolicy),
    "t2t": (T2TConfig, T2TPolicy),
    "flowblock": (FlowBlockConfig, FlowBlockPolicy),
    "flowblock_sync": (FlowBlockSyncConfig, FlowBlockSyncPolicy),
    "fast_dllm_cache": (FastDLLMCacheConfig, FastDLLMCachePolicy),
    "flash_dllm": (FlashDLLMConfig, FlashDLLMPolicy),
    "elastic_cache": (ElasticCacheConfig, ElasticCachePolicy),
    "mage": (MageConfig, MagePolicy),
    "herald": (HeraldConfig, HeraldPolicy),
    "infinigen": (InfiniGenConfig, InfiniGenPolicy),
}


def register_policy(name: str, config_cls: type[PolicyConfig], policy_cls: type[Policy]) -> None:
    """Make a policy available by name in recipes (`policy: {name: NAME, ...}`)."""
    if name in POLICIES and POLICIES[name] != (config_cls, policy_cls):
        raise ValueError(f"policy {name!r} is already registered")
    other = next((n for n, (c, _) in POLICIES.items() if c is config_cls and n != name), None)
    if other is not None:  # make_policy finds a policy by its config's class: one class, one policy
        raise ValueError(f"policy {name!r}: config class {config_cls.__name__} already belongs to policy {other!r}")
    POLICIES[name] = (config_cls, policy_cls)


def policy_config(params: dict | PolicyConfig) -> PolicyConfig:
    """{'name': 'threshold', 'block_size': 32, ...} -> a frozen config (or pass one through)."""
    if isinstance(params, PolicyConfig):
        return params
    params = dict(params)
    name = params.pop("name", None)
    if not isinstance(name, str) or name not in POLICIES:
        raise UserError(f"policy.name: {name!r} is not one of {', '.join(POLICIES)}")
    cls = POLICIES[name][0]
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise UserError(f"policy.{unknown[0]}: unknown parameter for policy {name} (allowed: {', '.join(sorted(allowed))})")
    try:
        _strict_params(cls).validate_python(params)  # the types, strictly: no bool for a number, no float for an int
        return _adapter(cls).validate_python(params)  # builds the config; its __post_init__ checks the ranges
    except ValidationError as e:
        raise UserError(_validation_message(e)) from None


@cache
def _adapter(cls: type[PolicyConfig]) -> TypeAdapter:
    """Built once per config class: building one is slow, and pydantic-core turns a stop signal that lands inside
    the build into a SchemaError (an eval's second policy, Ctrl-C, a traceback), where a built one is only called."""
    return TypeAdapter(cls)


@cache
def _strict_params(cls: type[PolicyConfig]) -> TypeAdapter:
    """The config's fields as a strict TypedDict (pydantic's strict mode would also want a config instance, not a
    mapping): booleans only true/false, integers not floats or bools, floats any int or float but not a bool."""
    hints = get_type_hints(cls)
    params = TypedDict(f"{cls.__name__}Params", {f.name: hints[f.name] for f in fields(cls)}, total=False)
    return TypeAdapter(with_config(ConfigDict(strict=True))(params))


def _validation_message(e: ValidationError) -> str:
    err = e.errors()[0]
    key = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not key:  # a range check of the whole config: its message names the key
        return f"policy.{msg}"
    return f"policy.{key}: {msg} (got {err.get('input')!r})"


def resolve_block(config: PolicyConfig, default_block: int) -> PolicyConfig:
    """The config with the model's block size where it names none; the range checks run again on the result."""
    try:
        return config.with_block(default_block)
    except ValueError as e:
        raise UserError(f"policy.{e}") from None


def policy_class(config: PolicyConfig) -> type[Policy]:
    for cfg_cls, pol_cls in POLICIES.values():
        if type(config) is cfg_cls:
            return pol_cls
    raise UserError(f"no policy for config {type(config).__name__}")


def make_policy(config: PolicyConfig, mask_id: int, bidirectional: bool = False) -> Policy:
    return policy_class(config)(config, mask_id, bidirectional)


def record_edits(params: dict | PolicyConfig, span: int) -> PolicyConfig:
    """The policy's config (from params, as policy_config) with its edit record on for the first `span` generated
    positions where its policy keeps one (an EditRecord: t2t, flowblock, flowblock_sync); any other unchanged."""
    config = policy_config(params)
    if not issubclass(policy_class(config), EditRecord):
        return config
    return replace(config, edit_span=span)


def policy_name(config: PolicyConfig) -> str:
    return next(n for n, (c, _) in POLICIES.items() if type(config) is c)


__all__ = ["POLICIES", "Policy", "PolicyConfig", "ThresholdConfig", "T2TConfig", "FlowBlockConfig", "make_policy", "policy_config",
           "policy_class", "policy_name", "record_edits", "register_policy", "resolve_block"]
