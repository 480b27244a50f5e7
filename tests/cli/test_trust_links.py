"""What a checkpoint or an exported engine is trusted with (issue #33 item 5, and the exported engine's overrides).

A weight file linked outside the checkpoint directory loads only when it resolves to a blob of a real Hugging Face
cache: ROOT/models--ORG--NAME/blobs/FILE where ROOT is the cache huggingface_hub uses (HF_HUB_CACHE), or the cache
the checkpoint is itself a snapshot of (that repository's blobs only). A folder merely named like one is refused.
An exported engine refuses a dtype it was not exported as (its packages are compiled for one) with one line naming
model.dtype, and takes MASK / EOS overrides (the engine uses them, not the packages), checked like a checkpoint's."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import constants
from safetensors.torch import save_file

import compiledllm
from checkpoints import write_checkpoint
from compiledllm.errors import UserError
from compiledllm.export import runtime
from compiledllm.export.runtime import EXPORT_FILE, FORMAT

ROOT = Path(compiledllm.__file__).resolve().parents[1]
REPO = "models--acme--tiny"


def cli(tmp_path: Path, model: dict, env: dict | None = None, *extra: str) -> subprocess.CompletedProcess:
    """`python -m compiledllm run` of three ids with the model section `model`, in a fresh interpreter."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": model, "prompts": [{"ids": [3, 4, 5]}], "batch_size": 1,
                                      "policy": {"name": "threshold", "block_size": 4},
                                      "generation": {"max_new_tokens": 4}, "output": None}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "compiledllm", "run", str(recipe), *extra], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_one_line(res: subprocess.CompletedProcess, *needles: str) -> None:
    err = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error:"), err
    for n in needles:
        assert n in err, (n, err)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "m", "sdar", 0)


def linked_checkpoint(tmp_path: Path, source: Path, blobs: Path) -> Path:
    """A checkpoint folder whose config.json is its own and whose model.safetensors links to a blob (named by its
    hash, as the Hub cache names them) in `blobs`."""
    data = (source / "model.safetensors").read_bytes()
    blob = blobs / hashlib.sha256(data).hexdigest()
    blobs.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copyfile(source / "config.json", ckpt / "config.json")
    (ckpt / "model.safetensors").symlink_to(blob)
    return ckpt


def test_a_look_alike_cache_folder_is_refused(tmp_path, source):
    """The issue's case: the link's target folder has a cache's name, but is not huggingface_hub's cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    ckpt = linked_checkpoint(tmp_path, source, tmp_path / "elsewhere" / REPO / "blobs")
    res = cli(tmp_path, {"path": str(ckpt)}, {"HF_HUB_CACHE": str(cache)})
    assert_one_line(res, str(ckpt), "model.safetensors", "lies outside the checkpoint directory")


def test_a_blob_of_the_cache_in_use_is_followed(tmp_path, source):
    """A `--local-dir`-style folder linking into HF_HUB_CACHE's blobs: loads and runs."""
    cache = tmp_path / "cache"
    ckpt = linked_checkpoint(tmp_path, source, cache / REPO / "blobs")
    res = cli(tmp_path, {"path": str(ckpt)}, {"HF_HUB_CACHE": str(cache)})
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("where", ["look_alike", "too_deep", "not_blobs", "cache_root"])
def test_only_the_cache_layout_counts(tmp_path, source, monkeypatch, where):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    blobs = {"look_alike": tmp_path / "x" / REPO / "blobs", "too_deep": cache / "sub" / REPO / "blobs",
             "not_blobs": cache / REPO / "snapshots", "cache_root": cache}[where]
    ckpt = linked_checkpoint(tmp_path, source, blobs)
    with pytest.raises(UserError, match="'model.safetensors' lies outside the checkpoint directory"):
        compiledllm.load_model(ckpt)


def test_the_cache_in_use_through_a_linked_root(tmp_path, source, monkeypatch):
    """HF_HUB_CACHE may itself be a link: paths are compared resolved."""
    real = tmp_path / "real_cache"
    ckpt = linked_checkpoint(tmp_path, source, real / REPO / "blobs")
    (tmp_path / "cache").symlink_to(real)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    assert compiledllm.load_model(ckpt).config.vocab_size == 96


