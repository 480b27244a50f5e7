"""CPU threads that follow the machine (docs/results.md, "CPU threads").

torch's OpenMP workers wait for each other at the end of every parallel op, spinning for a while first (libgomp's
default). When the machine is oversubscribed (other multi-threaded work beside the run), a worker whose core
another process holds stalls every small op of a decode step: with five test sessions beside it on a 2-core
machine, a small decode ran at 3.4 tokens/s with 2 threads and 14.5 with 1; LLM(...) on the quickstart with a job
on one core took 196.8 s with 2 threads and 15.7 s with 1 (issue 32). OMP_WAIT_POLICY is left to the user: PASSIVE
(sleep at once) halved the idle quickstart's speed at 2 threads and did not help under load.

One policy for the CLI and the Python API (LLM, compiledllm.generate, load_model + Engine): every CPU
EngineSession holds a ThreadFollower (follow()), so whatever builds the session gets it.
- At the start: the cores not busy now (default_threads: runnable tasks from /proc/loadavg, ~0.1 s of samples),
  measured while no count was chosen yet (the CLI: as its run starts, runner.set_threads; the API: at its first
  session); later sessions start from the count the policy chose last.
- While the run goes on, between steps (EngineSession.step calls check() before its phases): at most every
  CHECK_S seconds, one read of /proc/stat (the busy time of this process's cores) minus this process's own CPU
  time (time.process_time) since the last check = the cores other processes used meanwhile; never a blocking
  measurement. k threads need at least k - MARGIN free cores; fewer threads at once, more only after two checks
  in a row agree (a collapse costs ~10x, one thread on an idle 2-core machine ~15 %).
- Always 1..torch's own count (as first seen), set only between steps (torch.set_num_threads).

The user's choice wins, and the policy stays out (user_chose()):
- a `threads` setting: the recipe key / --threads, LLM(threads=n) (set_threads(n): pinned for the process);
- OMP_NUM_THREADS or MKL_NUM_THREADS in the environment (torch takes its count from them);
- torch.set_num_threads by the user: torch's count differs from the count this policy set last (or, before it
  set any, from torch's count when this module was first imported). Checked at every session start and every
  re-check: a change in the middle of a run stops the re-checks. A set_num_threads to torch's default count
  itself, before the policy set any, cannot be told apart from the default: give `threads` to pin that.
The module keeps three numbers (torch's count as first seen, the count it set last, the count a `threads`
setting pinned): torch's thread pool is process-wide, so is what owns it. CUDA (any non-CPU) runs are untouched.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

CHECK_S = 0.5         # re-check at most this often (seconds of wall time, at step boundaries)
MARGIN = 0.3          # k threads need >= k - MARGIN cores that other processes left free
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
log = logging.getLogger(__name__)

_baseline: int | None = None   # torch's count when first seen (its default, unless the user set it earlier)
_mine: int | None = None       # the count this policy set last (None: never, or a `threads` setting since)
_pinned: int | None = None     # the count a `threads` setting set (None: none)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def baseline() -> int:
    """torch's thread count as compiledllm first saw it: the policy's upper bound."""
    global _baseline
    if _baseline is None:
        _baseline = _torch_threads()
    return _baseline


if "torch" in sys.modules:  # imported with the engine: torch's count before anything here set it
    baseline()


def user_chose() -> bool:
    """Whether torch's thread count is the user's (a `threads` setting, the environment, torch.set_num_threads)
    rather than this policy's."""
    n = _torch_threads()
    if _pinned is not None and n == _pinned:
        return True
    if _mine is not None:
        return n != _mine
    return any(os.environ.get(k) for k in ENV_KEYS) or n != baseline()


def _set(n: int) -> int:
    import torch

    global _mine
    torch.set_num_threads(n)
    _mine = n
    return n


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


def cores() -> int:
    return len(os.sched_getaffinity(0))


def default_threads() -> int:
    """Cores this process may use that other processes are not using now, >= 1, <= torch's count as first seen."""
    return max(1, min(baseline(), round(cores() - busy_cores())))


def set_threads(threads: int | None) -> int:
    """The CLI's thread setting (runner): `threads` pins torch's count (the policy then stays out); None applies
    the default unless the user chose a count (user_chose()). Returns torch's count."""
    global _pinned, _mine
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        _pinned, _mine = threads, None
        return threads
    return apply_default()


def apply_default() -> int:
    """The default count (default_threads) unless the user chose one; returns torch's count."""
    if user_chose():
        return _torch_threads()
    n = _set(default_threads())
    log.debug("threads: %d at the start (cores %d)", n, cores())
    return n


# --- the re-check -------------------------------------------------------------------------------------------------
Reading = tuple[float, float, float]  # (wall s, busy s of this process's cores, this process's CPU s)


def machine_reading() -> Reading | None:
    """One non-blocking reading: monotonic seconds, the busy seconds of this process's cores since boot (/proc/stat:
    user, nice, system, irq, softirq, steal), this process's CPU seconds. None without /proc/stat."""
    try:
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                name, *v = line.split()
                if name in mine:
                    busy += sum(int(x) for x in v[0:3]) + sum(int(x) for x in v[5:8])
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def decide(free: float, cap: int) -> int:
    """The thread count for `free` cores (those other processes left free): k needs free >= k - MARGIN."""
    return max(1, min(cap, int(free + MARGIN)))


class ThreadFollower:
    """A session's re-check: check() between steps; changes torch's count only while the policy owns it."""

    def __init__(self, read: Callable[[], Reading | None] | None = None, interval_s: float | None = None):
        self.read = read or machine_reading
        self.interval_s = CHECK_S if interval_s is None else interval_s
        self.cap, self.cores = baseline(), cores()
        self.last = self.read()
        self.checked = time.monotonic()
        self.rising = 0          # checks in a row that asked for more threads
        self.changes: list[tuple[float, int]] = []  # (seconds into the session, count set)
        self.t0 = time.monotonic()
        self.active = self.last is not None

    def check(self) -> int | None:
        """Re-check if CHECK_S passed since the last one; returns the count set when it changed, else None."""
        if not self.active or time.monotonic() - self.checked < self.interval_s:
            return None
        self.checked = time.monotonic()
        if user_chose():  # torch.set_num_threads in the middle of the run: the user's from now on
            self.active = False
            return None
        now = self.read()
        if now is None:
            self.active = False
            return None
        wall = now[0] - self.last[0]
        if wall <= 0:
            return None
        others = max(0.0, (now[1] - self.last[1]) - (now[2] - self.last[2])) / wall
        self.last = now
        current = _torch_threads()
        target = decide(self.cores - others, self.cap)
        if target > current:
            self.rising += 1
            if self.rising < 2:
                return None
        self.rising = 0
        if target == current:
            return None
        self.changes.append((self.checked - self.t0, target))
        log.debug("threads: %d -> %d at %.1f s (other processes kept %.2f of %d cores busy)", current, target,
                  self.checked - self.t0, others, self.cores)
        return _set(target)


def follow(device) -> ThreadFollower | None:
    """A CPU session's follower, the default applied first (once per process; later sessions start from the
    count chosen last); None off the CPU or where the user chose the count."""
    if getattr(device, "type", str(device)) != "cpu" or user_chose():
        return None
    if _mine is None:
        apply_default()
    return ThreadFollower()
