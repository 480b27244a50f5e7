"""CPU threads that survive a busy machine (docs/results.md, "CPU threads").

torch's OpenMP workers wait for each other at the end of every parallel op, spinning for a while first (libgomp's
default). When the machine is oversubscribed (other multi-threaded work beside the run), a worker whose core
another process holds stalls every small op of a decode step: with five test sessions beside it on a 2-core
machine, a small decode ran at 3.4 tokens/s with 2 threads and 14.5 with 1. So by default a run takes the cores
that are not busy when it starts (runnable tasks now, from /proc/loadavg: instantaneous, where the load average
lags a minute behind), at least 1, at most torch's own default; the `threads` recipe key / `--threads` sets it.
OMP_WAIT_POLICY is left to the user: PASSIVE (sleep at once) halved the idle quickstart's speed at 2 threads and
did not help under load (tools/bench/bench_threads.py).
"""
from __future__ import annotations

import os
import time


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
