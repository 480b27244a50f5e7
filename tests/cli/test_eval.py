"""`compiledllm eval`: quality metrics per policy over task files; same numbers when run twice."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compiledllm.cli import app
from compiledllm.errors import UserError
from compiledllm.evaluate import (agreement_scores, continuation_scores, load_eval_recipe, load_tasks,
                                  quality_numbers, run_eval)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "eval_tiny.yaml"
TASKS = ROOT / "compiledllm" / "assets" / "tasks"


def test_eval_cli_gives_the_same_numbers_twice(tmp_path):
    runner = CliRunner()
    reports = []
    for i in range(2):
        out = tmp_path / f"report{i}.json"
        res = runner.invoke(app, ["eval", str(RECIPE), "--set", "limit=3", "--set", "max_new_tokens=8", "-o", str(out)])
        assert res.exit_code == 0, res.output
        assert "threshold-0.95" in res.output and "t2t" in res.output
        reports.append(json.loads(out.read_text()))
    assert quality_numbers(reports[0]) == quality_numbers(reports[1])
    assert set(reports[0]["files"]) == {"code_short.jsonl", "code_long.jsonl"}
    for entry in reports[0]["files"].values():
        assert entry["tasks"] == 3 and entry["reference"] == "threshold-0.95"
        assert list(entry["policies"]) == ["threshold-0.95", "threshold-0.9", "t2t"]
        ref = entry["policies"]["threshold-0.95"]
        assert ref["agreement"] == 1.0 and ref["agreement_exact"] == 1.0
        for m in entry["policies"].values():
            for key in ("exact_match", "token_accuracy", "agreement", "agreement_exact"):
                assert 0.0 <= m[key] <= 1.0
            assert m["forwards"] > 0 and m["tokens"] > 0 and m["tokens_per_s"] > 0
            assert m["tokens_per_forward"] == pytest.approx(m["tokens"] / m["forwards"])


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


def test_text_tasks_and_reference_by_index(tmp_path):
    file = tmp_path / "t.jsonl"
    file.write_text(json.dumps({"prompt": "def add(a, b):\n    return a", "reference": " + b"}) + "\n\n"
                    + json.dumps({"prompt_ids": [5, 6, 7], "reference_ids": [8, 9]}) + "\n")
    rec = {"model": {"path": "tiny-llada2"}, "tasks": [str(file)], "reference": 1, "output": None, "tokens": "text",
           "policies": [{"name": "threshold", "block_size": 8, "threshold": 0.9}, {"name": "threshold", "block_size": 8}]}
    report = run_eval(rec)
    entry = report["files"]["t.jsonl"]
    assert entry["tasks"] == 2 and entry["reference"] == "threshold(block_size=8)"
    assert entry["policies"]["threshold(block_size=8)"]["agreement"] == 1.0


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
    with pytest.raises(UserError, match="not found"):
        load_tasks(tmp_path / "missing.jsonl")
    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "not found" in res.output
