"""compiledllm: a PyTorch compile-centric engine for block diffusion language models.

Public API (imported lazily so that `import compiledllm.<sub>` stays cheap and independent):
    load_model(path, device="cpu", dtype=torch.float32) -> Model
    run(recipe) -> list[Result]
    LLM(model_or_recipe, ...).generate(prompts, SamplingParams(max_tokens=..., stop=...)) -> list[RequestOutput]
        (vLLM's shape: outputs[i].outputs[0] is a CompletionOutput with .text, .token_ids, .finish_reason)
    LLM(...).generate(prompts, params, stream=True) -> iterator of StreamOutput (new text per finished block)
    Recipe
"""
from __future__ import annotations

__version__ = "0.1.0"

# first: it records TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR as the user gave them, before torch's import of
# Dynamo writes its own default there (compile_cache.py); it imports nothing else
from compiledllm import compile_cache as _compile_cache  # noqa: E402, F401

# Triton's FMA contraction as every kernel figure here was measured (on), whatever Triton's default: 3.9 warns once a
# process that the default is unset, and 3.10 turns it off. A user's own setting stays.
import os as _os  # noqa: E402

_os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_LAZY = {
    "load_model": ("compiledllm.loader", "load_model"),
    "run": ("compiledllm.runner", "run"),
    "generate": ("compiledllm.engine", "generate"),
    "Recipe": ("compiledllm.recipe", "Recipe"),
    "LLM": ("compiledllm.llm", "LLM"),
    "SamplingParams": ("compiledllm.llm", "SamplingParams"),
    "RequestOutput": ("compiledllm.llm", "RequestOutput"),
    "CompletionOutput": ("compiledllm.llm", "CompletionOutput"),
    "StreamOutput": ("compiledllm.llm", "StreamOutput"),
    "UserError": ("compiledllm.errors", "UserError"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'compiledllm' has no attribute {name!r}")


__all__ = list(_LAZY) + ["__version__"]
