"""LLaDA2.2's block routing against standard per-token routing: one MoE layer alone (router + routed experts; the
shared expert, which runs on every token the same under both routings, only with --shared), bf16 on CUDA.

Two shapes: LLaDA2.0-mini's MoE (dim 2048, expert width 512, 256 experts, top 8, 8 groups / 4 kept) and a
"LLaDA2.2-flash-shaped, one layer" MoE (dim 4096, width 1024, 256 experts, top 8); random weights and router.
Batch B rows x one 32-token block each (route groups: every token of a row in its row's block 0). Standard
routing is the plain MoE, backend "auto" (the Triton router and experts); block routing is
BlockRoutedMoE.adopt of the same MoE (the same weights) at capacity 48, route block 32.

Inputs: every token its own random vector, so standard routing spreads like a trained load-balanced router's
(distinct experts per block ~ the uniform expectation E * (1 - (1 - k/E)^n), both are reported) rather than
collapsing a block onto a few experts, which would flatter block routing. Experts read per layer = the distinct
experts across the forward (the union over blocks). Bytes = those experts' weights + the router's gate + the
activations in and the k partial outputs out (bench_moe.py's count); roofline time = bytes / the HBM rate
measured in the same run. Times: the whole MoE forward, the router alone (route(): gate GEMM + routing op) and the
experts alone, each the median of CUDA-graph replays. On CUDA the Triton block router is also checked against the
torch block_route on the same logits (ids equal, weights allclose).

    python tools/bench/bench_block_routing.py --out docs/results/bench_block_routing_h200.json
    python tools/bench/bench_block_routing.py --cpu-smoke --out /tmp/x.json   # tiny shape, torch path, eager
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch

from gpu_timing import ceilings, graph_ms
from compiledllm.models import moe_triton
from compiledllm.models.block_routing import BlockRoutedMoE, block_route, route_index
from compiledllm.models.config import MoEConfig
from compiledllm.models.layers import MoE, router_logits
from compiledllm.models.routing import expected_touched

BLOCK = 32


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    label: str
    dim: int
    cfg: MoEConfig


def moe_cfg(experts: int, top_k: int, width: int, groups: int, kept: int) -> MoEConfig:
    return MoEConfig(num_experts=experts, top_k=top_k, expert_dim=width, num_shared=0, n_group=groups,
                     topk_group=kept, routed_scaling=2.5, norm_topk_prob=True)


SHAPES = {"mini": Shape("mini", "LLaDA2.0-mini MoE", 2048, moe_cfg(256, 8, 512, 8, 4)),
          "flash": Shape("flash", "LLaDA2.2-flash-shaped, one layer", 4096, moe_cfg(256, 8, 1024, 8, 4))}
SMOKE = Shape("smoke", "cpu smoke (tiny)", 64, moe_cfg(16, 4, 32, 4, 2))


def build(shape: Shape, device: str) -> MoE:
    with torch.device(device):
        moe = MoE(shape.dim, shape.cfg).to(torch.bfloat16)
    moe.expert_bias = moe.expert_bias.float()  # router state stays float32, as a loaded model keeps it
    with torch.no_grad():
        for p in (moe.gate, moe.w_gate_up, moe.w_down, *(moe.shared.parameters() if moe.shared else ())):
            p.normal_(std=shape.dim ** -0.5)  # router logits of std ~1 for unit-RMS tokens
    return moe


def eager_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def touched(ids: torch.Tensor, experts: int, rows: int) -> tuple[list[int], int]:
    """Distinct experts of each row's block and of the whole forward (id `experts`: a pair to no expert)."""
    per_block = [int(torch.unique(r[r < experts]).numel()) for r in ids.view(rows, -1)]
    return per_block, int(torch.unique(ids[ids < experts]).numel())


