"""The `compiledllm` command line: thin typer commands over library functions."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from compiledllm.errors import UserError
from compiledllm.signals import stop_on_signals

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run, evaluate, profile, export and serve block diffusion language models (LLaDA2, SDAR, "
                       "LLaDA).")
console = Console()                 # tables and reports (silent under --quiet)
err_console = Console(stderr=True)  # progress bars (silent under --quiet)
alerts = Console(stderr=True)       # errors and interruptions: always shown
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


TRUST_HELP = ("Allow model.path to be an exported engine: loading one runs its native code (same as the recipe key "
              "model.trust_exported: true).")


THREADS_HELP = ("torch's CPU threads, pinned (same as the recipe key threads; default: the cores other work leaves "
                "free, re-checked between steps while the run goes on).")


def with_flags(overrides: list[str] | None, trust_exported: bool = False, threads: int | None = None) -> list[str]:
    """The --set overrides plus those of --trust-exported and --threads (command-line flags win)."""
    return [*(overrides or []), *(["model.trust_exported=true"] if trust_exported else []),
            *([f"threads={threads}"] if threads is not None else [])]


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def fail(message: str) -> None:
    # the message as plain text: it may hold brackets ("compiledllm[plot]") that rich would read as markup
    alerts.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def interrupted(kept: str) -> None:
    """The one line a command stopped by SIGINT / SIGTERM prints (what it kept, and where; signals.py), and its exit
    code: 130 / 143."""
    import signal

    from compiledllm import signals

    by = "" if signals.received() == signal.SIGINT else f" by {signals.signal_name()}"  # Ctrl-C: as ever
    alerts.print(f"interrupted{by}: {kept}", highlight=False, soft_wrap=True)
    raise typer.Exit(signals.exit_code())


def stoppable(command):
    """A command that SIGINT / SIGTERM stop as signals.py says; one that arrives before the command's own handling
    (while torch is imported) is the same one line, not click's "Aborted!"."""
    @functools.wraps(command)
    def wrapped(*args, **kwargs):
        with stop_on_signals():
            try:
                return command(*args, **kwargs)
            except KeyboardInterrupt:
                interrupted("nothing had finished; nothing was written")
    return wrapped


