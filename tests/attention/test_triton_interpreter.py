"""The Triton kernels' logic on the CPU, through Triton's interpreter (in a subprocess: TRITON_INTERPRET must be
set before the kernels are defined and must not reach the GPU tests). Speed and bf16 are the GPU tests' job."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (the test extra installs it)")

CHECKS = Path(__file__).with_name("triton_interp_checks.py")


@pytest.mark.parametrize("check", ["routed", "routing", "confidence", "attention", "mass", "score", "head",
                                   "qkv"])
def test_kernel_in_interpreter(check):
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(CHECKS), check], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