@torch.no_grad()
def measure(moe: MoE, x: torch.Tensor, groups: torch.Tensor, timer: Callable[[Callable[[], object]], float],
            hbm: float | None) -> dict:
    """One (shape, batch, routing) record: x [rows, BLOCK, D], groups [rows, BLOCK]."""
    c, (rows, q, D) = moe.cfg, x.shape
    flat = x.view(-1, D)
    block = c.expert_capacity is not None
    index = route_index(groups) if block else None  # the model makes it once per forward, not per layer
    ids, w = moe.route(flat, "auto", groups, index)
    per_block, union = touched(ids, c.num_experts, rows)
    weight_bytes = ((union + c.num_shared) * 3 * D * c.expert_dim * 2  # routed experts read + the shared ones
                    + c.num_experts * D * 2)  # + the router's gate
    nbytes = weight_bytes + rows * q * D * 2 * (1 + c.top_k)  # + x in, the k partial outputs out (as bench_moe)
    triton = (moe_triton.supports(flat, moe.w_gate_up, moe.w_down)
              and moe_triton.auto_uses_triton(ids.numel(), c.num_experts))  # what backend "auto" runs here
    rec = {"routing": "block" if c.expert_capacity else "standard", "capacity": c.expert_capacity,
           "batch": rows, "tokens": rows * q, "experts_backend": "triton" if triton else "grouped_mm",
           "experts_per_block_mean": sum(per_block) / rows, "experts_per_block_max": max(per_block),
           "experts_per_forward": union,
           "uniform_per_block": expected_touched(c.num_experts, c.top_k, q),
           "uniform_per_forward": expected_touched(c.num_experts, c.top_k, rows * q),
           "weight_bytes": weight_bytes, "bytes": nbytes,
           "forward_ms": timer(lambda: moe(x, "auto", groups, index)),
           "router_ms": timer(lambda: moe.route(flat, "auto", groups, index)),
           "experts_ms": timer(lambda: moe._routed(flat, ids, w, "auto", skip=True))}
    if block:  # once per forward (the model's), not in forward_ms: here its cost alone
        rec["route_index_ms_per_forward"] = timer(lambda: route_index(groups))
    rec["gb_per_s"] = nbytes / rec["forward_ms"] / 1e6
    if hbm:
        rec["roofline_ms"] = nbytes / hbm * 1e3
        rec["hbm_share"] = rec["roofline_ms"] / rec["forward_ms"]
    return rec


@torch.no_grad()
def check_op(moe: BlockRoutedMoE, x: torch.Tensor, groups: torch.Tensor) -> dict:
    """The Triton block router against the torch block_route on the same logits."""
    c = moe.cfg
    logits = router_logits(x.view(-1, x.shape[-1]), moe.gate)
    ids, w = torch.ops.compiledllm.moe_block_route(logits, moe.expert_bias, route_index(groups), groups.shape[1],
                                                   c.expert_capacity, c.top_k, c.norm_topk_prob, c.routed_scaling)
    ref_ids, ref_w = block_route(logits, moe.expert_bias, groups, c)
    return {"ids_equal": bool(torch.equal(ids, ref_ids)),
            "tokens_with_other_ids": int((ids != ref_ids).any(-1).sum()),
            "weights_allclose": bool(torch.allclose(w, ref_w, rtol=1e-5, atol=1e-5)),
            "weights_max_abs_diff": float((w - ref_w).abs().max())}


# The router and sort forms the defaults do not take (the standard router's top-k by sort, admission by sort in
# rows longer than BLOCK_ROUTE_ROW_MAX, the one-program sort; each slower or even where timed so far), against
# moe_triton's defaults; `--candidate-forms` runs the whole benchmark under them.
CANDIDATE = {"ROUTER_TOPK_SORT": True, "BLOCK_ADMIT_SORT": True, "SORT_SMALL_PAIRS": 512}


