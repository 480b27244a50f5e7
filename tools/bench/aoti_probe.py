"""Issue 31 item 6: reduce the CUDA AOTInductor load crash (torch 2.11 + CUDA 13) to its smallest form and look for a
way round it. One nn.Linear is exported to a package three ways (as `compiledllm export` does, constants outside the
.so; constants inside; kernel binaries embedded), then each package is loaded and run in a child process under each
loading variant; a child's exit by signal is the crash. Prints a table and writes JSON.

    python tools/bench/aoti_probe.py [--out aoti_probe.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

# each child: load the package named by argv[1], run it on the input it was exported with, compare with argv[2]'s
CHILD = """
import sys, torch
{pre}
runner = torch._inductor.aoti_load_package(sys.argv[1]{kw})
{constants}
x, ref = torch.load(sys.argv[2], weights_only=True)
out = runner(x.to(sys.argv[4]))
out = out[0] if isinstance(out, (list, tuple)) else out
print("max_abs_err", (out.float().cpu() - ref.float()).abs().max().item())
"""
CHILD_CONSTANTS = ("weights = torch.load(sys.argv[3], weights_only=True)\n"
                   "runner.load_constants({k: v.to(sys.argv[4]) for k, v in weights.items()}, check_full_update=True, "
                   "user_managed=True)")
LOADS = {  # name: (code before the load, extra keyword arguments, environment)
    "plain": ("", "", {}),
    "cuda_context_first": ("torch.zeros(1, device=sys.argv[4]); torch.cuda.synchronize() if sys.argv[4] == 'cuda' "
                           "else None", "", {}),
    "device_index_0": ("", ", device_index=0", {}),
    "single_threaded": ("", ", run_single_threaded=True", {}),
    "module_loading_eager": ("", "", {"CUDA_MODULE_LOADING": "EAGER"}),
}
PACKAGES = {  # name: inductor configs (the first is what `compiledllm export` writes)
    "constants_outside": {"aot_inductor.package_constants_in_so": False},
    "constants_inside": {},
    "kernels_embedded": {"aot_inductor.embed_kernel_binary": True},
    "debug_compile": {"aot_inductor.debug_compile": True},  # -O0 -g: a crash that goes away is an optimisation's
}


def export(model: torch.nn.Module, x: torch.Tensor, path: Path, configs: dict) -> str | None:
    try:
        program = torch.export.export(model, (x,))
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
        return None
    except Exception as e:  # an option this torch does not know: recorded, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def child(package: Path, data: Path, load: str, outside: bool, device: str) -> dict:
    pre, kw, env = LOADS[load]
    constants = CHILD_CONSTANTS if outside else ""
    code = CHILD.format(pre=pre, kw=kw, constants=constants)
    t = time.perf_counter()
    try:
        res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, str(package), str(data),
                              str(data.with_name("weights.pt")), device], capture_output=True, text=True,
                             timeout=120, env=os.environ | env)
    except subprocess.TimeoutExpired:
        return {"rc": None, "s": round(time.perf_counter() - t, 2), "error": "no exit in 120 s"}
    rec = {"rc": res.returncode, "s": round(time.perf_counter() - t, 2)}
    if res.returncode < 0:
        rec["signal"] = signal.Signals(-res.returncode).name
        rec["stack"] = [ln.strip() for ln in res.stderr.splitlines() if ln.strip().startswith("File")][-6:]
    elif res.returncode:
        rec["error"] = (res.stderr.strip().splitlines() or ["no message"])[-1][:300]
    else:
        rec["max_abs_err"] = float(res.stdout.split()[-1])
    return rec


def native(package: Path, data: Path, load: str, outside: bool, device: str) -> dict:
    """The crash's native frames (gdb's backtrace of the same child) and what the package's .so links against (ldd):
    what names the defect where Python's frames stop at the loader."""
    out: dict = {}
    with zipfile.ZipFile(package) as z:
        sos = [n for n in z.namelist() if n.endswith(".so")]
        if sos and shutil.which("ldd"):
            so = Path(z.extract(sos[0], package.parent / "unz"))
            res = subprocess.run(["ldd", str(so)], capture_output=True, text=True)
            out["ldd"] = [ln.strip() for ln in res.stdout.splitlines()]
    if not shutil.which("gdb"):
        out["gdb"] = "not on this machine"
        return out
    pre, kw, env = LOADS[load]
    constants = "" if not outside else CHILD_CONSTANTS
    script = package.parent / "child.py"
    script.write_text(CHILD.format(pre=pre, kw=kw, constants=constants))
    res = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 30", "--args", sys.executable, str(script),
                          str(package), str(data), str(data.with_name("weights.pt")), device],
                         capture_output=True, text=True, timeout=300, env=os.environ | env)
    out["gdb"] = [ln for ln in res.stdout.splitlines() if ln.startswith("#") or "SIG" in ln][:40]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="aoti_probe.json")
    ap.add_argument("--device", default="cuda", help="cpu: the same probe of CPU packages (they load; a check of this"
                    " script)")
    ap.add_argument("--packages", default=",".join(PACKAGES), help="package forms to try, comma-separated")
    ap.add_argument("--loads", default=",".join(LOADS), help="loading variants to try, comma-separated")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("aoti_probe: needs a CUDA device (the crash is in loading CUDA packages)")
    tmp = Path(tempfile.mkdtemp(prefix="aoti_probe_"))
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to(args.device).eval()
    x = torch.randn(4, 64, device=args.device)
    with torch.no_grad():
        torch.save((x.cpu(), model(x).cpu()), tmp / "data.pt")
    torch.save({n: p.detach() for n, p in model.named_parameters()}, tmp / "weights.pt")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rec = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": name,
           "date": time.strftime("%Y-%m-%d"), "packages": {}}
    for pname, configs in ((p, PACKAGES[p]) for p in args.packages.split(",")):
        path = tmp / f"{pname}.pt2"
        t = time.perf_counter()
        err = export(model, x, path, configs)
        entry = {"configs": configs, "export_s": round(time.perf_counter() - t, 1), "loads": {}}
        if err:
            entry["export_error"] = err
        else:
            for load in args.loads.split(","):
                entry["loads"][load] = r = child(path, tmp / "data.pt", load, pname == "constants_outside", args.device)
                print(f"  {pname} / {load}: {r.get('signal') or r.get('error') or 'ok'} in {r['s']} s", flush=True)
        rec["packages"][pname] = entry
        Path(args.out).write_text(json.dumps(rec, indent=1))  # each package as it ends: a stage's timeout keeps them
        print(f"{pname:18s} export {entry['export_s']:5.1f} s " + (err or "  ".join(
            f"{k}: {v.get('signal') or ('ok %.1e' % v['max_abs_err'] if 'max_abs_err' in v else 'error')}"
            for k, v in entry["loads"].items())), flush=True)
    for pname, entry in rec["packages"].items():  # the crash's place, once, with its native frames
        load = next((k for k, v in entry["loads"].items() if v.get("stack")), None)
        if load:
            print(f"{pname} crash, Python frames: " + " | ".join(entry["loads"][load]["stack"]))
            rec["native"] = {"package": pname, "load": load, **native(
                tmp / f"{pname}.pt2", tmp / "data.pt", load, pname == "constants_outside", args.device)}
            print("\n".join(rec["native"].get("ldd", []) + list(rec["native"]["gdb"])), flush=True)
            Path(args.out).write_text(json.dumps(rec, indent=1))
            break
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
