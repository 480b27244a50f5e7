"""`compiledllm bench`: a recipe's end-to-end throughput and latency as it is served, over a grid of prompt lengths,
output lengths and batch sizes.

Each point decodes `requests` prompts (seeded random token ids that avoid special tokens, or a prompts file) with
every request making exactly its output length (ignore_eos), all at once or arriving as a seeded Poisson process,
and reads the engine's own accounting (Engine.stats: prefill and decode time and tokens; per request: arrival ->
first retired block and -> finish). Start-up (compile / capture) is reported apart and excluded from every rate. A
batch of "max" is the largest that really runs: probed by running the engine at the point's KV capacity for one
block at growing batch sizes (never estimated). Touched experts: the distinct routed experts each MoE layer picks
in an eager decode forward of the point's prompts (models/routing.py).
"""
from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from compiledllm.bench_probe import MaxProbe, free_memory
from compiledllm.engine import Engine, EngineConfig
from compiledllm.engine.engine import working_length
from compiledllm.errors import UserError
from compiledllm.models.routing import expected_touched, moe_layers, touched_after
from compiledllm.recipe import Recipe, load_recipe
from compiledllm.signals import shielded, signal_name

TOUCHED_ROWS = 64       # rows of the touched-experts forward at most (uniform routing touches all experts long before)
TOUCHED_CONTEXT = 1024  # cached prompt tokens per row before that forward


@dataclass(frozen=True)
class BenchSettings:
    prompt_lens: tuple[int, ...] = (512,)  # synthetic prompts of these lengths (ignored with prompts_file)
    prompts_file: Path | None = None       # JSONL of prompts (text, ids or messages), cycled to `requests`
    output_lens: tuple[int, ...] | None = None   # None: the recipe's generation.max_new_tokens
    batches: tuple[int | str, ...] | None = None  # sizes and/or "max"; None: the recipe's batch_size
    requests: int | None = None            # per point (None: the point's batch)
    rate: float = math.inf                 # requests per second (Poisson); inf: all at once
    seed: int = 0


class BenchInterrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM: signals.py) during the points: `report` holds every point that finished
    (marked "interrupted", with the signal)."""

    def __init__(self, report: dict):
        super().__init__()
        self.report = report


def parse_list(text: str, option: str, allow_max: bool = False) -> tuple:
    """'1,8,max' -> (1, 8, 'max'): positive integers (and `max` where allowed), each once, in the order given."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if allow_max and item == "max":
            value = "max"
        elif item.isdigit() and int(item) > 0:
            value = int(item)
        else:
            want = "positive integers or max" if allow_max else "positive integers"
            raise UserError(f"{option}: {item!r} in {text!r} is not one of {want} (a comma list, e.g. 1,8,32)")
        if value not in out:
            out.append(value)
    return tuple(out)


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise UserError(f"--rate: {text!r} is not a rate in requests per second > 0 (or inf: all at once)")
    return rate


def special_ids(model) -> set[int]:
    ids = {model.mask_token_id, model.eos_token_id}
    tok = model.tokenizer
    if tok is not None:
        ids |= {i for i, t in tok.tokenizer.get_added_tokens_decoder().items() if t.special}
    return ids


def synthetic_prompts(model, n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of `length` token ids, uniform over the vocabulary's ordinary tokens (seeded)."""
    specials = torch.tensor(sorted(special_ids(model)))
    allowed = torch.arange(model.config.vocab_size)
    allowed = allowed[~torch.isin(allowed, specials)]
    gen = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (n, length), generator=gen)].tolist()


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float] | None:
    """Arrival times (s) of a Poisson process of `rate` requests/s; None (all at once) for an infinite rate."""
    if math.isinf(rate):
        return None
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-th percentile (q in [0, 100]) of a non-empty sample."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def _rate(n: float, s: float) -> float | None:
    return n / s if s > 0 else None


