"""TPF and quality against FlowBlock's admission gate theta_spawn, one line per window W, from an eval report of
recipes/eval_flowblock.yaml (labels W<w>-s<spawn>; `t2t` drawn as the serial reference).

    python tools/plots/plot_flowblock.py docs/results/eval_flowblock_h200.json --out docs/results/flowblock_spawn_h200.png
"""
from __future__ import annotations

import argparse
import json
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABEL = re.compile(r"^W(\d+)-s([0-9.]+)$")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    report = json.load(open(args.report))
    files = list(report["files"].items())
    fig, axes = plt.subplots(2, len(files), figsize=(5.2 * len(files), 6.4), squeeze=False)
    for col, (name, entry) in enumerate(files):
        pols = entry["policies"]
        series: dict[int, list[tuple[float, dict]]] = {}
        for label, m in pols.items():
            hit = LABEL.match(label)
            if hit:
                series.setdefault(int(hit[1]), []).append((float(hit[2]), m))
        for row, (key, title) in enumerate((("tokens_per_forward", "tokens per forward"),
                                            ("agreement", "agreement with t2t / exact match"))):
            ax = axes[row][col]
            for w, pts in sorted(series.items()):
                pts.sort()
                ax.plot([s for s, _ in pts], [m[key] for _, m in pts], marker="o", color=f"C{w}", label=f"W={w}")
                if key == "agreement":
                    ax.plot([s for s, _ in pts], [m["exact_match"] for _, m in pts], ls=":", marker="x",
                            color=f"C{w}", label=f"W={w} exact match")
            ax.axhline(pols["t2t"][key], color="k", ls="--", lw=1, label="t2t (serial)")
            if key == "agreement":
                ax.axhline(pols["t2t"]["exact_match"], color="k", ls=":", lw=1, label="t2t exact match")
            ax.set_xlabel("theta_spawn")
            ax.set_ylabel(title)
            ax.set_title(f"{name} ({entry['tasks']} tasks, {entry['max_new_tokens']} new tokens)", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(f"FlowBlock on {report['model']} ({report['device']}): the gate trades tokens per forward for "
                 "agreement", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
