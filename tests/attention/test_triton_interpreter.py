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


@pytest.mark.parametrize("user", [None, "0"])
def test_fp_fusion_pinned_on_unless_the_user_set_it(user):
    """Importing compiledllm keeps Triton's FMA contraction on (the kernels' measured numerics), with no warning from
    Triton 3.9 that the default is unset; a user's own TRITON_DEFAULT_FP_FUSION stays."""
    code = ("import os, warnings\n"
            "import compiledllm\n"
            "from triton import knobs\n"
            "print(os.environ['TRITON_DEFAULT_FP_FUSION'])\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    ask = getattr(knobs.language, 'fp_fusion_enabled', None)  # Triton >= 3.9\n"
            "    on = ask(None) if ask else None\n"
            "print(on, sum('FP_FUSION' in str(w.message) for w in seen))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if user is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = user
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    value, knob = proc.stdout.split("\n")[:2]
    assert value == (user or "1")
    on, warned = knob.split()
    assert warned == "0" and on in ({"None", "True"} if user is None else {"None", "False"})
