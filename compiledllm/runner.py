"""Run a recipe end to end: load the model, encode prompts, decode, write results and a summary."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from compiledllm.engine import Engine, GenerationResult
from compiledllm.errors import UserError
from compiledllm.loader import build_random, load_model
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.policies import policy_name
from compiledllm.recipe import ModelSpec, PromptSpec, Recipe, load_recipe


@dataclass(frozen=True)
class Summary:
    model: str
    policy: str
    device: str
    prompts: int
    tokens: int
    forwards: int
    tokens_per_forward: float
    wall_s: float
    tokens_per_s: float
    load_s: float
    startup_s: float  # compile / CUDA-graph capture before the first step
    compile: bool


def load_from_spec(m: ModelSpec) -> BlockDiffusionLM:
    if m.init == "random":
        model = build_random(m.config, device=m.device, dtype=m.dtype, seed=m.seed, mask_token_id=m.mask_token_id,
                             eos_token_id=m.eos_token_id)
        if m.architecture is not None and m.architecture != model.config.architecture:
            raise UserError(f"model.architecture: {m.architecture!r} but the config describes "
                            f"{model.config.architecture!r}")
        return model
    return load_model(m.path, device=m.device, dtype=m.dtype, mask_token_id=m.mask_token_id,
                      eos_token_id=m.eos_token_id)


def encode_prompts(model: BlockDiffusionLM, prompts: list[PromptSpec]) -> list[list[int]]:
    tok = model.tokenizer
    out = []
    for i, p in enumerate(prompts):
        if p.ids is not None:
            out.append(list(p.ids))
            continue
        if tok is None:
            raise UserError(f"prompt {i}: the model has no tokenizer.json, so prompts must be token ids")
        text = p.text if p.text is not None else tok.apply_chat_template(p.messages)
        out.append(tok.encode(text))
    return out


def result_record(res: GenerationResult) -> dict:
    rec = {"index": res.index, "prompt_ids": res.prompt_ids, "output_ids": res.output_ids}
    if res.text is not None:
        rec["text"] = res.text
    rec |= {"steps": res.steps, "latency_s": round(res.latency_s, 6)}
    if res.extra:  # the policy's own per-request statistics (Policy.report)
        rec["policy_stats"] = res.extra
    return rec


def execute(recipe: Recipe, on_start: Callable[[int], None] | None = None,
            on_result: Callable[[GenerationResult], None] | None = None,
            output: Path | None = None) -> tuple[list[GenerationResult], Summary]:
    t0 = time.perf_counter()
    m = recipe.model
    model = load_from_spec(m)
    load_s = time.perf_counter() - t0
    prompts = encode_prompts(model, recipe.load_prompts())
    engine = Engine.from_recipe(model, recipe)
    if on_start is not None:
        on_start(len(prompts))
    sink = None
    if output is not None:
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            sink = output.open("w")
        except OSError as e:
            raise UserError(f"output: cannot write {output} ({e.strerror})") from None
    try:
        def record(res: GenerationResult) -> None:
            if sink is not None:  # written as each request ends, so an interrupted run keeps what finished
                sink.write(json.dumps(result_record(res)) + "\n")
                sink.flush()
            if on_result is not None:
                on_result(res)

        t1 = time.perf_counter()
        results = engine.generate(prompts, on_result=record)
        wall = time.perf_counter() - t1 - engine.startup_s
    finally:
        if sink is not None:
            sink.close()
    tokens = sum(len(r.output_ids) for r in results)
    forwards = sum(r.steps for r in results)
    summary = Summary(model=m.name, policy=policy_name(recipe.policy_config()), device=str(model.device),
                      prompts=len(results), tokens=tokens, forwards=forwards,
                      tokens_per_forward=tokens / max(forwards, 1), wall_s=wall, tokens_per_s=tokens / max(wall, 1e-9),
                      load_s=load_s, startup_s=engine.startup_s, compile=recipe.compile)
    return results, summary


def run(recipe: str | Path | dict | Recipe, overrides: list[str] | None = None) -> list[GenerationResult]:
    """Run a recipe (path, mapping or Recipe); one result per prompt, in prompt order. Writes no files."""
    results, _ = execute(load_recipe(recipe, overrides))
    return results


def summary_dict(summary: Summary) -> dict:
    return asdict(summary)
