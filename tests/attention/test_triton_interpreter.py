"""The Triton kernels' logic on the CPU, through Triton's interpreter (in a subprocess: TRITON_INTERPRET must be
set before the kernels are defined and must not reach the GPU tests). Speed and bf16 are the GPU tests' job."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_launches import SM90_SHARED_BYTES, compile_sm90, sm90_unavailable

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (the test extra installs it)")

CHECKS = Path(__file__).with_name("triton_interp_checks.py")


@pytest.mark.parametrize("check", ["routed", "routing", "confidence", "attention", "mass", "score", "head",
                                   "qkv"])
def test_kernel_in_interpreter(check, tmp_path):
    """The check's kernels run by the interpreter, then each of their launches compiled for sm_90 (triton_launches.py:
    compilable for an H100 / H200, within its shared memory)."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root), str(root / "tests"), os.environ.get("PYTHONPATH")]))
    log = tmp_path / "launches.jsonl"
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": path, "TRITON_LAUNCH_LOG": str(log)}
    proc = subprocess.run([sys.executable, str(CHECKS), check], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    if (why := sm90_unavailable()) is not None:
        pytest.skip(f"{check}: the interpreter check passed; its launches cannot be compiled for sm_90 here ({why})")
    shared = compile_sm90(log)
    assert shared, f"{check}: no launch recorded"
    assert all(0 <= b <= SM90_SHARED_BYTES for b in shared.values()), shared
