"""tools/bench/herald_ceilings.py on the CPU: the DRAM read rate, ext/'s scan and gather at a small prefix and the
per-request block costs derived from them (the GPU ceilings come only where CUDA is)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compiledllm.kv import cpu_select

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_select.extension_available(), reason="ext/ is not built (python setup.py build_ext)")
def test_measures_the_host_side_and_derives_a_blocks_costs(tmp_path):
    out = tmp_path / "c.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools/bench/herald_ceilings.py"), "--prefix", "512", "--rows",
                          "1,2", "--dram-gib", "0.125", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rec = json.loads(out.read_text())
    assert rec["dram"]["ext_read_probe_gbs"] > 0 and [r["rows"] for r in rec["ext"]] == [1, 2]
    block = rec["per_request_block"]
    assert block["keys_bytes"] == 18 * 4 * 512 * 128 * 2 and block["selection_kv_bytes"] == 2 * 18 * 4 * 26 * 128 * 2
    assert block["cpu_scan_s"] > 0 and ("pcie_kv_s" in block) == ("gpu" in rec)
    assert "scan" in res.stdout and "per request and block" in res.stdout