def run_point(model, config: EngineConfig, prompts: list[list[int]], arrivals: list[float] | None,
              on_startup: Callable[[int, int, str], None] | None = None) -> dict:
    """One generate() of `prompts` under `config`, measured: the point's JSON record (bench docstring)."""
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    engine = Engine(model, config)
    results = engine.generate(prompts, arrivals=arrivals, on_startup=on_startup)
    s = engine.stats
    lat = [r.latency_s for r in results]
    rec = {
        "batch": min(config.batch_size, len(prompts)), "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts), "generated_tokens": s.generated_tokens,
        "wall_s": s.wall_s, "startup_s": s.startup_s,
        "compile_cache": asdict(engine.compile_cache) if engine.compile_cache is not None else None,
        "prefill_tokens": s.prefill_tokens, "prefill_forwards": s.prefill_forwards, "prefill_s": s.prefill_s,
        "prefill_tokens_per_s": _rate(s.prefill_tokens, s.prefill_s), "prefill_first_ms": 1e3 * s.prefill_first_s,
        "decode_steps": s.decode_steps, "decode_s": s.decode_s,
        "decode_tokens_per_s": _rate(s.generated_tokens, s.decode_s),
        "decode_step_ms": 1e3 * s.decode_s / max(s.decode_steps, 1),
        "stalled_steps": s.stalled_steps, "stall_max_ms": 1e3 * s.stall_max_s,
        "stall_mean_ms": 1e3 * s.stall_s / max(s.stalled_steps, 1),
        "output_tokens_per_s": _rate(s.generated_tokens, s.wall_s),
        "first_block_p50_s": statistics.median(r.first_block_s for r in results),
        **{f"latency_p{q}_s": percentile(lat, q) for q in (50, 90, 99)},
        "peak_memory_bytes": torch.cuda.max_memory_allocated(model.device) if cuda else None,
        "hooks_s": s.hooks_s, "sync_s": s.sync_s, "policy_stats": s.policy, "phases": s.phases, "opening": s.opening,
    }
    del engine, results
    free_memory(model)
    return rec


def touched_record(model, prompts: list[list[int]], block: int) -> dict:
    """touched_experts: per MoE layer, at the first forward of a block of every row (at most TOUCHED_ROWS rows);
    touched_uniform: what uniform independent routing would touch for those tokens."""
    if not moe_layers(model):
        return {"touched_experts": None}
    rows = prompts[:TOUCHED_ROWS]
    per_layer = touched_after(model, rows, block, TOUCHED_CONTEXT)
    m = model.config.moe
    free_memory(model)
    return {"touched_experts": per_layer, "touched_rows": len(rows), "experts": m.num_experts,
            "touched_uniform": expected_touched(m.num_experts, m.top_k, len(rows) * block)}


def load_bench_recipe(path: Path, overrides: list[str] | None) -> Recipe:
    """The recipe as `run` reads it; its prompts and output are not used (bench brings its own prompts), so a
    placeholder prompt stands in for them."""
    return load_recipe(path, [*(overrides or []), "prompts=[{ids: [0]}]", "prompts_file=null", "output=null"])


def file_prompts(model, recipe: Recipe, path: Path) -> list[list[int]]:
    from compiledllm.runner import encode_prompts

    specs = recipe.model_copy(update={"prompts": [], "prompts_file": str(path.resolve())}).load_prompts()
    return encode_prompts(model, specs)


def plan(settings: BenchSettings, recipe: Recipe) -> list[tuple[int | None, int, int | str]]:
    """(prompt length or None for the prompts file, output length, batch) of every point, in order."""
    lens = [None] if settings.prompts_file is not None else list(settings.prompt_lens)
    outs = settings.output_lens or (recipe.generation.max_new_tokens,)
    batches = settings.batches or (recipe.batch_size,)
    return [(p, o, b) for p in lens for o in outs for b in batches]


