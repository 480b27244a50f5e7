"""Run a recipe end to end: load the model, encode prompts, decode, write results and a summary."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from compiledllm.compile_cache import CacheReport
from compiledllm.engine import BlockEvent, Engine, GenerationResult
from compiledllm.errors import UserError
from compiledllm.loader import build_random, load_model
from compiledllm.models.base import BlockDiffusionLM
from compiledllm.models.block_routing import use_block_routing
from compiledllm.outputs import ResultSink, check_outputs, run_outputs
from compiledllm.parallel import SINGLE, Mesh, generate_share, init_mesh, main_rank, replica_share, shard_model
from compiledllm.policies import policy_name
from compiledllm.recipe import ModelSpec, PromptSpec, Recipe, load_recipe
from compiledllm.signals import finishing, shielded, signal_name
from compiledllm.threads import set_threads


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
    compile: bool     # whether the decode step ran compiled (the recipe's auto resolved for the device)
    threads: int = 0  # torch's CPU threads during the run
    compile_cache: CacheReport | None = None  # what the start-up's compile found in Inductor's cache (compiled only)


def load_from_spec(m: ModelSpec, mesh: Mesh = SINGLE) -> BlockDiffusionLM:
    """The recipe's model; with a mesh of several ranks, this rank's share: a checkpoint's read alone (its slices
    of the files), a random one's cut from the whole (random weights are for benchmarks). model.expert_capacity
    turns block routing on (models/block_routing.py)."""
    if m.init == "random":
        model = build_random(m.config, device=m.device, dtype=m.dtype, seed=m.seed, mask_token_id=m.mask_token_id,
                             eos_token_id=m.eos_token_id, routing=m.routing)
        if m.architecture is not None and m.architecture != model.config.architecture:
            raise UserError(f"model.architecture: {m.architecture!r} but the config describes "
                            f"{model.config.architecture!r}")
        model = with_capacity(model, m.expert_capacity)
        return shard_model(model, mesh) if mesh.world > 1 else model
    dtype = m.dtype if "dtype" in m.model_fields_set else None  # not given: float32, or an exported engine's own
    model = load_model(m.path, device=m.device, dtype=dtype, mask_token_id=m.mask_token_id,
                       eos_token_id=m.eos_token_id, allow_nonfinite=m.allow_nonfinite, trust_exported=m.trust_exported,
                       revision=m.revision, mesh=mesh)
    return with_capacity(model, m.expert_capacity)


def with_capacity(model, capacity: int | None):
    if capacity is None:
        return model
    if getattr(model, "static_shapes", None) is not None:
        raise UserError("model.expert_capacity: an exported engine routes as it was exported (set it at export)")
    return use_block_routing(model, capacity)


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


class RunInterrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM: signals.py) during a run: `kept` results were kept in `path` (None: no
    output file)."""

    def __init__(self, kept: int, path: Path | None):
        super().__init__(kept, path)
        self.kept, self.path = kept, path


def run_inputs(recipe: Recipe, recipe_path: Path | None = None) -> list[Path]:
    """The files a run reads, which its output must not be."""
    found = [recipe_path] if recipe_path is not None else []
    if recipe.prompts_file is not None:
        found.append(recipe.resolve(recipe.prompts_file))
    if recipe.model.init == "checkpoint" and Path(recipe.model.path).exists():
        found.append(Path(recipe.model.path))
    return found


def prepare(recipe: Recipe) -> tuple[BlockDiffusionLM, list[list[int]], Engine, float]:
    """(model, encoded prompts, engine, load seconds) of a recipe, every prompt checked against the engine (ids,
    KV capacity) before any decoding; the run's CPU threads set first. One engine (replica) runs every prompt."""
    if recipe.parallel.data > 1:
        raise UserError(f"parallel.data={recipe.parallel.data}: only `run` spreads requests over engine replicas; "
                        "use parallel.data=1 here")
    return _prepare(recipe)[:4]


def _prepare(recipe: Recipe) -> tuple[BlockDiffusionLM, list[list[int]], Engine, float, Mesh]:
    specs = recipe.load_prompts()  # a bad prompts file fails before the model is loaded
    set_threads(recipe.threads)
    p = recipe.parallel
    mesh = init_mesh(p.tensor, p.expert, p.data)  # one process unless parallel asks for more
    t0 = time.perf_counter()
    model = load_from_spec(recipe.model, mesh)
    load_s = time.perf_counter() - t0
    prompts = encode_prompts(model, specs)
    engine = Engine.from_recipe(model, recipe)
    engine.validate(prompts)
    engine.capacity_for(prompts)
    return model, prompts, engine, load_s, mesh


