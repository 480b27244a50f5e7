"""Every Triton kernel launch of an interpreter check (tests/attention/triton_interp_checks.py), compiled again for
an H100 / H200 (sm_90) ahead of time.

In the interpreter subprocess (TRITON_INTERPRET=1; TRITON_LAUNCH_LOG set), `record` notes each launch's kernel,
argument types, constexpr values and launch options as JSON lines; back in the test (no interpreter), `compile_sm90`
compiles each distinct one with Triton's own compiler and ptxas for sm_90: the interpreter checks the kernels'
logic, this their compilation for the GPU (layouts, tl.dot shapes, shared memory), both on a machine without one.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
from pathlib import Path

SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one H100 / H200 block can have
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "int8": "i8", "int16": "i16",
          "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1"}


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def _arg_type(value) -> str | None:
    """Triton's signature type of a runtime argument (None: not one this recorder knows)."""
    import torch
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def record(log: Path) -> None:
    """Make every interpreted launch append its description to `log`."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
        bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k not in OPTIONS}
        signature, constexprs = {}, {}
        for name, param in params.items():
            value = bound.get(name, param.default)
            if _is_constexpr(param) or value is None:
                constexprs[name] = value
            else:
                signature[name] = _arg_type(value)
        entry = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": signature,
                 "constexprs": constexprs, "options": options}
        try:
            line = json.dumps(entry, sort_keys=True)
        except TypeError:  # a constexpr this recorder cannot write down (a dtype object, ...): noted, not compiled
            line = json.dumps({"module": entry["module"], "name": entry["name"], "unrecorded": True})
        with open(log, "a") as f:
            f.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording


@functools.cache
def sm90_unavailable() -> str | None:
    """Why Triton cannot compile for sm_90 on this machine (e.g. no ptxas for its platform), or None."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), tl.zeros((N,), tl.float32))

    try:
        compile_kernel(probe, {"x_ptr": "*fp32"}, {"N": 16}, {})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def compile_kernel(fn, signature: dict, constexprs: dict, options: dict):
    """One Triton kernel compiled for sm_90: `signature` the runtime arguments' types, `constexprs` their values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import compiledllm  # noqa: F401  (compiled with the product's Triton settings: its FMA contraction)
    src = ASTSource(fn=fn, signature=signature | {k: "constexpr" for k in constexprs}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_sm90(log: Path) -> dict[str, int]:
    """Compiles each distinct launch in `log` for sm_90; returns {kernel: most shared memory bytes among its
    launches}. Raises on the first launch that does not compile, naming it."""
    shared: dict[str, int] = {}
    for line in sorted(set(log.read_text().splitlines())):
        entry = json.loads(line)
        if entry.get("unrecorded") or None in entry["signature"].values():
            continue
        fn = getattr(importlib.import_module(entry["module"]), entry["name"])
        try:
            kernel = compile_kernel(fn, entry["signature"], entry["constexprs"], entry["options"])
        except Exception as e:
            raise AssertionError(f"{entry['name']} does not compile for sm_90 with {entry}: {e}") from e
        shared[entry["name"]] = max(shared.get(entry["name"], 0), kernel.metadata.shared)
    return shared
