"""model.path ORG/NAME through huggingface_hub's cache (issue #20): against a cache this file builds, laid out as
huggingface_hub lays it (models--ORG--NAME/blobs, snapshots/<commit>/ links, refs/<branch or tag>), holding the
built-in tiny-llada2's files. The Hub itself is never reached: offline mode, or an HF_ENDPOINT on a closed port."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import pytest
import yaml
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects
from typer.testing import CliRunner

import compiledllm
from compiledllm import hub
from compiledllm.builtin import ASSETS
from compiledllm.cli import app
from compiledllm.loader import checkpoint_dir
from user_errors import assert_user_error

runner = CliRunner()
TINY = ASSETS / "tiny-llada2"
ROOT = Path(compiledllm.__file__).resolve().parents[1]
REPO = "acme/tiny-llada2"
MAIN, OLD = hashlib.sha1(b"main").hexdigest(), hashlib.sha1(b"v1").hexdigest()
PROMPTS = [{"text": "def main("}, {"ids": [3, 4, 5]}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A hub cache holding REPO: commit MAIN (refs/main) with every file of tiny-llada2, and commit OLD (tag v1,
    branch dev) without tokenizer.json, so that which commit was read shows in the output (no text)."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo = root / ("models--" + REPO.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    for commit, names in ((MAIN, ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]),
                          (OLD, ["config.json", "model.safetensors", "tokenizer_config.json"])):
        (repo / "snapshots" / commit).mkdir(parents=True)
        for name in names:
            blob = hashlib.sha256((TINY / name).read_bytes()).hexdigest()
            if not (repo / "blobs" / blob).exists():
                shutil.copyfile(TINY / name, repo / "blobs" / blob)
            (repo / "snapshots" / commit / name).symlink_to(Path("../../blobs") / blob)
    for ref, commit in (("main", MAIN), ("v1", OLD), ("dev", OLD)):
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return root


@pytest.fixture
def offline(monkeypatch, cache) -> Path:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=cache, as huggingface_hub holds them once imported."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path: Path, model: dict, prompts=PROMPTS):
    """`compiledllm run` on a recipe for the model section `model`; the result and its records (stdout)."""
    recipe = {"model": model, "policy": {"name": "threshold", "block_size": 2}, "generation": {"max_new_tokens": 2},
              "prompts": prompts, "batch_size": 2, "output": None}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = runner.invoke(app, ["run", str(path)])
    rows = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    return res, sorted(rows, key=lambda r: r["index"])


def test_offline_hub_name_matches_local_directory(offline, tmp_path):
    res, by_name = run(tmp_path, {"path": REPO})
    assert res.exit_code == 0, res.output
    res, local = run(tmp_path, {"path": str(TINY)})
    assert res.exit_code == 0, res.output
    assert [r["output_ids"] for r in by_name] == [r["output_ids"] for r in local] and len(by_name) == 2
    assert "text" in by_name[0]  # the text prompt was encoded with the snapshot's tokenizer.json


def test_environment_variables_are_honoured(cache, tmp_path):
    """A fresh process reads HF_HOME and HF_HUB_OFFLINE itself (the cache is HF_HOME/hub)."""
    env = {**os.environ, "HF_HOME": str(cache.parent), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
           "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    code = ("import sys; from compiledllm import hub; from compiledllm.errors import UserError\n"
            "print(hub.snapshot(sys.argv[1]))\n"
            "try: hub.snapshot('acme/absent')\nexcept UserError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code, REPO], env=env, capture_output=True, text=True, timeout=120)
    found, missing = out.stdout.splitlines()
    assert Path(found) == cache / "models--acme--tiny-llada2" / "snapshots" / MAIN, out.stderr
    assert "acme/absent" in missing and "HF_HUB_OFFLINE" in missing and str(cache) in missing


@pytest.mark.parametrize("revision, commit", [("v1", OLD), ("dev", OLD), (OLD, OLD), ("main", MAIN)])
def test_revision_by_tag_branch_or_commit(offline, revision, commit):
    assert checkpoint_dir(REPO, revision) == offline / "models--acme--tiny-llada2" / "snapshots" / commit


def test_revision_from_the_recipe(offline, tmp_path):
    res, rows = run(tmp_path, {"path": REPO, "revision": "v1"}, prompts=[{"ids": [3, 4, 5]}])
    assert res.exit_code == 0, res.output
    assert rows and "text" not in rows[0]  # commit OLD has no tokenizer.json; main's would have decoded text


def test_not_in_the_cache_offline(offline, tmp_path):
    res, _ = run(tmp_path, {"path": "acme/absent"})
    assert_user_error(res, "acme/absent", "HF_HUB_OFFLINE", "`hf download acme/absent`", str(offline))
    res, _ = run(tmp_path, {"path": REPO, "revision": "v9"})
    assert_user_error(res, f"{REPO} (revision v9)", "HF_HUB_OFFLINE", f"`hf download {REPO} --revision v9`")


def test_unreachable_hub(monkeypatch, cache, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    start = time.monotonic()
    assert checkpoint_dir(REPO, None).name == MAIN  # a cached snapshot serves while the Hub is down
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    res, _ = run(tmp_path, {"path": REPO})
    assert_user_error(res, REPO, "the Hub cannot be reached", "ConnectError", "HF_ENDPOINT", f"hf download {REPO}")
    assert time.monotonic() - start < 10


def test_only_safetensors_config_and_tokenizer_files_are_fetched(monkeypatch, tmp_path):
    """The patterns snapshot_download is given, applied by huggingface_hub's own filter to a realistic listing."""
    listing = ["config.json", "generation_config.json", "model.safetensors.index.json",
               "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "README.md", ".gitattributes",
               "pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "training_args.bin", "model.pt",
               "consolidated.pth", "last.ckpt", "modeling_llada2_moe.py", "configuration_llada2_moe.py",
               "tokenization.py", "original/model.safetensors", "sub/config.json", "onnx/model.onnx",
               "tf_model.h5", "flax_model.msgpack"]
    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub.snapshot(REPO, "v2") == tmp_path
    (repo_id, kw), = calls
    assert (repo_id, kw["revision"], kw["local_files_only"], kw["cache_dir"]) == (REPO, "v2", False,
                                                                               str(tmp_path / "cache"))
    fetched = set(filter_repo_objects(listing, allow_patterns=kw["allow_patterns"],
                                      ignore_patterns=kw["ignore_patterns"]))
    assert fetched == {"config.json", "generation_config.json", "model.safetensors.index.json",
                       "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json",
                       "tokenizer_config.json", "special_tokens_map.json"}


