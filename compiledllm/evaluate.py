"""Quality evaluation: decode task files with several policies and measure what each one costs.

A task file is JSONL, one task a line: the prompt (`prompt_ids`, or `prompt` text) and the reference
continuation (`reference_ids`, or `reference` text), optionally an `id` and a `metric` ("exact", the only one:
the generated tokens are compared with the reference's, position by position); other keys (e.g. `meta`) are
ignored. Token ids take precedence (they are the exact token boundary of the original text; re-encoding
prompt and reference separately can split a token differently, which load_tasks warns about); an eval recipe with
`tokens: text` encodes the text fields instead where a task has them (for models with another tokenizer). Text is
encoded with the model's tokenizer, without special tokens.

Per policy and task file it reports:
  exact_match      share of tasks whose first len(reference) generated tokens equal the reference
  token_accuracy   share of reference tokens matched position by position (micro average)
  prefix_tokens    mean length of the matching prefix, in tokens
  agreement        share of generated positions equal to the reference policy's output (micro average)
  agreement_exact  share of tasks whose output equals the reference policy's output
  forwards, tokens, tokens_per_forward, wall_s, tokens_per_s (prefill forwards are not counted), blocks
and for the T2T policies (t2t, flowblock, flowblock_sync; policies/edits.py EditRecord), where an edit rewrites an
already generated token and each edited position is judged by its draft (the first token written there) and its
final token against the reference (positions inside both the output and the reference):
  edits            rewrites made (a position rewritten twice counts twice; the whole working length)
  edit_blocks      decoded blocks in which at least one edit happened; edit_block_share: of `blocks`
  edited_tokens    edited positions judged
  edit_fixes       draft wrong, final right; edit_fix_share: of edited_tokens (None when nothing was judged)
  edit_breaks      draft right, final wrong; edit_break_share: of edited_tokens
The reference policy is the exact decode the others are compared with: the first policy unless `reference`
names another (by label or index).

Lengths: `max_new_tokens: auto` (the default; `null` means the same) decodes each task file for as many new tokens
as its longest reference has, so no reference is cut short. A number applies to every file; a reference longer
than it can never match exactly, so such a file gets one warning (how many of its references are longer, the
longest, and the max_new_tokens that fits them) and its report entry records the same under `longer_references`
({"count", "longest", "max_new_tokens", "fits"}; count 0 when none is longer) and `warnings`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from compiledllm.errors import UserError
from compiledllm.recipe import (CompileMode, ModelSpec, Text, TokenId, first_error, load_validated, parse_json,
                                read_text)
from compiledllm.signals import shielded, signal_name
from compiledllm.threads import set_threads

TIMING_KEYS = ("wall_s", "tokens_per_s")  # the only metrics that vary from run to run
EDIT_KEYS = ("edits", "edit_blocks", "edit_offsets", "edit_drafts")  # EditRecord.edit_report's
log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # no bool for a number, no float for an int


class EvalRecipe(_Strict):
    model: ModelSpec = Field(default={}, validate_default=True)  # required: {} fails, saying what to give
    tasks: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)  # JSONL task files (relative to the recipe)
    policies: list[dict[str, Any]] = Field(min_length=1)        # policy params, plus an optional `label`
    reference: int | str | None = None                          # label or index of the reference policy
    # "auto" (or null): per task file, its longest reference; a number: every file (longer references: a warning)
    max_new_tokens: Any = "auto"
    ignore_eos: bool = False  # decode max_new_tokens for every task (room for multi-block policies to show themselves)
    batch_size: int = Field(default=16, ge=1)
    limit: int | None = Field(default=None, ge=1)               # first N tasks of each file
    tokens: Literal["ids", "text"] = "ids"
    compile: CompileMode = "auto"                               # auto and false: not compiled (eval_compile); true
    cuda_graphs: bool = True                                    # on CUDA: capture the step per batch bucket
    save_outputs: bool = False                                  # include every generated token list in the JSON
    output: str | None = Field(default="eval_results.json", min_length=1)
    threads: int | None = Field(default=None, ge=1)              # torch's CPU threads (default: threads.py)
    base_dir: str = Field(default=".", exclude=True)

    @field_validator("max_new_tokens")
    @classmethod
    def _lengths(cls, v):
        if v is None or v == "auto" or (type(v) is int and v >= 1):
            return v
        raise ValueError("a number of tokens >= 1, or auto (each task file's longest reference)")

    @model_validator(mode="after")
    def _check(self):
        labels = policy_labels(self.policies)  # validates every policy's parameters
        reference_index(self.reference, labels)
        return self

    def resolve(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p


class _TaskLine(BaseModel):
    """One line of a task file as written; other keys (e.g. `meta`) are the file's own."""
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)
    id: str | int | None = None
    prompt: Text | None = None
    reference: Text | None = None
    prompt_ids: list[TokenId] | None = None
    reference_ids: list[TokenId] | None = None
    metric: Literal["exact"] = "exact"