def run_bench(path: Path, overrides: list[str] | None, settings: BenchSettings,
              on_start: Callable[[int], None] | None = None, on_progress: Callable[[str], None] | None = None,
              on_point: Callable[[dict], None] | None = None,
              on_startup: Callable[[int, int, str], None] | None = None) -> dict:
    """Every point of the grid for the recipe at `path`; the report (settings, device, points) that --out writes.
    on_point gets the report so far after each point (the CLI writes it then: a run cut short keeps its points);
    on_startup(done, total, what): each engine's compile / capture progress (the warm-up's and every point's);
    a stop signal during the points raises BenchInterrupted with the points that finished."""
    from compiledllm.parallel import init_mesh
    from compiledllm.policies import policy_name
    from compiledllm.recipe import resolved_policy
    from compiledllm.runner import load_from_spec
    from compiledllm.threads import set_threads

    recipe = load_bench_recipe(path, overrides)
    if recipe.parallel.data > 1:  # each process would measure a whole copy of the grid
        raise UserError(f"parallel.data={recipe.parallel.data}: bench measures one engine replica; set "
                        "parallel.data=1 (`run` spreads requests over replicas)")
    par = recipe.parallel
    points = plan(settings, recipe)
    if par.tensor * par.expert > 1 and any(b == "max" for _, _, b in points):
        raise UserError("--batch max with a split model (parallel.tensor / expert): give batch sizes (a probe that "
                        "fails on one rank would leave the others waiting in a collective)")
    threads = set_threads(recipe.threads)
    mesh = init_mesh(par.tensor, par.expert)  # under torchrun every rank runs every point; rank 0 reports
    model = load_from_spec(recipe.model, mesh)
    if model.device.type != "cuda" and any(b == "max" for _, _, b in points):
        raise UserError("--batch max: probes GPU memory by running batches until one fails; on the CPU (where a "
                        "process swaps or is killed instead) give batch sizes")
    given = file_prompts(model, recipe, settings.prompts_file) if settings.prompts_file is not None else None
    base = replace(EngineConfig.from_recipe(recipe), ignore_eos=True)
    probe_engine = Engine(model, base)  # its cuda_graphs: what is used (CUDA only, not an exported engine)
    block = probe_engine.block
    probe = MaxProbe(model, base, block, lambda n, length: synthetic_prompts(model, n, length, settings.seed))
    if on_start is not None:
        on_start(len(points))
    if model.device.type == "cuda":
        _warm_up(model, base, block, max(len(p) for p in given) if given else max(settings.prompt_lens), settings.seed,
                 on_startup)
    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    report = {"recipe": str(path), "overrides": list(overrides or []), "model": recipe.model.name,
              "routing": recipe.model.routing, "dtype": recipe.model.dtype, "policy": resolved_policy(recipe.policy),
              "policy_name": policy_name(recipe.policy_config()), "block": block, "compile": probe_engine.compile,
              "compile_asked": base.compile,
              "cuda_graphs": probe_engine.cuda_graphs, "cuda_graphs_asked": base.cuda_graphs,
              "prefill_chunk": base.prefill_chunk,
              "prefill_tokens": base.prefill_tokens, "prefill_compile": probe_engine.prefill_compile,
              "prefill_compile_asked": base.prefill_compile, "prefill_priority": base.prefill_priority,
              "parallel": {"tensor": par.tensor, "expert": par.expert},
              "parameters": sum(t.numel() for t in model.parameters()),  # this rank's share of a split model
              "device": device, "torch": torch.__version__,
              "threads": threads if model.device.type == "cpu" else None, "date": time.strftime("%Y-%m-%d"),
              "settings": settings_record(settings), "points": []}
    try:
        for plen, out, batch in points:
            if on_progress is not None:
                on_progress(f"prompt {plen or 'file'} · output {out} · batch {batch}")
            rec = {"prompt_len": plen, "output_len": out, "batch_asked": batch}
            try:
                rec |= bench_point(model, base, settings, probe, given, plen, out, batch, on_startup)
            except (UserError, torch.OutOfMemoryError) as e:  # the point fails; the grid goes on
                free_memory(model)
                rec["error"] = str(e).splitlines()[0]
            with shielded():  # a stop signal waits until the point is in the report (and on_point wrote it)
                report["points"].append(rec)
                if on_point is not None:
                    on_point(report)
    except KeyboardInterrupt:  # SIGINT or SIGTERM (signals.py): the points that finished
        raise BenchInterrupted(report | {"interrupted": True, "signal": signal_name()}) from None
    return report


