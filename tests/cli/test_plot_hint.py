"""Without matplotlib: the install hint keeps its extra's name (rich read `[plot]` as markup), and `bench --plot`
fails before the run, not after it."""
from __future__ import annotations

import sys

from typer.testing import CliRunner

from compiledllm.cli import app

runner = CliRunner()


def test_bench_plot_without_matplotlib_fails_before_running(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "recipes/quickstart.yaml", "--prompt-len", "8", "--output-len", "4",
                              "--out", str(out), "--plot", str(tmp_path / "bench.png")])
    assert res.exit_code == 2
    assert "needs matplotlib (pip install 'compiledllm[plot]')" in " ".join(res.output.split())
    assert not out.exists()  # nothing ran: no report written
