"""Decode-step throughput on the GPU against the roofline (issue: GPU engine).

`threshold` with a fixed schedule (tau 1.0, steps 20, block 32) on real-size random models (presets
llada2.0-mini, sdar-8b). For each context and batch the slot state is built directly: every row has a
`context`-token prefix whose KV is filled with random values and decodes a fresh block after it. The decode
step (forward of every row's block against its cached prefix + acceptance) is timed eagerly and as a
replayed CUDA graph (optionally compiled + captured) with CUDA events as the mean over a block's 20 steps
(the head computes only the still-masked rows, so a block's steps differ), and compared with the roofline
step time from ceilings measured in the same run: max(bytes / HBM bandwidth, FLOPs / bf16 matmul rate)
over weights read, KV read and the head. The models route like a load-balanced trained router (balanced
routing, models/routing.py; --routing random: the plain init of the figures before it), and each point reports
the distinct experts every MoE layer touched over the timed block (`touched_experts`, the roofline's expert reads).

    python tools/bench/bench_decode.py --out docs/results/bench_decode_h200.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch

from gpu_timing import ceilings, graph_ms, time_ms

from compiledllm.attention import triton_packed
from compiledllm.attention.packed import packed_attention
from compiledllm.attention.spec import Kernels
from compiledllm.engine.state import SlotState
from compiledllm.engine.step import run_step
from compiledllm.engine.stepper import Stepper
from compiledllm.kv.cache import KVCache
from compiledllm.loader import build_random
from compiledllm.models.head import head_logits
from compiledllm.models.layers import MoE
from compiledllm.models.routing import ROUTINGS, count_touched, moe_layers
from compiledllm.policies.threshold import ThresholdConfig, ThresholdPolicy

BLOCK, STEPS = 32, 20


def masked_share(block: int = BLOCK, steps: int = STEPS) -> float:
    """The mean share of a block's positions still masked at a step, over a block's `steps` steps under the fixed
    schedule (the head's rows: it computes only those)."""
    left, total = block, 0
    for step in range(steps):
        total += left
        left -= block // steps + (step < block % steps)
    return total / (steps * block)


def step_costs(cfg, batch: int, context: int, touched: list[int] | None = None, block: int = BLOCK,
               steps: int = STEPS) -> dict:
    """Bytes read and FLOPs of one decode step (weights, KV, head), counted from the model shape, as a mean over a
    block's steps (head FLOPs for the still-masked rows). `touched`: the distinct routed experts each MoE layer
    really used; without it, the expectation under uniform routing."""
    tokens = batch * block
    d, L, H, KVH, hd, V = cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    attn = d * (H + 2 * KVH) * hd + H * hd * d
    dense = 3 * d * cfg.intermediate_size
    if cfg.moe is not None:
        m = cfg.moe
        expert, shared, router = 3 * d * m.expert_dim, 3 * d * m.expert_dim * m.num_shared, d * m.num_experts
        moe_layers = L - m.first_dense_layers
        if touched is None:
            touched = [m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** tokens)] * moe_layers
        read = L * attn + m.first_dense_layers * dense + moe_layers * (router + shared) + sum(touched) * expert
        active = L * attn + m.first_dense_layers * dense + moe_layers * (router + shared + m.top_k * expert)
    else:
        read = active = L * (attn + dense)
    weight_bytes = 2 * (read + V * d)
    kv_bytes = batch * L * 2 * KVH * hd * 2 * (context + block)
    flops = 2 * tokens * (active + masked_share(block, steps) * V * d) + 4 * tokens * (context + block) * H * hd * L
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops}


def roofline_ms(costs: dict, ceil: dict) -> tuple[float, str]:
    """max(bytes / HBM bandwidth, FLOPs / matmul rate) and which one bounds."""
    mem = (costs["weight_bytes"] + costs["kv_bytes"]) / ceil["hbm_bytes_per_s"] * 1e3
    comp = costs["flops"] / ceil["bf16_flops_per_s"] * 1e3
    return max(mem, comp), "memory" if mem >= comp else "compute"