@contextlib.contextmanager
def forms(**settings):
    """moe_triton's kernel-form settings for the duration (restored after)."""
    before = {k: getattr(moe_triton, k) for k in settings}
    for k, v in settings.items():
        setattr(moe_triton, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(moe_triton, k, v)


@torch.no_grad()
def sweep(standard: MoE, moe: BlockRoutedMoE, x: torch.Tensor, groups: torch.Tensor) -> dict:
    """What the routers', the sort's and the experts' forms cost at this shape, CUDA-graph medians: the block
    router by (phase 1 per row or by atomic max, admission by sort or rank tiles, top-k by sort or max picks) and
    warps, and the standard router by top-k form (on fixed logits); the sort in one program or three kernels; the
    whole layer of both routings under the defaults, the candidate forms, and the experts' sorted and scan forms
    (the scan form only where it applies: up to SCAN_MAX_TOKENS tokens, else None); the experts' (gate_up, down)
    tiles on the block-routed assignment (gate_up tiles first with the default down tile, then down tiles with the best
    gate_up)."""
    c, D = moe.cfg, x.shape[-1]
    flat = x.view(-1, D)
    logits, index, row = router_logits(flat, moe.gate), route_index(groups), groups.shape[1]
    live = groups.reshape(-1)
    block_forms = [("row", row, None, True), ("row", row, None, False), ("atomic", 0, True, True),
                   ("atomic", 0, False, True), ("atomic", 0, False, False)]
    router = [{"phase1": p1, "admit": "sort" if admit is not False else "rank", "topk": "sort" if ts else "max",
               "warps": warps, "ms": graph_ms(lambda: moe_triton.block_route_launch(
                   logits, moe.expert_bias, index, row, c.expert_capacity, c.top_k, c.norm_topk_prob,
                   c.routed_scaling, warps=warps, admit_sort=admit, topk_sort=ts, row_max=rm))}
              for p1, rm, admit, ts in block_forms for warps in (1, 2, 4, 8)]
    sc = standard.cfg
    std_router = [{"topk": "sort" if ts else "max", "ms": graph_ms(lambda: moe_triton.route_launch(
        logits, standard.expert_bias, live, sc.n_group, sc.topk_group, sc.top_k, sc.norm_topk_prob,
        sc.routed_scaling, topk_sort=ts))} for ts in (True, False)]
    ids, w = moe.route(flat, "auto", groups, index)
    up0, down0 = moe_triton.default_tiles(ids.numel(), c.num_experts, D, c.expert_dim)
    bms = (up0.block_m, down0.block_m)
    sort = {f"{'one_program' if small else 'three_kernels'}_ms": graph_ms(
        lambda: moe_triton.sort_pairs(ids, c.num_experts, bms, small)) for small in (True, False)}
    layers = {"scan": None}
    scan = {"EXPERT_SCAN_TOKENS": moe_triton.SCAN_MAX_TOKENS} if flat.shape[0] <= moe_triton.SCAN_MAX_TOKENS else None
    for name, settings in (("default", {}), ("candidate", CANDIDATE), ("sorted", {"EXPERT_SCAN_TOKENS": 0}),
                           ("scan", scan)):
        if settings is None:
            continue
        with forms(**settings):
            layers[name] = {"standard_ms": graph_ms(lambda: standard(x, "auto", groups, None)),
                            "block_ms": graph_ms(lambda: moe(x, "auto", groups, index))}

    def tiles_ms(up: moe_triton.MoETile, down: moe_triton.MoETile) -> float:
        return graph_ms(lambda: moe_triton.launch(flat, moe.w_gate_up, moe.w_down, ids, w, (up, down)))

    spec = lambda bm, bn, bk, warps, st, n, k: moe_triton.MoETile(  # noqa: E731
        bm, moe_triton._block(n, bn), moe_triton._block(k, bk), warps, st)
    grid = [(16, bn, bk, warps, st) for bn in (32, 64, 128) for bk in (64, 128) for warps in (2, 4) for st in (3, 4)]
    ups = [{"tile": t, "ms": tiles_ms(spec(*t, c.expert_dim, D), down0)} for t in grid]
    best_up = min(ups, key=lambda r: r["ms"])
    up = spec(*best_up["tile"], c.expert_dim, D)
    downs = [{"tile": t, "ms": tiles_ms(up, spec(*t, D, c.expert_dim))} for t in grid]
    best_down = min(downs, key=lambda r: r["ms"])
    down = spec(*best_down["tile"], D, c.expert_dim)
    default_tiles = moe_triton.default_tiles
    moe_triton.default_tiles = lambda *a, **k: (up, down)  # the whole block-routed layer with the best tiles
    try:
        forward_best = graph_ms(lambda: moe(x, "auto", groups, index))
    finally:
        moe_triton.default_tiles = default_tiles
    return {"router": router, "standard_router": std_router, "sort": sort, "layers": layers,
            "default_tiles": [dataclasses.asdict(up0), dataclasses.asdict(down0)],
            "default_ms": tiles_ms(up0, down0), "gate_up": ups, "down": downs,
            "best": {"gate_up": best_up, "down": best_down}, "forward_ms_best_tiles": forward_best}


# The A/B of decode-row settings (--ab): the defaults against the forms they replaced on 2026-12-06 (the block
# router's phase 1 by atomic max with admission by rank tiles and top-k by max picks; the scan form on
# default_tiles' 128-wide decode tiles), each alone and both; and, with --shared, the shared expert as its own MLP
# (moe_triton.FUSE_SHARED off; the default since 2026-12-06 runs it inside the routed op)
AB = {"default": {}, "atomic_router": {"BLOCK_ROUTE_ROW_MAX": 0, "BLOCK_TOPK_SORT": False},
      "wide_tiles": {"SCAN_TILE_SPECS": ((128, 128, 4, 3), (128, 128, 4, 3))},
      "shared_separate": {"FUSE_SHARED": False}}
AB["before"] = AB["atomic_router"] | AB["wide_tiles"]


@torch.no_grad()
def ab(standard: MoE, moe: BlockRoutedMoE, x: torch.Tensor, groups: torch.Tensor, rounds: int) -> dict:
    """The whole layer of both routings under each AB setting, `rounds` rounds interleaved (a drift of the clocks
    moves every setting alike), CUDA-graph medians; per setting the median over rounds of each routing and of the
    ratio, and each layer's kernels once (kernel durations from the profiler)."""
    index = route_index(groups)
    runs = {name: [] for name in AB}
    for _ in range(rounds):
        for name, settings in AB.items():
            with forms(**settings):
                s = graph_ms(lambda: standard(x, "auto", groups, None))
                b = graph_ms(lambda: moe(x, "auto", groups, index))
            runs[name].append({"standard_ms": s, "block_ms": b, "ratio": s / b})
    out = {}
    for name, rs in runs.items():
        with forms(**AB[name]):
            profiles = {"standard": kernels(standard, x, groups)["kernel_us_sum"],
                        "block": kernels(moe, x, groups)["kernel_us_sum"]}
        out[name] = {"settings": AB[name], "rounds": rs,
                     **{k: statistics.median(r[k] for r in rs) for k in ("standard_ms", "block_ms", "ratio")},
                     "kernel_us_sum": profiles}
    return out


def print_sweep(s: dict) -> None:
    best = s["best"]
    fastest = sorted(s["router"], key=lambda r: r["ms"])[:4]
    print(f"sweep {s['shape']} B={s['batch']}: block router fastest " + ", ".join(
        f"{r['phase1']}/{r['admit']}/{r['topk']}/w{r['warps']} {r['ms'] * 1e3:.1f}us" for r in fastest)
        + "; all: " + ", ".join(f"{r['phase1']}/{r['admit']}/{r['topk']}/w{r['warps']} {r['ms'] * 1e3:.1f}"
                                for r in s["router"]), flush=True)
    print(f"sweep {s['shape']} B={s['batch']}: standard router " + ", ".join(
        f"topk {r['topk']} {r['ms'] * 1e3:.1f}us" for r in s["standard_router"]) + "; sort " + ", ".join(
        f"{k} {v * 1e3:.1f}us" for k, v in s["sort"].items()) + "; layer std/block, default forms " +
        "{standard_ms:.4f}/{block_ms:.4f} ms, candidate forms {c[standard_ms]:.4f}/{c[block_ms]:.4f} ms".format(
            **s["layers"]["default"], c=s["layers"]["candidate"]) + ", experts " + ", ".join(
            f"{form} " + ("{standard_ms:.4f}/{block_ms:.4f} ms".format(**t) if t else "- (too many tokens)")
            for form, t in (("sorted", s["layers"]["sorted"]), ("scan", s["layers"]["scan"]))) +
        f"; experts default tiles {s['default_ms']:.4f} ms, best up {best['gate_up']['tile']} -> down "
        f"{best['down']['tile']} {best['down']['ms']:.4f} ms; layer with them {s['forward_ms_best_tiles']:.4f} ms",
        flush=True)


@torch.no_grad()
def kernels(moe: MoE, x: torch.Tensor, groups: torch.Tensor, calls: int = 20) -> dict:
    """The layer's CUDA kernels by time per call (the profiler over eager calls: kernel durations, not the
    launch gaps a graph replay removes) and their sum, to set beside the graph replay's forward_ms."""
    from torch.profiler import ProfilerActivity, profile

    from compiledllm.profiler import top_ops

    index = route_index(groups) if moe.cfg.expert_capacity is not None else None
    for _ in range(3):
        moe(x, "auto", groups, index)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            moe(x, "auto", groups, index)
        torch.cuda.synchronize()
    rows = [{"kernel": r["name"][:90], "calls": r["calls"] / calls, "us": r["total_ms"] * 1e3 / calls}
            for r in top_ops(prof, cuda=True, limit=None)]
    return {"kernels": rows, "kernel_us_sum": sum(r["us"] for r in rows)}


def table(records: list[dict]) -> None:
    print(f"\n{'shape':>6} {'B':>3} {'routing':>8} {'exp/blk':>11} {'exp/fwd':>7} {'unif/fwd':>8} {'weight MB':>9} "
          f"{'fwd ms':>8} {'router ms':>9} {'experts ms':>10} {'GB/s':>6} {'%HBM':>5} {'speedup':>7}")
    for r in records:
        blk = f"{r['experts_per_block_mean']:.1f}/{r['experts_per_block_max']}"
        pct = f"{r['hbm_share']:5.0%}" if "hbm_share" in r else f"{'-':>5}"
        up = f"{r['speedup']:6.2f}x" if "speedup" in r else f"{'':>7}"
        print(f"{r['shape']:>6} {r['batch']:>3} {r['routing']:>8} {blk:>11} {r['experts_per_forward']:>7} "
              f"{r['uniform_per_forward']:8.1f} {r['weight_bytes'] / 1e6:9.1f} {r['forward_ms']:8.3f} "
              f"{r['router_ms']:9.3f} {r['experts_ms']:10.3f} {r['gb_per_s']:6.0f} {pct} {up}")
    print("exp/blk: distinct experts per 32-token block, mean/max; exp/fwd: per forward (the union, read per layer);"
          " unif/fwd: uniform routing's expectation; speedup: standard fwd ms / block fwd ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="mini,flash", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--batches", default="1,8,32", help="rows of one 32-token block each")
    ap.add_argument("--capacity", type=int, default=None, help="experts a block admits (default 48; smoke 6)")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU: torch path, eager timing")
    ap.add_argument("--sweep", default="", help="batches (e.g. 1,8) at which to also time the block router's "
                                                "variants and the experts' tiles under block routing (CUDA)")
    ap.add_argument("--candidate-forms", action="store_true",
                    help="the whole run with the router and sort forms the defaults do not take (CANDIDATE)")
    ap.add_argument("--kernels", action="store_true", help="also list each layer's CUDA kernels by time (CUDA)")
    ap.add_argument("--shared", type=int, default=0,
                    help="shared experts in the layer (LLaDA2.0-mini and LLaDA2.2-flash have 1; default 0: the part "
                         "block routing changes)")
    ap.add_argument("--ab", type=int, default=0, help="rounds of the decode-row A/B (AB) at batch 1 (CUDA; 0: none)")
    ap.add_argument("--out", default="docs/results/bench_block_routing.json")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    with forms(**(CANDIDATE if args.candidate_forms else {})):
        run(args, smoke)


def run(args: argparse.Namespace, smoke: bool) -> None:
    if not smoke and not torch.cuda.is_available():
        sys.exit("bench_block_routing: needs CUDA (or --cpu-smoke)")
    device = "cpu" if smoke else "cuda"
    capacity = args.capacity or (6 if smoke else 48)
    shapes = [dataclasses.replace(s, cfg=dataclasses.replace(s.cfg, num_shared=args.shared))
              for s in ([SMOKE] if smoke else [SHAPES[s] for s in args.shapes.split(",")])]
    batches = [int(b) for b in args.batches.split(",") if b]
    ceil = None if smoke else ceilings()
    timer = eager_ms if smoke else graph_ms
    records, checks, sweeps, abs_ = [], [], [], []
    for shape in shapes:
        torch.manual_seed(0)  # weights and tokens: the same experts touched in every run
        standard = build(shape, device)
        blocked = BlockRoutedMoE.adopt(standard, dataclasses.replace(shape.cfg, expert_capacity=capacity,
                                                                     route_block=BLOCK))
        for batch in batches:
            x = torch.randn(batch, BLOCK, shape.dim, device=device).to(torch.bfloat16)  # each token its own vector
            groups = torch.zeros(batch, BLOCK, dtype=torch.long, device=device)  # one block per row: block 0
            pair = [measure(m, x, groups, timer, ceil and ceil["hbm_bytes_per_s"]) for m in (standard, blocked)]
            pair[1]["speedup"] = pair[0]["forward_ms"] / pair[1]["forward_ms"]
            for r in pair:
                r |= {"shape": shape.name, "label": shape.label}
                print(json.dumps(r), flush=True)
            if args.kernels and not smoke:
                for m, r in zip((standard, blocked), pair):
                    r["kernel_profile"] = kernels(m, x, groups)
                    print(f"kernels {shape.name} B={batch} {r['routing']}: graph {r['forward_ms'] * 1e3:.1f} us, "
                          f"kernels {r['kernel_profile']['kernel_us_sum']:.1f} us: " + "; ".join(
                              f"{k['kernel'][:40]} {k['us']:.1f}" for k in r["kernel_profile"]["kernels"]),
                          flush=True)
            records += pair
            if not smoke:
                checks.append({"shape": shape.name, "batch": batch, **check_op(blocked, x, groups)})
                print("Triton moe_block_route vs torch block_route:", json.dumps(checks[-1]), flush=True)
            if batch == 1 and args.ab and not smoke:
                abs_.append({"shape": shape.name, **ab(standard, blocked, x, groups, args.ab)})
                print(f"ab {shape.name} B=1 (standard / block ms, ratio; medians of {args.ab} rounds): " + ", ".join(
                    f"{k} {v['standard_ms']:.4f}/{v['block_ms']:.4f} {v['ratio']:.3f}x"
                    for k, v in abs_[-1].items() if k != "shape"), flush=True)
            if str(batch) in args.sweep.split(",") and not smoke:
                sweeps.append({"shape": shape.name, "batch": batch, **sweep(standard, blocked, x, groups)})
                print_sweep(sweeps[-1])
        del standard, blocked
    out = {"device": torch.cuda.get_device_name() if not smoke else "cpu (smoke)", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "command": shlex.join(["python3", *sys.argv]), "ceilings": ceil,
           "block": BLOCK, "capacity": capacity,
           "forms": {k: getattr(moe_triton, k) for k in (*CANDIDATE, "BLOCK_TOPK_SORT", "BLOCK_ROUTE_ROW_MAX",
                                                          "EXPERT_SCAN_TOKENS", "SCAN_TILE_SPECS", "FUSE_SHARED")},
           "shared_experts": args.shared,
           "shapes": {s.name: {"label": s.label, "dim": s.dim, **dataclasses.asdict(s.cfg)} for s in shapes},
           "op_checks": checks if not smoke else "skipped: no CUDA (the Triton router)", "records": records,
           **({"sweeps": sweeps} if sweeps else {}), **({"ab": abs_} if abs_ else {})}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    for c in checks:
        print(f"op check {c['shape']} B={c['batch']}: ids equal {c['ids_equal']}, weights allclose "
              f"{c['weights_allclose']} (max |diff| {c['weights_max_abs_diff']:.2e})")
    table(records)


if __name__ == "__main__":
    main()