@dataclass(frozen=True)
class Task:
    id: str
    prompt_ids: list[int]
    reference_ids: list[int]


def policy_labels(policies: list[dict]) -> list[str]:
    """A unique label per policy: its `label`, else name(param=value, ...) of the parameters given."""
    from compiledllm.policies import policy_config

    labels = []
    for i, p in enumerate(policies):
        if "label" in p and not (isinstance(p["label"], str) and p["label"]):
            raise UserError(f"policies[{i}].label: a non-empty string (got {p['label']!r})")
        params = {k: v for k, v in p.items() if k != "label"}
        try:
            policy_config(params)
        except UserError as e:
            raise UserError(f"policies[{i}]: {e}") from None
        label = p.get("label") or "{}({})".format(
            params.get("name"), ",".join(f"{k}={v}" for k, v in params.items() if k != "name"))
        labels.append(str(label))
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise UserError(f"policies: duplicate label {dup[0]!r} (give each policy a distinct `label`)")
    return labels


def reference_index(reference: int | str | None, labels: list[str]) -> int:
    if reference is None:
        return 0
    if isinstance(reference, int):
        if not 0 <= reference < len(labels):
            raise UserError(f"reference: index {reference} is outside [0, {len(labels)})")
        return reference
    if reference not in labels:
        raise UserError(f"reference: {reference!r} is not a policy label ({', '.join(labels)})")
    return labels.index(reference)


def load_tasks(file: Path, tokenizer=None, tokens: str = "ids", limit: int | None = None) -> list[Task]:
    tasks, split, lines = [], 0, {}
    for n, line in enumerate(read_text(file, "task file").split("\n"), 1):  # JSON strings may hold U+2028
        if not line.strip():
            continue
        if limit is not None and len(tasks) >= limit:
            break
        raw = parse_json(line, f"{file}:{n}")
        if not isinstance(raw, dict):
            raise UserError(f"{file}:{n}: a task is a JSON object")
        try:
            rec = _TaskLine.model_validate(raw)
        except ValidationError as e:
            raise UserError(f"{file}:{n}: {first_error(e)}") from None
        ids, encoded = {}, 0
        for key in ("prompt", "reference"):
            given, text = getattr(rec, f"{key}_ids"), getattr(rec, key)
            if given is not None and (tokens == "ids" or text is None):
                ids[key] = given
            elif text is not None:
                if tokenizer is None:
                    raise UserError(f"{file}:{n}: {key} is text but the model has no tokenizer.json")
                ids[key] = tokenizer.encode(text)
                encoded += 1
            else:
                raise UserError(f"{file}:{n}: needs {key} (text) or {key}_ids")
        if not ids["prompt"] or not ids["reference"]:
            raise UserError(f"{file}:{n}: empty prompt or reference")
        if encoded == 2:
            split += tokenizer.encode(rec.prompt + rec.reference) != ids["prompt"] + ids["reference"]
        task_id = f"{file.stem}/{n}" if rec.id is None else str(rec.id)
        if task_id in lines:  # the report's outputs and any later comparison go by id
            raise UserError(f"{file}:{n}: id {task_id!r} is also the id of line {lines[task_id]}; give each task "
                            "its own id")
        lines[task_id] = n
        tasks.append(Task(task_id, ids["prompt"], ids["reference"]))
    if not tasks:
        raise UserError(f"{file}: task file holds no tasks")
    if split:  # the model reads the joined text's tokens: a reference split otherwise is hard to match
        log.warning("%s: %d of %d text tasks tokenize differently joined (prompt + reference) than apart, so the "
                    "model may not be able to produce the reference's ids: end the prompt where a token ends, or give "
                    "prompt_ids / reference_ids", file, split, len(tasks))
    return tasks