def execute(recipe: Recipe, on_start: Callable[[int, BlockDiffusionLM], None] | None = None,
            on_result: Callable[[GenerationResult], None] | None = None,
            output: Path | None = None, inputs: list[Path] = (),
            on_block: Callable[[int, list[int]], None] | None = None,
            on_startup: Callable[[int, int, str], None] | None = None) -> tuple[list[GenerationResult], Summary]:
    """Run a recipe. on_start(prompts, model): once the model is loaded and the prompts encoded;
    on_block(prompt index, tokens): a request's newly final tokens, per retired block (one
    process; with parallel.data > 1 only results are reported); on_startup(done, total, what): the compile /
    CUDA-graph capture's progress before the first step (Stepper). With `output`, results are written as each
    request ends to a temporary file that replaces `output` (with its summary) only when the run ends: everything is
    validated before, and a failure leaves the previous files as they were (outputs.py). With parallel.data > 1 each
    engine replica decodes its share of the prompts and global rank 0 gets (and writes) every result; the other
    ranks return none."""
    if output is not None:
        check_outputs(run_outputs(output), [*inputs, *run_inputs(recipe)])
    model, prompts, engine, load_s, mesh = _prepare(recipe)
    if mesh.data > 1:
        engine, mine = replica_share(engine, prompts, mesh)
    if not main_rank():
        output = None  # every rank of a replica decodes the same tokens (parallel/); rank 0 writes the run's
    if on_start is not None:
        on_start(len(prompts), model)
    sink: ResultSink | None = None
    done: list[GenerationResult] = []

    def record(res: GenerationResult) -> None:
        with shielded():  # a stop signal waits: the result is in `done` and in the file, or in neither
            done.append(res)
            if sink is not None:
                sink.write(result_record(res))
        if on_result is not None:
            on_result(res)

    t1 = time.perf_counter()
    try:
        with shielded():  # a stop signal waits until the sink holds its lock and its file
            sink = ResultSink(output) if output is not None else None
        if mesh.data == 1 and on_block is not None:
            results = _with_blocks(engine, prompts, record, on_block, on_startup)
        elif mesh.data == 1:
            results = engine.generate(prompts, on_result=record, on_startup=on_startup)
        else:  # the wall time then includes waiting for the slowest replica
            results = generate_share(engine, mine, prompts, mesh, on_result=record, on_startup=on_startup)
        finishing()  # every result is in: a stop signal now lets the run commit them
    except KeyboardInterrupt:  # SIGINT or SIGTERM (signals.py)
        kept = None
        if sink is not None and not done:  # nothing to keep: an earlier partial file stays as it was
            sink.discard()
        elif sink is not None:
            summary = make_summary(recipe, engine, done, time.perf_counter() - t1 - engine.startup_s, load_s)
            kept = sink.keep_partial(asdict(summary) | {"interrupted": True, "signal": signal_name(),
                                                        "prompts_given": len(prompts)})
        raise RunInterrupted(len(done), kept) from None
    except BaseException:
        if sink is not None:
            sink.discard()
        raise
    summary = make_summary(recipe, engine, results, time.perf_counter() - t1 - engine.startup_s, load_s)
    if sink is not None:
        sink.commit(asdict(summary))
    return results, summary


def _with_blocks(engine: Engine, prompts: list[list[int]], record: Callable[[GenerationResult], None],
                 on_block: Callable[[int, list[int]], None],
                 on_startup: Callable[[int, int, str], None] | None = None) -> list[GenerationResult]:
    """engine.generate, with every block's tokens reported as the session retires it."""
    results: dict[int, GenerationResult] = {}
    for ev in engine.events(prompts, on_startup=on_startup):
        if isinstance(ev, BlockEvent):
            on_block(ev.request_id, ev.tokens)
        else:
            results[ev.request_id] = ev.result
            record(ev.result)
    return [results[i] for i in range(len(prompts))]


def make_summary(recipe: Recipe, engine: Engine, results: list[GenerationResult], wall: float,
                 load_s: float) -> Summary:
    """The run's summary; start-up and compile as the engine's last generate() had them."""
    tokens = sum(len(r.output_ids) for r in results)
    forwards = sum(r.steps for r in results)
    return Summary(model=recipe.model.name, policy=policy_name(recipe.policy_config()),
                   device=str(engine.model.device), prompts=len(results), tokens=tokens, forwards=forwards,
                   tokens_per_forward=tokens / max(forwards, 1), wall_s=wall, tokens_per_s=tokens / max(wall, 1e-9),
                   load_s=load_s, startup_s=engine.startup_s, compile=engine.compile,
                   threads=torch.get_num_threads(), compile_cache=engine.compile_cache)


def run(recipe: str | Path | dict | Recipe, overrides: list[str] | None = None) -> list[GenerationResult]:
    """Run a recipe (path, mapping or Recipe); one result per prompt, in prompt order. Writes no files."""
    if overrides is not None and (not isinstance(overrides, (list, tuple))
                                  or not all(isinstance(o, str) for o in overrides)):
        raise UserError(f"overrides: a list of 'key.path=value' strings, got {overrides!r}")
    results, _ = execute(load_recipe(recipe, overrides))
    return results