def test_a_snapshot_follows_its_own_repository_blobs_only(tmp_path, source, monkeypatch):
    """A snapshot of a cache other than HF_HUB_CACHE (a --cache-dir download): its own repository's blobs load, a
    link into another repository's blobs of that folder does not."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "default_cache"))
    other = tmp_path / "other_cache"
    data = (source / "model.safetensors").read_bytes()
    for repo in (REPO, "models--acme--else"):
        (other / repo / "blobs").mkdir(parents=True)
        (other / repo / "blobs" / "b").write_bytes(data)
    snap = other / REPO / "snapshots" / "0123"
    snap.mkdir(parents=True)
    shutil.copyfile(source / "config.json", snap / "config.json")
    (snap / "model.safetensors").symlink_to("../../blobs/b")
    assert compiledllm.load_model(snap).config.vocab_size == 96
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(other / "models--acme--else" / "blobs" / "b")
    with pytest.raises(UserError, match="lies outside the checkpoint directory"):
        compiledllm.load_model(snap)


# ---- an exported engine: what it cannot change is refused, what it can is taken ----------------------------

@pytest.fixture(scope="module")
def export_meta(source) -> dict:
    config = dataclasses.asdict(compiledllm.load_model(source).config)
    return {"format": FORMAT, "torch": torch.__version__, "config": config, "dtype": "bfloat16", "device": "cpu",
            "block_size": 4, "capacity": 32, "buckets": [1], "files": {"1": "step_b1.pt2"},
            "weights": {"file": "weights.safetensors", "tensors": {"w": {"dtype": "bfloat16", "shape": [2]}}}}


def fake_export(tmp_path: Path, meta: dict) -> Path:
    """An export's metadata and files (no real package: every case here ends before one would load)."""
    out = tmp_path / "exp"
    out.mkdir()
    (out / "step_b1.pt2").write_bytes(b"PK not a package")
    save_file({"w": torch.zeros(2, dtype=torch.bfloat16)}, str(out / "weights.safetensors"))
    (out / EXPORT_FILE).write_text(json.dumps(meta))
    return out


class Loaded:
    """Stands in for ExportedModel (whose packages take a minute to export on the CPU): what load_model gives."""

    def __init__(self, path: Path, meta: runtime.ExportMeta):
        self.config, self.dtype = meta.config, meta.dtype


def test_a_dtype_the_export_was_not_made_for_is_one_line(tmp_path, export_meta):
    export = fake_export(tmp_path, export_meta)
    res = cli(tmp_path, {"path": str(export), "trust_exported": True}, None, "--set", "model.dtype=float16")
    assert_one_line(res, "model.dtype: float16", "exported as bfloat16", "set model.dtype: bfloat16")


def test_exported_engine_overrides(tmp_path, export_meta, monkeypatch):
    monkeypatch.setattr(runtime, "ExportedModel", Loaded)
    export = fake_export(tmp_path, export_meta)
    load = dict(trust_exported=True)
    assert compiledllm.load_model(export, **load).dtype == torch.bfloat16  # no dtype given: the export's
    assert compiledllm.load_model(export, dtype="bfloat16", **load).dtype == torch.bfloat16
    with pytest.raises(UserError, match=r"^model\.dtype: float32, but the exported engine .* exported as bfloat16"):
        compiledllm.load_model(export, dtype=torch.float32, **load)
    mask, eos = export_meta["config"]["mask_token_id"], export_meta["config"]["eos_token_id"]
    model = compiledllm.load_model(export, mask_token_id=5, **load)
    assert (model.config.mask_token_id, model.config.eos_token_id) == (5, eos)
    model = compiledllm.load_model(export, eos_token_id=7, **load)
    assert (model.config.mask_token_id, model.config.eos_token_id) == (mask, 7)
    with pytest.raises(UserError, match="mask_token_id 500 is outside the vocabulary"):
        compiledllm.load_model(export, mask_token_id=500, **load)
    with pytest.raises(UserError, match=f"mask_token_id and eos_token_id are both {eos}"):
        compiledllm.load_model(export, mask_token_id=eos, **load)
