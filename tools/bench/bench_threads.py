"""CPU threads under a competing load (issues 20, 32): the quickstart as a user runs it (`compiledllm run`, a fresh
process each time, load and prefill included), idle and with busy processes beside it, for thread counts and
OpenMP wait policies. tokens/s is the run's own summary figure (decode tokens / decode wall time).

    python tools/bench/bench_threads.py --out docs/results/threads_cpu.json
    python tools/bench/bench_threads.py --mode policy --out docs/results/threads_cpu_run3.json

--mode policy (issue 32): the thread policy (compiledllm/threads.py: the idle cores at the start, re-checked
between steps) against fixed `--threads N` (which pins the count), with 0, 1 and 2 other busy torch jobs started
before the run, and one started --during-s seconds after the run's process (in its decode); also the Python API
(`LLM(recipe).generate(prompts)`, nothing set) with the policy. A run that passes --timeout is killed and recorded
as timed out (its tokens/s below 256 / timeout). Each row records the threads the run ended with.

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


# the Python API as a user writes it: nothing about threads set; decode tokens / generate() wall time
API_RUN = ("import json, sys, time\nimport torch\nfrom compiledllm import LLM\n"
           "from compiledllm.recipe import load_recipe\n"
           "rec = load_recipe(sys.argv[1])\nllm = LLM(rec)\nprompts = [p.text for p in rec.load_prompts()]\n"
           "t = time.perf_counter()\nouts = llm.generate(prompts)\nwall = time.perf_counter() - t\n"
           "n = sum(len(o.token_ids) for o in outs)\n"
           "print(json.dumps({'tokens_per_s': n / wall, 'wall_s': wall, 'threads': torch.get_num_threads()}))\n")


def policy_settings(cores: int) -> dict[str, list[str] | None]:
    """--mode policy: name -> extra `compiledllm run` flags (None: the Python API)."""
    return {"policy (default)": [], **{f"--threads {n}": ["--threads", str(n)] for n in range(1, cores + 1)},
            "API: LLM(recipe), default": None}


def machine_busy_s() -> float:
    """Busy seconds of this process's cores since boot (/proc/stat)."""
    from compiledllm.threads import machine_reading

    return machine_reading()[1]


def children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def outside_load(busy0: float, cpu0: float, wall: float) -> float:
    """Cores that processes outside this benchmark (its run and its jobs, all waited for) kept busy meanwhile."""
    return max(0.0, (machine_busy_s() - busy0) - (children_cpu_s() - cpu0)) / max(wall, 1e-9)


def run_policy_once(recipe: Path, flags: list[str] | None, out: Path, load: list[str], during_s: float | None,
                    timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    cmd = ([sys.executable, "-c", API_RUN, str(recipe)] if flags is None else
           [sys.executable, "-m", "compiledllm", "--log-level", "debug", "run", str(recipe), "-o", str(out), *flags])
    r0, c0 = machine_busy_s(), children_cpu_s()
    jobs = [subprocess.Popen([sys.executable, "-c", code], env=env) for code in load] if during_s is None else []
    if jobs:
        time.sleep(1.0)  # the jobs are busy before the run starts
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        if during_s is not None:
            try:
                proc.wait(during_s)
            except subprocess.TimeoutExpired:
                jobs = [subprocess.Popen([sys.executable, "-c", code], env=env) for code in load]
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"timed_out": True, "process_s": time.perf_counter() - t0, "tokens_per_s": None,
                    "outside_load_cores": None}
    finally:
        for j in jobs:
            j.kill()
            j.wait()
        outside = outside_load(r0, c0, time.perf_counter() - t0 + (1.0 if jobs and during_s is None else 0.0))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({flags}): {stderr[-2000:]}")
    if flags is None:
        res = json.loads(stdout.strip().splitlines()[-1])
        return {"tokens_per_s": res["tokens_per_s"], "decode_s": res["wall_s"], "threads_at_end": res["threads"],
                "process_s": wall, "timed_out": False, "outside_load_cores": outside}
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    changes = [line.split("threads: ", 1)[1] for line in stderr.splitlines() if "threads: " in line]
    return {"tokens_per_s": summary["tokens_per_s"], "decode_s": summary["wall_s"],
            "threads_at_end": summary["threads"], "process_s": wall, "timed_out": False, "outside_load_cores": outside,
            "thread_log": changes}


