"""The headline chart and tables of docs/results.md: decode tokens/s against batch size, one panel per model, one
colour per context, this engine (measured on one H200) against the published figures of other engines (normalised
to one H200 by HBM bandwidth ratio).

    python3 tools/plots/plot_headline.py             # writes docs/results/headline_decode_h200.png
    python3 tools/plots/plot_headline.py --tables    # prints docs/results.md's decode and peers tables (markdown)

Everything is read from JSON under docs/results/: this engine's figures from the benchmark files named by the
arguments (the run-6 grid of tools/bench/bench_decode.py, the session-7 re-run, the session-7 end-to-end runs), the peers'
from headline_peers.json, where each published figure is typed in with its source, hardware and setting. A peer's
figure is normalised as tokens/s x (H200 HBM) / (its GPU count x its GPU's HBM), datasheet bandwidths on both
sides: decode steps of these models stream their weights and KV once per step, so the bandwidth ratio is the most a
faster memory can buy. It does not make the workloads the same (model, tokens per forward, GPU count, memory
capacity and software differ): the chart and docs/results.md say so beside every figure.
"""
from __future__ import annotations

import argparse
import json
import os

RESULTS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "results"))

MODELS = [("llada2.0-mini", "LLaDA2.0-mini shape (16B MoE), random weights"),
          ("sdar-8b", "SDAR-8B shape (dense), random weights")]
CONTEXTS = {4096: "C0", 16384: "C1", 32768: "C2"}
SUMMARY_BATCHES = (1, 8, 32, 64)
TICKS = {"llada2.0-mini": [1, 8, 16, 32, 64, 128, 306], "sdar-8b": [1, 8, 15, 32, 64, 128], "other": [1, 32]}


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def tokens_per_s(batch: int, block: int, steps: int, ms: float) -> float:
    """The benchmark's own definition: batch x block tokens per (steps + 1) forwards of a block."""
    return batch * block / (steps + 1) / ms * 1e3


def records(name: str) -> list[dict]:
    d = load(name)
    return [dict(r, _block=d["block"], _steps=d["steps"]) for r in d["records"] if "error" not in r]


def tps(r: dict, mode: str = "compiled+graphs") -> float:
    return tokens_per_s(r["batch"], r["_block"], r["_steps"], r[f"{mode}_ms"])


def normalise(peers: dict, gpu: str, gpus: int) -> float:
    hbm = peers["hbm_tb_per_s"]
    return hbm[peers["target"]]["value"] / (gpus * hbm[gpu]["value"])


def ctx_label(ctx: int | None) -> str:
    return "-" if ctx is None else f"{ctx // 1024}K"


def fmt(x: float) -> str:
    return f"{x:,.0f}"


def shown(pt: dict) -> str:
    """A published figure as its source states it (">800" where it says "over 800")."""
    return pt.get("shown", f"{pt['tokens_per_s']:,}")


