"""CPU threads under a competing load (issue 20): the quickstart as a user runs it (`compiledllm run`, a fresh
process each time, load and prefill included), idle and with busy processes beside it, for thread counts and
OpenMP wait policies. tokens/s is the run's own summary figure (decode tokens / decode wall time).

    python tools/bench/bench_threads.py --out docs/results/threads_cpu.json

Settings: "product default" runs with nothing set (what compiledllm chooses); the others pin OMP_NUM_THREADS /
OMP_WAIT_POLICY in the environment, which torch and compiledllm honour (OMP_WAIT_POLICY: ACTIVE spins at every
barrier, PASSIVE sleeps at once, libgomp's default (set empty here) spins a while first, less when oversubscribed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# competing loads: plain CPU-bound processes (one busy core each), and another torch job of small ops on every core
# with OpenMP's defaults (the suite or a second run beside this one: its workers spin and wait at barriers too)
BUSY = "while True:\n    pass\n"
TORCH_JOB = ("import torch\nx = torch.randn(192, 192)\nwhile True:\n    for _ in range(100):\n"
             "        x = torch.tanh(x @ x * 0.05)\n")


def settings(cores: int) -> dict[str, dict[str, str]]:
    return {"product default": {},
            f"{cores} threads, libgomp default wait": {"OMP_NUM_THREADS": str(cores), "OMP_WAIT_POLICY": ""},
            f"{cores} threads, ACTIVE": {"OMP_NUM_THREADS": str(cores), "OMP_WAIT_POLICY": "ACTIVE"},
            f"{cores} threads, PASSIVE": {"OMP_NUM_THREADS": str(cores), "OMP_WAIT_POLICY": "PASSIVE"},
            "1 thread": {"OMP_NUM_THREADS": "1"}}


def run_once(recipe: Path, env_set: dict[str, str], out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env |= env_set  # OMP_WAIT_POLICY "": set but empty, so compiledllm leaves it and libgomp takes its default
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "compiledllm", "run", str(recipe), "-o", str(out)], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({env_set}): {proc.stderr[-2000:]}")
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    return {"tokens_per_s": summary["tokens_per_s"], "decode_s": summary["wall_s"], "process_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes/quickstart.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", type=int, default=None, help="competing busy processes (default: one per core)")
    ap.add_argument("--loads", default="idle,busy,torch,torch x2", help="comma-separated: idle, busy (plain CPU-bound "
                    "processes), torch (another torch job on every core), torch x2 (two: oversubscribed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    busy_n = args.busy if args.busy is not None else cores
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        loads = {"idle": [], "busy": [BUSY] * busy_n, "torch": [TORCH_JOB], "torch x2": [TORCH_JOB] * 2}
        names = {"idle": "idle", "busy": f"{busy_n} busy processes", "torch": "a torch job on every core",
                 "torch x2": "two torch jobs on every core"}
        for key in args.loads.split(","):
            load, codes = names[key], loads[key]
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
            procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for code in codes]
            try:
                for name, env_set in settings(cores).items():
                    runs = [run_once(args.recipe, env_set, Path(tmp) / "r.jsonl") for _ in range(args.repeats)]
                    tps = [r["tokens_per_s"] for r in runs]
                    rows.append({"load": load, "setting": name, "env": env_set, "runs": runs,
                                 "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps),
                                 "process_s_median": statistics.median(r["process_s"] for r in runs)})
                    print(f"{load:>26} | {name:<34} | {statistics.median(tps):7.1f} tok/s (min {min(tps):6.1f}) "
                          f"| process {rows[-1]['process_s_median']:5.1f} s", flush=True)
            finally:
                for p in procs:
                    p.kill()
    report = {"recipe": str(args.recipe.relative_to(ROOT)), "cores": cores, "cpu": platform.processor() or
              platform.machine(), "python": platform.python_version(), "repeats": args.repeats,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    try:
        import torch

        report["torch"] = torch.__version__
    except ImportError:
        pass
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
