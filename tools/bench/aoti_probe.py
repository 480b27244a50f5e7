"""Issue 31 item 6: reduce the CUDA AOTInductor load crash (torch 2.11 + CUDA 13) to its smallest form and look for a
way round it. One nn.Linear is exported six ways (constants outside the .so; the same linked with the static
libraries' symbols private, as `compiledllm export` does (compiledllm/export/toolchain.py); constants inside; kernel
binaries embedded; compiled -O0 -g; the deprecated bare .so of torch._inductor.aot_compile, loaded by
torch._export.aot_load), then each is loaded and run in a child process under each loading variant; a child's exit by
signal is the crash. For the first crash: the .so's links (ldd), its native frames (gdb, else a preloaded SIGSEGV
handler's backtrace) and the C++ toolchain (which libstdc++ the compiler links, which one torch's process maps, and
whether the .so carries libstdc++'s own code). Prints a table and writes JSON.

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
from contextlib import nullcontext
from pathlib import Path

import torch

from compiledllm.export.toolchain import private_static_libs

# each child: load the package named by argv[1], run it on the input it was exported with, compare with argv[2]'s
CHILD = """
import sys, torch
{pre}
runner = {loader}
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
    "preload_stdcxx": ("", "", {}),  # LD_PRELOAD: the libstdc++.so.6 the compiler resolves (set in main, if a file)
}
PACKAGES = {  # name: inductor configs (the first is what `compiledllm export` writes)
    "constants_outside": {"aot_inductor.package_constants_in_so": False},
    "private_libs": {"aot_inductor.package_constants_in_so": False},  # + -Wl,--exclude-libs,ALL (PRIVATE)
    "constants_inside": {},
    "kernels_embedded": {"aot_inductor.embed_kernel_binary": True},
    "debug_compile": {"aot_inductor.debug_compile": True},  # -O0 -g: a crash that goes away is an optimisation's
    "legacy_so": None,  # no package: torch._inductor.aot_compile's .so, loaded by torch._export.aot_load (deprecated)
}
PRIVATE = {"private_libs"}  # linked within compiledllm.export.toolchain.private_static_libs


def outside(pname: str) -> bool:
    """Whether package form `pname` keeps its constants outside the .so (the child then loads them)."""
    return bool(PACKAGES[pname]) and PACKAGES[pname].get("aot_inductor.package_constants_in_so") is False


def package_path(tmp: Path, pname: str) -> Path:
    """Where package form `pname` is written: a bare .so for the legacy form, else a .pt2 archive."""
    return tmp / (f"{pname}.so" if PACKAGES[pname] is None else f"{pname}.pt2")


def loader(pname: str, kw: str) -> str:
    """The child's load call for package form `pname` (the legacy .so takes no keyword arguments)."""
    if PACKAGES[pname] is None:
        return "torch._export.aot_load(sys.argv[1], sys.argv[4])"
    return f"torch._inductor.aoti_load_package(sys.argv[1]{kw})"


def export(model: torch.nn.Module, x: torch.Tensor, path: Path, pname: str) -> str | None:
    configs = PACKAGES[pname]
    try:
        program = torch.export.export(model, (x,))
        if configs is None:  # the legacy form: a bare .so, its constants inside
            shutil.copy(torch._inductor.aot_compile(program.module(), (x,)), path)
            return None
        with private_static_libs() if pname in PRIVATE else nullcontext():
            torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
        return None
    except Exception as e:  # an option this torch does not know: recorded, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def child(package: Path, data: Path, load: str, device: str, pname: str) -> dict:
    pre, kw, env = LOADS[load]
    constants = CHILD_CONSTANTS if outside(pname) else ""
    code = CHILD.format(pre=pre, loader=loader(pname, kw), constants=constants)
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


# where gdb is missing (the device has none): a SIGSEGV handler preloaded into the child prints glibc's backtrace
SEGV_HANDLER = r"""
#include <execinfo.h>
#include <signal.h>
static void on_segv(int sig) { void *f[64]; int n = backtrace(f, 64); backtrace_symbols_fd(f, n, 2);
                               signal(sig, SIG_DFL); raise(sig); }
__attribute__((constructor)) static void install(void) { signal(SIGSEGV, on_segv); }
"""