def synthetic_state(model, policy, batch: int, context: int) -> tuple[SlotState, KVCache]:
    cfg, dev = model.config, model.device
    capacity = context + 16 * BLOCK
    params = {k: torch.full((batch,), float(v), device=dev) for k, v in policy.row_params().items()}  # as a session
    st = SlotState.allocate(batch, capacity, policy.init_state(batch, dev), model.mask_token_id, dev, params)
    st.seq[:, :context] = torch.randint(0, cfg.vocab_size - 2, (batch, context), device=dev)
    st.prompt_len.fill_(context)
    st.work_len.fill_(capacity)
    st.block_start.fill_(context)
    st.active.fill_(True)
    kv = KVCache.allocate(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, model.dtype, dev)
    kv.k.normal_()
    kv.v.normal_()
    return st, kv


def cycle_ms(run, repeats: int = 3) -> float:
    """Mean step time over STEPS consecutive steps: with tau 1.0 a block takes exactly STEPS forwards, so that
    is every phase of a block once (the head computes only the still-masked rows: a block's steps differ).
    Median over `repeats` cycles, after 2 warm-up steps."""
    for _ in range(2):
        run()
    cycles = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(STEPS):
            run()
        b.record()
        b.synchronize()
        cycles.append(a.elapsed_time(b) / STEPS)
    return sorted(cycles)[len(cycles) // 2]


def max_batch(model, context: int) -> int:
    cfg = model.config
    per_row = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * (context + 16 * BLOCK)
    per_row += BLOCK * cfg.vocab_size * 4 * 4 + BLOCK * 64 * cfg.hidden_size * 4  # logits/softmax + activations
    free = torch.cuda.mem_get_info()[0]
    return max(1, int(0.80 * free // per_row))


def touched_experts(model, policy, st, kv) -> list[float]:
    """The distinct routed experts each MoE layer's routing chose, as the mean over one block's STEPS + 1 decode
    steps run eagerly on the point's state (the routing of the steps being timed: a block's MASK share falls from
    1 to 0 over them). Before this, the tool counted one forward of the point's first block after it was decoded."""
    with count_touched(model) as found:
        for _ in range(STEPS + 1):
            run_step(model, policy, st, kv)
    return found.mean_per_layer()


def step_split(model, policy, st, kv) -> dict:
    """Where a step's time goes: each piece captured alone as a CUDA graph on the step's real inputs
    (layer 1 stands for every later layer). `sum_ms` adds the pieces up as the step runs them."""
    cfg = model.config
    fwd = policy.plan("decode", st)
    window, idx = fwd.tokens, fwd.positions
    h = model.embed(window)
    cos, sin = model.rotary.cos_sin(idx)
    first, layer = model.layers[0], model.layers[min(1, cfg.num_layers - 1)]
    att = layer.attn
    B, L, _ = h.shape
    q, k, v = att.qkv(h).view(B, L, att.h + 2 * att.kvh, att.hd).split([att.h, att.kvh, att.kvh], dim=2)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    lkv = kv.layer(1)
    x = layer.post_norm(h).reshape(B * L, -1)
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    logits = model(fwd, kv)
    parts = {
        "plan": lambda: policy.plan("decode", st),
        "embed": lambda: model.embed(window),
        "attn_sublayer": lambda: att(layer.input_norm(h), model.rotary, cos, sin, fwd, lkv),
        "attn_kernel": lambda: packed_attention(q, lkv.k, lkv.v, st.block_start, k, v, BLOCK),
        "first_mlp_sublayer": lambda: first.mlp(first.post_norm(h)),
        "mlp_sublayer": lambda: layer.mlp(layer.post_norm(h)),
        "head_all_rows": lambda: model.norm(h) @ head.t(),
        "head_needed_rows": lambda: head_logits(model.norm(h), head, fwd.logits_rows),
        "policy_update": lambda: policy.update("decode", st, fwd, logits),
    }
    if isinstance(layer.mlp, MoE):
        moe = layer.mlp
        ids, w = moe.route(x)
        parts["moe_route"] = lambda: moe.route(x)
        if moe.shared is not None:
            parts["moe_shared"] = lambda: moe.shared(x)
        for backend in ("triton", "grouped_mm"):
            parts[f"moe_routed_{backend}"] = lambda backend=backend: moe._routed(x, ids, w, backend)
    out = {}
    for name, fn in parts.items():
        try:
            out[name] = graph_ms(fn)
        except Exception as e:  # a piece that cannot run (e.g. no Triton) is reported, not fatal
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    num = [out.get(n) for n in ("plan", "embed", "attn_sublayer", "first_mlp_sublayer", "mlp_sublayer",
                                "head_needed_rows", "policy_update")]
    if all(isinstance(t, float) for t in num):
        plan, emb, attn, first_mlp, mlp, hd, upd = num
        out["sum_ms"] = plan + emb + cfg.num_layers * attn + first_mlp + (cfg.num_layers - 1) * mlp + hd + upd
    return out


def bench_point(model, policy, batch, context, ceil, modes, split=False, moe_ab=False, attn_ab=False) -> dict:
    rec = {"batch": batch, "context": context}
    torch.manual_seed(context * 1009 + batch)  # the same prefix and KV, so the same experts touched, in every run
    st, kv = synthetic_state(model, policy, batch, context)
    with torch.no_grad():
        if "eager" in modes:
            rec["eager_ms"] = cycle_ms(lambda: run_step(model, policy, st, kv), 1)
            fwd = policy.plan("decode", st)
            rec["eager_forward_ms"] = time_ms(lambda: model(fwd, kv), 8)
        for mode in [m for m in modes if m != "eager"]:
            t0 = time.perf_counter()
            # compiled+graphs: regional compilation (the engine's); compiled-whole+graphs: the step as one graph
            stepper = Stepper(model, policy, st, kv, [batch], compile=mode != "graphs", cuda_graphs=True,
                              regional=mode != "compiled-whole+graphs")
            rec[f"{mode}_startup_s"] = time.perf_counter() - t0
            rec[f"{mode}_ms"] = cycle_ms(lambda: stepper.run(batch))
            del stepper
            # each point stands alone: drop Dynamo's compiled variants (without this, a grid's later points found
            # far less free memory: the largest batch at 32K came out 39 and 19, against 63 with it) and hand the
            # capture's private pool back
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        if moe_ab and moe_layers(model) and "graphs" in modes:  # the grouped-GEMM MoE in the same run
            stepper = Stepper(model, policy, st, kv, [batch], compile=False, cuda_graphs=True,
                              kernels=Kernels(moe="grouped_mm"))
            rec["graphs_grouped_mm_ms"] = cycle_ms(lambda: stepper.run(batch))
            del stepper
            torch.cuda.empty_cache()
        if attn_ab and "graphs" in modes:  # each packed-attention kernel in the same run
            for name in ("cupy", "triton"):
                stepper = Stepper(model, policy, st, kv, [batch], compile=False, cuda_graphs=True,
                                  kernels=Kernels(attention=name))
                rec[f"graphs_attn_{name}_ms"] = cycle_ms(lambda: stepper.run(batch))
                del stepper
                torch.cuda.empty_cache()
        if split:
            rec["split"] = step_split(model, policy, st, kv)
        touched = touched_experts(model, policy, st, kv) if moe_layers(model) else None
    if touched is not None:
        rec["touched_experts"] = touched
        rec["roofline_uniform_routing_ms"] = roofline_ms(step_costs(model.config, batch, context), ceil)[0]
    costs = step_costs(model.config, batch, context, touched)
    roof, bound = roofline_ms(costs, ceil)
    rec |= costs | {"roofline_ms": roof, "roofline_bound": bound}
    best = min(rec.get(f"{m}_ms", math.inf) for m in modes)
    rec["best_ms"] = best
    rec["tokens_per_s"] = batch * BLOCK / (STEPS + 1) / (best / 1e3)  # tokens decoded per forward: block / (T+1)
    rec["roofline_ratio"] = best / rec["roofline_ms"]
    del st, kv
    torch.cuda.empty_cache()
    return rec


def pending(preset: str, context: int, fit: int, wanted: list[str], records: list[dict]) -> list[int]:
    """The batch sizes still to measure at (preset, context): `wanted` holds sizes and "max" (= fit); sizes above
    fit and points already in `records` are left out ("max" is done once any record there was its run's fit,
    which may differ between runs)."""
    mine = [r for r in records if (r["model"], r["context"]) == (preset, context)]
    done = {r["batch"] for r in mine}
    max_done = any(r["batch"] == r["largest_fit"] for r in mine)
    sizes = {fit if x == "max" else int(x) for x in wanted if x != "max" or not max_done}
    return sorted(b for b in sizes if b <= fit and b not in done)


def write_json(path: str, ceil: dict, modes: list[str], records: list[dict]) -> None:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil, "block": BLOCK,
           "attn_tile": dataclasses.asdict(triton_packed.default_triton_tile(128)),
           "steps": STEPS, "threshold": 1.0, "modes": modes, "records": records, "date": time.strftime("%Y-%m-%d")}
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


def print_table(records: list[dict]) -> None:
    print(f"\n{'model':14} {'ctx':>6} {'B':>4} {'eager ms':>9} {'graph ms':>9} {'x':>5} {'comp ms':>8} {'roof ms':>8} "
          f"{'vs roof':>7} {'tok/s':>9} {'experts/layer':>13}")
    for r in records:
        if "error" in r:
            print(f"{r['model']:14} {r['context']:>6} {r['batch']:>4}  {r['error'][:60]}")
            continue
        e, g = r.get("eager_ms", float("nan")), r.get("graphs_ms", float("nan"))
        c = r.get("compiled+graphs_ms", float("nan"))
        t = r.get("touched_experts")  # per MoE layer: mean (min-max)
        experts = f"{sum(t) / len(t):.0f} ({min(t):.0f}-{max(t):.0f})" if t else "-"
        print(f"{r['model']:14} {r['context']:>6} {r['batch']:>4} {e:9.2f} {g:9.2f} {e / g:5.2f} {c:8.2f} "
              f"{r['roofline_ms']:8.2f} {r['roofline_ratio']:7.2f} {r['tokens_per_s']:9.0f} {experts:>13}")
    for r in records:
        if "split" in r:
            pieces = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r["split"].items())
            print(f"split {r['model']} {r['context']} B{r['batch']} (graph {r.get('graphs_ms', float('nan')):.2f} ms, "
                  f"grouped-GEMM MoE {r.get('graphs_grouped_mm_ms', float('nan')):.2f} ms): {pieces}")


def load_records(paths: list[str]) -> tuple[list[dict], dict]:
    """The finished points of earlier runs' JSONs, each point once (shards that resumed the same file all hold
    its points; errors dropped), and the first file's header for a merge."""
    found, header = {}, {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        header = header or data
        for r in data["records"]:
            if "error" not in r:
                found.setdefault((r["model"], r["context"], r["batch"]), r)
    return list(found.values()), header


def plan_key(plan: str, r: dict) -> tuple:
    """Grid order of a record: the plan's preset and context order, then batch."""
    items = [(preset, int(c)) for preset, cs in (i.split(":") for i in plan.split(";")) for c in cs.split(",")]
    where = (r["model"], r["context"])
    return (items.index(where) if where in items else len(items), r["batch"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default="llada2.0-mini:4096,16384,32768;sdar-8b:4096,16384",
                    help="preset:context,context;... (contexts in tokens)")
    ap.add_argument("--batches", default="1,8,32,64,max")
    ap.add_argument("--modes", default="eager,graphs",
                    help="eager, graphs, compiled+graphs (regional compile), compiled-whole+graphs (one graph per step)")
    ap.add_argument("--out", default="docs/results/bench_decode.json")
    ap.add_argument("--split", action="store_true", help="also time the step's pieces (CUDA graph each)")
    ap.add_argument("--moe-ab", action="store_true", help="also run the CUDA-graph step with the grouped-GEMM MoE")
    ap.add_argument("--attn-ab", action="store_true", help="also run the CUDA-graph step with each attention kernel")
    ap.add_argument("--resume", nargs="+", default=[],
                    help="JSONs this tool wrote: their finished points are kept, not re-measured (each record holds "
                         "the ceilings of the run that measured it)")
    ap.add_argument("--merge", action="store_true", help="only merge the --resume JSONs into --out (no GPU work)")
    ap.add_argument("--shard", default="0/1", help="I/N: measure every N-th pending point from the I-th (one "
                                                   "process per GPU; merge the shards' JSONs with --merge)")
    ap.add_argument("--routing", choices=ROUTINGS, default="balanced",
                    help="random models' routing (models/routing.py): balanced spreads a block over the experts a "
                         "trained router would; random is the plain init of earlier figures (few experts per block)")
    ap.add_argument("--attn-tile", choices=list(triton_packed.TRITON_TILES),
                    help="the Triton attention tile for every step (default: the engine's choice)")
    args = ap.parse_args()
    records, header = load_records(args.resume)
    if args.merge:
        records.sort(key=lambda r: plan_key(args.plan, r))
        header = {**header, "records": records}
        with open(args.out, "w") as f:
            json.dump(header, f, indent=2)
        print_table(records)
        return
    shard, shards = map(int, args.shard.split("/"))
    if args.attn_tile:  # the launch looks the default up at call time
        tile = triton_packed.TRITON_TILES[args.attn_tile]
        triton_packed.default_triton_tile = lambda rows: tile
    modes = args.modes.split(",")
    ceil = ceilings()
    print(f"ceilings: HBM {ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s",
          flush=True)
    resumed, point = len(records), -1
    for item in args.plan.split(";"):
        preset, contexts = item.split(":")
        t0 = time.perf_counter()
        model = build_random(preset, device="cuda", dtype=torch.bfloat16, routing=args.routing)
        build_s = time.perf_counter() - t0
        policy = ThresholdPolicy(ThresholdConfig(block_size=BLOCK, threshold=1.0, steps=STEPS), model.mask_token_id)
        for context in map(int, contexts.split(",")):
            fit = max_batch(model, context)
            for batch in pending(preset, context, fit, args.batches.split(","), records[:resumed]):
                point += 1
                if point % shards != shard:
                    continue
                try:
                    rec = bench_point(model, policy, batch, context, ceil, modes, args.split, args.moe_ab, args.attn_ab)
                except torch.OutOfMemoryError as e:
                    rec = {"batch": batch, "context": context, "error": f"OOM: {str(e).splitlines()[0]}"}
                    torch.cuda.empty_cache()
                except Exception as e:  # keep the run going; the JSON says what failed
                    rec = {"batch": batch, "context": context, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                rec |= {"model": preset, "routing": args.routing, "build_s": build_s, "largest_fit": fit,
                        "ceilings": ceil}
                records.append(rec)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                                  if k != "ceilings"}), flush=True)
                write_json(args.out, ceil, modes, records)  # after every point: a cut-off run keeps what it measured
        del model
        torch.cuda.empty_cache()
    print_table(records)


if __name__ == "__main__":
    main()