class _StderrLog(logging.Handler):
    """Log records to whatever sys.stderr is when they are emitted (above a progress bar while one shows)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001  (logging's own convention: report, never raise)
            self.handleError(record)


_TORCH_LEVEL = [logging.WARNING]  # what torch's loggers get once torch is imported (settle_torch_logging)
log = logging.getLogger("compiledllm.cli")


def configure_logging(level: str) -> None:
    """The `compiledllm` logger at `level`, to stderr (under --quiet too: it silences progress bars and tables, not
    log lines); torch's loggers at warning or above (TORCH_LOGS, where set, decides those instead). torch is not
    imported here: its loggers are set when it is (settle_torch_logging), after the arguments are checked."""
    log = logging.getLogger("compiledllm")
    if not any(isinstance(h, _StderrLog) for h in log.handlers):
        handler = _StderrLog()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(LOG_LEVELS[level])
    log.propagate = False  # not twice where the root logger has a handler too
    _TORCH_LEVEL[0] = max(LOG_LEVELS[level], logging.WARNING)
    if "torch" in sys.modules:
        settle_torch_logging()


def settle_torch_logging() -> None:
    """Import torch (the commands call this once their inputs are checked) and set its loggers' level: its import
    sets them up, so the level is set after it."""
    if "TORCH_LOGS" not in os.environ:
        import torch  # noqa: F401

        logging.getLogger("torch").setLevel(_TORCH_LEVEL[0])


def _print_version(value: bool) -> None:
    if value:
        from compiledllm import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _global_options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the package version and exit."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars and no tables; errors are still "
                               "shown and output files still written."),
    log_level: str = typer.Option("warning", "--log-level", metavar="LEVEL",
                                  help="debug, info, warning or error: what the compiledllm logger shows on stderr "
                                  "(torch's loggers stay at warning or above; TORCH_LOGS sets those)."),
) -> None:
    console.quiet = err_console.quiet = quiet  # set on every invocation: nothing carries over to the next one
    level = log_level.lower()
    if level not in LOG_LEVELS:
        fail(f"--log-level: {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    configure_logging(level)


def precheck_file(recipe: Path, kind: str = "recipe") -> None:
    """A missing or unreadable recipe file fails (one line, as the recipe loaders say it) before torch is imported."""
    from compiledllm.recipe import MAX_RECIPE_BYTES, read_text

    try:
        read_text(recipe, kind, MAX_RECIPE_BYTES)
    except UserError as e:
        fail(str(e))


def progress(*columns) -> Progress:
    """A transient progress display on stderr; none under --quiet, nor on the other ranks of a split model. Where
    stderr is no terminal (a log file, CI) rich draws nothing, so a plain line stands in for it (LineProgress)."""
    from compiledllm.parallel import main_rank

    kind = Progress if err_console.is_terminal else LineProgress
    return kind(*columns, console=err_console, transient=True, disable=err_console.quiet or not main_rank())


class LineProgress(Progress):
    """A progress display for a stderr that is no terminal: a line such as "eval code.jsonl: t2t  3/9  412 s" when
    the description or the count changed, at most one every EVERY seconds, the first after EVERY seconds (a short
    run prints none), so that a long eval or bench written to a log shows it is alive and where it is."""
    EVERY = 30.0

    def __init__(self, *columns, **kwargs):
        super().__init__(*columns, **kwargs)
        self._said, self._next = None, time.monotonic() + self.EVERY
        self._label = next((c for c in self.columns if isinstance(c, TextColumn)), None)  # the line's label

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._line(task_id)

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._line(task_id)

    def _line(self, task_id) -> None:
        now = time.monotonic()
        task = next(t for t in self.tasks if t.id == task_id)
        label = Text.from_markup(self._label.text_format.format(task=task)).plain if self._label else task.description
        said = (label, task.completed)
        if self.disable or now < self._next or said == self._said:
            return
        total = "" if task.total is None else f"/{task.total:.0f}"
        self.console.print(f"{label}  {task.completed:.0f}{total}  {task.elapsed or 0:.0f} s", markup=False,
                           highlight=False, soft_wrap=True)
        self._said, self._next = said, now + self.EVERY


def compact_table(title: str) -> Table:
    """A table without side borders or doubled padding, so that a row of numbers fits 80 columns."""
    return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)


def summary_table(summary) -> Table:
    n = summary.threads
    threads = f" · {n} thread{'s' if n != 1 else ''}" if summary.device == "cpu" and n else ""
    table = compact_table(f"{summary.model} · {summary.policy} · {summary.device}{threads}")
    for col in ("prompts", "tokens", "forwards", "tokens per\nforward", "tokens/s", "wall s", "load s", "startup s"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_row(str(summary.prompts), str(summary.tokens), str(summary.forwards),
                  f"{summary.tokens_per_forward:.2f}", f"{summary.tokens_per_s:.1f}", f"{summary.wall_s:.2f}",
                  f"{summary.load_s:.2f}", f"{summary.startup_s:.2f}")
    return table


def startup_line(compiled: bool, startup_s: float, cache) -> str | None:
    """What ran before the first step, and what Inductor's cache (a CacheReport) held for it; None when nothing
    ran (the CPU without compile)."""
    if compiled and cache is not None:
        from compiledllm.compile_cache import describe

        return f"start-up {startup_s:.2f} s: compiled · {describe(cache)}"
    if startup_s > 0:
        return f"start-up {startup_s:.2f} s: steps captured as CUDA graphs, not compiled (compile: false)"
    return None


class StartupRow:
    """A row of a progress display while an engine compiles and / or captures its steps (Stepper's on_startup),
    gone when they are done."""

    def __init__(self, bar: Progress):
        self.bar, self.task = bar, None

    def __call__(self, done: int, total: int, what: str) -> None:
        if self.task is None:
            self.task = self.bar.add_task(f"start-up: {what}", total=total)
        self.bar.update(self.task, completed=done, total=total, description=f"start-up: {what}")
        if done >= total:
            self.bar.remove_task(self.task)
            self.task = None


PROMPT_HELP = "A text prompt (repeatable): with a MODEL, the run's prompts; with a recipe, they replace its prompts."
PROMPTS_HELP = ("JSONL prompts, one {text | ids | messages} a line: with a MODEL, the run's prompts (after any "
                "--prompt); with a recipe, they replace its prompts and prompts_file.")
POLICY_HELP = ("With a MODEL: the policy's name (threshold, t2t, flowblock, flowblock_sync, fast_dllm_cache, flash_dllm, "
               "elastic_cache, mage, herald, infinigen; default threshold).")
TARGET_HELP = ("A recipe YAML file, or a MODEL: a built-in name (tiny-llada2, ...), a checkpoint directory or a "
               "Hugging Face ORG/NAME, with --prompt / --prompts (the recipe's other keys take their defaults).")


def is_recipe_target(target: str) -> bool:
    """Whether `run TARGET` reads TARGET as a recipe: a file, or a name ending .yaml / .yml (a missing one is then
    "recipe not found") that is not a checkpoint directory."""
    path = Path(target)
    return path.is_file() or (target.lower().endswith((".yaml", ".yml")) and not (path / "config.json").is_file())


def source_recipe(target: str, overrides: list[str], prompt: list[str] | None, prompts_file: Path | None,
                  policy: str | None):
    """(Recipe, its file or None) that `run TARGET` means: TARGET a recipe file, or a model (a built-in name, a
    checkpoint directory or ORG/NAME) given as the minimal recipe {model: {path: TARGET}, policy: {name: POLICY},
    prompts: [{text: PROMPT}, ...], prompts_file: FILE}. The policy's parameters are not checked yet (that imports
    torch): recipe.check_policy does it, once the model's path is checked."""
    from compiledllm import hub
    from compiledllm.builtin_names import BUILTIN_NAMES, is_builtin_name
    from compiledllm.inputs import check_file
    from compiledllm.recipe import MAX_RECIPE_BYTES, load_recipe, parse_yaml, read_text

    if prompts_file is not None:  # a regular file (not a FIFO, device or directory): read later, by load_prompts
        try:
            check_file(prompts_file, "prompts file")
        except UserError as e:
            raise UserError(f"--prompts: {e}") from None
    given = [{"text": t} for t in prompt or []]
    path = Path(target)
    if is_recipe_target(target):
        if policy is not None:
            raise UserError(f"--policy {policy}: with a recipe file, set the policy there or with "
                            f"--set policy.name={policy}")
        if not given and prompts_file is None:
            return load_recipe(path, overrides, check_policy=False), path
        # the command line's prompts replace the recipe's (set as values: no YAML round trip of the text)
        data = parse_yaml(read_text(path, "recipe", MAX_RECIPE_BYTES), str(path))
        if not isinstance(data, dict):
            raise UserError(f"{path}: a recipe is a YAML mapping")
        data |= {"prompts": given, "prompts_file": str(prompts_file.resolve()) if prompts_file else None,
                 "base_dir": str(path.parent)}
        try:
            return load_recipe(data, overrides, check_policy=False), path
        except UserError as e:
            raise UserError(f"{path}: {str(e).removeprefix('recipe: ')}") from None
    if not (path.is_dir() or is_builtin_name(target) or hub.is_repo_id(target)):
        raise UserError(f"{target}: not a recipe file, a checkpoint directory, a built-in model "
                        f"({', '.join(BUILTIN_NAMES)}) nor a Hugging Face model ORG/NAME (e.g. {hub.EXAMPLE})")
    if not given and prompts_file is None:
        raise UserError(f"{target}: no prompts: give --prompt TEXT (repeatable) or --prompts FILE")
    data = {"model": {"path": target}, "policy": {"name": policy or "threshold"}, "prompts": given}
    if prompts_file is not None:
        data["prompts_file"] = str(prompts_file.resolve())
    try:
        return load_recipe(data, overrides, check_policy=False), None
    except UserError as e:  # "recipe: key: ..." -> "MODEL: key: ...", as a recipe file's errors name the file
        raise UserError(f"{target}: {str(e).removeprefix('recipe: ')}") from None


