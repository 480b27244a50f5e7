"""The text-level API in vLLM's shape: `LLM(model).generate(["text", ...], SamplingParams(...))`.

An LLM holds one loaded model and the engine settings (policy, batch size, KV capacity, compile). Each call takes
its SamplingParams (length and sampling), builds the run's EngineConfig from both and rebuilds the Engine only when
that config differs from the last call's. Prompts are text (encoded with the checkpoint's tokenizer), token-id
lists, or (chat) conversations rendered through the checkpoint's chat template; outputs come back one per prompt,
in prompt order, whatever the batch size.
"""
from __future__ import annotations

import numbers
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from pydantic import ValidationError

from compiledllm.engine import Engine, EngineConfig, GenerationResult
from compiledllm.errors import UserError
from compiledllm.loader import load_model
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.parallel.group import check_one_process
from compiledllm.policies import PolicyConfig
from compiledllm.policies.sampling import Sampling
from compiledllm.recipe import ModelSpec, Recipe, first_error, load_recipe
from compiledllm.runner import load_from_spec
from compiledllm.stream import text_deltas
from compiledllm.threads import set_threads

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")  # SamplingParams' fields that PolicyConfig carries


@dataclass(frozen=True)
class SamplingParams:
    """How one generate() / chat() call decodes: its length and how each token is chosen (temperature 0: greedy)."""
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int | None = None     # keep the k most likely tokens (None: all)
    top_p: float | None = None   # keep the smallest most likely set with mass >= top_p (None: all)
    seed: int = 0                # with the prompt's place in the call, keys its sampling noise

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise UserError(f"SamplingParams.max_new_tokens: an integer >= 1, got {n!r}")
        try:
            Sampling(self.temperature, self.top_k, self.top_p, self.seed)  # the policies' own checks
        except ValueError as e:
            raise UserError(f"SamplingParams.{e}") from None


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result."""
    prompt: str | None           # the text given (chat: the rendered template); None for a token-id prompt
    prompt_token_ids: list[int]
    text: str | None             # the generated text, special tokens skipped; None without a tokenizer
    token_ids: list[int]         # the generated ids, up to and including the first EOS
    finish_reason: Literal["eos", "length"]
    steps: int                   # forwards made for this request (prefill not counted)
    latency_s: float             # arrival (the run's start) to finish, its queueing and prefill included
    policy_stats: dict = field(default_factory=dict)  # the policy's own statistics (Policy.report)


@dataclass(frozen=True)
class StreamOutput:
    """One piece of a prompt's output as it is decoded (LLM.generate(..., stream=True)): `text` / `token_ids` are
    new since the prompt's last piece (text never splits a character; None without a tokenizer); the prompt's last
    piece has `output`, its RequestOutput."""
    index: int                   # the prompt's place in the call
    text: str | None
    token_ids: list[int]
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None


def with_sampling(policy: PolicyConfig, params: SamplingParams) -> PolicyConfig:
    """The policy's config with the call's sampling (every PolicyConfig carries SAMPLING_FIELDS)."""
    return replace(policy, **{k: getattr(params, k) for k in SAMPLING_FIELDS})


def _model_spec(spec: ModelSpec, options: dict) -> ModelSpec:
    """The recipe's model with LLM()'s loading options over it, validated as a recipe's would be."""
    if not options:
        return spec
    options = {k: str(v).removeprefix("torch.") if k in ("device", "dtype") else v for k, v in options.items()}
    try:
        return ModelSpec.model_validate({**spec.model_dump(exclude_unset=True), **options})
    except ValidationError as e:
        raise UserError(f"LLM: model.{first_error(e)}") from None


