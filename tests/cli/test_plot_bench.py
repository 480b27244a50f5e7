"""tools/bench/plot_bench.py: tokens/s after prefill against batch, one line per bench report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))
import plot_bench  # noqa: E402


def _report(name: str, overrides: list[str]) -> dict:
    pts = [{"prompt_len": 64, "batch": b, "generated_tokens": 100 * b, "wall_s": 3.0, "prefill_s": 1.0, "error": None}
           for b in (1, 4)]
    pts.append({"prompt_len": 64, "batch": 8, "error": "does not fit"})
    pts.append({"prompt_len": 128, "batch": 1, "generated_tokens": 10, "wall_s": 2.0, "prefill_s": 1.0, "error": None})
    return {"policy_name": name, "overrides": overrides, "device": "cpu", "points": pts}


def test_rates_after_prefill_per_prompt_length_and_labels():
    r = _report("herald", ["compile=false", "policy.name=herald", "policy.budget=0.05", "policy.pool=host"])
    assert plot_bench.points(r, 64) == [(1, 50.0), (4, 200.0)]  # failed points left out, other lengths too
    assert plot_bench.points(r, None)[0] == (1, 10.0)
    assert plot_bench.label(r) == "herald pool=host"


def test_writes_a_png(tmp_path):
    paths = []
    for name in ("threshold", "mage"):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(_report(name, [f"policy.name={name}"])))
        paths.append(str(p))
    out = tmp_path / "plot.png"
    subprocess.run([sys.executable, str(ROOT / "tools/bench/plot_bench.py"), *paths, "--prompt-len", "64", "--out",
                    str(out)], check=True, capture_output=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
