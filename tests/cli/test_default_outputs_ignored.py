"""What the shipped recipes and the README's commands write by default is git-ignored: `git status` stays clean
after the quickstart (issue 32 item 6)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from compiledllm.outputs import partial_path, summary_path

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs git and a checkout")


def default_outputs() -> list[str]:
    paths = ["profile/trace.json.gz", "profile/profile.json", "profile/profile.png", "engine/weights.safetensors",
             "bench.json", "bench.png", "bench.partial.json", ".results.jsonl.lock", ".results.jsonl.1234.tmp"]
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        out = yaml.safe_load(recipe.read_text()).get("output")
        if not out:
            continue
        out = Path(out)
        if "tasks" in yaml.safe_load(recipe.read_text()):  # an eval recipe: report, chart, partial report
            paths += [out, out.with_suffix(".png"), partial_path(out)]
        else:  # a run recipe: results, summary, and both kept by Ctrl-C
            paths += [out, summary_path(out), partial_path(out), summary_path(partial_path(out))]
    return [str(p) for p in paths]


def test_default_outputs_are_ignored():
    paths = default_outputs()
    assert "results.summary.json" in paths and "eval_yardstick.json" in paths
    res = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-z"], cwd=ROOT, capture_output=True,
                         input="\0".join(paths).encode())
    ignored = set(res.stdout.decode().split("\0")) - {""}
    assert ignored == set(paths), sorted(set(paths) - ignored)
