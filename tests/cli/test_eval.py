"""`compiledllm eval`: quality metrics per policy over task files; same numbers when run twice."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compiledllm.cli import app
from compiledllm.errors import UserError
from compiledllm.evaluate import (agreement_scores, continuation_scores, edit_scores, load_eval_recipe, load_tasks,
                                  quality_numbers, run_eval)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "eval_tiny.yaml"
TASKS = ROOT / "compiledllm" / "assets" / "tasks"


def test_eval_cli_gives_the_same_numbers_twice(tmp_path):
    # the shipped recipe once over both files (the long one's 1,900-token prompts dominate the cost), then its short
    # file twice more: the second and third runs must give the first run's numbers for that file
    runner = CliRunner()
    reports = []
    short = ["--set", f"tasks=[{TASKS / 'code_short.jsonl'}]"]
    for i, extra in enumerate([["--set", "limit=1"], [*short, "--set", "limit=1"], [*short, "--set", "limit=1"]]):
        out = tmp_path / f"report{i}.json"
        res = runner.invoke(app, ["eval", str(RECIPE), "--set", "max_new_tokens=8", *extra, "-o", str(out)])
        assert res.exit_code == 0, res.output
        assert "threshold-0.95" in res.output and "t2t" in res.output
        reports.append(json.loads(out.read_text()))
    first_short = {"code_short.jsonl": quality_numbers(reports[0])["code_short.jsonl"]}
    assert quality_numbers(reports[1]) == quality_numbers(reports[2]) == first_short
    assert set(reports[0]["files"]) == {"code_short.jsonl", "code_long.jsonl"}
    for entry in reports[0]["files"].values():
        assert entry["tasks"] == 1 and entry["reference"] == "threshold-0.95"
        assert list(entry["policies"]) == ["threshold-0.95", "threshold-0.9", "t2t"]
        ref = entry["policies"]["threshold-0.95"]
        assert ref["agreement"] == 1.0 and ref["agreement_exact"] == 1.0
        for m in entry["policies"].values():
            for key in ("exact_match", "token_accuracy", "agreement", "agreement_exact"):
                assert 0.0 <= m[key] <= 1.0
            assert m["forwards"] > 0 and m["tokens"] > 0 and m["tokens_per_s"] > 0
            assert m["tokens_per_forward"] == pytest.approx(m["tokens"] / m["forwards"])


def test_eval_compiles_only_when_asked():
    """An eval's `compile: auto` does not compile (one session per policy and task file, each compiling its own
    steps, took minutes to start on an H100 where the captured eager eval took 35 s); `true` does."""
    from compiledllm.evaluate import eval_compile

    assert eval_compile("auto") is False and eval_compile(False) is False and eval_compile(True) is True


def test_task_files_shipped():
    for name, lo in (("code_short.jsonl", 0), ("code_long.jsonl", 1500)):
        lines = (TASKS / name).read_text().splitlines()
        assert 50 <= len(lines) <= 100
        for line in lines:
            t = json.loads(line)
            assert t["prompt_ids"] and 2 <= len(t["reference_ids"]) <= 16 and len(t["prompt_ids"]) >= lo
            assert t["prompt"] and t["reference"] and t["id"].startswith(name.split(".")[0])
        if name == "code_long.jsonl":
            assert all(json.loads(x)["meta"]["definition_distance"] >= 1000 for x in lines)


def test_metrics_by_hand():
    outs = [[1, 2, 3, 9], [5, 6], [7, 8, 9]]
    refs = [[1, 2, 3], [5, 7], [1, 8]]
    s = continuation_scores(outs, refs)
    assert s["exact_match"] == pytest.approx(1 / 3)
    assert s["token_accuracy"] == pytest.approx(5 / 7)  # 3 + 1 + 1 of 7 reference tokens
    assert s["prefix_tokens"] == pytest.approx((3 + 1 + 0) / 3)
    a = agreement_scores([[1, 2, 3], [4]], [[1, 2, 4], [4, 5]])
    assert a["agreement"] == pytest.approx(3 / 5) and a["agreement_exact"] == 0.0


def test_edit_scores_by_hand():
    outs = [[1, 2, 3, 4], [5, 4]]
    refs = [[1, 9, 3], [5, 6, 7]]
    records = [{"edits": 5, "edit_blocks": 2, "edit_offsets": [0, 1, 2, 3], "edit_drafts": [7, 2, 3, 8]},
               {"edits": 1, "edit_blocks": 1, "edit_offsets": [1, 5], "edit_drafts": [6, 6]}]
    # task 0: offset 0 fixed (7 -> 1), 1 wrong -> wrong, 2 right -> right (edited away and back), 3 past the
    # reference; task 1: offset 1 broken (6 -> 4), 5 past the output
    s = edit_scores(outs, refs, records)
    assert s == {"edits": 6, "edit_blocks": 3, "edited_tokens": 4, "edit_fixes": 1, "edit_breaks": 1,
                 "edit_fix_share": 0.25, "edit_break_share": 0.25}
    none = edit_scores([[1]], [[1]], [{"edits": 0, "edit_blocks": 0, "edit_offsets": [], "edit_drafts": []}])
    assert none["edited_tokens"] == 0 and none["edit_fix_share"] is None and none["edit_break_share"] is None


def test_text_tasks_and_reference_by_index(tmp_path):
    file = tmp_path / "t.jsonl"
    file.write_text(json.dumps({"prompt": "def add(a, b):\n    return a", "reference": " + b", "metric": "exact"})
                    + "\n\n"
                    + json.dumps({"prompt_ids": [5, 6, 7], "reference_ids": [8, 9]}) + "\n")
    rec = {"model": {"path": "tiny-llada2"}, "tasks": [str(file)], "reference": 1, "output": None, "tokens": "text",
           "policies": [{"name": "threshold", "block_size": 8, "threshold": 0.9}, {"name": "threshold", "block_size": 8}]}
    report = run_eval(rec)
    entry = report["files"]["t.jsonl"]
    assert entry["tasks"] == 2 and entry["reference"] == "threshold(block_size=8)"
    assert entry["policies"]["threshold(block_size=8)"]["agreement"] == 1.0


def test_text_tasks_split_inside_a_token_are_flagged(tmp_path, caplog, monkeypatch):
    from compiledllm.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(ROOT / "compiledllm" / "assets" / "tiny-llada2")
    file = tmp_path / "split.jsonl"
    file.write_text(json.dumps({"prompt": "def ad", "reference": "d(a, b)"}) + "\n"  # "add" cut in two
                    + json.dumps({"prompt": "def add(a, b):\n    return a", "reference": " + b"}) + "\n")
    monkeypatch.setattr(logging.getLogger("compiledllm"), "propagate", True)  # the CLI tests turn it off
    with caplog.at_level("WARNING", logger="compiledllm.evaluate"):
        tasks = load_tasks(file, tok)
    assert [t.reference_ids for t in tasks] == [tok.encode("d(a, b)"), tok.encode(" + b")]
    # one warning (distinct messages: after some other tests in the same process a record is captured twice)
    messages = {r.getMessage() for r in caplog.records}
    assert len(messages) == 1 and "1 of 2 text tasks" in caplog.text


@pytest.mark.parametrize("change, message", [
    ({"policies": [{"name": "nope"}]}, "policies[0]"),
    ({"policies": [{"name": "t2t"}, {"name": "t2t"}]}, "duplicate label"),
    ({"reference": "missing"}, "reference"),
    ({"reference": 5}, "reference"),
    ({"tasks": []}, "tasks"),
    ({"batch_size": 0}, "batch_size"),
])
def test_bad_eval_recipes(change, message):
    base = {"model": {"path": "tiny-llada2-random"}, "tasks": ["x.jsonl"], "policies": [{"name": "threshold"}]}
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_eval_recipe({**base, **change})


def test_bad_task_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1]}\n')
    with pytest.raises(UserError, match="reference"):
        load_tasks(bad)
    bad.write_text("{not json\n")
    with pytest.raises(UserError, match="malformed"):
        load_tasks(bad)
    bad.write_text('{"prompt_ids": [1], "reference_ids": [2], "metric": "bleu"}\n')
    with pytest.raises(UserError, match="bad.jsonl:1: metric"):
        load_tasks(bad)
    with pytest.raises(UserError, match="not found"):
        load_tasks(tmp_path / "missing.jsonl")
    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "not found" in res.output


# ---- the CLI around a decode: progress, legend, 80 columns, quiet, Ctrl-C, recipe show -------------------

def small_eval(tmp_path: Path, **change) -> Path:
    """Two short tasks, two policies, four new tokens on the random built-in: seconds, not minutes."""
    import yaml

    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"prompt_ids": [5 + i, 6, 7, 8], "reference_ids": [9, 10, 11]}) + "\n"
                             for i in range(2)))
    recipe = {"model": {"path": "tiny-llada2-random"}, "tasks": [tasks.name], "max_new_tokens": 4,
              "policies": [{"label": "threshold-0.95", "name": "threshold", "block_size": 4, "threshold": 0.95},
                           {"label": "t2t", "name": "t2t", "block_size": 4}],
              "output": str(tmp_path / "report.json"), **change}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_eval_progress_legend_and_80_columns(tmp_path, monkeypatch):
    from rich.progress import Progress, TimeRemainingColumn

    import compiledllm.cli as cli

    seen = {"totals": [], "advanced": 0, "descriptions": [], "columns": []}

    class Recording(Progress):
        def __init__(self, *columns, **kw):
            seen["columns"] += [type(c) for c in columns]
            super().__init__(*columns, **kw)

        def update(self, task_id, *, total=None, description=None, **kw):
            if total is not None:
                seen["totals"].append(total)
            if description is not None:
                seen["descriptions"].append(description)
            super().update(task_id, total=total, description=description, **kw)

        def advance(self, task_id, advance=1):
            seen["advanced"] += advance
            super().advance(task_id, advance)

    monkeypatch.setattr(cli, "Progress", Recording)
    monkeypatch.setattr(cli, "LineProgress", Recording)  # CliRunner's stderr is no terminal
    res = CliRunner().invoke(app, ["eval", str(small_eval(tmp_path))])
    assert res.exit_code == 0, res.output
    assert TimeRemainingColumn in seen["columns"]
    assert seen["totals"] == [4] and seen["advanced"] == 4  # 2 tasks x 2 policies
    assert seen["descriptions"] == ["t.jsonl: threshold-0.95", "t.jsonl: t2t"]
    lines = res.stdout.splitlines()
    assert "…" not in res.stdout and max(map(len, lines)) <= 80, res.stdout  # CliRunner's console: 80 columns
    for word in ("policy", "EM", "tok", "acc", "prefix", "agree", "forwards", "fwd", "tok/s", "threshold-0.95"):
        assert word in res.stdout, word
    for column in ("EM ", "tok acc ", "prefix ", "agree ", "agree EM ", "forwards ", "tok/fwd ", "tok/s ",
                   "edits ", "judged ", "fixed ", "broke ", "blocks ", "edited "):
        assert any(line.startswith(column) for line in lines), (column, res.stdout)  # the legend
    assert "t.jsonl · T2T edits" in res.stdout
    assert "wrote" in res.stdout and f"chart: {tmp_path / 'report.png'}" in res.stdout
    policies = json.loads((tmp_path / "report.json").read_text())["files"]["t.jsonl"]["policies"]
    assert "edits" not in policies["threshold-0.95"]  # threshold never edits: no edit figures
    t2t = policies["t2t"]
    assert t2t["blocks"] > 0 and 0 <= t2t["edit_blocks"] <= t2t["blocks"] and t2t["edited_tokens"] <= t2t["edits"]
    assert t2t["edit_block_share"] == pytest.approx(t2t["edit_blocks"] / t2t["blocks"])
    assert t2t["edit_fixes"] + t2t["edit_breaks"] <= t2t["edited_tokens"]
    assert "policy_stats" not in t2t  # the per-task edit records are scored, not summed
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "report.png").shape[2] in (3, 4)  # decodes as an image


def test_chart_marks_agreement_with_the_reference(tmp_path, monkeypatch):
    """Each policy's agreement with the reference policy is drawn (left axis) where the report has it: on tasks
    beyond the model, exact match is 0 for every policy and agreement is what tells them apart."""
    import matplotlib.figure

    from compiledllm.evaluate import write_chart

    seen = {}

    def record(fig, path, **kw):
        ax = fig.axes[0]
        seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        seen["points"] = [list(line.get_ydata()) for line in ax.get_lines()]
        Path(path).write_bytes(b"png")  # write_files renames the temporary into place

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    pol = lambda agree: {"exact_match": 0.0, "tokens_per_forward": 1.0, "agreement": agree}  # noqa: E731
    report = {"model": "m", "device": "cpu", "files": {"t.jsonl": {
        "tasks": 2, "max_new_tokens": 8, "reference": "t2t", "policies": {"t2t": pol(1.0), "fb": pol(0.25)}}}}
    write_chart(report, tmp_path / "a.png")
    assert "agreement with t2t" in seen["legend"] and seen["points"] == [[1.0, 0.25]]
    del report["files"]["t.jsonl"]["policies"]["fb"]["agreement"]  # a partial report: no markers, no error
    write_chart(report, tmp_path / "b.png")
    assert "agreement with t2t" not in seen["legend"] and seen["points"] == []


def test_eval_table_fits_80_columns():
    from rich.console import Console

    from compiledllm.cli import EDIT_LEGEND, EVAL_LEGEND, edit_table, eval_table

    m = {"exact_match": 1.0, "token_accuracy": 0.875, "prefix_tokens": 12.34, "agreement": 0.999,
         "agreement_exact": 0.5, "forwards": 123456, "tokens_per_forward": 12.34, "tokens_per_s": 12345.6}
    entry = {"tasks": 100, "max_new_tokens": 256, "reference": "threshold-0.95",
             "policies": {"threshold-0.95": m, "flowblock-w2-s0.6": m, "t2t": m}}
    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(eval_table("code_short.jsonl", entry))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    for word in ("policy", "EM", "tok", "acc", "prefix", "agree", "forwards", "fwd", "tok/s", "threshold-0.95",
                 "flowblock-w2-s0.6", "123456", "12345.6", "0.875", "12.34"):
        assert word in text, (word, text)
    assert max(map(len, EVAL_LEGEND.splitlines())) <= 80
    edits = {"edits": 123456, "edited_tokens": 12345, "edit_fix_share": 0.875, "edit_break_share": None,
             "blocks": 123456, "edit_block_share": 0.05}
    entry["policies"] = {"threshold-0.95": m, "flowblock-w2-s0.6": m | edits, "t2t": m | edits}
    console.print(edit_table("code_short.jsonl", entry))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    assert "threshold-0.95" not in text.split("T2T edits")[1]  # only the policies that edit
    for word in ("flowblock-w2-s0.6", "123456", "12345", "0.875", "0.050", " -"):
        assert word in text, (word, text)
    assert max(map(len, EDIT_LEGEND.splitlines())) <= 80


def test_eval_quiet_writes_the_report_and_logs_at_info(tmp_path):
    res = CliRunner().invoke(app, ["-q", "--log-level", "info", "eval", str(small_eval(tmp_path))])
    assert res.exit_code == 0, res.output
    assert res.stdout == "", res.stdout  # no tables, no legend, no "wrote"
    logged = res.output.splitlines()
    assert logged and all(line.startswith("INFO compiledllm.evaluate: ") for line in logged), res.output
    assert any("t2t: 2 tasks" in line for line in logged)
    assert list(json.loads((tmp_path / "report.json").read_text())["files"]["t.jsonl"]["policies"]) == [
        "threshold-0.95", "t2t"]


def test_eval_ctrl_c_keeps_a_partial_report(tmp_path, monkeypatch):
    from compiledllm.engine import Engine

    generate, calls = Engine.generate, []

    def interrupted_after_the_first_policy(self, prompts, on_result=None):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return generate(self, prompts, on_result=on_result)

    monkeypatch.setattr(Engine, "generate", interrupted_after_the_first_policy)
    recipe = small_eval(tmp_path)
    (tmp_path / "report.json").write_text("earlier report\n")
    res = CliRunner().invoke(app, ["eval", str(recipe)])
    assert res.exit_code == 130, res.output
    assert (tmp_path / "report.json").read_text() == "earlier report\n"
    partial = json.loads((tmp_path / "report.partial.json").read_text())
    assert partial["interrupted"] is True
    assert list(partial["files"]["t.jsonl"]["policies"]) == ["threshold-0.95"]
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "report.partial.json" in lines[0] and "unchanged" in lines[0], res.output

    calls.clear()  # no output: the tables of what finished, nothing written
    res = CliRunner().invoke(app, ["eval", str(recipe), "--set", "output=null"])
    assert res.exit_code == 130, res.output
    assert "threshold-0.95" in res.stdout and "agree EM" in res.stdout and "t2t" not in res.stdout
    assert "interrupted" in res.output and "nothing was written" in res.output


def test_recipe_show_eval_round_trips(tmp_path):
    from compiledllm.evaluate import resolved_eval_recipe

    res = CliRunner().invoke(app, ["recipe", "show", str(RECIPE), "--set", "limit=2"])
    assert res.exit_code == 0, res.output
    shown = RECIPE.parent / f".shown-{tmp_path.name}.yaml"  # beside the recipe: its task paths are relative
    try:
        shown.write_text(res.stdout)
        again = load_eval_recipe(shown)
    finally:
        shown.unlink()
    given = load_eval_recipe(RECIPE, ["limit=2"])
    assert resolved_eval_recipe(again) == resolved_eval_recipe(given)
    data = resolved_eval_recipe(again)
    assert [p["label"] for p in data["policies"]] == ["threshold-0.95", "threshold-0.9", "t2t"]
    assert data["policies"][2] == {"label": "t2t", "name": "t2t", "block_size": 32, "temperature": 0.0,
                                   "top_k": None, "top_p": None, "seed": 0, "threshold": 0.7,
                                   "edit_threshold": 0.5, "max_post_steps": 16}
    assert data["limit"] == 2 and data["batch_size"] == 16 and data["save_outputs"] is False


def test_recipe_show_keeps_derived_labels(tmp_path):
    rec = small_eval(tmp_path, policies=[{"name": "threshold", "block_size": 4}, {"name": "t2t"}], reference=1)
    res = CliRunner().invoke(app, ["recipe", "show", str(rec)])
    assert res.exit_code == 0, res.output
    (tmp_path / "shown.yaml").write_text(res.stdout)
    again = load_eval_recipe(tmp_path / "shown.yaml")
    assert [p["label"] for p in again.policies] == ["threshold(block_size=4)", "t2t()"]
    assert again.reference == "t2t()"


# ---- lengths: a reference longer than max_new_tokens is a warning; `auto` fits each file ------------------

def two_lengths(tmp_path: Path, **change) -> Path:
    """small_eval with one 3-token and one 6-token reference."""
    path = small_eval(tmp_path, **change)
    (tmp_path / "t.jsonl").write_text(
        json.dumps({"prompt_ids": [5, 6, 7, 8], "reference_ids": [9, 10, 11]}) + "\n"
        + json.dumps({"prompt_ids": [6, 6, 7, 8], "reference_ids": [9, 10, 11, 12, 13, 14]}) + "\n")
    return path


def test_longer_references_by_hand():
    from compiledllm.evaluate import Task, longer_references

    tasks = [Task("a", [1], [2] * 3), Task("b", [1], [2] * 6), Task("c", [1], [2] * 5)]
    assert longer_references(tasks, 4) == {"count": 2, "longest": 6, "max_new_tokens": 4, "fits": 6}
    assert longer_references(tasks, 6)["count"] == 0
    for auto in ("auto", None):
        assert longer_references(tasks, auto) == {"count": 0, "longest": 6, "max_new_tokens": 6, "fits": 6}


def test_references_longer_than_max_new_tokens_warn_once_and_are_recorded(tmp_path):
    res = CliRunner().invoke(app, ["eval", str(two_lengths(tmp_path))])  # max_new_tokens: 4
    assert res.exit_code == 0, res.output
    warned = [ln for ln in res.output.splitlines() if "longer than max_new_tokens" in ln]
    assert len(warned) == 1, res.output  # once per task file, not per policy
    assert "t.jsonl: 1 of 2 references" in warned[0] and "max_new_tokens=4" in warned[0]
    assert "6 tokens" in warned[0] and "max_new_tokens=6" in warned[0], warned[0]
    entry = json.loads((tmp_path / "report.json").read_text())["files"]["t.jsonl"]
    assert entry["max_new_tokens"] == 4
    assert entry["longer_references"] == {"count": 1, "longest": 6, "max_new_tokens": 4, "fits": 6}
    assert len(entry["warnings"]) == 1 and "1 of 2 references" in entry["warnings"][0]


def test_max_new_tokens_auto_fits_each_task_file(tmp_path):
    res = CliRunner().invoke(app, ["eval", str(two_lengths(tmp_path, max_new_tokens="auto"))])
    assert res.exit_code == 0, res.output
    assert "longer than max_new_tokens" not in res.output
    entry = json.loads((tmp_path / "report.json").read_text())["files"]["t.jsonl"]
    assert entry["max_new_tokens"] == 6 and entry["longer_references"]["count"] == 0 and "warnings" not in entry
    assert "6 new tokens" in res.stdout


@pytest.mark.parametrize("value", [0, -1, "forever", 2.5, True])
def test_bad_max_new_tokens(value):
    base = {"model": {"path": "tiny-llada2-random"}, "tasks": ["x.jsonl"], "policies": [{"name": "threshold"}]}
    with pytest.raises(UserError, match="max_new_tokens: a number of tokens >= 1, or auto"):
        load_eval_recipe({**base, "max_new_tokens": value})
    assert load_eval_recipe(base).max_new_tokens == "auto"  # the default


def test_eval_yardstick_recipe_loads():
    from compiledllm.evaluate import resolved_eval_recipe

    path = ROOT / "recipes" / "eval_yardstick.yaml"
    for model in ("tiny-llada2.1", "tiny-llada"):
        rec = load_eval_recipe(path, [f"model.path={model}"])
        assert rec.model.name == model and rec.max_new_tokens == "auto"
        assert all(rec.resolve(t).is_file() for t in rec.tasks)
        data = resolved_eval_recipe(rec)
        assert [p["label"] for p in data["policies"]] == ["threshold-0.95", "threshold-0.9", "t2t"]
        assert data["reference"] == "threshold-0.95"
    res = CliRunner().invoke(app, ["recipe", "show", str(path)])
    assert res.exit_code == 0, res.output
    assert "max_new_tokens: auto" in res.stdout


def test_ignore_eos_decodes_every_task_to_max_new_tokens(tmp_path):
    """tiny-llada2.1 ends a list with EOS; with ignore_eos every output runs to max_new_tokens (room for a window)."""
    base = {"model": {"path": "tiny-llada2.1", "dtype": "float32", "device": "cpu"},
            "tasks": [str(TASKS / "lists.jsonl")], "policies": [{"label": "t", "name": "threshold", "block_size": 32}],
            "max_new_tokens": 64, "limit": 2, "output": str(tmp_path / "r.json")}
    tokens = {}
    for ignore in (False, True):
        report = run_eval(base | {"ignore_eos": ignore})
        tokens[ignore] = report["files"]["lists.jsonl"]["policies"]["t"]["tokens"]
    assert tokens[True] == 2 * 64 and tokens[False] < 2 * 64
