"""The `compiledllm` command line: thin typer commands over library functions."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from compiledllm.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Serve block diffusion language models.")
console = Console()
err_console = Console(stderr=True)


TRUST_HELP = ("Allow model.path to be an exported engine: loading one runs its native code (same as the recipe key "
              "model.trust_exported: true).")


def trusting(overrides: list[str] | None, trust_exported: bool) -> list[str]:
    return [*(overrides or []), *(["model.trust_exported=true"] if trust_exported else [])]


def fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def summary_table(summary) -> Table:
    table = Table(title=f"{summary.model} · {summary.policy} · {summary.device}")
    for col in ("prompts", "tokens", "forwards", "tokens/forward", "tokens/s", "wall s", "load s", "startup s"):
        table.add_column(col, justify="right")
    table.add_row(str(summary.prompts), str(summary.tokens), str(summary.forwards),
                  f"{summary.tokens_per_forward:.2f}", f"{summary.tokens_per_s:.1f}", f"{summary.wall_s:.2f}",
                  f"{summary.load_s:.2f}", f"{summary.startup_s:.2f}")
    return table


@app.command()
def run(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value (repeatable)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Results JSONL (overrides the recipe's output)."),
    trust_exported: bool = typer.Option(False, "--trust-exported", help=TRUST_HELP),
) -> None:
    """Decode every prompt of RECIPE; write one JSON line per prompt and print a summary."""
    from compiledllm.recipe import load_recipe
    from compiledllm.runner import RunInterrupted, execute, result_record

    try:
        rec = load_recipe(recipe, trusting(set_, trust_exported))
        out = output if output is not None else (Path(rec.output) if rec.output else None)
        with Progress(TextColumn("[bold]decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True) as progress:
            task = progress.add_task("decode", total=None)
            results, summary = execute(
                rec, on_start=lambda n: progress.update(task, total=n),
                on_result=lambda r: progress.advance(task), output=out, inputs=[recipe])
    except UserError as e:
        fail(str(e))
    except RunInterrupted as e:
        kept = f"kept {e.kept} finished results in {e.path}" if e.path else f"{e.kept} results had finished"
        err_console.print(f"interrupted: {kept}" + (f"; {out} is unchanged" if out else ""), highlight=False)
        raise typer.Exit(130)
    if out is None:
        for r in results:
            sys.stdout.write(json.dumps(result_record(r)) + "\n")
    else:
        console.print(f"wrote {len(results)} results to {out} (summary: {out.with_suffix('.summary.json')})")
    console.print(summary_table(summary))


@app.command()
def profile(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    out: Path = typer.Option(Path("profile"), "--out", help="Folder for trace.json, profile.json, profile.png."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value."),
) -> None:
    """Run RECIPE eagerly under torch.profiler; print where a step's time goes, per phase."""
    from compiledllm.profiler import profile_recipe

    try:
        if out.exists() and not out.is_dir():
            raise UserError(f"--out: {out} is a file; profile writes a folder (trace.json, profile.json, profile.png)")
        table, summary, chart, ops = profile_recipe(recipe, out, set_)
    except UserError as e:
        fail(str(e))
    t = Table(title=f"{summary.model} · {summary.policy} · {summary.device} · {summary.forwards} steps")
    for col in ("phase", "total ms", "ms / step", "ms / block", "share"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for r in table:
        t.add_row(r.phase, f"{r.total_ms:.1f}", f"{r.per_step_ms:.3f}", f"{r.per_block_ms:.2f}", f"{r.share:.1%}")
    console.print(t)
    k = Table(title="largest kernels of the whole run (prefill included)" if summary.device.startswith("cuda")
              else "largest CPU ops of the whole run (prefill included)")
    for col in ("name", "calls", "total ms"):
        k.add_column(col, justify="left" if col == "name" else "right", overflow="ellipsis", max_width=70)
    for o in ops[:10]:
        k.add_row(o["name"], str(o["calls"]), f"{o['total_ms']:.1f}")
    console.print(k)
    console.print(f"trace: {out / 'trace.json'}   report: {out / 'profile.json'}")
    console.print(f"chart: {chart}" if chart else "chart: skipped (pip install 'compiledllm[plot]' for matplotlib)")


@app.command()
def export(
    recipe: Path = typer.Argument(..., help="Recipe YAML file (model, policy block size, batch buckets, lengths)."),
    out: Path = typer.Option(..., "--out", help="Folder for the exported engine."),
    backend: str = typer.Option("aoti", "--backend", help="aoti (AOTInductor) or tensorrt."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value."),
) -> None:
    """Package the recipe's step forwards (one per batch bucket) for `compiledllm run` (model.path: OUT)."""
    from compiledllm.export.trace import export_recipe

    try:
        if out.exists() and not out.is_dir():
            raise UserError(f"--out: {out} is a file; export writes a folder")
        if out.is_dir() and any(out.iterdir()) and not (out / "compiledllm_export.json").exists():
            raise UserError(f"--out: {out} is a folder with other files in it; name an empty or new folder "
                            "(an earlier export there is replaced)")
        with Progress(TextColumn("[bold]exporting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True) as progress:
            task = progress.add_task("export", total=None)
            meta = export_recipe(recipe, out, backend, set_, on_start=lambda n: progress.update(task, total=n),
                                 on_bucket=lambda b: progress.advance(task))
    except UserError as e:
        fail(str(e))
    console.print(f"exported buckets {meta['buckets']} (block {meta['block_size']}, KV capacity {meta['capacity']}) "
                  f"to {out}; run it with --set model.path={out}")


@app.command()
def version() -> None:
    """Print the package version."""
    from compiledllm import __version__

    console.print(__version__)


def eval_table(name: str, entry: dict) -> Table:
    table = Table(title=f"{name} · {entry['tasks']} tasks · {entry['max_new_tokens']} new tokens · "
                        f"agreement with {entry['reference']}")
    table.add_column("policy", no_wrap=True)
    for col in ("EM", "tok acc", "prefix", "agree", "agree EM", "forwards", "tok/fwd", "tok/s"):
        table.add_column(col, justify="right", no_wrap=True)
    for label, m in entry["policies"].items():
        table.add_row(label, f"{m['exact_match']:.3f}", f"{m['token_accuracy']:.3f}", f"{m['prefix_tokens']:.2f}",
                      f"{m['agreement']:.3f}", f"{m['agreement_exact']:.3f}", str(m["forwards"]),
                      f"{m['tokens_per_forward']:.2f}", f"{m['tokens_per_s']:.1f}")
    return table


@app.command("eval")
def eval_(
    recipe: Path = typer.Argument(..., help="Eval recipe YAML file (model, policies, task files)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value (repeatable)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Report JSON (overrides the recipe's output)."),
    trust_exported: bool = typer.Option(False, "--trust-exported", help=TRUST_HELP),
) -> None:
    """Decode every task of RECIPE with each policy; print quality and speed per policy and write a JSON report."""
    from compiledllm.evaluate import load_eval_recipe, run_eval

    from compiledllm.outputs import check_output, write_atomic

    try:
        rec = load_eval_recipe(recipe, trusting(set_, trust_exported))
        out = output if output is not None else (Path(rec.output) if rec.output else None)
        if out is not None:  # before the evaluation, not after it
            check_output(out, [recipe, *(rec.resolve(t) for t in rec.tasks)], "eval output")
        with Progress(TextColumn("[bold]eval[/] {task.description}"), TimeElapsedColumn(), console=err_console,
                      transient=True) as progress:
            task = progress.add_task("loading", total=None)
            report = run_eval(rec, on_progress=lambda s: progress.update(task, description=s))
        if out is not None:
            write_atomic(out, json.dumps(report, indent=2) + "\n", "eval output")
    except UserError as e:
        fail(str(e))
    for name, entry in report["files"].items():
        console.print(eval_table(name, entry))
    if out is not None:
        console.print(f"wrote {out}")


def main() -> None:
    app()