def never(*args, **kw):
    raise AssertionError("the Hub was consulted")


@pytest.mark.parametrize("name", ["no-such-model", "a/b/c", "acme/bad--name"])
def test_neither_directory_nor_hub_name_keeps_its_hint(monkeypatch, name, tmp_path):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", never)
    res, _ = run(tmp_path, {"path": name})
    assert_user_error(res, name, "not a model directory", "tiny-llada2", "ORG/NAME", hub.EXAMPLE)


def test_local_directory_named_like_a_hub_name_wins(monkeypatch, cache, tmp_path):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", never)
    monkeypatch.chdir(tmp_path)
    (tmp_path / REPO).mkdir(parents=True)  # REPO is also in the cache: the empty local one must still win
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert checkpoint_dir(REPO, None) == Path(REPO)
    res, _ = run(tmp_path, {"path": REPO})
    assert_user_error(res, f"{REPO}/config.json", "not found")
    res, _ = run(tmp_path, {"path": REPO, "revision": "main"})
    assert_user_error(res, "model.revision", REPO, "a local path, not a Hugging Face model name")
    res, _ = run(tmp_path, {"path": "tiny-llada2", "revision": "main"})
    assert_user_error(res, "model.revision", "tiny-llada2", "a built-in model, not a Hugging Face model name")


@pytest.mark.parametrize("model, needle", [({"path": REPO, "revision": 3}, "model.revision"),
                                           ({"path": REPO, "revision": " "}, "model.revision"),
                                           ({"init": "random", "config": "tiny-random-llada2", "revision": "v1"},
                                            "path/revision are for init: checkpoint")])
def test_bad_revision_values(model, needle, tmp_path):
    res, _ = run(tmp_path, model)
    assert_user_error(res, needle)


def test_missing_huggingface_hub_is_one_line(monkeypatch, tmp_path):
    for module in ("huggingface_hub", "huggingface_hub.errors", "huggingface_hub.utils"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    res, _ = run(tmp_path, {"path": REPO})
    assert_user_error(res, REPO, "pip install huggingface_hub")
