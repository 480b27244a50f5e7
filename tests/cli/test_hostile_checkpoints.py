"""Checkpoints, exported engines and chat templates are hostile input (issue #17): each case below ends in a
one-line UserError naming the file, key or value - through the CLI exit code 2, one line, no traceback - never a
traceback, a hang, an abort or silent acceptance."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import compiledllm
from checkpoints import EOS_ID, MASK_ID, write_checkpoint, write_tokenizer
from compiledllm import tokenizer as tokenizer_module
from compiledllm.cli import app
from compiledllm.errors import UserError
from compiledllm.export.runtime import EXPORT_FILE, FORMAT
from compiledllm.loader import parse_device
from compiledllm.tokenizer import TextTokenizer
from user_errors import assert_user_error

runner = CliRunner()
MESSAGES = [{"messages": [{"role": "user", "content": "the fox"}]}]


def run(tmp_path: Path, model, prompts=({"ids": [3, 4, 5]},)):
    """`compiledllm run` on a recipe for `model` (a checkpoint directory, or a model section)."""
    recipe = {"model": model if isinstance(model, dict) else {"path": str(model)},
              "policy": {"name": "threshold", "block_size": 4}, "generation": {"max_new_tokens": 4},
              "prompts": list(prompts), "batch_size": 1, "output": str(tmp_path / "out.jsonl")}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return runner.invoke(app, ["run", str(path)])


def checkpoint(tmp_path: Path, arch: str = "sdar", tokenizer: bool = False, **kw) -> Path:
    ckpt = write_checkpoint(tmp_path / "m", arch, 0, **kw)
    if tokenizer:
        write_tokenizer(ckpt)
    return ckpt


def edit_json(file: Path, **changes) -> None:
    data = json.loads(file.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    file.write_text(json.dumps(data))


def sparse(file: Path, size: int) -> None:
    """A file of `size` bytes (zeros) that takes no disk space."""
    file.unlink(missing_ok=True)
    with file.open("wb") as f:
        f.truncate(size)


# ---- 1. size limits, and files that are not regular files -------------------------------------------------

@pytest.mark.parametrize("name,size", [("config.json", 17 << 20), ("tokenizer.json", 65 << 20),
                                       ("tokenizer_config.json", 17 << 20), ("model.safetensors.index.json", 17 << 20)])
def test_oversized_files_fail_fast_naming_file_and_limit(tmp_path, name, size):
    ckpt = checkpoint(tmp_path, tokenizer=True, sharded=name.startswith("model."))
    sparse(ckpt / name, size)
    limit = "64 MiB" if name == "tokenizer.json" else "16 MiB"
    assert_user_error(run(tmp_path, ckpt), name, limit)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_endless_device_file(tmp_path, name):
    ckpt = checkpoint(tmp_path, tokenizer=True)
    (ckpt / name).unlink()
    os.symlink("/dev/zero", ckpt / name)
    assert_user_error(run(tmp_path, ckpt), name, "character device", "MiB")


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_not_a_regular_file(tmp_path, kind):
    ckpt = checkpoint(tmp_path, tokenizer=True)
    (ckpt / "tokenizer_config.json").unlink()
    (ckpt / "tokenizer_config.json").mkdir() if kind == "directory" else os.mkfifo(ckpt / "tokenizer_config.json")
    # a FIFO with no writer would block a plain open() forever
    assert_user_error(run(tmp_path, ckpt), "tokenizer_config.json", "directory" if kind == "directory" else "FIFO")


def test_json_nested_too_deeply(tmp_path):
    ckpt = checkpoint(tmp_path)
    (ckpt / "config.json").write_text("[" * 200_000)
    assert_user_error(run(tmp_path, ckpt), "config.json", "nested too deeply")


# ---- 2. shard files named by the index ----------------------------------------------------------------------

def _first_shard(ckpt: Path, name) -> None:
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    old = next(iter(data["weight_map"].values()))
    data["weight_map"] = {k: (name if v == old else v) for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))


@pytest.mark.parametrize("entry", ["dotdot", "absolute", "symlink"])
def test_shards_outside_the_checkpoint_are_refused(tmp_path, entry):
    ckpt = checkpoint(tmp_path, sharded=True)
    outside = tmp_path / "outside.safetensors"
    save_file({"model.norm.weight": torch.ones(32)}, str(outside))
    name = {"dotdot": "../outside.safetensors", "absolute": str(outside), "symlink": "link.safetensors"}[entry]
    if entry == "symlink":
        os.symlink(outside, ckpt / name)
    _first_shard(ckpt, name)
    assert_user_error(run(tmp_path, ckpt), "model.safetensors.index.json", name, "outside the checkpoint")


@pytest.mark.parametrize("weight_map,needle", [(["model.norm.weight"], "weight_map must be"),
                                              ({"a": 3}, "weight_map['a']")])
def test_malformed_weight_map(tmp_path, weight_map, needle):
    ckpt = checkpoint(tmp_path, sharded=True)
    edit_json(ckpt / "model.safetensors.index.json", weight_map=weight_map)
    assert_user_error(run(tmp_path, ckpt), "model.safetensors.index.json", needle)


def test_hugging_face_cache_snapshot_links_still_load(tmp_path):
    """The hub cache's snapshots link every file to ../../blobs/: links into a cache's blobs/ are not 'outside'."""
    src = checkpoint(tmp_path, sharded=True)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        (repo / "blobs" / f.name).write_bytes(f.read_bytes())
        os.symlink(f"../../blobs/{f.name}", snapshot / f.name)
    assert compiledllm.load_model(snapshot).config.vocab_size == 96


# ---- 3. weights: non-finite values, integer dtypes -------------------------------------------------------

def _set_tensor(ckpt: Path, name: str, value: torch.Tensor) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors[name] = value
    save_file(tensors, str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_weights_are_refused(tmp_path, bad):
    ckpt = checkpoint(tmp_path)
    weight = torch.ones(32)
    weight[5] = bad
    _set_tensor(ckpt, "model.norm.weight", weight)
    assert_user_error(run(tmp_path, ckpt), "model.safetensors", "model.norm.weight", "NaN/inf", "allow_nonfinite")


def test_nonfinite_weights_load_with_one_warning_when_allowed(tmp_path):
    ckpt = checkpoint(tmp_path)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.norm.weight"][0] = float("nan")
    tensors["lm_head.weight"][1, 2] = float("-inf")
    save_file(tensors, str(ckpt / "model.safetensors"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = compiledllm.load_model(ckpt, allow_nonfinite=True)
    assert torch.isnan(model.norm.weight[0])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "2 tensors" in messages[0], messages


def test_overflow_when_cast_to_float16_counts_as_nonfinite(tmp_path):
    ckpt = checkpoint(tmp_path)
    _set_tensor(ckpt, "model.norm.weight", torch.full((32,), 1e6))
    with pytest.raises(UserError, match=r"model\.norm\.weight has 32 NaN/inf values as float16"):
        compiledllm.load_model(ckpt, dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_weights_are_refused(tmp_path, dtype):
    ckpt = checkpoint(tmp_path)
    _set_tensor(ckpt, "model.norm.weight", torch.ones(32, dtype=dtype))
    assert_user_error(run(tmp_path, ckpt), "model.safetensors", "model.norm.weight",
                      str(dtype).removeprefix("torch."), "floating point")


# ---- 4. config.json values of the wrong type or impossible -----------------------------------------------

@pytest.mark.parametrize("arch,changes,needles", [
    ("sdar", {"hidden_size": "32"}, ("hidden_size", "integer", '"32"')),
    ("sdar", {"hidden_size": 32.0}, ("hidden_size", "integer", "32.0")),
    ("sdar", {"num_hidden_layers": True}, ("num_hidden_layers", "integer", "true")),
    ("sdar", {"intermediate_size": [64]}, ("intermediate_size", "[64]")),
    ("sdar", {"hidden_size": 0}, ("hidden_size", ">= 1", "0")),
    ("sdar", {"intermediate_size": -64}, ("intermediate_size", "-64")),
    ("sdar", {"num_attention_heads": 0}, ("num_attention_heads", ">= 1")),
    ("sdar", {"num_key_value_heads": 3}, ("num_attention_heads=4", "multiple of num_key_value_heads=3")),
    ("sdar", {"head_dim": None, "hidden_size": 30}, ("hidden_size=30", "num_attention_heads=4")),
    ("sdar", {"head_dim": 15}, ("head_dim=15", "even")),
    ("sdar", {"vocab_size": 1}, ("vocab_size", ">= 2")),
    ("sdar", {"rope_theta": float("nan")}, ("rope_theta", "finite")),
    ("sdar", {"rms_norm_eps": "1e-6"}, ("rms_norm_eps", "number")),
    ("sdar", {"tie_word_embeddings": "no"}, ("tie_word_embeddings", "true or false")),
    ("sdar", {"architectures": "SDARForCausalLM"}, ("architectures", "list of strings")),
    ("sdar", {"eos_token_id": [0, "x"]}, ("eos_token_id", '"x"')),
    ("llada2", {"partial_rotary_factor": 2.0}, ("partial_rotary_factor", "(0, 1]")),
    ("llada2", {"partial_rotary_factor": 0.25}, ("partial_rotary_factor", "rotary_dim", "=3", "even")),
    ("llada2", {"num_experts_per_tok": 9}, ("num_experts_per_tok=9",)),
    ("llada2", {"n_group": 3}, ("num_experts=8", "n_group=3")),
    ("llada2", {"first_k_dense_replace": 9}, ("first_k_dense_replace=9", "num_hidden_layers=3")),
    ("llada2", {"num_experts": "8"}, ("num_experts", '"8"')),
    ("llada", {"d_model": 30}, ("d_model=30", "n_heads=4")),
    ("llada", {"weight_tying": 1}, ("weight_tying", "true or false")),
])
def test_bad_config_values_name_the_key(tmp_path, arch, changes, needles):
    ckpt = checkpoint(tmp_path, arch)
    edit_json(ckpt / "config.json", **changes)
    assert_user_error(run(tmp_path, ckpt), "config.json", *needles)


@pytest.mark.parametrize("changes,needles", [
    ({"vocab_size": 10 ** 6}, ("lm_head.weight", "[96, 32]", "the config implies [1000000, 32]")),
    ({"num_hidden_layers": 1000}, ("config.json", "num_hidden_layers=1000 needs at least",)),
    ({"vocab_size": 10 ** 12}, ("config.json", "vocab_size must be <=")),  # past the bounds: before any shape
    ({"intermediate_size": 2 ** 62}, ("config.json", "intermediate_size must be <= 262144")),
])
def test_a_config_that_lies_about_sizes_allocates_nothing(tmp_path, changes, needles):
    """Shapes are checked on the meta device against the safetensors headers before any memory is allocated."""
    ckpt = checkpoint(tmp_path)
    edit_json(ckpt / "config.json", **changes)
    assert_user_error(run(tmp_path, ckpt), *needles)


# ---- 5. MASK == EOS, whichever source gives them ------------------------------------------------------------

@pytest.mark.parametrize("source", ["recipe", "config", "tokenizer", "recipe_and_config"])
def test_mask_equal_to_eos_is_refused(tmp_path, source):
    ckpt = checkpoint(tmp_path, tokenizer=True)
    model = {"path": str(ckpt)}
    if source == "recipe":
        model["mask_token_id"] = model["eos_token_id"] = 7
    elif source == "config":
        edit_json(ckpt / "config.json", mask_token_id=EOS_ID)
    elif source == "tokenizer":  # config.json gives neither; the tokenizer's eos_token is its mask token
        edit_json(ckpt / "config.json", mask_token_id=..., eos_token_id=...)
        edit_json(ckpt / "tokenizer_config.json", eos_token="<|mask|>")
    else:
        model["eos_token_id"] = MASK_ID
    assert_user_error(run(tmp_path, model), "mask_token_id and eos_token_id are both", "never stop at EOS")


# ---- 6. load_model's arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [None, 123, "", "   ", ["m"], b"m"])
def test_load_model_refuses_non_paths(path):
    with pytest.raises(UserError, match="model.path: expected a checkpoint directory"):
        compiledllm.load_model(path)


@pytest.mark.parametrize("kw,needle", [
    ({"device": "gpu"}, "model.device: 'gpu' is not a device"), ({"device": "meta"}, "model.device: .* 'meta'"),
    ({"device": 0}, "model.device: expected a device name"), ({"dtype": "int8"}, "model.dtype: 'int8'"),
    ({"dtype": torch.int64}, "model.dtype: torch.int64"), ({"dtype": ["float32"]}, "model.dtype"),
    ({"mask_token_id": "3"}, "model.mask_token_id: expected a token id"),
    ({"eos_token_id": True}, "model.eos_token_id: expected a token id"),
])
def test_load_model_refuses_bad_arguments(tmp_path, kw, needle):
    with pytest.raises(UserError, match=needle):
        compiledllm.load_model(checkpoint(tmp_path), **kw)


def test_parse_device_names_the_devices_there_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(UserError, match=r"model\.device: cuda: CUDA is not available .*available here: cpu\)"):
        parse_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match=r"recipe\.device: cuda:7 does not exist \(available here: cpu, cuda:0, cuda:1"):
        parse_device("cuda:7", what="recipe.device")
    assert parse_device("cuda:1") == torch.device("cuda:1") and parse_device(torch.device("cpu")).type == "cpu"


# ---- 7. chat templates --------------------------------------------------------------------------------------

def template_checkpoint(tmp_path: Path, template) -> Path:
    ckpt = checkpoint(tmp_path, tokenizer=True)
    edit_json(ckpt / "tokenizer_config.json", chat_template=template)
    return ckpt


@pytest.mark.parametrize("template,needles", [
    ("{{ raise_exception('Conversation roles must alternate\\nuser/assistant') }}",
     ("refused the messages", "Conversation roles must alternate user/assistant")),
    ("{% for m in messages %}{{ m }", ("does not compile", "line 1")),
    ([], ("chat_template", "default")),
    ([{"name": "tool_use", "template": "x"}], ("chat_template", "tool_use", "default")),
    (5, ("chat_template must be a string or a list",)),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", ("unsafe operation",)),
    ("{{ messages.append(1) }}", ("unsafe operation",)),
    ("{{ 'x' * 10 ** 9 }}", ("over the limit",)),
    ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     ("over 1048576",)),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", ("RecursionError",)),
])
def test_bad_chat_templates(tmp_path, template, needles):
    assert_user_error(run(tmp_path, template_checkpoint(tmp_path, template), MESSAGES), "tokenizer_config.json",
                      *needles)


def test_a_template_that_does_not_compile_is_known_at_load_time(tmp_path):
    tok = TextTokenizer.from_dir(template_checkpoint(tmp_path, "{% if %}"))
    with pytest.raises(UserError, match="tokenizer_config.json: chat_template does not compile"):
        tok.check_chat_template()


def test_a_bad_template_does_not_break_text_and_id_prompts(tmp_path):
    ckpt = template_checkpoint(tmp_path, "{% for m in messages %}{{ m }")
    res = run(tmp_path, ckpt, [{"text": "hello world"}, {"ids": [5, 6]}])
    assert res.exit_code == 0, res.output


def test_output_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "CHAT_TEMPLATE_MAX_CHARS", 1000)
    ckpt = template_checkpoint(tmp_path, "{% for i in range(100) %}{{ 'abcdefghij' * 2 }}{% endfor %}")
    assert_user_error(run(tmp_path, ckpt, MESSAGES), "tokenizer_config.json", "over 1000 characters")


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # no output, no calls
    "{% set l = [0] * 100000 %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",  # 2^60 calls
])
def test_time_bound(tmp_path, monkeypatch, template):
    monkeypatch.setattr(tokenizer_module, "CHAT_TEMPLATE_TIMEOUT_S", 0.2)

    def hung(*_):  # without the bound these loops run for hours: fail instead of hanging the suite
        raise AssertionError("the template render was not stopped")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        res = run(tmp_path, template_checkpoint(tmp_path, template), MESSAGES)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert_user_error(res, "tokenizer_config.json", "took over 0.2 s")


def test_hugging_face_template_helpers(tmp_path):
    template = [{"name": "tool_use", "template": "no"}, {"name": "default", "template": (
        "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{% if loop.index0 == 3 %}"
        "{% break %}{% endif %}{{ m.content }}|{% endfor %}{{ {'k': '<b>'} | tojson }}|{{ strftime_now('%Y') }}")}]
    tok = TextTokenizer.from_dir(template_checkpoint(tmp_path, template))
    out = tok.apply_chat_template([{"role": "user", "content": c} for c in "abcd"])
    assert out == f'a|c|{{"k": "<b>"}}|{__import__("datetime").date.today().year}'


# ---- 8. exported engines: an explicit trust decision, metadata checked before any library loads --------------

@pytest.fixture(scope="module")
def export_meta(tmp_path_factory) -> dict:
    model = compiledllm.load_model(write_checkpoint(tmp_path_factory.mktemp("m"), "sdar", 0))
    return {"format": FORMAT, "torch": torch.__version__, "config": dataclasses.asdict(model.config),
            "dtype": "float32", "device": "cpu", "block_size": 4, "capacity": 32, "buckets": [1],
            "files": {"1": "step_b1.pt2"},
            "weights": {"file": "weights.safetensors", "tensors": {"w": {"dtype": "float32", "shape": [2]}}}}


def fake_export(tmp_path: Path, meta: dict) -> Path:
    out = tmp_path / "exp"
    out.mkdir()
    (out / "step_b1.pt2").write_bytes(b"PK not a package")
    save_file({"w": torch.zeros(2)}, str(out / "weights.safetensors"))
    (out / EXPORT_FILE).write_text(json.dumps(meta))
    return out


def test_exported_engines_need_trust(tmp_path, export_meta):
    export = fake_export(tmp_path, export_meta)
    with pytest.raises(UserError, match="native code.*trust_exported=True"):
        compiledllm.load_model(export)
    assert_user_error(run(tmp_path, export), str(export), "trust_exported", "--trust-exported")


def test_a_trusted_damaged_package_is_one_line(tmp_path, export_meta):
    with pytest.raises(UserError, match=r"step_b1\.pt2: the exported package does not load"):
        compiledllm.load_model(fake_export(tmp_path, export_meta), trust_exported=True)


@pytest.mark.parametrize("change,needle", [
    ({"capacity": ...}, "missing key 'capacity'"),
    ({"extra_key": 1}, "unknown key 'extra_key'"),
    ({"format": 1}, "export format 1"),
    ({"block_size": "4"}, "block_size must be an integer"),
    ({"capacity": 0}, "capacity must be >= 1"),
    ({"buckets": []}, "buckets must be a non-empty list"),
    ({"buckets": [1, True]}, "buckets must be an integer"),
    ({"files": {"2": "step_b1.pt2"}}, "files must map each bucket"),
    ({"files": {"1": "../step_b1.pt2"}}, "lies outside the export directory"),
    ({"files": {"1": "/bin/true"}}, "must be a file name inside"),
    ({"files": {"1": "missing.pt2"}}, "is not a file"),
    ({"dtype": "load"}, "dtype: 'load'"),
    ({"device": "gpu"}, "device: 'gpu' is not a device"),
    ({"torch": 2}, "torch must be a version string"),
    ({"config": {"vocab_size": 96}}, "config: missing"),
    ({"config": "sdar"}, "config: expected a mapping"),
    ({"config.vocab_size": "96"}, "config: vocab_size must be an integer"),
    ({"config.bogus": 1}, "config: got an unexpected keyword argument 'bogus'"),
    ({"config.mask_token_id": EOS_ID}, "must be two different ids"),
    ({"weights": "weights.safetensors"}, "weights must be {file, tensors}"),
    ({"weights.file": "../weights.safetensors"}, "weights.file = '../weights.safetensors' lies outside"),
    ({"weights.tensors": {"w": {"dtype": "pickle", "shape": [2]}}}, "weights.tensors['w'] must be {dtype, shape}"),
    ({"weights.tensors": {"w": {"dtype": "float32", "shape": [-1]}}}, "weights.tensors['w'] must be"),
])
def test_export_metadata_is_checked_before_any_package_loads(tmp_path, export_meta, monkeypatch, change, needle):
    def never(path):
        raise AssertionError(f"a package was loaded: {path}")

    monkeypatch.setattr(torch._inductor, "aoti_load_package", never)
    meta = json.loads(json.dumps(export_meta))
    for key, value in change.items():
        node, _, leaf = key.rpartition(".")
        target = meta[node] if node else meta
        if value is ...:
            del target[leaf]
        else:
            target[leaf] = value
    export = fake_export(tmp_path, meta)
    with pytest.raises(UserError, match=f"{EXPORT_FILE}: .*{re.escape(needle)}"):
        compiledllm.load_model(export, trust_exported=True)


def test_export_package_linked_outside_is_refused(tmp_path, export_meta):
    export = fake_export(tmp_path, {**export_meta, "files": {"1": "link.pt2"}})
    os.symlink(tmp_path / "elsewhere.pt2", export / "link.pt2")
    (tmp_path / "elsewhere.pt2").write_bytes(b"x")
    with pytest.raises(UserError, match="'link.pt2' lies outside the export directory"):
        compiledllm.load_model(export, trust_exported=True)


def test_oversized_export_metadata(tmp_path, export_meta):
    export = fake_export(tmp_path, export_meta)
    sparse(export / EXPORT_FILE, 17 << 20)
    with pytest.raises(UserError, match=f"{EXPORT_FILE}: larger than the 16 MiB limit"):
        compiledllm.load_model(export, trust_exported=True)