class LLM:
    """A loaded model and engine settings. `model`: a built-in name ("tiny-llada2"), a checkpoint directory, a
    Hugging Face name (ORG/NAME), an exported engine, a recipe file or Recipe (its model and engine settings; the
    keyword arguments override them), or a model already loaded. Settings left None keep the recipe's values, else
    EngineConfig's defaults; `policy` is a name ("t2t"), a mapping of policy parameters or a PolicyConfig.
    `threads`: torch's CPU threads, pinned from the first call on as --threads pins them (default: the recipe's
    `threads`, else the CLI's policy, compiledllm/threads.py: the cores other work leaves free, re-checked while a
    call runs)."""

    def __init__(self, model: str | os.PathLike | Recipe | BlockDiffusionLM, *,
                 policy: str | dict | PolicyConfig | None = None, batch_size: int | None = None,
                 max_seq_len: int | None = None, compile: bool | None = None, cuda_graphs: bool | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 mask_token_id: int | None = None, eos_token_id: int | None = None, trust_exported: bool = False,
                 revision: str | None = None, threads: int | None = None):
        load = {"device": device, "dtype": dtype, "mask_token_id": mask_token_id, "eos_token_id": eos_token_id,
                "revision": revision, "trust_exported": trust_exported or None}
        load = {k: v for k, v in load.items() if v is not None}  # only what was given overrides a recipe's model
        recipe = None
        if isinstance(model, Recipe) or (isinstance(model, (str, os.PathLike)) and os.path.isfile(model)):
            recipe = load_recipe(model)
        elif not isinstance(model, (str, os.PathLike, BlockDiffusionLM)):
            raise UserError(f"LLM: model is a built-in name, a checkpoint directory, ORG/NAME, a recipe file, a Recipe "
                            f"or a loaded model, got {type(model).__name__}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, numbers.Integral)
                                    or threads < 1):
            raise UserError(f"LLM: threads: an integer >= 1 (or None: follow the machine), got {threads!r}")
        self.threads = threads if threads is not None else (recipe.threads if recipe else None)
        if isinstance(policy, str):
            policy = {"name": policy}
        settings = {"policy": policy, "batch_size": batch_size, "max_seq_len": max_seq_len, "compile": compile,
                    "cuda_graphs": cuda_graphs}
        settings = {k: v for k, v in settings.items() if v is not None}
        # settings are checked before the model loads: a mistake costs no loading time
        base = EngineConfig.from_recipe(recipe) if recipe else EngineConfig({"name": "threshold"},
                                                                            SamplingParams.max_new_tokens)
        self.config: EngineConfig = replace(base, **settings)
        if recipe is not None:
            p = recipe.parallel
            check_one_process(p.tensor, p.expert, p.data, "LLM")  # one engine here; a split is never ignored
            self.name = recipe.model.name
            self.model = load_from_spec(_model_spec(recipe.model, load))
        elif isinstance(model, BlockDiffusionLM):
            if load:
                raise UserError(f"LLM: {', '.join(load)} apply when loading; this model is already loaded")
            self.name, self.model = type(model).__name__, model
        else:
            self.name = os.fspath(model)
            self.model = load_model(model, **load)
        pcfg = self.config.policy  # a recipe's (or policy=...'s) sampling is every call's default
        self.default_params = SamplingParams(self.config.max_new_tokens,
                                             **{k: getattr(pcfg, k) for k in SAMPLING_FIELDS})
        self._engine: Engine | None = None

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def engine(self) -> Engine | None:
        """The engine of the last call (None before the first)."""
        return self._engine

    def engine_for(self, params: SamplingParams) -> Engine:
        """The engine for these params: the last one where the run's config is the same, else a new one."""
        config = replace(self.config, policy=with_sampling(self.config.policy, params),
                         max_new_tokens=params.max_new_tokens)
        if self._engine is None or self._engine.config != config:
            self._engine = Engine(self.model, config)
        return self._engine

    def generate(self, prompts: str | Sequence[str | Sequence[int]], params: SamplingParams | None = None, *,
                 progress: bool = False, stream: bool = False) -> list[RequestOutput] | Iterator[StreamOutput]:
        """Decode each prompt (text, or a list of token ids); one output per prompt, in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            hint = " (call .tolist())" if isinstance(prompts, torch.Tensor) else ""
            raise UserError(f"prompts: a string, a list of strings or a list of token-id lists, got "
                            f"{type(prompts).__name__}{hint}")
        texts = [p if isinstance(p, str) else None for p in prompts]
        if any(t is not None for t in texts) and self.tokenizer is None:
            i = next(i for i, t in enumerate(texts) if t is not None)
            raise UserError(f"prompt {i}: text, but {self.name} has no tokenizer.json; give token ids")
        ids = [self.tokenizer.encode(p) if t is not None else p for p, t in zip(prompts, texts)]
        return self._stream(texts, ids, params) if stream else self._run(texts, ids, params, progress)

    def stream(self, prompts: str | Sequence[str | Sequence[int]], params: SamplingParams | None = None
               ) -> Iterator[StreamOutput]:
        """generate(prompts, params, stream=True): each prompt's new text as its blocks finish (StreamOutput, the
        last one of a prompt carrying its RequestOutput); prompts interleave as they decode."""
        return self.generate(prompts, params, stream=True)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], params: SamplingParams | None = None, *,
             add_generation_prompt: bool = True, progress: bool = False) -> list[RequestOutput]:
        """Decode one conversation ([{"role": ..., "content": ...}, ...]) or a list of them, each rendered through
        the checkpoint's chat template; one output per conversation, in order."""
        shape = "a conversation (a list of {role, content} mappings) or a list of conversations"
        if not isinstance(messages, (list, tuple)) or not messages:
            raise UserError(f"messages: {shape}, got {messages!r:.60}")
        conversations = [messages] if all(isinstance(m, dict) for m in messages) else messages
        for i, conv in enumerate(conversations):
            if not isinstance(conv, (list, tuple)) or not conv or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in conv):
                raise UserError(f"messages: conversation {i} is not a non-empty list of {{role, content}} mappings "
                                f"({shape})")
        if self.tokenizer is None:
            raise UserError(f"chat: {self.name} has no tokenizer.json (and so no chat template)")
        texts = []
        for i, conv in enumerate(conversations):
            try:
                texts.append(self.tokenizer.apply_chat_template(list(conv), add_generation_prompt))
            except UserError as e:
                raise UserError(f"conversation {i}: {e}") from None
        return self._run(texts, [self.tokenizer.encode(t) for t in texts], params, progress)

    def _stream(self, texts: list[str | None], ids: list, params: SamplingParams | None) -> Iterator[StreamOutput]:
        events = self._engine_of(params).events(ids)  # the settings and prompts are checked here, not at next()
        return self._deltas(texts, events)

    def _deltas(self, texts: list[str | None], events) -> Iterator[StreamOutput]:
        for d in text_deltas(events, self.tokenizer):
            out = None if d.result is None else self._output(texts[d.request_id], d.result)
            yield StreamOutput(d.request_id, d.text if self.tokenizer is not None else None, d.token_ids, out)

    def _engine_of(self, params: SamplingParams | None) -> Engine:
        if params is None:
            params = self.default_params
        elif not isinstance(params, SamplingParams):
            raise UserError(f"params: a compiledllm.SamplingParams, got {type(params).__name__}"
                            + (" (SamplingParams(**params))" if isinstance(params, dict) else ""))
        engine = self.engine_for(params)
        if self.threads is not None:  # pinned, as --threads; else the session's thread policy (threads.py)
            set_threads(self.threads)
        return engine

    def _run(self, texts: list[str | None], ids: list, params: SamplingParams | None,
             progress: bool) -> list[RequestOutput]:
        engine = self._engine_of(params)
        if not progress:
            results = engine.generate(ids)
        else:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("generating", total=len(ids))
                results = engine.generate(ids, on_result=lambda _: bar.advance(task))
        return [self._output(t, r) for t, r in zip(texts, results)]

    def _output(self, text: str | None, res: GenerationResult) -> RequestOutput:
        eos = bool(res.output_ids) and res.output_ids[-1] == self.model.eos_token_id
        return RequestOutput(prompt=text, prompt_token_ids=res.prompt_ids, text=res.text, token_ids=res.output_ids,
                             finish_reason="eos" if eos else "length", steps=res.steps, latency_s=res.latency_s,
                             policy_stats=res.extra)
