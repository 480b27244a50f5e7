"""CPU threads that survive a busy machine (docs/results.md, "CPU threads").

torch's OpenMP workers wait for each other at the end of every parallel op. With libgomp's default wait (spin a
while, then sleep) a worker whose core another process holds stalls every small op of a decode step: on a 2-core
machine with other work running, the quickstart fell from ~100 to 2-3 tokens/s. Two defaults fix that:

* OMP_WAIT_POLICY=PASSIVE (waiting workers sleep at once), set when compiledllm is imported, unless the
  environment sets it; OpenMP reads it once, when torch loads, so it takes effect when compiledllm is imported
  first (the CLI always is); the CPU selection extension in ext/ uses the same OpenMP runtime and setting.
* threads: a recipe key / `--threads`; by default the cores this process may run on that are not busy with other
  work when the run starts (runnable tasks now, from /proc/loadavg), at least 1, at most torch's own default.
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (compiledllm/__init__.py runs this)


def busy_cores(samples: int = 10, interval_s: float = 0.01) -> float:
    """Cores other processes keep busy now: the runnable tasks of /proc/loadavg besides this one, the median of a
    few samples (instantaneous, where the load average lags a minute behind); getloadavg where /proc is absent."""
    try:
        counts = []
        for _ in range(samples):
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
            time.sleep(interval_s)
        return float(sorted(counts)[len(counts) // 2])
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]


def default_threads() -> int:
    """Cores this process may use that other processes are not using now, >= 1, <= torch's default."""
    import torch

    cores = len(os.sched_getaffinity(0))
    return max(1, min(torch.get_num_threads(), round(cores - busy_cores())))


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads: `threads`, or default_threads() for None. Returns the number set."""
    import torch

    n = default_threads() if threads is None else threads
    torch.set_num_threads(n)
    return n