def check_model_path(rec) -> None:
    """The recipe's model.path is a directory, a built-in or a Hub model there is (a Hub model missing from the cache
    is downloaded, and fails fast without network): before torch and the model code are imported."""
    from compiledllm import hub
    from compiledllm.builtin_names import BUILTIN_NAMES, is_builtin_name

    m = rec.model
    if m.init != "checkpoint" or is_builtin_name(m.path) or Path(m.path).exists():
        return
    if hub.is_repo_id(m.path):
        hub.snapshot(m.path, hub.parse_revision(m.revision))
        return
    raise UserError(f"{m.path}: not a model directory (nor a built-in model: {', '.join(BUILTIN_NAMES)}; for a "
                    f"Hugging Face model give ORG/NAME, e.g. {hub.EXAMPLE})")


def checked_recipe(target: str, overrides: list[str], prompt, prompts_file, policy):
    """source_recipe, then the model's path and the policy checked: a UserError before any model code runs."""
    from compiledllm.recipe import check_policy

    rec, path = source_recipe(target, overrides, prompt, prompts_file, policy)
    check_model_path(rec)
    check_policy(rec, str(path) if path is not None else target)
    return rec, path


@app.command()
@stoppable  # SIGINT / SIGTERM keep the finished results (runner.execute)
def run(
    recipe: str = typer.Argument(..., metavar="RECIPE_OR_MODEL", help=TARGET_HELP),
    prompt: Optional[List[str]] = typer.Option(None, "--prompt", metavar="TEXT", help=PROMPT_HELP),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", metavar="FILE", help=PROMPTS_HELP),
    policy: Optional[str] = typer.Option(None, "--policy", metavar="NAME", help=POLICY_HELP),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value (repeatable)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Results JSONL (overrides the recipe's output)."),
    trust_exported: bool = typer.Option(False, "--trust-exported", help=TRUST_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help=THREADS_HELP),
) -> None:
    """Decode every prompt of RECIPE (or of --prompt / --prompts with a MODEL); write one JSON line per prompt (in
    prompt order) and print a summary."""
    out = None
    try:
        rec, path = checked_recipe(recipe, with_flags(set_, trust_exported, threads), prompt, prompts_file, policy)
        out = output if output is not None else (Path(rec.output) if rec.output else None)
        log.info("%s: model %s, policy %s, %d prompts%s, output %s", path or "command line", rec.model.name,
                 rec.policy.get("name"), len(rec.prompts), f" + {rec.prompts_file}" if rec.prompts_file else "",
                 out or "stdout")
        settle_torch_logging()
        from compiledllm.runner import RunInterrupted, execute, result_record

        log.debug("engine modules imported")
        from compiledllm.live import RunDisplay
        from compiledllm.parallel import main_rank

        # each result's text (streamed on a terminal) where it does not mix with the results: stderr when the
        # results go to stdout; nothing under --quiet, nor on the other ranks of a split model
        shown = err_console if out is None else console
        with contextlib.ExitStack() as stack:
            display: list[RunDisplay] = []

            def start(n: int, model) -> None:
                if main_rank() and not shown.quiet:
                    display.append(stack.enter_context(RunDisplay(shown, model.tokenizer, n,
                                                                  rec.generation.max_new_tokens)))

            streamed = shown.is_terminal and not shown.quiet  # text as it is decoded; else whole results
            results, summary = execute(
                rec, on_start=start, on_block=(lambda i, t: display and display[0].on_block(i, t)) if streamed
                else None,
                on_result=lambda r: display and display[0].on_result(r), output=out,
                inputs=[path] if path is not None else [],
                on_startup=lambda done, total, what: display and display[0].on_startup(done, total, what))
    except UserError as e:
        fail(str(e))
    except RunInterrupted as e:
        if not e.kept:
            interrupted("no result had finished; nothing was written" + (f" ({out} is unchanged)" if out else ""))
        kept = (f"kept {e.kept} finished results in {e.path} (summary: {e.path.with_suffix('.summary.json')})"
                if e.path else f"{e.kept} results had finished")
        interrupted(kept + (f"; {out} is unchanged" if out else ""))
    except KeyboardInterrupt:  # before the first decode began
        interrupted("no result had finished; nothing was written" + (f" ({out} is unchanged)" if out else ""))
    if not main_rank():  # the other ranks of a split model decoded the same tokens: rank 0 reports them
        return
    log.info("%d prompts: %d tokens in %d forwards, %.2f s (load %.2f s, start-up %.2f s)", summary.prompts,
             summary.tokens, summary.forwards, summary.wall_s, summary.load_s, summary.startup_s)
    if out is None:
        for r in results:
            sys.stdout.write(json.dumps(result_record(r)) + "\n")
    else:
        console.print(f"wrote {len(results)} results to {out}, in prompt order "
                      f"(summary: {out.with_suffix('.summary.json')})", highlight=False, soft_wrap=True)
    console.print(summary_table(summary))
    line = startup_line(summary.compile, summary.startup_s, summary.compile_cache)
    if line is not None:
        console.print(line, highlight=False, soft_wrap=True, markup=False)


@app.command()
def profile(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    out: Path = typer.Option(Path("profile"), "--out", help="Folder for trace.json.gz, profile.json, profile.png."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value."),
    record_steps: int = typer.Option(5, "--record-steps", min=1, help="Steps torch.profiler records in the trace "
                                     "(after skipping one and warming up one); the whole run is timed per phase."),
    trust_exported: bool = typer.Option(False, "--trust-exported", help=TRUST_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help=THREADS_HELP),
) -> None:
    """Run RECIPE eagerly, profiled; print where the run's time goes, per phase, and write a short trace."""
    precheck_file(recipe)
    settle_torch_logging()
    from compiledllm.profiler import MODE, STEPS_MEANING, profile_recipe, title

    from compiledllm.outputs import check_folder

    try:
        check_folder(out, "--out")  # first: a name too long for the filesystem fails every other look at it
        if out.exists() and not out.is_dir():
            raise UserError(f"--out: {out} is a file; profile writes a folder (trace.json.gz, profile.json, "
                            "profile.png)")
        res = profile_recipe(recipe, out, with_flags(set_, trust_exported, threads), record_steps)
    except UserError as e:
        fail(str(e))
    t = Table(title=title(res.summary, res.steps), caption=f"a step: one of the {res.steps} {STEPS_MEANING}; "
              f"share: of the {res.summary.wall_s * 1000:.0f} ms run ({MODE})")
    for col in ("phase", "total ms", "ms / step", "share"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for r in res.rows:
        per_step = "run total" if r.per_step_ms is None else f"{r.per_step_ms:.3f}"
        t.add_row(r.phase, f"{r.total_ms:.1f}", per_step, f"{r.share:.1%}")
    console.print(t)
    what = "kernels" if res.summary.device.startswith("cuda") else "CPU ops"
    k = Table(title=f"largest {what} of the {res.recorded_steps} recorded steps")
    for col in ("name", "calls", "total ms"):
        k.add_column(col, justify="left" if col == "name" else "right", overflow="ellipsis", max_width=70,
                     no_wrap=True)
    for o in res.ops[:10]:
        k.add_row(o["name"], str(o["calls"]), f"{o['total_ms']:.1f}")
    if res.ops:
        console.print(k)
    if res.gpu_busy_ms is not None and res.recorded_steps:
        console.print(f"GPU busy {res.gpu_busy_ms / res.recorded_steps:.2f} ms per recorded step (kernels only; the "
                      f"run's wall time per step is {res.summary.wall_s * 1000 / res.steps:.2f} ms: the rest is host "
                      "work and launch gaps)")
    trace = res.trace or f"none (the run's {res.steps} steps ended before the recorded ones)"
    console.print(f"trace: {trace}   report: {out / 'profile.json'}")
    console.print(f"chart: {res.chart}" if res.chart else "chart: skipped (pip install 'compiledllm[plot]' for "
                  "matplotlib)", markup=False, highlight=False, soft_wrap=True)


@app.command()
def export(
    recipe: Path = typer.Argument(..., help="Recipe YAML file (model, policy block size, batch buckets, lengths)."),
    out: Path = typer.Option(..., "--out", help="Folder for the exported engine."),
    backend: str = typer.Option("aoti", "--backend", help="aoti (AOTInductor) or tensorrt."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value."),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", min=1, help="KV capacity per slot, fixed in "
                                              "the export (default: the recipe's generation.max_seq_len, else what "
                                              "its prompts need)."),
) -> None:
    """Package the recipe's step forwards (one per batch bucket, sharing one weights file) for `compiledllm run`
    (model.path: OUT)."""
    precheck_file(recipe)
    settle_torch_logging()
    from compiledllm.export.trace import export_recipe

    from compiledllm.outputs import check_folder

    try:
        check_folder(out, "--out")  # first: a name too long for the filesystem fails every other look at it
        if out.exists() and not out.is_dir():
            raise UserError(f"--out: {out} is a file; export writes a folder")
        if out.is_dir() and any(out.iterdir()) and not (out / "compiledllm_export.json").exists():
            raise UserError(f"--out: {out} is a folder with other files in it; name an empty or new folder "
                            "(an earlier export there is replaced)")
        with Progress(TextColumn("[bold]exporting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True) as progress:
            task = progress.add_task("export", total=None)
            meta = export_recipe(recipe, out, backend, set_, max_seq_len,
                                 on_start=lambda n: progress.update(task, total=n),
                                 on_bucket=lambda b: progress.advance(task))
    except UserError as e:
        fail(str(e))
    console.print(f"exported buckets {meta['buckets']} (block {meta['block_size']}) to {out}; KV capacity "
                  f"{meta['capacity']} positions ({meta['capacity_from']}; longer runs need --max-seq-len N); run it "
                  f"with --set model.path={out} --trust-exported")


@app.command()
def version() -> None:
    """Print the package version."""
    from compiledllm import __version__

    console.print(__version__)


EVAL_LEGEND = """\
EM        exact match of the continuation with the reference (share of tasks)
tok acc   share of the reference tokens matched, position by position
prefix    mean length of the matching prefix, in tokens
agree     token agreement: positions equal to the reference policy's output
agree EM  share of tasks whose output equals the reference policy's output
forwards  decoding forwards of the model (prefill is not counted)
tok/fwd   generated tokens per forward
tok/s     generated tokens per second of decoding (compile time excluded)"""

EDIT_LEGEND = """\
edits     T2T rewrites of generated tokens (t2t, flowblock, flowblock_sync)
judged    edited positions inside the output and the reference (the draft of
          a position: the first token written there)
fixed     share of the judged positions: draft wrong, final token right
broke     share of the judged positions: draft right, final token wrong
blocks    blocks decoded
edited    share of the blocks in which at least one edit happened"""


def fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def eval_table(name: str, entry: dict) -> Table:
    table = compact_table(f"{name} · {entry['tasks']} tasks · {entry['max_new_tokens']} new tokens · "
                          f"agreement with {entry['reference']}")
    table.add_column("policy", overflow="fold")  # a long label wraps; nothing is cut
    for col in ("EM", "tok\nacc", "prefix", "agree", "agree\nEM", "forwards", "tok/\nfwd", "tok/s"):
        table.add_column(col, justify="right", no_wrap=True)
    for label, m in entry["policies"].items():
        table.add_row(label, f"{m['exact_match']:.3f}", f"{m['token_accuracy']:.3f}", f"{m['prefix_tokens']:.2f}",
                      f"{m['agreement']:.3f}", f"{m['agreement_exact']:.3f}", str(m["forwards"]),
                      f"{m['tokens_per_forward']:.2f}", f"{m['tokens_per_s']:.1f}")
    return table


def edit_table(name: str, entry: dict) -> Table | None:
    """The T2T policies' edits (None when no policy of the file edits)."""
    rows = {label: m for label, m in entry["policies"].items() if "edits" in m}
    if not rows:
        return None
    table = compact_table(f"{name} · T2T edits, judged against the reference")
    table.add_column("policy", overflow="fold")
    for col in ("edits", "judged", "fixed", "broke", "blocks", "edited"):
        table.add_column(col, justify="right", no_wrap=True)
    for label, m in rows.items():
        table.add_row(label, str(m["edits"]), str(m["edited_tokens"]), fmt_share(m["edit_fix_share"]),
                      fmt_share(m["edit_break_share"]), str(m["blocks"]), fmt_share(m["edit_block_share"]))
    return table


@app.command("eval")
@stoppable  # SIGINT / SIGTERM keep the finished policy runs (evaluate.EvalInterrupted)
def eval_(
    recipe: Path = typer.Argument(..., help="Eval recipe YAML file (model, policies, task files)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value (repeatable)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Report JSON (overrides the recipe's output)."),
    trust_exported: bool = typer.Option(False, "--trust-exported", help=TRUST_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help=THREADS_HELP),
) -> None:
    """Decode every task of RECIPE with each policy; print quality and speed per policy and write a JSON report.

    A legend below the tables explains the columns.

    Beside the report, <stem>.png charts each policy's exact match and tokens per forward, per task file.
    Ctrl-C or SIGTERM keeps the policies that finished in <stem>.partial.json beside the output (which stays
    unchanged).
    """
    precheck_file(recipe, "eval recipe")
    settle_torch_logging()
    from compiledllm.evaluate import EvalInterrupted, chart_writer, load_eval_recipe, run_eval
    from compiledllm.outputs import check_outputs, locked, partial_path, write_files
    from compiledllm.signals import finishing

    out, chart, stopped = None, None, False
    try:
        rec = load_eval_recipe(recipe, with_flags(set_, trust_exported, threads))
        out = output if output is not None else (Path(rec.output) if rec.output else None)
        with contextlib.ExitStack() as held:
            if out is not None:  # before the evaluation, not after it; a second eval on the report is refused
                files = [("eval output", out), ("eval chart", out.with_suffix(".png")),
                         ("eval partial report", partial_path(out))]
                check_outputs(files, [recipe, *(rec.resolve(t) for t in rec.tasks)])
                held.enter_context(locked(files))
            with progress(TextColumn("[bold]eval[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn()) as bar:
                task = bar.add_task("loading the model", total=None)
                try:
                    report = run_eval(rec, on_progress=lambda s: bar.update(task, description=s),
                                      on_start=lambda n: bar.update(task, total=n),
                                      on_result=lambda r: bar.advance(task))
                except EvalInterrupted as e:
                    report, stopped = e.report, True
            finishing()  # the report is whole: a stop signal now lets it be written
            done = sum(len(entry["policies"]) for entry in report["files"].values())
            if stopped and not done:
                raise KeyboardInterrupt  # nothing to keep: an earlier partial report stays as it was
            if out is not None:
                text = json.dumps(report, indent=2) + "\n"
                draw = None if stopped else chart_writer(report)
                write_files([("eval output", partial_path(out) if stopped else out, text),
                             *([("eval chart", out.with_suffix(".png"), draw)] if draw else [])])
                chart = out.with_suffix(".png") if draw else None
    except UserError as e:
        fail(str(e))
    except KeyboardInterrupt:  # before the first decode began
        interrupted("no policy had finished; nothing was written" + (f" ({out} is unchanged)" if out else ""))
    if out is None or not stopped:
        edits = False
        for name, entry in report["files"].items():
            if entry["policies"]:
                console.print(eval_table(name, entry))
                table = edit_table(name, entry)
                if table is not None:
                    console.print(table)
                    edits = True
        console.print(Text(EVAL_LEGEND + ("\n" + EDIT_LEGEND if edits else ""), style="dim"))
    if stopped:
        runs = f"{done} finished policy run{'s' * (done != 1)}"
        interrupted(f"kept the {runs} in {partial_path(out)}; {out} is unchanged" if out is not None
                    else f"{runs} (above); nothing was written")
    if out is not None:
        console.print(f"wrote {out}", highlight=False, soft_wrap=True)
        console.print(f"chart: {chart}" if chart else "chart: skipped (pip install 'compiledllm[plot]' for "
                      "matplotlib)", markup=False, highlight=False, soft_wrap=True)


recipe_app = typer.Typer(no_args_is_help=True, help="Inspect recipes.")
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("show")
def recipe_show(
    recipe: str = typer.Argument(..., metavar="RECIPE_OR_MODEL", help="Recipe YAML file (a run or an eval recipe), "
                                 "or a MODEL with --prompt / --prompts, as `compiledllm run` takes them."),
    prompt: Optional[List[str]] = typer.Option(None, "--prompt", metavar="TEXT", help=PROMPT_HELP),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", metavar="FILE", help=PROMPTS_HELP),
    policy: Optional[str] = typer.Option(None, "--policy", metavar="NAME", help=POLICY_HELP),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value (repeatable)."),
    eval_recipe: bool = typer.Option(False, "--eval", help="Read RECIPE as an eval recipe (default: when it has "
                                     "`tasks`)."),
) -> None:
    """Print RECIPE (or the recipe that `compiledllm run MODEL --prompt ...` means) as it is read, as YAML: every
    default written out, the policy's parameters included."""
    from compiledllm.recipe import (MAX_RECIPE_BYTES, check_policy, dump_recipe, parse_yaml, read_text,
                                    resolved_recipe)

    path = Path(recipe)
    try:
        is_eval = False
        if is_recipe_target(recipe):
            raw = parse_yaml(read_text(path, "recipe", MAX_RECIPE_BYTES), str(path))
            is_eval = eval_recipe or (isinstance(raw, dict) and "tasks" in raw)
        elif eval_recipe:
            raise UserError(f"--eval: {recipe} is not a recipe file")
        if is_eval:
            if prompt or prompts_file is not None or policy is not None:
                raise UserError(f"{recipe}: an eval recipe takes no --prompt, --prompts or --policy")
            settle_torch_logging()
            from compiledllm.evaluate import load_eval_recipe, resolved_eval_recipe

            data = resolved_eval_recipe(load_eval_recipe(path, set_))
        else:
            rec, source = source_recipe(recipe, set_ or [], prompt, prompts_file, policy)
            check_policy(rec, str(source) if source is not None else recipe)
            data = resolved_recipe(rec)
    except UserError as e:
        fail(str(e))
    if is_eval or source is not None:
        files = "tasks" if is_eval else "prompts_file"
        head = (f"# {recipe} as `compiledllm {'eval' if is_eval else 'run'}` reads it, every default written out\n"
                f"# relative paths: {files} from the recipe's folder, model.path and output from the working "
                "directory\n")
    else:
        head = (f"# the recipe `compiledllm run {recipe}` with these options means, every default written out\n"
                "# relative paths: from the working directory\n")
    sys.stdout.write(head + dump_recipe(data))


BENCH_LEGEND = """\
prefill, decode  prompt tokens/s of prefill; generated tokens/s of decode steps
output           generated tokens/s of the whole run (start-up excluded)
1st blk          arrival -> a request's first finished block, median (s)
p50 p90 p99      arrival -> finish of a request (s)
GiB              peak GPU memory (torch.cuda.max_memory_allocated; - on the CPU)
start            compile / CUDA-graph capture before the run (s), in no other
                 column"""
MOE_LEGEND = """
MoE exp          distinct routed experts per MoE layer (mean) in a decode
                 forward of the batch's blocks (out of each layer's experts)"""


def has_moe(report: dict) -> bool:
    return any(r.get("touched_experts") for r in report["points"] if "error" not in r)


def _tps(x: float | None) -> str:
    """A rate in 3 significant digits (at most 5 characters: 0.123, 12.3k, 1.2M)."""
    if x is None:
        return "-"
    return next(t + u for u, d in (("", 1), ("k", 1e3), ("M", 1e6), ("G", 1e9)) if "e" not in (t := f"{x / d:.3g}"))


def _secs(x: float) -> str:
    """Seconds in at most 5 characters."""
    return "0" if x < 5e-4 else f"{x:.0f}" if x >= 100 else f"{x:.3g}" if x >= 1 else f"{x:.3f}"


def bench_table(report: dict) -> Table:
    """One row per point, in 80 columns: numbers right-aligned, one space apart."""
    split = report.get("parallel") or {"tensor": 1, "expert": 1}  # reports from before the key
    ranks, where = split["tensor"] * split["expert"], report["device"]
    if ranks > 1:
        where += f" x {ranks} ranks (tensor {split['tensor']}, expert {split['expert']})"
    table = compact_table(f"{report['model']} · {report['policy_name']} · {where} · rate {report['settings']['rate']}")
    table.padding = (0, 0)
    moe = has_moe(report)  # the column only for a model with routed experts
    for col in ("prompt", "out", "batch", "prefill\ntok/s", "decode\ntok/s", "output\ntok/s", "1st\nblk", "p50",
                "p90", "p99", "GiB", "start", *(("MoE\nexp",) if moe else ())):
        table.add_column(col, justify="right", no_wrap=True)
    for r in report["points"]:
        if "error" in r:
            continue
        experts, mem = r.get("touched_experts"), r["peak_memory_bytes"]
        table.add_row(str(r["prompt_len"]), str(r["output_len"]), str(r["batch"]), _tps(r["prefill_tokens_per_s"]),
                      _tps(r["decode_tokens_per_s"]), _tps(r["output_tokens_per_s"]), _secs(r["first_block_p50_s"]),
                      _secs(r["latency_p50_s"]), _secs(r["latency_p90_s"]), _secs(r["latency_p99_s"]),
                      "-" if mem is None else f"{mem / 2**30:.3g}", _secs(r["startup_s"]),
                      *(("-" if not experts else f"{sum(experts) / len(experts):.0f}",) if moe else ()))
    return table


def stall_table(report: dict) -> Table | None:
    """Per point where decode steps waited for another request's prefill forward: how long (None: none did)."""
    rows = [r for r in report["points"] if "error" not in r and r["stalled_steps"]]
    if not rows:
        return None
    table = compact_table("decode steps that waited for a prefill forward (chunked prefill between steps)")
    for col in ("prompt", "out", "batch", "step ms", "waited", "mean ms", "max ms"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(str(r["prompt_len"]), str(r["output_len"]), str(r["batch"]), f"{r['decode_step_ms']:.1f}",
                      f"{r['stalled_steps']}/{r['decode_steps']}", f"{r['stall_mean_ms']:.1f}",
                      f"{r['stall_max_ms']:.1f}")
    return table


def phase_table(report: dict) -> Table | None:
    """Per point run with `phase_times: true`: each decode phase's runs, device ms a run and share of the decode
    time (None: no point timed its phases)."""
    rows = [r for r in report["points"] if "error" not in r and r.get("phases")]
    if not rows:
        return None
    table = compact_table("decode phases on the device (phase_times: true)")
    for col in ("prompt", "out", "batch", "phase", "runs", "uncaptured", "ms / run", "% of decode"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        for name, p in r["phases"].items():
            table.add_row(str(r["prompt_len"]), str(r["output_len"]), str(r["batch"]), name, str(p["runs"]),
                          str(p["uncaptured"]), f"{1e3 * p['seconds'] / max(p['runs'], 1):.2f}",
                          f"{100 * p['seconds'] / r['decode_s']:.0f}" if r["decode_s"] else "-")
    return table


def compile_lines(report: dict) -> list[str]:
    """Per point of a compiled run: its start-up and what Inductor's cache held for it (none when not compiled)."""
    from compiledllm.compile_cache import CacheReport, describe

    return [f"prompt {r['prompt_len']} · out {r['output_len']} · batch {r['batch']}: start-up "
            f"{r['startup_s']:.2f} s, compiled · {describe(CacheReport(**r['compile_cache']))}"
            for r in report["points"] if "error" not in r and r.get("compile_cache")]


@app.command()
@stoppable  # SIGINT / SIGTERM keep the finished points (bench.BenchInterrupted)
def bench(
    recipe: Path = typer.Argument(..., help="Recipe YAML file (model, policy, batch_size, compile, cuda_graphs, ...; "
                                  "its prompts and output are not used)."),
    prompt_len: Optional[str] = typer.Option(None, "--prompt-len", metavar="N,N", help="Prompt lengths in tokens: "
                                             "seeded random ids that avoid special tokens (default 512)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", metavar="FILE", help="JSONL prompts instead (one "
                                           "{text | ids | messages} a line), cycled to --requests."),
    output_len: Optional[str] = typer.Option(None, "--output-len", metavar="N,N", help="Output lengths in tokens; "
                                             "every request makes exactly this many (default: the recipe's "
                                             "generation.max_new_tokens)."),
    batch: Optional[str] = typer.Option(None, "--batch", metavar="N,max", help="Batch sizes; max: the largest that "
                                        "runs, probed by running it (default: the recipe's batch_size)."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, help="Requests per point (default: the "
                                           "point's batch)."),
    rate: str = typer.Option("inf", "--rate", help="Requests arriving per second, Poisson (seeded); inf: all at "
                             "once."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic prompts and the arrival times."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="JSON", help="Report: settings, device, torch "
                                       "version and every point."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="PNG", help="Output tokens/s and p50 latency "
                                        "against batch size, one line per prompt length."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value (repeatable)."),
    trust_exported: bool = typer.Option(False, "--trust-exported", help=TRUST_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help=THREADS_HELP),
) -> None:
    """Measure RECIPE end to end as served: throughput and latency per (prompt length, output length, batch).

    A legend below the table explains the columns.
    """
    precheck_file(recipe)
    settle_torch_logging()
    from compiledllm.bench import (BenchInterrupted, BenchSettings, all_failed, parse_list, parse_rate, plot_writer,
                                   run_bench)
    from compiledllm.outputs import check_outputs, locked, partial_path, write_files
    from compiledllm.parallel import main_rank
    from compiledllm.signals import finishing

    stopped = False
    try:
        if prompts is not None and prompt_len is not None:
            raise UserError("--prompts and --prompt-len: give one of them")
        if prompts is not None and not prompts.is_file():
            raise UserError(f"--prompts: {prompts} is not a file")
        settings = BenchSettings(
            prompt_lens=parse_list(prompt_len or "512", "--prompt-len"), prompts_file=prompts,
            output_lens=parse_list(output_len, "--output-len") if output_len else None,
            batches=parse_list(batch, "--batch", allow_max=True) if batch else None, requests=requests,
            rate=parse_rate(rate), seed=seed)
        inputs = [recipe, *([prompts] if prompts else [])]
        if plot is not None and not has_matplotlib():  # before the run, not after it
            raise UserError("--plot: needs matplotlib (pip install 'compiledllm[plot]'), or leave --plot out")
        kept = partial_path(out) if out is not None else None  # the points so far, after each one
        files = [(what, path) for what, path in (("--out", out), ("--plot", plot), ("--out partial report", kept))
                 if path is not None]
        check_outputs(files, inputs)
        writes = os.environ.get("RANK", "0") == "0"  # rank 0 of torchrun writes (its mesh is not up yet)
        with locked(files if writes else []):  # a second bench on these files is refused
            with progress(TextColumn("[bold]bench[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn()) as bar:
                task = bar.add_task("loading the model", total=None)

                def point_done(report: dict) -> None:
                    bar.advance(task)
                    if kept is not None and main_rank():  # after every point: a run cut short keeps what it measured
                        write_files([("--out", kept, json.dumps(report, indent=2) + "\n")])

                try:
                    report = run_bench(recipe, with_flags(set_, trust_exported, threads), settings,
                                       on_start=lambda n: bar.update(task, total=n),
                                       on_progress=lambda s: bar.update(task, description=s), on_point=point_done,
                                       on_startup=StartupRow(bar))
                except BenchInterrupted as e:
                    report, stopped = e.report, True
            finishing()  # the report is whole: a stop signal now lets it be written
            if not main_rank():  # the other ranks of a split model ran the same points: rank 0 reports them
                return
            text = json.dumps(report, indent=2) + "\n"
            failed = None if stopped else all_failed(report)
            if stopped and not report["points"]:
                raise KeyboardInterrupt  # nothing to keep: an earlier partial report stays as it was
            if stopped and kept is not None:
                write_files([("--out", kept, text)])  # marked interrupted
            elif not stopped:
                if failed is None:
                    write_files([*([("--out", out, text)] if out else []),
                                 *([("--plot", plot, plot_writer(report))] if plot else [])])
                if kept is not None:
                    kept.unlink(missing_ok=True)  # the report (or the error) replaces what was kept on the way
            if failed is not None:
                raise UserError(f"bench: {failed}; nothing was written")
    except UserError as e:
        fail(str(e))
    except KeyboardInterrupt:  # before the first point finished
        interrupted("no point had finished; nothing was written" + (f" ({out} is unchanged)" if out else ""))
    console.print(bench_table(report))
    for r in report["points"]:
        if "error" in r:
            console.print(f"prompt {r['prompt_len']} · out {r['output_len']} · batch {r['batch_asked']}: "
                          f"{r['error']}", highlight=False, soft_wrap=True)
    for line in compile_lines(report):
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    for table in (stall_table(report), phase_table(report)):
        if table is not None:
            console.print(table)
    console.print(Text(BENCH_LEGEND + (MOE_LEGEND if has_moe(report) else ""), style="dim"))
    if stopped:
        n = len(report["points"])
        points = f"{n} finished point{'s' * (n != 1)}"
        interrupted(f"kept the {points} in {kept}; {out} is unchanged" if kept is not None
                    else f"{points} (above); nothing was written")
    for path, what in ((out, "report"), (plot, "chart")):
        if path is not None:
            console.print(f"{what}: {path}", highlight=False, soft_wrap=True)

@app.command()
def serve(
    recipe: str = typer.Argument(..., metavar="RECIPE_OR_MODEL", help="A recipe YAML file (its model, policy, "
                                 "batch_size and generation settings; its prompts are not used), or a MODEL: a "
                                 "built-in name, a checkpoint directory or a Hugging Face ORG/NAME."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (default: loopback only)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0: any free one, printed)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="COMPILEDLLM_API_KEY",
                                          help="Every request must send 'Authorization: Bearer KEY'."),
    policy: Optional[str] = typer.Option(None, "--policy", metavar="NAME", help=POLICY_HELP),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: key.path=value (repeatable)."),
    max_queue: int = typer.Option(256, "--max-queue", min=1, help="Requests that may wait for a slot (more: 429)."),
    timeout: float = typer.Option(600.0, "--timeout", min=0.001, help="Seconds a request may take (then 408)."),
    name: Optional[str] = typer.Option(None, "--served-model-name", help="The model name clients give "
                                       "(default: the recipe's model name)."),
    trust_exported: bool = typer.Option(False, "--trust-exported", help=TRUST_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help=THREADS_HELP),
) -> None:
    """Serve RECIPE's model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics), with the engine's continuous batching; SIGINT / SIGTERM drain and stop."""
    try:
        from compiledllm.recipe import check_policy, load_recipe

        overrides = with_flags(set_, trust_exported, threads)
        if is_recipe_target(recipe):
            if policy is not None:
                raise UserError(f"--policy {policy}: with a recipe file, set the policy there or with "
                                f"--set policy.name={policy}")
            rec = load_recipe(Path(recipe), overrides, check_policy=False)
        else:
            rec, _ = source_recipe(recipe, overrides, [SERVE_PROMPT], None, policy)
        check_model_path(rec)
        check_policy(rec, recipe)
        from compiledllm.server.launch import bind, build_server, is_loopback, serve as serve_forever

        sock = bind(host, port)
        settle_torch_logging()
        with err_console.status(f"loading {rec.model.name} and capturing its engine"):
            server = build_server(rec, api_key, max_queue, timeout, name)
    except UserError as e:
        fail(str(e))
    if not is_loopback(host) and api_key is None:
        alerts.print(f"warning: serving on {host} without --api-key: anyone who reaches the port can use it",
                     highlight=False, soft_wrap=True)
    cfg = server.config

    def ready(url: str) -> None:
        console.print(f"serving {cfg.name} on {url}/v1 ({cfg.slots} slots of {cfg.capacity} positions, queue "
                      f"{cfg.max_queue}); Ctrl-C or SIGTERM stops after the running requests", highlight=False,
                      soft_wrap=True)
        session = server.worker.session
        line = startup_line(server.engine.compile, session.startup_s, session.compile_cache) if session else None
        if line is not None:
            console.print(line, highlight=False, soft_wrap=True, markup=False)
        sys.stdout.flush()

    serve_forever(server, sock, "debug" if logging.getLogger().level <= logging.DEBUG else "warning", ready)
    console.print("stopped", highlight=False)


SERVE_PROMPT = "served"  # a model target's minimal recipe needs a prompt; the server never decodes it


def main() -> None:
    app()
