"""Configs are bounded before anything is built from them (issue #33 item 3): every size of a checkpoint's
config.json, an inline random config or an export's metadata lies within models/config.py LIMITS, and a model that
fits them must fit in the device's free memory (engine/memory.py check_weights_fit) before any tensor is
allocated. Each case is one line naming the file or key and the value, exit code 2 on the CLI, at once (no memory
grows: a 10^9-layer config used to allocate until the process was killed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import compiledllm
from checkpoints import default_config, write_checkpoint
from compiledllm.errors import UserError
from compiledllm.loader import build_random, load_model
from compiledllm.models.config import LIMITS
from compiledllm.models.presets import SDAR_8B, TINY_LLADA2

ROOT = Path(compiledllm.__file__).resolve().parents[1]
MIB = 1 << 20


def cli(tmp_path: Path, model: dict, *extra: str) -> subprocess.CompletedProcess:
    """`python -m compiledllm run` on a recipe for the model section `model`, in a fresh interpreter (killed after
    120 s); `maxrss` is that child's own peak resident memory in bytes (os.wait4's)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": model, "prompts": [{"ids": [3, 4, 5]}],
                                      "generation": {"max_new_tokens": 4}, "output": None}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400", "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "compiledllm", "run", str(recipe), *extra]
    with open(tmp_path / "stdout", "w+") as out, open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=out, stderr=err)
        watchdog = threading.Timer(120, proc.kill)
        watchdog.start()
        _, status, usage = os.wait4(proc.pid, 0)
        watchdog.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        res = subprocess.CompletedProcess(args, proc.returncode, out.read(), err.read())
    res.maxrss = usage.ru_maxrss * 1024  # KiB on Linux
    return res


def assert_one_line(res: subprocess.CompletedProcess, *needles: str) -> None:
    err = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error:"), err
    for n in needles:
        assert n in err, (n, err)


def random_model(**changes) -> dict:
    return {"init": "random", "config": {**TINY_LLADA2, **changes}}


def test_a_billion_random_layers_fail_at_once(tmp_path):
    """The issue's case: a random model's layers set on the command line."""
    res = cli(tmp_path, random_model(), "--set", "model.config.num_hidden_layers=1000000000")
    assert_one_line(res, "model.config", "num_hidden_layers", "1000000000", f"<= {LIMITS['num_layers']}")
    assert res.maxrss < 4096 * MIB  # the interpreter and torch, no model


def test_a_checkpoint_with_1e15_positions_is_refused(tmp_path):
    ckpt = write_checkpoint(tmp_path / "m", "sdar", 0)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10 ** 15}))
    res = cli(tmp_path, {"path": str(ckpt)})
    assert_one_line(res, str(ckpt / "config.json"), "max_position_embeddings", "1000000000000000")


@pytest.mark.parametrize("key, value, needle", [
    ("num_hidden_layers", 10 ** 9, "num_hidden_layers must be <= 1024"),
    ("num_hidden_layers", 1025, "num_hidden_layers must be <= 1024"),
    ("max_position_embeddings", 10 ** 15, "max_position_embeddings must be <= 16777216"),
    ("vocab_size", (1 << 22) + 1, "vocab_size must be <= 4194304"),
    ("hidden_size", 1 << 20, "hidden_size must be <= 65536"),
    ("intermediate_size", 1 << 30, "intermediate_size must be <= 262144"),
    ("num_attention_heads", 4096, "num_attention_heads must be <= 1024"),
    ("num_key_value_heads", 2048, "num_key_value_heads must be <= 1024"),
    ("head_dim", 10 ** 400, "head_dim must be <= 1024"),  # llada2 multiplies it by a float: no OverflowError
    ("num_experts", 1 << 14, "num_experts must be <= 4096"),
    ("moe_intermediate_size", 1 << 40, "moe_intermediate_size must be <= 262144"),
    ("num_shared_experts", 1 << 20, "num_shared_experts must be <= 4096"),
    ("rope_theta", 10 ** 400, "rope_theta must be a finite number"),
])
def test_random_config_sizes_are_bounded(key, value, needle):
    t0 = time.perf_counter()
    with pytest.raises(UserError) as e:
        build_random({**TINY_LLADA2, key: value})
    assert time.perf_counter() - t0 < 0.5
    assert str(e.value).startswith("model.config: ") and needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("arch, key, value", [
    ("sdar", "num_hidden_layers", 10 ** 9), ("sdar", "head_dim", 4096), ("llada", "n_layers", 10 ** 9),
    ("llada", "max_sequence_length", 10 ** 15), ("llada", "d_model", 1 << 20), ("llada2", "num_experts", 10 ** 9),
])
def test_checkpoint_config_sizes_name_the_file_and_key(tmp_path, arch, key, value):
    ckpt = write_checkpoint(tmp_path / "m", arch, 0)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(UserError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert msg.startswith(f"{ckpt / 'config.json'}: {key} must be <= ") and str(value) in msg, msg


def test_a_model_within_the_limits_must_fit_in_memory():
    """Each size within its limit, the whole too large for any machine: refused before a tensor is allocated (on
    the meta device: the count of bytes, not an allocation)."""
    huge = {**SDAR_8B, "num_hidden_layers": 1024, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
            "vocab_size": 1 << 22, "num_attention_heads": 512, "num_key_value_heads": 8}
    t0 = time.perf_counter()
    with pytest.raises(UserError) as e:
        build_random(huge)
    assert time.perf_counter() - t0 < 30  # 1024 layers built on the meta device
    msg = str(e.value)
    assert msg.startswith("model.config: ") and "parameters as float32 need about" in msg and "GiB on cpu" in msg


def test_the_limits_admit_the_presets():
    for preset in ("llada2.0-mini", "sdar-8b", "sdar-4b", "llada-8b"):
        from compiledllm.loader import parse_model_config
        from compiledllm.models.presets import PRESETS

        parse_model_config(PRESETS[preset], preset)  # real-size shapes parse
    assert default_config("sdar")["num_hidden_layers"] <= LIMITS["num_layers"]
