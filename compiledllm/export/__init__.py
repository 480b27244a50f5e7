"""Exported engines: `trace` packages a recipe's step forwards (AOTInductor), `runtime` runs them.

Only the runtime is imported here: the loader needs it, and `trace` needs the engine and the runner, which need
the loader (importing it here would close that circle)."""
from compiledllm.export.runtime import (EXPORT_FILE, ExportedModel, StaticShapes, is_exported, load_exported,
                                        probe_load, same_device)

__all__ = ["EXPORT_FILE", "ExportedModel", "StaticShapes", "is_exported", "load_exported", "probe_load",
           "same_device"]
