"""`parallel` without a complete torchrun environment (issue #33 item 6): before torch.distributed starts, each
variable its env:// start reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is checked, and what is
missing or wrong is one line naming it, never torch's traceback nor a wait for ranks that never come."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

import compiledllm
from compiledllm.errors import UserError
from compiledllm.parallel import init_mesh
from compiledllm.parallel.group import TORCHRUN_ENV

ROOT = Path(compiledllm.__file__).resolve().parents[1]
FULL = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


@pytest.fixture
def torchrun_env(monkeypatch):
    """Sets the given variables (and unsets the other torchrun ones); torch.distributed must not have started."""
    def set_env(**values: str) -> None:
        for name in TORCHRUN_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    yield set_env
    assert not dist.is_initialized()


def test_the_issue_case_on_the_command_line(tmp_path):
    """parallel.tensor 2 with RANK / WORLD_SIZE but no MASTER_ADDR / MASTER_PORT: one line naming them."""
    recipe = tmp_path / "tp.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": "tiny-llada2"}, "parallel": {"tensor": 2},
                                      "prompts": [{"ids": [3, 4]}], "generation": {"max_new_tokens": 4},
                                      "output": None}))
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env |= {"PYTHONPATH": str(ROOT), "COLUMNS": "400", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    res = subprocess.run([sys.executable, "-m", "compiledllm", "run", str(recipe)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    err = res.stderr.strip()
    assert res.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error: parallel: ") and "MASTER_ADDR, MASTER_PORT are unset" in err, err
    assert "torchrun --nproc-per-node 2" in err, err


@pytest.mark.parametrize("absent", TORCHRUN_ENV)
def test_each_missing_variable_is_named(torchrun_env, absent):
    torchrun_env(**{k: v for k, v in FULL.items() if k != absent})
    with pytest.raises(UserError) as e:
        init_mesh(2)
    msg = str(e.value)
    assert f"the environment variable {absent} is unset" in msg and "\n" not in msg, msg
    assert "env:// start needs RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in msg


def test_outside_torchrun_says_how_to_start(torchrun_env):
    torchrun_env()
    with pytest.raises(UserError, match=r"needs 2 processes; start them with torchrun --nproc-per-node 2"):
        init_mesh(2)


@pytest.mark.parametrize("change, needle", [
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"RANK": "one"}, "RANK='one' is not an integer"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
    ({"MASTER_ADDR": "a..b"}, "MASTER_ADDR='a..b' does not resolve"),  # refused locally: no DNS asked
    ({"RANK": "2"}, "rank 2 of 2 processes: RANK must lie in [0, WORLD_SIZE)"),
    ({"WORLD_SIZE": "4", "RANK": "3"}, "data 1 x tensor 2 x expert 1 = 2 ranks, but 4 processes run"),
])
def test_wrong_values_are_one_line(torchrun_env, change, needle):
    torchrun_env(**(FULL | change))
    with pytest.raises(UserError) as e:
        init_mesh(2)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_explicit_rank_needs_only_the_address(torchrun_env):
    """A given rank and world size stand in for RANK / WORLD_SIZE / LOCAL_RANK; env:// still needs the address."""
    torchrun_env()
    with pytest.raises(UserError) as e:
        init_mesh(2, rank=0, world_size=2)
    assert "MASTER_ADDR, MASTER_PORT are unset" in str(e.value)
    assert "needs MASTER_ADDR, MASTER_PORT;" in str(e.value)