def all_failed(report: dict) -> str | None:
    """Why no point ran (the first point's error), or None when one did."""
    points = report["points"]
    if not points or any("error" not in r for r in points):
        return None
    r = points[0]
    return (f"every point failed ({len(points)}); the first, prompt {r['prompt_len'] or 'file'} · out "
            f"{r['output_len']} · batch {r['batch_asked']}: {r['error']}")


def bench_point(model, base: EngineConfig, settings: BenchSettings, probe: MaxProbe, given: list[list[int]] | None,
                plen: int | None, out: int, batch: int | str,
                on_startup: Callable[[int, int, str], None] | None = None) -> dict:
    """One point of the grid: its batch (probed for "max"), its requests' prompts and arrivals, its measurements."""
    longest = max(len(p) for p in given) if given else plen
    size = probe(longest, working_length(longest, out, probe.block)) if batch == "max" else batch
    n = settings.requests or size
    prompts = [given[i % len(given)] for i in range(n)] if given else synthetic_prompts(model, n, plen, settings.seed)
    rec = run_point(model, replace(base, batch_size=size, max_new_tokens=out), prompts,
                    poisson_arrivals(n, settings.rate, settings.seed), on_startup)
    rec |= touched_record(model, prompts[:size], probe.block)
    if given:
        rec["prompt_len"] = round(rec["prompt_tokens"] / n)
    return rec


def _warm_up(model, config: EngineConfig, block: int, longest: int, seed: int,
             on_startup: Callable[[int, int, str], None] | None = None) -> None:
    """One untimed request (a prefill chunk and a block) so that the first point does not pay for Triton's JIT."""
    length = max(block, min(longest, config.prefill_chunk))
    engine = Engine(model, replace(config, batch_size=1, max_new_tokens=block))
    engine.generate(synthetic_prompts(model, 1, length, seed), on_startup=on_startup)
    free_memory(model)


def settings_record(s: BenchSettings) -> dict:
    return {"prompt_lens": None if s.prompts_file else list(s.prompt_lens),
            "prompts_file": str(s.prompts_file) if s.prompts_file else None,
            "output_lens": list(s.output_lens) if s.output_lens else None,
            "batches": list(s.batches) if s.batches else None, "requests": s.requests,
            "rate": "inf" if math.isinf(s.rate) else s.rate, "seed": s.seed}


def write_plot(report: dict, path: Path) -> None:
    """The plot (plot_writer) at `path`, written whole or not at all."""
    from compiledllm.outputs import write_files

    write_files([("--plot", path, plot_writer(report))])


def plot_writer(report: dict) -> Callable[[Path], None]:
    """What writes, as a PNG at the path it is given, output tokens/s and p50 latency against the batch used, one
    line per prompt length (and output length)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot: needs matplotlib (pip install 'compiledllm[plot]')") from None
    return lambda path: _draw_plot(plt, report, path)


def _draw_plot(plt, report: dict, path: Path) -> None:
    lines: dict[tuple, list[dict]] = {}
    for r in report["points"]:
        if "error" not in r:
            lines.setdefault((r["prompt_len"], r["output_len"]), []).append(r)
    outs = sorted({o for _, o in lines})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        for (plen, out), rs in sorted(lines.items()):
            rs = sorted(rs, key=lambda r: r["batch"])
            style = dict(marker="o", linestyle=["-", "--", ":", "-."][outs.index(out) % 4],
                         label=f"prompt {plen}, output {out}")
            axes[0].plot([r["batch"] for r in rs], [r["output_tokens_per_s"] or 0 for r in rs], **style)
            axes[1].plot([r["batch"] for r in rs], [r["latency_p50_s"] for r in rs], **style)
        batches = sorted({r["batch"] for rs in lines.values() for r in rs})
        for ax, what in zip(axes, ("output tokens/s, end to end", "request latency p50 (s)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.minorticks_off()
            ax.set_xlabel("batch")
            ax.set_ylabel(what)
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{report['model']} · {report['policy_name']} · {report['device']} · torch {report['torch']}",
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120, format="png")  # the path is a temporary: no suffix to go by
    finally:
        plt.close(fig)