def native_frames(cmd: list[str], env: dict, work: Path) -> list[str]:
    """The native frames of a child that crashes: gdb's backtrace, else the preloaded handler's (demangled by
    c++filt where there is one); [reason] where neither can run."""
    if shutil.which("gdb"):
        res = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 30", "--args", *cmd], capture_output=True,
                             text=True, timeout=300, env=env)
        return [ln for ln in res.stdout.splitlines() if ln.startswith("#") or "SIG" in ln][:40]
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    if cc is None:
        return ["neither gdb nor a C compiler on this machine"]
    (work / "segv.c").write_text(SEGV_HANDLER)
    build = subprocess.run([cc, "-shared", "-fPIC", "-o", str(work / "segv.so"), str(work / "segv.c")],
                           capture_output=True, text=True)
    if build.returncode:
        return [f"segv handler did not build: {build.stderr.strip()[:200]}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=env | {"LD_PRELOAD": str(work / "segv.so")})
    frames = [ln for ln in res.stderr.splitlines() if "(" in ln and "[0x" in ln][:40]
    if frames and shutil.which("c++filt"):
        frames = subprocess.run(["c++filt"], input="\n".join(frames), capture_output=True,
                                text=True).stdout.splitlines()
    return frames or [f"no frames (rc {res.returncode}): {res.stderr.strip()[-200:]}"]


def run_text(*cmd: str) -> str:
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return (res.stdout + res.stderr).strip()


def package_so(package: Path) -> Path | None:
    """The .so of a package form (the bare .so itself, or the first .so in a .pt2 archive, extracted beside it)."""
    if not zipfile.is_zipfile(package):
        return package
    with zipfile.ZipFile(package) as z:
        sos = [n for n in z.namelist() if n.endswith(".so")]
        return Path(z.extract(sos[0], package.parent / f"unz_{package.stem}")) if sos else None


def exported_libstdcxx(so: Path | None) -> int | None:
    """How many of libstdc++'s own symbols (locale, codecvt) the .so defines and exports: nonzero means a static
    copy of libstdc++ inside it whose symbols can mix with the process's libstdc++.so.6."""
    if so is None or not shutil.which("nm"):
        return None
    lines = run_text("nm", "-C", "--defined-only", "--extern-only", str(so)).splitlines()
    return sum(("std::locale::" in ln or "std::codecvt<" in ln) for ln in lines)


def cxx_facts() -> dict:
    """The C++ compiler Inductor uses, the libstdc++ it links (shared and static), and the libstdc++ that a process
    which imported torch maps."""
    from torch._inductor import cpp_builder

    cxx = cpp_builder.get_cpp_compiler()
    maps = run_text(sys.executable, "-c", "import torch; print(open('/proc/self/maps').read())").splitlines()
    return {"compiler": cxx, "version": run_text(cxx, "--version").splitlines()[:1],
            "configured": [opt for ln in run_text(cxx, "-v").splitlines() if ln.startswith("Configured") for opt in
                           ln.split() if any(w in opt for w in ("shared", "static", "prefix=", "libstdcxx"))],
            "libstdcxx_so": run_text(cxx, "-print-file-name=libstdc++.so.6"),
            "libstdcxx_a": run_text(cxx, "-print-file-name=libstdc++.a"),
            "process_maps": sorted({ln.split()[-1] for ln in maps if "libstdc++" in ln})}


def native(package: Path, data: Path, load: str, device: str, pname: str) -> dict:
    """The crash's native frames (native_frames, same child) and what the package's .so links against (ldd): what
    names the defect where Python's frames stop at the loader."""
    out: dict = {}
    so = package_so(package)
    if so is not None and shutil.which("ldd"):
        res = subprocess.run(["ldd", str(so)], capture_output=True, text=True)
        out["ldd"] = [ln.strip() for ln in res.stdout.splitlines()]
    pre, kw, env = LOADS[load]
    script = package.parent / "child.py"
    constants = CHILD_CONSTANTS if outside(pname) else ""
    script.write_text(CHILD.format(pre=pre, loader=loader(pname, kw), constants=constants))
    cmd = [sys.executable, str(script), str(package), str(data), str(data.with_name("weights.pt")), device]
    out["frames"] = native_frames(cmd, os.environ | env, package.parent)
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
           "date": time.strftime("%Y-%m-%d"), "cxx": cxx_facts(), "packages": {}}
    print(json.dumps(rec["cxx"], indent=1), flush=True)
    own = rec["cxx"]["libstdcxx_so"]
    if os.path.isabs(own):  # (a bare name: the compiler has no shared libstdc++ of its own)
        LOADS["preload_stdcxx"] = ("", "", {"LD_PRELOAD": own})
    for pname in args.packages.split(","):
        path = package_path(tmp, pname)
        t = time.perf_counter()
        err = export(model, x, path, pname)
        entry = {"configs": PACKAGES[pname], "private_libs": pname in PRIVATE,
                 "export_s": round(time.perf_counter() - t, 1), "loads": {}}
        if err:
            entry["export_error"] = err
        else:
            entry["exported_libstdcxx_symbols"] = exported_libstdcxx(package_so(path))
            for load in args.loads.split(","):
                if load == "preload_stdcxx" and not LOADS[load][2]:
                    r = {"s": 0.0, "error": f"the compiler's libstdc++.so.6 is not a file: {own}"}
                    entry["loads"][load] = r
                else:
                    entry["loads"][load] = r = child(path, tmp / "data.pt", load, args.device, pname)
                print(f"  {pname} / {load}: {r.get('signal') or r.get('error') or 'ok'} in {r['s']} s", flush=True)
        rec["packages"][pname] = entry
        Path(args.out).write_text(json.dumps(rec, indent=1))  # each package as it ends: a stage's timeout keeps them
        print(f"{pname:18s} export {entry['export_s']:5.1f} s, exports {entry.get('exported_libstdcxx_symbols')} "
              "libstdc++ symbols; " + (err or "  ".join(
            f"{k}: {v.get('signal') or ('ok %.1e' % v['max_abs_err'] if 'max_abs_err' in v else 'error')}"
            for k, v in entry["loads"].items())), flush=True)
    for pname, entry in rec["packages"].items():  # the crash's place, once, with its native frames
        load = next((k for k, v in entry["loads"].items() if v.get("stack")), None)
        if load:
            print(f"{pname} crash, Python frames: " + " | ".join(entry["loads"][load]["stack"]))
            rec["native"] = {"package": pname, "load": load, **native(
                package_path(tmp, pname), tmp / "data.pt", load,
                args.device, pname)}
            print("\n".join(rec["native"].get("ldd", []) + rec["native"]["frames"]), flush=True)
            Path(args.out).write_text(json.dumps(rec, indent=1))
            break
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
