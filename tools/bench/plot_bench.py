"""Tokens/s against batch size, one line per `compiledllm bench` report (HERALD's Fig. 12 for this machine).

    python tools/bench/plot_bench.py docs/results/herald_bench_16k_*_h200.json --prompt-len 16384 \\
        --out docs/results/herald_bench_16k_h200.png

The rate is the generated tokens over the time after prefill (wall - prefill: the decode steps and every host hook
around them, as a user waits for them), so reports taken before decode_s counted the hooks plot the same quantity.
Each line is labelled by the report's policy name and the settings its overrides changed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def label(report: dict) -> str:
    sets = [o.split("=", 1) for o in report.get("overrides", []) if o.startswith("policy.") and "=" in o]
    extra = [f"{k.removeprefix('policy.')}={v}" for k, v in sets if k not in ("policy.name", "policy.budget")]
    return " ".join([report.get("policy_name", "?"), *extra])


def points(report: dict, prompt_len: int | None, output_len: int | None = None) -> list[tuple[int, float]]:
    out = []
    for p in report["points"]:
        if p.get("error") or (prompt_len is not None and p.get("prompt_len") != prompt_len):
            continue
        if output_len is not None and p.get("output_len") != output_len:
            continue
        after = p["wall_s"] - p["prefill_s"]
        if after > 0:
            out.append((p["batch"], p["generated_tokens"] / after))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--prompt-len", type=int, default=None, help="only the points of this prompt length")
    ap.add_argument("--output-len", type=int, default=None, help="only the points of this output length")
    ap.add_argument("--title", default=None)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    device = None
    for path in a.reports:
        report = json.loads(path.read_text())
        device = device or report.get("device")
        pts = points(report, a.prompt_len, a.output_len)
        if pts:
            ax.plot([b for b, _ in pts], [r for _, r in pts], marker="o", label=label(report))
    ax.set_xlabel("batch (requests decoding at once)")
    ax.set_ylabel("generated tokens/s after prefill")
    outputs = f", outputs of {a.output_len}" if a.output_len else ""
    ax.set_title(a.title or f"{device or ''}, prompts of {a.prompt_len or 'every length'}{outputs}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