def longer_references(tasks: list[Task], max_new_tokens: int | str | None) -> dict:
    """How many references are longer (in tokens) than `max_new_tokens` (a number; "auto" / None: the longest
    reference, so none), the longest, and the max_new_tokens that fits them all."""
    longest = max(len(t.reference_ids) for t in tasks)
    n_new = longest if max_new_tokens in (None, "auto") else max_new_tokens
    return {"count": sum(len(t.reference_ids) > n_new for t in tasks), "longest": longest, "max_new_tokens": n_new,
            "fits": longest}


def longer_references_warning(name: str, info: dict, total: int) -> str | None:
    if not info["count"]:
        return None
    return (f"{name}: {info['count']} of {total} references are longer than max_new_tokens={info['max_new_tokens']} "
            f"(the longest: {info['longest']} tokens) and cannot match exactly; max_new_tokens={info['fits']} "
            "(or max_new_tokens: auto) fits them all")


def continuation_scores(outputs: list[list[int]], references: list[list[int]]) -> dict:
    correct = total = exact = prefix = 0
    for out, ref in zip(outputs, references):
        head = out[: len(ref)]
        match = [a == b for a, b in zip(head, ref)]
        correct += sum(match)
        total += len(ref)
        exact += head == ref
        prefix += next((i for i, m in enumerate(match) if not m), len(match))
    n = max(len(references), 1)
    return {"exact_match": exact / n, "token_accuracy": correct / max(total, 1), "prefix_tokens": prefix / n}


def agreement_scores(outputs: list[list[int]], reference_outputs: list[list[int]]) -> dict:
    same = total = exact = 0
    for out, ref in zip(outputs, reference_outputs):
        total += max(len(out), len(ref))
        same += sum(a == b for a, b in zip(out, ref))
        exact += out == ref
    return {"agreement": same / max(total, 1), "agreement_exact": exact / max(len(outputs), 1)}


def edit_scores(outputs: list[list[int]], references: list[list[int]], records: list[dict]) -> dict:
    """Edits judged against the reference: records are EditRecord.edit_report's, one per task (edits,
    edit_blocks, edit_offsets and their edit_drafts, offsets counted from the prompt's end)."""
    judged = fixes = breaks = 0
    for out, ref, rec in zip(outputs, references, records):
        for off, draft in zip(rec["edit_offsets"], rec["edit_drafts"]):
            if off >= min(len(out), len(ref)):
                continue  # past the output (EOS, max_new_tokens) or the reference: nothing to judge it by
            judged += 1
            fixes += draft != ref[off] and out[off] == ref[off]
            breaks += draft == ref[off] and out[off] != ref[off]
    share = lambda k: k / judged if judged else None  # noqa: E731
    return {"edits": sum(r["edits"] for r in records), "edit_blocks": sum(r["edit_blocks"] for r in records),
            "edited_tokens": judged, "edit_fixes": fixes, "edit_breaks": breaks, "edit_fix_share": share(fixes),
            "edit_break_share": share(breaks)}


