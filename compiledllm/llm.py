"""The text-level API in vLLM's shape: `LLM(model).generate(["text", ...], SamplingParams(...))`.

An LLM holds one loaded model and the engine settings (policy, batch size, KV capacity, compile). Each call takes
its SamplingParams: the sampling (temperature, top_k, top_p, seed) goes into the run's EngineConfig, and the Engine
is rebuilt only when that config differs from the last call's; the length (max_tokens) and the stop strings are
the requests' own settings in the engine's session (RequestParams), so changing them keeps the engine. Prompts are
text (encoded with the checkpoint's tokenizer), token-id lists, or (chat) conversations rendered through the
checkpoint's chat template; outputs come back one per prompt, in prompt order, whatever the batch size, shaped as
vLLM's RequestOutput (`outputs[0].text`, `.token_ids`, `.finish_reason`) beside the flat fields.
"""
from __future__ import annotations

import itertools
import numbers
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from pydantic import ValidationError

from compiledllm.engine import Engine, EngineConfig, GenerationResult, RequestParams
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
DEFAULT_MAX_TOKENS = 256  # vLLM's default is 16
VLLM_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}  # ours -> vLLM's words


def _length(name: str, n) -> int | None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
        raise UserError(f"SamplingParams.{name}: an integer >= 1, got {n!r}")
    return None if n is None else int(n)


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How one generate() / chat() call decodes: its length, where it stops and how each token is chosen
    (temperature 0: greedy). The names are vLLM's and the OpenAI API's:

    max_tokens: new tokens per prompt at most; `max_new_tokens` is its alias (either may be given, or both if they
        agree; either attribute reads the value; `dataclasses.replace` takes `max_tokens`). The default is 256
        (vLLM's is 16): give max_tokens to get vLLM's lengths.
    stop: a string or a list of them: a prompt's output ends where its text first holds one; the text is cut where
        that string begins (finish_reason "stop", its `outputs[0].stop_reason` the string). Stored as a tuple.
    n: completions per prompt; only 1.
    Keyword arguments this engine does not have (presence_penalty, logprobs, ...) raise TypeError."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int | None = None     # keep the k most likely tokens (None: all)
    top_p: float | None = None   # keep the smallest most likely set with mass >= top_p (None: all)
    seed: int = 0                # with the prompt's place in the call, keys its sampling noise
    stop: tuple[str, ...] = ()   # stop strings (given as a string, a list of strings or None)
    n: int = 1

    def __init__(self, max_tokens: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, stop: str | Sequence[str] | None = None, n: int = 1, *,
                 max_new_tokens: int | None = None):
        given, alias = _length("max_tokens", max_tokens), _length("max_new_tokens", max_new_tokens)
        if given is not None and alias is not None and given != alias:
            raise UserError(f"SamplingParams: max_tokens={given} and max_new_tokens={alias} differ (max_new_tokens is "
                            "an alias of max_tokens: give one)")
        length = given if given is not None else alias if alias is not None else DEFAULT_MAX_TOKENS
        stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or any(not isinstance(x, str) or not x for x in stops):
            raise UserError(f"SamplingParams.stop: a non-empty string or a list of them, got {stop!r}")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n != 1:
            raise UserError(f"SamplingParams.n: only n=1 (one completion per prompt) is supported, got {n!r}")
        try:
            Sampling(temperature, top_k, top_p, seed)  # the policies' own checks
        except ValueError as e:
            raise UserError(f"SamplingParams.{e}") from None
        values = {"max_tokens": length, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                  "stop": tuple(stops), "n": 1}
        for k, v in values.items():  # frozen
            object.__setattr__(self, k, v)

    @property
    def max_new_tokens(self) -> int:
        """max_tokens, by this engine's older name."""
        return self.max_tokens


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a prompt, as vLLM's CompletionOutput: `finish_reason` in vLLM's words ("stop": an EOS or
    a stop string; "length": max_tokens reached), `stop_reason` the stop string that ended it (None for an EOS or
    the length). No log-probabilities are computed (None)."""
    index: int
    text: str | None             # None without a tokenizer
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result: the flat fields, and vLLM's RequestOutput names beside them (`request_id`, `outputs`:
    one CompletionOutput, `finished`)."""
    prompt: str | None           # the text given (chat: the rendered template); None for a token-id prompt
    prompt_token_ids: list[int]
    text: str | None             # the generated text, special tokens skipped, cut before a stop string; None
                                 # without a tokenizer
    token_ids: list[int]         # the generated ids, up to and including the first EOS (or the stop string's end)
    finish_reason: Literal["eos", "length", "stop"]  # "stop": a stop string (vLLM's words: outputs[0])
    steps: int                   # forwards made for this request (prefill not counted)
    latency_s: float             # arrival (the run's start) to finish, its queueing and prefill included
    policy_stats: dict = field(default_factory=dict)  # the policy's own statistics (Policy.report)
    request_id: str = field(default="", compare=False)  # the LLM's running count, as vLLM's ("0", "1", ...)
    outputs: list[CompletionOutput] = field(default_factory=list)  # vLLM's: [the completion] (n = 1)
    finished: bool = True

    def __post_init__(self) -> None:
        if not self.outputs:  # built from the flat fields alone
            object.__setattr__(self, "outputs", [CompletionOutput(0, self.text, self.token_ids,
                                                                  finish_reason=VLLM_FINISH[self.finish_reason])])


@dataclass(frozen=True)
class StreamOutput:
    """One piece of a prompt's output as it is decoded (LLM.generate(..., stream=True)): `text` / `token_ids` are
    new since the prompt's last piece (text never splits a character and never shows a stop string; None without
    a tokenizer); the prompt's last piece has `output`, its RequestOutput."""
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
    EngineConfig's defaults, but `compile` then is "auto" as in a recipe (compiled on CUDA, not on the CPU; True /
    False force it); `policy` is a name ("t2t"), a mapping of policy parameters or a PolicyConfig.
    `threads`: torch's CPU threads, pinned from the first call on as --threads pins them (default: the recipe's
    `threads`, else the CLI's policy, compiledllm/threads.py: the cores other work leaves free, re-checked while a
    call runs)."""

    def __init__(self, model: str | os.PathLike | Recipe | BlockDiffusionLM, *,
                 policy: str | dict | PolicyConfig | None = None, batch_size: int | None = None,
                 max_seq_len: int | None = None, compile: bool | str | None = None, cuda_graphs: bool | None = None,
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
                                                                            DEFAULT_MAX_TOKENS, compile="auto")
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
        self._request_ids = itertools.count()  # RequestOutput.request_id, as vLLM's LLM counts them

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def engine(self) -> Engine | None:
        """The engine of the last call (None before the first)."""
        return self._engine

    def engine_for(self, params: SamplingParams) -> Engine:
        """The engine for these params: the last one where the run's config is the same, else a new one. Only the
        sampling is in the config (the engine's max_new_tokens stays the LLM's default); a call's max_tokens and
        stop strings go to its requests (request_params), so a change of them keeps the engine."""
        config = replace(self.config, policy=with_sampling(self.config.policy, params))
        if self._engine is None or self._engine.config != config:
            self._engine = Engine(self.model, config)
        return self._engine

    @staticmethod
    def request_params(params: SamplingParams) -> RequestParams:
        """What the session takes per request from these params: the length and the stop strings."""
        return RequestParams(max_new_tokens=params.max_tokens, stop=params.stop)

    def generate(self, prompts: str | Sequence[str | Sequence[int]], params: SamplingParams | None = None, *,
                 progress: bool = False, stream: bool = False, sampling_params: SamplingParams | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput] | Iterator[StreamOutput]:
        """Decode each prompt (text, or a list of token ids); one output per prompt, in prompt order.
        `sampling_params` / `use_tqdm`: vLLM's names of `params` / `progress` (default off here)."""
        params, progress = _vllm_names(params, sampling_params, progress, use_tqdm)
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

    def stream(self, prompts: str | Sequence[str | Sequence[int]], params: SamplingParams | None = None, *,
               sampling_params: SamplingParams | None = None) -> Iterator[StreamOutput]:
        """generate(prompts, params, stream=True): each prompt's new text as its blocks finish (StreamOutput, the
        last one of a prompt carrying its RequestOutput); prompts interleave as they decode."""
        return self.generate(prompts, params, stream=True, sampling_params=sampling_params)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], params: SamplingParams | None = None, *,
             add_generation_prompt: bool = True, progress: bool = False, sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Decode one conversation ([{"role": ..., "content": ...}, ...]) or a list of them, each rendered through
        the checkpoint's chat template; one output per conversation, in order."""
        params, progress = _vllm_names(params, sampling_params, progress, use_tqdm)
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
        engine, params = self._engine_of(params)  # the settings and prompts are checked here, not at next()
        events = engine.events(ids, params=self.request_params(params))
        return self._deltas(texts, events, params.stop, [str(next(self._request_ids)) for _ in ids])

    def _deltas(self, texts: list[str | None], events, stop: tuple[str, ...], rids: list[str]
                ) -> Iterator[StreamOutput]:
        sent = [0] * len(texts)  # tokens shown per prompt
        for d in text_deltas(events, self.tokenizer, max(map(len, stop), default=1) - 1):
            i, tokens, out = d.request_id, d.token_ids, None
            if d.result is not None:  # a stop string's block is not streamed: its tokens come with the result
                tokens = tokens + d.result.output_ids[sent[i] + len(tokens):]
                out = self._output(texts[i], d.result, rids[i])
            sent[i] += len(tokens)
            yield StreamOutput(i, d.text if self.tokenizer is not None else None, tokens, out)

    def _engine_of(self, params: SamplingParams | None) -> tuple[Engine, SamplingParams]:
        if params is None:
            params = self.default_params
        elif not isinstance(params, SamplingParams):
            raise UserError(f"params: a compiledllm.SamplingParams, got {type(params).__name__}"
                            + (" (SamplingParams(**params))" if isinstance(params, dict) else ""))
        if params.stop and self.tokenizer is None:
            raise UserError(f"SamplingParams.stop: stop strings need a tokenizer; {self.name} has no tokenizer.json")
        engine = self.engine_for(params)
        if self.threads is not None:  # pinned, as --threads; else the session's thread policy (threads.py)
            set_threads(self.threads)
        return engine, params

    def _run(self, texts: list[str | None], ids: list, params: SamplingParams | None,
             progress: bool) -> list[RequestOutput]:
        engine, params = self._engine_of(params)
        per_request = self.request_params(params)
        if not progress:
            results = engine.generate(ids, params=per_request)
        else:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("generating", total=len(ids))
                results = engine.generate(ids, on_result=lambda _: bar.advance(task), params=per_request)
        return [self._output(t, r, str(next(self._request_ids))) for t, r in zip(texts, results)]

    def _output(self, text: str | None, res: GenerationResult, request_id: str) -> RequestOutput:
        reason = res.finish_reason
        completion = CompletionOutput(0, res.text, res.output_ids, finish_reason=VLLM_FINISH[reason],
                                      stop_reason=res.stop_reason)
        return RequestOutput(prompt=text, prompt_token_ids=res.prompt_ids, text=res.text, token_ids=res.output_ids,
                             finish_reason=reason, steps=res.steps, latency_s=res.latency_s, policy_stats=res.extra,
                             request_id=request_id, outputs=[completion])


def _vllm_names(params, sampling_params, progress: bool, use_tqdm: bool) -> tuple[SamplingParams | None, bool]:
    """generate() / chat()'s arguments under vLLM's names (sampling_params, use_tqdm) as ours."""
    if sampling_params is not None:
        if params is not None and params is not sampling_params:
            raise UserError("give params or sampling_params (vLLM's name for it), not both")
        params = sampling_params
    return params, bool(progress or use_tqdm)