def policy_main(args, cores: int) -> list[dict]:
    loads = {"0": ("no other job", [TORCH_JOB] * 0, None), "1": ("1 torch job", [TORCH_JOB], None),
             "2": ("2 torch jobs", [TORCH_JOB] * 2, None),
             "during": (f"1 torch job from {args.during_s:g} s into the run", [TORCH_JOB], args.during_s)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.loads.split(","):
            load, codes, during = loads[key]
            for name, flags in policy_settings(cores).items():
                runs = [run_policy_once(args.recipe, flags, Path(tmp) / "r.jsonl", codes, during, args.timeout)
                        for _ in range(args.repeats)]
                tps = [r["tokens_per_s"] for r in runs if r["tokens_per_s"] is not None]
                rows.append({"load": load, "setting": name, "runs": runs,
                             "tokens_per_s_median": statistics.median(tps) if tps else None,
                             "timed_out": sum(r["timed_out"] for r in runs),
                             "process_s_median": statistics.median(r["process_s"] for r in runs),
                             "threads_at_end": [r.get("threads_at_end") for r in runs],
                             "outside_load_cores": [r["outside_load_cores"] for r in runs]})
                med = rows[-1]["tokens_per_s_median"]
                print(f"{load:>32} | {name:<28} | " + (f"{med:7.1f} tok/s" if med is not None else "  timed out  ")
                      + f" | process {rows[-1]['process_s_median']:5.1f} s | threads {rows[-1]['threads_at_end']}"
                      f" | outside load {rows[-1]['outside_load_cores']}",
                      flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes/quickstart.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", type=int, default=None, help="competing busy processes (default: one per core)")
    ap.add_argument("--loads", default="idle,busy,torch,torch x2", help="comma-separated: idle, busy (plain CPU-bound "
                    "processes), torch (another torch job on every core), torch x2 (two: oversubscribed)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mode", choices=("omp", "policy"), default="omp", help="omp: OMP_NUM_THREADS / OMP_WAIT_POLICY "
                    "settings (runs 1, 2); policy: the thread policy against --threads N (run 3; --loads 0,1,2,during)")
    ap.add_argument("--during-s", type=float, default=8.0, help="policy mode, load `during`: seconds after the run's "
                    "process starts")
    ap.add_argument("--timeout", type=float, default=90.0, help="policy mode: seconds a run may take")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    busy_n = args.busy if args.busy is not None else cores
    rows = []
    if args.mode == "policy" and args.loads == ap.get_default("loads"):
        args.loads = "0,1,2,during"
    if args.mode == "policy":
        rows = policy_main(args, cores)
    with tempfile.TemporaryDirectory() as tmp:
        loads = {"idle": [], "busy": [BUSY] * busy_n, "torch": [TORCH_JOB], "torch x2": [TORCH_JOB] * 2}
        names = {"idle": "idle", "busy": f"{busy_n} busy processes", "torch": "a torch job on every core",
                 "torch x2": "two torch jobs on every core"}
        for key in (args.loads.split(",") if args.mode == "omp" else []):
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
              "date": time.strftime("%Y-%m-%d"), "mode": args.mode, "rows": rows}
    if args.mode == "policy":
        report |= {"timeout_s": args.timeout, "during_s": args.during_s,
                   "loadavg_after": Path("/proc/loadavg").read_text().strip()}
    try:
        import torch

        report["torch"] = torch.__version__
    except ImportError:
        pass
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