def decode_table(grid: list[dict]) -> str:
    rows = ["| model (random weights) | context | batch 1 | 8 | 32 | 64 | largest that fits (batch) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for model, _ in MODELS:
        for ctx in CONTEXTS:
            pts = {r["batch"]: r for r in grid if r["model"] == model and r["context"] == ctx}
            if not pts:
                continue
            top = max(pts)
            cells = [fmt(tps(pts[b])) if b in pts else "-" for b in SUMMARY_BATCHES]
            rows.append(f"| {model} | {ctx_label(ctx)} | " + " | ".join(cells) + f" | {fmt(tps(pts[top]))} ({top}) |")
    return "\n".join(rows)


def peers_summary(peers: dict) -> str:
    """The summary's short table: one row per published source and setup that the chart draws."""
    rows = [("| engine (published) | model | hardware | context, batch | tokens/s | normalised to one H200 | setting "
             "differs | source |"),
            "|---|---|---|---|---:|---:|---|---|"]
    for p in peers["peers"]:
        k = normalise(peers, p["gpu"], p["gpus"])
        pts = p["points"]
        where = " / ".join(f"{pt['batch']}" if pt["context"] is None else f"{ctx_label(pt['context'])}, {pt['batch']}"
                           for pt in pts)
        published = " / ".join(shown(pt) for pt in pts)
        normalised = " / ".join(fmt(pt["tokens_per_s"] * k) for pt in pts)
        rows.append(f"| {p['engine']} | {p['model']} | {p['gpus']}x {p['gpu']} | {where} | {published} | "
                    f"{normalised} (x{k:.2f}) | {p['short']} | {p['cite']} |")
    return "\n".join(rows)


def peers_table(peers: dict) -> str:
    rows = [("| engine (published) | model | hardware | context, batch | tokens/s published | normalised to one "
             "H200 | differs from this engine's figure | source |"),
            "|---|---|---|---|---:|---:|---|---|"]
    for p in peers["peers"]:
        k = normalise(peers, p["gpu"], p["gpus"])
        hw = f"{p['gpus']}x {p['gpu']}"
        for pt in p["points"]:
            note = f" ({pt['note']})" if pt.get("note") else ""
            where = f"{pt['batch']}" if pt["context"] is None else f"{ctx_label(pt['context'])}, {pt['batch']}"
            rows.append(f"| {p['engine']} | {p['model']} | {hw} | {where} | "
                        f"{shown(pt)}{note} | {fmt(pt['tokens_per_s'] * k)} (x{k:.3f}) | {p['setting']} | "
                        f"{p['source']} |")
    rows.append("")
    rows.append("Published, but neither normalised nor plotted:")
    rows.append("")
    for p in peers["not_plotted"]:
        rows.append(f"- **{p['engine']}**, {p['model']}, {p['gpus']}x {p['gpu']}: {p['figure']}. Not plotted: "
                    f"{p['why']}. Source: {p['source']}.")
    return "\n".join(rows)


def plot(args, grid, rerun, e2e, peers) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, 3, figsize=(18, 7.6), sharey=True, gridspec_kw={"width_ratios": [1.15, 1.0, 0.8]})
    for ax, (model, title) in zip(axes, MODELS):
        for ctx, colour in CONTEXTS.items():
            pts = sorted((r for r in grid if r["model"] == model and r["context"] == ctx), key=lambda r: r["batch"])
            if not pts:
                continue
            xs = [r["batch"] for r in pts]
            ax.plot(xs, [tps(r) for r in pts], "-o", color=colour, lw=2)
            ax.plot(xs, [tps(r, "graphs") for r in pts], "--", color=colour, lw=1, alpha=0.7)
            ax.plot(xs, [tps(r, "roofline") for r in pts], ":", color=colour, lw=1.2, alpha=0.8)
            ax.annotate(f"largest: {xs[-1]}", (xs[-1], tps(pts[-1])), textcoords="offset points", xytext=(-22, 7),
                        fontsize=7, color=colour)
        for r in rerun:
            if r["model"] == model:
                ax.plot(r["batch"], tps(r), "D", ms=7, mfc=CONTEXTS[r["context"]], mec="k")
        for p in peers["peers"]:
            if p["panel"] != model:
                continue
            k = normalise(peers, p["gpu"], p["gpus"])
            for pt in p["points"]:
                colour, b, t = CONTEXTS[pt["context"]], pt["batch"], pt["tokens_per_s"]
                ax.plot([b, b], [t, t * k], "-", color=colour, lw=3, alpha=0.45)
                ax.plot(b, t, "*", ms=14, mfc="white", mec=colour, mew=1.5)
                ax.plot(b, t * k, "*", ms=14, mfc=colour, mec="k", mew=0.6)
                ax.annotate(f"{t:,.0f} -> {t * k:,.0f}", (b, t), textcoords="offset points", xytext=(-30, -15),
                            fontsize=7, color=colour)
        if model == "llada2.0-mini":
            for s in e2e:
                ax.plot(s["_batch"], s["tokens_per_s"], "X", ms=9, color="0.35")
            if e2e:
                ax.annotate("end to end, prefill included", (e2e[0]["_batch"], min(s["tokens_per_s"] for s in e2e)),
                            textcoords="offset points", xytext=(8, -4), fontsize=7, color="0.35")
        if model == "sdar-8b":
            ax.annotate("SDAR-8B at 32K: no engine figure", (8, 458), textcoords="offset points", xytext=(-20, -32),
                        fontsize=7, color=CONTEXTS[32768])
        ax.set_title(title, fontsize=10)

    ax = axes[2]
    markers = iter("ovsP^")
    spread = iter((0.62, 0.8, 1.05, 1.35, 1.7))  # batch-1 points side by side (log axis), so that none hides another
    other = []
    for p in peers["peers"]:
        if p["panel"] != "other":
            continue
        k = normalise(peers, p["gpu"], p["gpus"])
        m = next(markers)
        dx = next(spread)
        xs = [pt["batch"] * (dx if pt["batch"] == 1 else 1) for pt in p["points"]]
        ys = [pt["tokens_per_s"] for pt in p["points"]]
        ax.plot(xs, ys, m, ms=9, mfc="white", mec="0.3", ls="-" if len(xs) > 1 else "", color="0.7")
        ax.plot(xs, [y * k for y in ys], m, ms=9, color="0.3", ls="-" if len(xs) > 1 else "")
        for x, y in zip(xs, ys):
            ax.plot([x, x], [y, y * k], "-", color="0.6", lw=2, alpha=0.5)
        figures = ", ".join(f"batch {pt['batch']}: {shown(pt)} -> {pt['tokens_per_s'] * k:,.0f}"
                            for pt in p["points"])
        other.append(Line2D([], [], color="0.3", marker=m, ls="", ms=8,
                            label=f"{p['engine']}\n  {p['model']}, {p['gpus']}x {p['gpu']}; {figures}"))
    ax.set_title("Other engines, other models: published, normalised\n(not the same workload: see docs/results.md)",
                 fontsize=10)
    ax.legend(handles=other, loc="upper left", fontsize=6.5, frameon=False, title="published -> normalised tokens/s",
              title_fontsize=7)

    for ax, model in zip(axes, [m for m, _ in MODELS] + ["other"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = TICKS[model]
        ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("batch size (rows decoded together)")
        ax.grid(True, which="major", alpha=0.3)
    axes[2].set_xlim(0.45, 64)
    axes[0].set_ylabel("tokens/s")
    axes[0].set_ylim(50, 20000)

    g = "0.15"
    d0 = load(args.grid)
    styles = [
        Line2D([], [], color=g, ls="-", marker="o", lw=2, label=f"this engine (H200, measured): decode step, compiled "
               f"+ CUDA graphs ({args.grid}, {d0['date']})"),
        Line2D([], [], color=g, ls="--", lw=1, label="this engine (H200, measured): decode step, CUDA graphs only "
               "(the default of compiledllm run)"),
        Line2D([], [], color=g, ls=":", lw=1.2, label="roofline of the same points (the run's measured HBM and "
               "matmul ceilings)"),
        Line2D([], [], color=g, ls="", marker="D", mfc="white", mec="k", label=f"this engine (H200, measured): decode "
               f"step re-run, compiled + graphs ({args.rerun})"),
        Line2D([], [], color="0.35", ls="", marker="X", ms=9, label="this engine (H200, measured): end to end, "
               "compiledllm run, 4K prompts, 64 new tokens, graphs, prefill included"),
        Line2D([], [], color=g, ls="", marker="*", ms=13, mfc="white", mec=g, label="SGLang, HERALD's Dense baseline "
               "(published: HERALD Table II, one H100 SXM, real weights)"),
        Line2D([], [], color=g, ls="", marker="*", ms=13, mfc=g, mec=g, label="the same, normalised to one H200 by "
               "HBM bandwidth ratio (4.8 / 3.35 TB/s)"),
    ]
    colours = [Line2D([], [], color=c, lw=6, label=f"context {ctx // 1024}K") for ctx, c in CONTEXTS.items()]
    fig.legend(handles=styles, loc="lower left", bbox_to_anchor=(0.01, 0.075), fontsize=7.5, frameon=False, ncol=2)
    fig.legend(handles=colours, loc="lower right", bbox_to_anchor=(0.99, 0.10), fontsize=8, frameon=False)
    fig.suptitle(f"Decode tokens/s against batch size: this engine on one {d0['device']} (measured, torch "
                 f"{d0['torch']}) and other engines' published figures (normalised to one H200 by HBM bandwidth "
                 "ratio;\ndifferent models/settings; published figures, not re-run here)", fontsize=11)
    fig.text(0.01, 0.005,
             "This engine: tools/bench/bench_decode.py, threshold tau 1.0 with 20 steps per block of 32 (tokens/s = batch x "
             "32 / 21 forwards / step time), after a random-KV prefix of the context; prefill, admission and the "
             "host loop are not in it.\nRandom weights: at batch 1 a block of MASK tokens routes alike, so the MoE "
             "step touches few experts and the LLaDA2.0-mini batch-1 figures are flattering. Hollow marker = "
             "published, filled = normalised (x its stated ratio).\nPeers decode with their own settings (real "
             "weights; SGLang Dense: T = 20 as here; others: adaptive thresholds with more tokens per forward, "
             "other models, several GPUs). The ratio ignores memory capacity (141 vs 80 GB) and compute.",
             fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.25, 1, 0.95))
    fig.savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default="bench_decode_grid_h200_run6.json")
    ap.add_argument("--rerun", default="plans_versus_new_r3_h200.json")
    ap.add_argument("--e2e", nargs="*", default=["plans_e2e_new_r1_h200.summary.json",
                                                  "plans_e2e_new_r2_h200.summary.json"])
    ap.add_argument("--e2e-batch", type=int, default=32, help="the batch_size the end-to-end runs used")
    ap.add_argument("--peers", default="headline_peers.json")
    ap.add_argument("--out", default=os.path.join(RESULTS, "headline_decode_h200.png"))
    ap.add_argument("--dpi", type=int, default=110)
    ap.add_argument("--tables", action="store_true", help="print the summary's markdown tables instead of plotting")
    args = ap.parse_args(argv)

    grid = records(args.grid)
    rerun = records(args.rerun) if args.rerun else []
    e2e = [dict(load(n), _batch=args.e2e_batch) for n in args.e2e]
    peers = load(args.peers)
    if args.tables:
        print("\n\n".join([decode_table(grid), peers_summary(peers), peers_table(peers)]))
        return
    plot(args, grid, rerun, e2e, peers)


if __name__ == "__main__":
    main()
