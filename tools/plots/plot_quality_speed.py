"""Quality against speed, one point per policy, from a `compiledllm eval` report (e.g. recipes/eval_flash.yaml):
exact match against decode tokens/s and against tokens per forward, a column per task file. Tokens/s is the
report's own (generated tokens per second of decoding on the report's device): a CPU report's tokens/s orders
policies only roughly (run-to-run spread on a 2-core machine reaches 1.5x), tokens per forward does not vary.

    python tools/plots/plot_quality_speed.py docs/results/eval_flash_cpu_s12_run4.json --out quality_speed.png
"""
from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402

MARKERS = "osD^vP*Xh<>"
AXES = (("tokens_per_s", "decode tokens/s (report's device)"), ("tokens_per_forward", "tokens per forward"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dpi", type=int, default=110)
    args = ap.parse_args(argv)
    report = json.load(open(args.report))
    files = list(report["files"].items())
    fig, axes = plt.subplots(len(AXES), len(files), figsize=(5.6 * len(files), 4.2 * len(AXES)), squeeze=False)
    for col, (name, entry) in enumerate(files):
        pols = entry["policies"]
        for row, (key, title) in enumerate(AXES):
            ax = axes[row][col]
            for i, (label, m) in enumerate(pols.items()):  # a colour and marker a policy, named in one legend
                ax.scatter(m[key], m["exact_match"], color=f"C{i % 10}", marker=MARKERS[i % len(MARKERS)], s=48,
                           zorder=3, alpha=0.85, label=label)
            if key == "tokens_per_s":
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(ScalarFormatter())
                ax.xaxis.set_minor_formatter(ScalarFormatter())
                ax.tick_params(axis="x", which="minor", labelsize=7)
            ax.set_xlabel(title)
            ax.set_ylabel("exact match")
            ax.set_ylim(-0.05, 1.1)
            ax.grid(alpha=0.3)
            ax.set_title(f"{name} ({entry['tasks']} tasks, {entry['max_new_tokens']} new tokens)", fontsize=9)
    fig.suptitle(f"{report['model']} on {report['device']}: exact match against speed, one point per policy",
                 fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(args.out, dpi=args.dpi)


if __name__ == "__main__":
    main()