class EvalInterrupted(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM: signals.py) during an evaluation: `report` holds every policy that finished
    (marked "interrupted", with the signal)."""

    def __init__(self, report: dict):
        super().__init__()
        self.report = report


def _stopped() -> dict:
    return {"interrupted": True, "signal": signal_name()}


def evaluate(model, tasks: list[Task], policies: list[dict], *, max_new_tokens: int | None = None,
             batch_size: int = 16, reference: int | str | None = None, compile: bool | str = False,
             cuda_graphs: bool = True, ignore_eos: bool = False, on_policy: Callable[[str], None] | None = None,
             on_result: Callable[[object], None] | None = None) -> dict:
    """Decode every task with every policy. Returns {"tasks", "max_new_tokens", "reference", "policies":
    {label: metrics}, "outputs": {label: [generated ids per task]}} (policies in the order given); on Ctrl-C raises
    EvalInterrupted with the policies that finished (the reference decodes first, so their agreement is known)."""
    labels = policy_labels(policies)
    ref_i = reference_index(reference, labels)
    n_new = longer_references(tasks, max_new_tokens)["max_new_tokens"]
    outputs: dict[str, list[list[int]]] = {}
    metrics: dict[str, dict] = {}
    order = [ref_i] + [i for i in range(len(policies)) if i != ref_i]  # the reference decodes first
    try:
        for i in order:
            _evaluate_policy(model, tasks, policies[i], labels[i], n_new, batch_size, compile, cuda_graphs,
                             ignore_eos, outputs, metrics, on_policy, on_result)
    except KeyboardInterrupt:
        raise EvalInterrupted(_report(tasks, n_new, labels, ref_i, outputs, metrics) | _stopped()) from None
    return _report(tasks, n_new, labels, ref_i, outputs, metrics)


def _report(tasks, n_new, labels, ref_i, outputs, metrics) -> dict:
    done = [lb for lb in labels if lb in metrics]
    for label in done:
        metrics[label] |= agreement_scores(outputs[label], outputs[labels[ref_i]])
    return {"tasks": len(tasks), "max_new_tokens": n_new, "reference": labels[ref_i],
            "policies": {lb: metrics[lb] for lb in done}, "outputs": {lb: outputs[lb] for lb in done}}


def _evaluate_policy(model, tasks, policy, label, n_new, batch_size, compile, cuda_graphs, ignore_eos, outputs,
                     metrics, on_policy, on_result) -> None:
    """One policy over the tasks: its outputs and metrics (agreement is added once the reference is known)."""
    from compiledllm.engine import Engine, EngineConfig
    from compiledllm.policies import record_edits
    from compiledllm.policies.edits import EditRecord

    prompts = [t.prompt_ids for t in tasks]
    refs = [t.reference_ids for t in tasks]
    if on_policy is not None:
        on_policy(label)
    params = {k: v for k, v in policy.items() if k != "label"}
    params = record_edits(params, n_new)  # T2T policies: drafts at the positions scored, the first n_new generated
    engine = Engine(model, EngineConfig(params, max_new_tokens=n_new, batch_size=batch_size, compile=compile,
                                        cuda_graphs=cuda_graphs, ignore_eos=ignore_eos))
    tracked = isinstance(engine.policy, EditRecord)
    t0 = time.perf_counter()
    results = engine.generate(prompts, on_result=on_result)
    if model.device.type == "cuda":
        import torch

        torch.cuda.synchronize(model.device)
    wall = time.perf_counter() - t0 - engine.startup_s  # compile / graph capture is not decoding time
    outs = [r.output_ids for r in results]
    tokens, forwards = sum(len(o) for o in outs), sum(r.steps for r in results)
    blocks = sum(r.blocks for r in results)
    m = {**continuation_scores(outs, refs), "forwards": forwards, "tokens": tokens,
         "tokens_per_forward": tokens / max(forwards, 1), "wall_s": wall, "tokens_per_s": tokens / max(wall, 1e-9),
         "blocks": blocks}
    extras = [dict(r.extra) for r in results]
    if tracked:
        m |= edit_scores(outs, refs, [{k: e.pop(k) for k in EDIT_KEYS} for e in extras])
        m["edit_block_share"] = m["edit_blocks"] / max(blocks, 1)
    stats = [e for e in extras if e]
    if stats:  # the policy's own statistics (Policy.report), summed over the tasks
        m["policy_stats"] = {k: sum(s[k] for s in stats) for k in stats[0]}
    with shielded():  # a stop signal waits: the policy run is in the report whole, or not at all
        outputs[label], metrics[label] = outs, m
    log.info("%s: %d tasks, %d tokens in %d forwards, %.2f s", label, len(tasks), tokens, forwards, wall)


def load_eval_recipe(source: str | Path | dict | EvalRecipe, overrides: list[str] | None = None) -> EvalRecipe:
    return load_validated(EvalRecipe, source, overrides, kind="eval recipe")


def run_eval(recipe: str | Path | dict | EvalRecipe, overrides: list[str] | None = None,
             on_progress: Callable[[str], None] | None = None, model=None,
             on_start: Callable[[int], None] | None = None, on_result: Callable[[object], None] | None = None
             ) -> dict:
    """Run an eval recipe: load the model, evaluate every task file. Returns the report (JSON-ready); writes nothing.
    Every task file is read (and checked) before the first decode; on_start gets the number of task decodes
    (tasks x policies), on_result is called as each ends. On Ctrl-C raises EvalInterrupted with the report of what
    finished. A loaded `model` may be passed to skip loading."""
    from compiledllm.runner import load_from_spec

    rec = load_eval_recipe(recipe, overrides)
    m = rec.model
    threads = set_threads(rec.threads)
    t0 = time.perf_counter()
    if model is None:
        model = load_from_spec(m)
    compiled = eval_compile(rec.compile)
    report = {"model": m.name, "device": str(model.device), "dtype": m.dtype, "batch_size": rec.batch_size,
              "compile": compiled, "threads": threads, "load_s": time.perf_counter() - t0, "files": {}}
    log.info("model %s on %s ready in %.2f s", m.name, model.device, report["load_s"])
    files = [(path, rec.resolve(path)) for path in rec.tasks]
    loaded = [load_tasks(file, model.tokenizer, rec.tokens, rec.limit) for _, file in files]
    lengths = {}
    for (_, file), tasks in zip(files, loaded):  # before the first decode: once per task file
        info = longer_references(tasks, rec.max_new_tokens)
        msg = longer_references_warning(file.name, info, len(tasks))
        if msg:
            log.warning("%s", msg)
        lengths[file.name] = {"longer_references": info, **({"warnings": [msg]} if msg else {})}
    if on_start is not None:
        on_start(sum(len(tasks) for tasks in loaded) * len(rec.policies))
    for (path, file), tasks in zip(files, loaded):
        try:
            res = evaluate(model, tasks, rec.policies, max_new_tokens=rec.max_new_tokens, batch_size=rec.batch_size,
                           reference=rec.reference, compile=compiled, cuda_graphs=rec.cuda_graphs,
                           ignore_eos=rec.ignore_eos, on_policy=None if on_progress is None else (lambda lb, f=file: on_progress(f"{f.name}: {lb}")),
                           on_result=on_result)
        except EvalInterrupted as e:
            report["files"][file.name] = _entry(path, e.report, rec.save_outputs) | lengths[file.name]
            raise EvalInterrupted(report | _stopped()) from None
        report["files"][file.name] = _entry(path, res, rec.save_outputs) | lengths[file.name]
    return report


def eval_compile(mode: bool | str) -> bool:
    """An eval recipe's `compile`: only true compiles (auto does not, unlike a run's). An eval opens one session per
    (policy, task file), and each compiles its own (phase, bucket) steps: ~3 s a piece cold on an H100, so
    eval_flash.yaml's 16 sessions (365 pieces) would spend ~18 minutes starting, where the whole eval on captured
    eager steps took 35 s (2026-12-06)."""
    return mode is True


def _entry(path: str, res: dict, save_outputs: bool) -> dict:
    entry = {"path": str(path), **{k: v for k, v in res.items() if k != "outputs"}}
    if save_outputs:
        entry["outputs"] = res["outputs"]
    return entry


def resolved_eval_recipe(recipe: EvalRecipe) -> dict:
    """The eval recipe as `load_eval_recipe` sees it: every default written out, each policy's too, with its label
    (the label of the parameters as given, so that it stays the same) and the reference by label."""
    from compiledllm.recipe import resolved_policy

    labels = policy_labels(recipe.policies)
    data = recipe.model_dump(mode="json")
    data["policies"] = [{"label": lb, **resolved_policy({k: v for k, v in p.items() if k != "label"})}
                        for lb, p in zip(labels, recipe.policies)]
    data["reference"] = labels[reference_index(recipe.reference, labels)]
    return data


def quality_numbers(report: dict) -> dict:
    """The report without timings: what must be identical when the same eval runs twice."""
    return {name: {label: {k: v for k, v in met.items() if k not in TIMING_KEYS}
                   for label, met in f["policies"].items()} for name, f in report["files"].items()}


def write_chart(report: dict, path: Path) -> Path | None:
    """The chart (chart_writer) at `path`, written whole or not at all; None when there is none to draw."""
    from compiledllm.outputs import write_files

    draw = chart_writer(report)
    if draw is None:
        return None
    write_files([("eval chart", path, draw)])
    return path


def chart_writer(report: dict) -> Callable[[Path], None] | None:
    """What writes the chart as a PNG at the path it is given: bars of each policy's exact match (left axis) beside
    its tokens per forward (right axis), values on the bars, and each policy's agreement with the reference policy
    as a marker on the left axis (where the references are out of the model's reach, exact match is 0 everywhere
    and agreement is what tells the policies apart); one panel per task file. None when matplotlib is missing or no
    policy finished."""
    files = {name: f for name, f in report["files"].items() if f["policies"]}
    if not files:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return lambda path: _draw_chart(plt, report["model"], report["device"], files, path)


def _draw_chart(plt, model: str, device: str, files: dict, path: Path) -> None:
    most = max(len(f["policies"]) for f in files.values())
    fig, axes = plt.subplots(len(files), 1, figsize=(max(6.0, 1.3 * most + 2), 3.6 * len(files)), squeeze=False)
    try:
        for ax, (name, f) in zip(axes[:, 0], files.items()):
            labels = list(f["policies"])
            x = range(len(labels))
            em = ax.bar([i - 0.2 for i in x], [f["policies"][lb]["exact_match"] for lb in labels], 0.4,
                        color="#4477aa", label="exact match")
            ax.bar_label(em, fmt="%.2f", padding=2, fontsize=8)
            ax.set_ylim(0, 1.3)  # headroom: the legend sits above the bars
            ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
            ax.set_ylabel("exact match", color="#4477aa")
            handles = [em]
            if all("agreement" in f["policies"][lb] for lb in labels):
                handles += ax.plot([i - 0.2 for i in x], [f["policies"][lb]["agreement"] for lb in labels], "D",
                                   color="black", markersize=5,
                                   label=f"agreement with {f.get('reference', 'the reference')}")
                ax.set_ylabel("exact match, agreement", color="#4477aa")
            right = ax.twinx()
            tpf = [f["policies"][lb]["tokens_per_forward"] for lb in labels]
            bars = right.bar([i + 0.2 for i in x], tpf, 0.4, color="#cc6677", label="tokens per forward")
            right.bar_label(bars, fmt="%.2f", padding=2, fontsize=8)
            right.set_ylim(0, max(tpf) * 1.3 or 1)
            right.set_ylabel("tokens per forward", color="#cc6677")
            tilt = max(map(len, labels)) > 12  # long labels slant so that they do not overlap
            ax.set_xticks(list(x), labels, rotation=20 if tilt else 0, ha="right" if tilt else "center", fontsize=8)
            ax.set_title(f"{name} · {f['tasks']} tasks · {f['max_new_tokens']} new tokens", fontsize=9)
            ax.legend(handles=handles + [bars], loc="upper left", fontsize=7, frameon=False)
        fig.suptitle(f"{model} on {device}: quality vs tokens per forward", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=120, format="png")  # the path is a temporary: no suffix to go by
    finally:
        plt.close(fig)


__all__ = ["EvalInterrupted", "EvalRecipe", "Task", "evaluate", "run_eval", "load_eval_recipe", "load_tasks", "quality_numbers",
           "longer_references",
           "continuation_scores", "agreement_scores", "edit_scores", "resolved_eval_recipe", "write_chart",
           "chart_writer"]
