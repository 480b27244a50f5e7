"""`compiledllm export` (AOTInductor, CPU and CUDA): the exported engine gives the same tokens as the eager one, its
bucket packages share one weights file, its KV capacity is an export option, and a run needing more says so.

Compiling is slow on the CPU: one export (two buckets) per device serves every test here (a module fixture), of a
2-layer LLaDA2 (a dense layer and an MoE layer; the package unrolls every layer, so each costs compile time)."""
from __future__ import annotations

import json
import shutil
import warnings
import zipfile

import pytest
import torch
import yaml
from checkpoints import write_checkpoint, write_tokenizer
from typer.testing import CliRunner
from user_errors import assert_user_error

from compiledllm.cli import app

runner = CliRunner()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="exporting for CUDA needs a CUDA device")
CAPACITY = 40  # --max-seq-len: more than the recipe's generation.max_seq_len, which the option overrides


def write_recipe(path, **changes):
    path.write_text(yaml.safe_dump(changes))
    return path


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def exported(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"export_{request.param}")
    ckpt = write_checkpoint(tmp / "m", "llada2", 3, num_hidden_layers=2)
    write_tokenizer(ckpt)  # the exported engine carries the tokenizer: text prompts still work
    recipe = {"model": {"path": str(ckpt), "device": request.param},
              "policy": {"name": "t2t", "block_size": 4, "threshold": 0.5},
              "generation": {"max_new_tokens": 9, "max_seq_len": 32},
              "prompts": [{"ids": [5, 6, 7]}, {"ids": list(range(10, 19))}, {"text": "the quick brown fox"}],
              "batch_size": 2, "buckets": [1, 2], "output": str(tmp / "eager.jsonl"),
              "compile": False}  # the eager engine the export is held against (auto would compile it on CUDA)
    path = write_recipe(tmp / "r.yaml", **recipe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, each time (not once per place, nor pytest's filters)
        res = runner.invoke(app, ["export", str(path), "--out", str(tmp / "exp"), "--max-seq-len", str(CAPACITY)])
    assert res.exit_code == 0, res.output
    EXPORT_WARNINGS[request.param] = [w for w in caught if issubclass(w.category, FutureWarning)]
    return tmp, path, recipe, res.output


EXPORT_WARNINGS: dict[str, list] = {}  # the FutureWarnings each device's export raised (the fixture fills it)


@pytest.mark.slow
def test_export_raises_no_future_warnings(exported):
    # torch 2.13 warned once per bucket that LeafSpec is deprecated (from its own graph copy): silenced there only
    device = exported[2]["model"]["device"]
    assert not EXPORT_WARNINGS[device], [f"{w.filename}:{w.lineno}: {w.message}" for w in EXPORT_WARNINGS[device]]
    assert "FutureWarning" not in exported[3]


def test_the_leafspec_filter_is_narrow():
    from compiledllm.export.trace import torch_internal_warnings_off

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch_internal_warnings_off():
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
            warnings.warn("something else is deprecated", FutureWarning)
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", UserWarning)
    assert [str(w.message) for w in caught] == ["something else is deprecated",
                                                "`isinstance(treespec, LeafSpec)` is deprecated"]


@pytest.mark.slow
def test_exported_engine_matches_eager(exported):
    tmp, path, _, output = exported
    meta = json.loads((tmp / "exp" / "compiledllm_export.json").read_text())
    assert meta["buckets"] == [1, 2] and meta["capacity"] == CAPACITY and meta["block_size"] == 4
    assert f"KV capacity {CAPACITY} positions (--max-seq-len" in " ".join(output.split())
    same_kv = ["--set", f"generation.max_seq_len={CAPACITY}"]  # tokens are batch invariant for a given capacity
    assert runner.invoke(app, ["run", str(path), *same_kv]).exit_code == 0
    untrusted = runner.invoke(app, ["run", str(path), "--set", f"model.path={tmp / 'exp'}"])
    assert untrusted.exit_code == 2 and "trust" in untrusted.output  # an exported engine runs native code
    res = runner.invoke(app, ["run", str(path), "--set", f"model.path={tmp / 'exp'}", "--trust-exported",
                              "--set", f"output={tmp / 'aoti.jsonl'}"])
    assert res.exit_code == 0, res.output

    def rows(name):
        return {r["index"]: (r["output_ids"], r["steps"], r["text"])
                for r in map(json.loads, (tmp / name).read_text().splitlines())}

    eager, aoti = rows("eager.jsonl"), rows("aoti.jsonl")
    assert eager == aoti and len(eager) == 3
    assert len({tuple(ids) for ids, _, _ in eager.values()}) > 1  # real, varied outputs


@pytest.mark.slow
def test_bench_measures_an_exported_engine(exported):
    """`compiledllm bench --trust-exported` runs an exported engine as it runs the live one (it died counting its
    parameters)."""
    from safetensors.torch import load_file

    tmp, path = exported[0], exported[1]
    out = tmp / "bench_exported.json"
    res = runner.invoke(app, ["bench", str(path), "--set", f"model.path={tmp / 'exp'}", "--trust-exported",
                              "--prompt-len", "8", "--output-len", "8", "--batch", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    weights = load_file(str(tmp / "exp" / json.loads((tmp / "exp" / "compiledllm_export.json").read_text())[
        "weights"]["file"]))
    assert report["parameters"] == sum(t.numel() for t in weights.values()) > 0
    assert report["points"][0]["generated_tokens"] == 16


@pytest.mark.slow
def test_bucket_packages_share_one_weights_file(exported):
    tmp = exported[0]
    exp = tmp / "exp"
    meta = json.loads((exp / "compiledllm_export.json").read_text())
    weights = exp / meta["weights"]["file"]
    packages = sorted(exp.glob("*.pt2"))
    assert [p.name for p in packages] == sorted(meta["files"].values()) and len(packages) == 2
    from safetensors.torch import load_file

    tensors = load_file(str(weights))
    assert set(tensors) == set(meta["weights"]["tensors"])
    assert sum(t.nbytes for t in tensors.values()) <= weights.stat().st_size  # every weight, once
    probe = tensors["model.embed.weight"].flatten()[:16].numpy().tobytes()  # 64 distinctive bytes
    assert weights.read_bytes().count(probe) == 1
    for p in packages:  # no copy of the weights inside any package, compressed or not
        assert probe not in p.read_bytes()
        with zipfile.ZipFile(p) as z:
            assert all(probe not in z.read(n) for n in z.namelist())


@pytest.mark.slow
def test_a_run_longer_than_the_export_says_to_export_again(exported):
    tmp = exported[0]
    long = write_recipe(tmp / "long.yaml", model={"path": str(tmp / "exp"), "trust_exported": True,
                                                  "device": exported[2]["model"]["device"]},
                        policy={"name": "t2t", "block_size": 4, "threshold": 0.5},
                        generation={"max_new_tokens": 9}, prompts=[{"ids": list(range(5, 45))}], batch_size=2)
    res = runner.invoke(app, ["run", str(long), "--set", "output=null"])
    assert_user_error(res, f"KV capacity is {CAPACITY}", "needs 52", "export the recipe again with --max-seq-len 52")


@pytest.mark.slow
def test_weights_that_disagree_with_the_metadata_are_refused_before_running(exported):
    from compiledllm.errors import UserError
    from compiledllm.export import load_exported

    tmp = exported[0]
    bad = tmp / "bad"
    shutil.copytree(tmp / "exp", bad, dirs_exist_ok=True)
    meta = json.loads((bad / "compiledllm_export.json").read_text())
    meta["weights"]["tensors"]["model.norm.weight"]["shape"] = [3]
    (bad / "compiledllm_export.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"model\.norm\.weight is float32 \[\d+\], the metadata says float32 \[3\]"):
        load_exported(bad)
    meta["weights"]["file"] = "../elsewhere.safetensors"
    (bad / "compiledllm_export.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="weights.file .* lies outside the export directory"):
        load_exported(bad)
    meta["format"] = 2
    (bad / "compiledllm_export.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="export format 2, this compiledllm reads 3"):
        load_exported(bad)


def test_export_capacity_shorter_than_the_prompts_is_a_one_line_error(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", model={"path": "tiny-llada2-random"}, prompts=[{"ids": list(range(20))}],
                        policy={"name": "threshold", "block_size": 8}, generation={"max_new_tokens": 4})
    res = runner.invoke(app, ["export", str(path), "--out", str(tmp_path / "x"), "--max-seq-len", "16"])
    assert_user_error(res, "--max-seq-len 16", "(24 positions")
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_export_of_a_split_recipe_is_a_one_line_error(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", model={"path": "tiny-llada2-random"}, prompts=[{"ids": [1, 2]}],
                        generation={"max_new_tokens": 4}, parallel={"tensor": 2})
    res = runner.invoke(app, ["export", str(path), "--out", str(tmp_path / "x")])
    assert_user_error(res, "parallel.tensor=2", "export runs the whole model")


def test_export_tensorrt_missing_is_a_clear_error(tmp_path):
    pytest.importorskip("typer")
    try:
        import torch_tensorrt  # noqa: F401
        pytest.skip("torch_tensorrt is installed here; this test covers machines without it")
    except ImportError:
        pass
    path = write_recipe(tmp_path / "r.yaml", model={"path": "tiny-llada2-random"}, prompts=[{"ids": [1, 2]}],
                        generation={"max_new_tokens": 4})
    res = runner.invoke(app, ["export", str(path), "--out", str(tmp_path / "x"), "--backend", "tensorrt"])
    assert res.exit_code == 2 and "torch_tensorrt" in res.output and "Traceback" not in res.output


def test_an_export_for_cuda_0_serves_a_recipe_asking_for_cuda():
    from compiledllm.export import same_device

    dev = torch.device
    assert same_device(dev("cuda"), dev("cuda:0")) and same_device(dev("cuda:0"), dev("cuda:0"))
    assert not same_device(dev("cuda:1"), dev("cuda:0")) and not same_device(dev("cpu"), dev("cuda:0"))
    assert same_device(dev("cpu"), dev("cpu"))


def test_exports_link_their_static_libraries_privately():
    """The flag that made CUDA packages load on the device (toolchain.py) is on only while exporting."""
    from torch._inductor import cpp_builder

    from compiledllm.export.toolchain import PRIVATE_STATIC_LIBS, private_static_libs

    before = cpp_builder._get_optimization_cflags("g++")
    with private_static_libs() as applies:
        inside = cpp_builder._get_optimization_cflags("g++")
    assert applies and inside == (before[0], [*before[1], PRIVATE_STATIC_LIBS])
    assert cpp_builder._get_optimization_cflags("g++") == before and PRIVATE_STATIC_LIBS not in before[1]


def test_a_loader_crash_in_the_probe_is_a_one_line_error(tmp_path):
    from compiledllm.errors import UserError
    from compiledllm.export import probe_load

    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    with pytest.raises(UserError, match=r"step_b1\.pt2: torch .* crashes \(SIGSEGV\)"):
        probe_load(tmp_path / "step_b1.pt2", crash)
    with pytest.raises(UserError, match=r"does not load: ValueError: bad archive"):
        probe_load(tmp_path / "step_b1.pt2", "raise ValueError('bad archive')")
    probe_load(tmp_path / "step_b1.pt2", "import sys; assert sys.argv[1].endswith('step_b1.pt2')")
