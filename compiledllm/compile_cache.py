"""Where torch.compile's work is kept between runs, and what a start-up found there.

Inductor keeps the graphs it compiled on disk (and Triton their kernels), but its default directory is
/tmp/torchinductor_$USER: gone with a reboot or a fresh container, so such a run compiles from nothing (SDAR-4B at
batch 128 on an H200: 43.5 s of start-up cold, 16.6 s warm). Before a Stepper first compiles, `use_cache` points
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at `inductor/` and `triton/` under the user's cache directory
(COMPILEDLLM_CACHE_DIR, else $XDG_CACHE_HOME/compiledllm, else ~/.cache/compiledllm), each unless the user set it.
Inductor reads TORCHINDUCTOR_CACHE_DIR whenever it looks a graph up (torch._inductor.runtime.cache_dir_utils
.cache_dir, torch 2.11-2.13; its compile workers get the variables with every job) and Triton reads
TRITON_CACHE_DIR per kernel, so setting them before the first compile is enough.

Importing torch._dynamo writes torch's own default into TORCHINDUCTOR_CACHE_DIR, so a value there is the user's
when it was there as compiledllm was imported (GIVEN: before any of this package imports Dynamo), or when it is
not torch's default directory (set by the user's code later).

`CacheReport` is what a start-up observed, from torch's own counters: the graphs Dynamo traced and how many of
them Inductor's FX graph cache held (hits) or compiled (misses, and graphs it could not cache).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV = "COMPILEDLLM_CACHE_DIR"
INDUCTOR, TRITON = "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"
GIVEN = {name: os.environ.get(name) for name in (INDUCTOR, TRITON)}  # as the process had them (package import)

log = logging.getLogger(__name__)


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """COMPILEDLLM_CACHE_DIR, else $XDG_CACHE_HOME/compiledllm (an absolute XDG_CACHE_HOME only, as the XDG spec
    says), else ~/.cache/compiledllm."""
    if environ.get(ENV):
        return Path(environ[ENV]).expanduser().absolute()
    xdg = environ.get("XDG_CACHE_HOME", "")
    home = Path(environ["HOME"]) if environ.get("HOME") else Path.home()
    return (Path(xdg) if os.path.isabs(xdg) else home / ".cache") / "compiledllm"


def torch_default() -> str | None:
    """torch's own Inductor cache directory (/tmp/torchinductor_$USER), None where this torch does not say."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    except Exception:  # noqa: BLE001  (a private module: any torch may move it)
        return None


def users(name: str, environ: Mapping[str, str], given: Mapping[str, str | None], default: str | None) -> bool:
    """Whether the variable `name` is the user's choice: set as the process began, or set to something other than
    torch's default directory (which torch writes there itself)."""
    value = environ.get(name)
    if not value:
        return False
    if given.get(name) == value:
        return True
    path = os.path.abspath(value)
    return default is None or not (path == default or path.startswith(default.rstrip(os.sep) + os.sep))


def planned(environ: Mapping[str, str] = os.environ, given: Mapping[str, str | None] = GIVEN,
            default: str | None = None) -> dict[str, str]:
    """The variables use_cache sets: TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR under cache_root, each unless the
    user's (`users`); `default`: torch's own directory (torch_default)."""
    root = cache_root(environ)
    return {name: str(root / sub) for name, sub in ((INDUCTOR, "inductor"), (TRITON, "triton"))
            if not users(name, environ, given, default)}


def use_cache() -> str:
    """Point Inductor's and Triton's caches into the user's cache directory where the user chose none (a
    directory that cannot be made is left to torch's default, with a warning); returns Inductor's cache directory
    in effect. Called before a compile, only where one will happen (Stepper, a compiled Prefiller)."""
    default = torch_default()
    for name, path in planned(os.environ, GIVEN, default).items():
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            log.warning("%s: cannot use %s (%s); torch's default stays", name, path, e.strerror or e)
            continue
        os.environ[name] = path
    return os.environ.get(INDUCTOR) or default or ""


@dataclass(frozen=True)
class CacheReport:
    """What one start-up's compiles found in Inductor's on-disk cache (torch's counters over the start-up)."""

    dir: str       # Inductor's cache directory
    graphs: int    # graphs Dynamo traced (0: every one was already compiled in this process)
    loaded: int    # FX graph cache hits: compiled graphs read from `dir`
    compiled: int  # misses (compiled now, and written there) and graphs Inductor could not cache
    state: str     # cold, warm, partly warm, in process (nothing new to compile), uncounted

    @classmethod
    def between(cls, dir: str, before: tuple[int, int, int], after: tuple[int, int, int]) -> "CacheReport":
        graphs, loaded, compiled = (max(a - b, 0) for a, b in zip(after, before))
        return cls(dir, graphs, loaded, compiled, cache_state(graphs, loaded, compiled))


def cache_state(graphs: int, loaded: int, compiled: int) -> str:
    if compiled and loaded:
        return "partly warm"
    if compiled:
        return "cold"
    if loaded:
        return "warm"
    # graphs traced, but neither counted: Inductor's FX graph cache is off (TORCHINDUCTOR_FX_GRAPH_CACHE=0)
    return "uncounted" if graphs else "in process"


def counts() -> tuple[int, int, int]:
    """(graphs Dynamo traced, FX graph cache hits, misses + bypasses) so far in this process."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return (counters["stats"]["unique_graphs"], inductor["fxgraph_cache_hit"],
            inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"])


def describe(report: CacheReport) -> str:
    """One line: what the start-up's compile found, e.g. "Inductor cache warm: 24 graphs loaded, 0 compiled (DIR)"."""
    if report.state == "in process":
        return "every graph was already compiled in this process"
    if report.state == "uncounted":
        return f"{report.graphs} graphs traced; Inductor's FX graph cache reported no hits or misses ({report.dir})"
    return f"Inductor cache {report.state}: {report.loaded} graphs loaded, {report.compiled} compiled ({report.dir})"
