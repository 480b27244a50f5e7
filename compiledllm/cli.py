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


def fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def summary_table(summary) -> Table:
    table = Table(title=f"{summary.model} · {summary.policy} · {summary.device}")
    for col in ("prompts", "tokens", "forwards", "tokens/forward", "tokens/s", "wall s", "load s"):
        table.add_column(col, justify="right")
    table.add_row(str(summary.prompts), str(summary.tokens), str(summary.forwards),
                  f"{summary.tokens_per_forward:.2f}", f"{summary.tokens_per_s:.1f}", f"{summary.wall_s:.2f}",
                  f"{summary.load_s:.2f}")
    return table


@app.command()
def run(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value (repeatable)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Results JSONL (overrides the recipe's output)."),
) -> None:
    """Decode every prompt of RECIPE; write one JSON line per prompt and print a summary."""
    from compiledllm.recipe import load_recipe
    from compiledllm.runner import execute, result_record, summary_dict

    try:
        rec = load_recipe(recipe, set_)
        out = output if output is not None else (Path(rec.output) if rec.output else None)
        with Progress(TextColumn("[bold]decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True) as progress:
            task = progress.add_task("decode", total=None)
            results, summary = execute(
                rec, on_start=lambda n: progress.update(task, total=n),
                on_result=lambda r: progress.advance(task), output=out)
    except UserError as e:
        fail(str(e))
    if out is None:
        for r in results:
            sys.stdout.write(json.dumps(result_record(r)) + "\n")
    else:
        out.with_suffix(".summary.json").write_text(json.dumps(summary_dict(summary), indent=2) + "\n")
        console.print(f"wrote {len(results)} results to {out}")
    console.print(summary_table(summary))


@app.command()
def version() -> None:
    """Print the package version."""
    from compiledllm import __version__

    console.print(__version__)


def main() -> None:
    app()
