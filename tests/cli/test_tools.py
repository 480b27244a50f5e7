"""CPU checks of the benchmark tools' own logic (the measurements themselves run on the GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

for _folder in ("bench", "plots"):  # script folders: their tools import each other by bare name
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / _folder))

from bench_decode import masked_share, pending  # noqa: E402


def test_pending_skips_measured_points_and_a_measured_max():
    records = [{"model": "m", "context": 4096, "batch": 8, "largest_fit": 300},
               {"model": "m", "context": 4096, "batch": 300, "largest_fit": 300},
               {"model": "m", "context": 32768, "batch": 8, "largest_fit": 60},
               {"model": "other", "context": 4096, "batch": 32, "largest_fit": 300}]
    wanted = ["1", "8", "32", "64", "max"]
    # 4K: 8 and max done (this run's fit is 306, the resumed run's max was 300): 1, 32, 64 left
    assert pending("m", 4096, 306, wanted, records) == [1, 32, 64]
    # 32K: only 8 done; max = this run's fit; 64 does not fit
    assert pending("m", 32768, 60, wanted, records) == [1, 32, 60]
    assert pending("m", 16384, 117, wanted, []) == [1, 8, 32, 64, 117]
    assert pending("m", 16384, 20, wanted, []) == [1, 8, 20]


def test_masked_share_of_the_fixed_schedule():
    # block 32 in 20 steps: steps 0-11 accept 2 tokens, steps 12-19 accept 1, so the masked rows at each step
    # are 32, 30, ..., 10 (sum 252) then 8, 7, ..., 1 (sum 36): 288 of 20 x 32 = 0.45 (the head's FLOPs share)
    assert masked_share() == pytest.approx(288 / 640)
    assert masked_share(4, 4) == pytest.approx(10 / 16) and masked_share(4, 2) == pytest.approx(6 / 8)  # SDAR's block


def test_sdar4b_step_costs_count_its_block_of_four():
    """Issue 31's SDAR workload: ~8 GB of bf16 weights a step, 4 query tokens a row, not bench_decode's 32."""
    from bench_decode import step_costs

    from compiledllm.loader import parse_model_config
    from compiledllm.models.presets import PRESETS

    cfg = parse_model_config(PRESETS["sdar-4b"], "sdar-4b")
    c4, c32 = step_costs(cfg, 128, 640, block=4, steps=4), step_costs(cfg, 128, 640)
    assert 7.5e9 < c4["weight_bytes"] < 8.5e9 and c4["weight_bytes"] == c32["weight_bytes"]
    assert c4["kv_bytes"] == 128 * 36 * 2 * 8 * 128 * 2 * (640 + 4)
    assert 7 < c32["flops"] / c4["flops"] < 9  # ~8x the query tokens (the head's masked share differs a little)


def test_merge_keeps_each_point_once_in_plan_order(tmp_path):
    import json

    from bench_decode import load_records, plan_key

    def rec(model, context, batch):
        return {"model": model, "context": context, "batch": batch, "largest_fit": 60}

    resumed = rec("m", 32768, 1)  # both shards resumed the same file: both hold this point
    shard0 = {"device": "d", "records": [resumed, rec("m", 32768, 60), rec("s", 4096, 8)]}
    shard1 = {"device": "d", "records": [resumed, rec("m", 4096, 8), {**rec("m", 4096, 64), "error": "OOM"}]}
    paths = []
    for i, data in enumerate((shard0, shard1)):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(data))
    records, header = load_records([str(p) for p in paths])
    assert header["device"] == "d"
    plan = "m:4096,32768;s:4096"
    keys = [(r["model"], r["context"], r["batch"]) for r in sorted(records, key=lambda r: plan_key(plan, r))]
    assert keys == [("m", 4096, 8), ("m", 32768, 1), ("m", 32768, 60), ("s", 4096, 8)]


# --- docs/results.md: the headline chart and every raw file it names (issue 20) ---------------------------------

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
RESULT_PAGES = [ROOT / "docs" / "results.md", ROOT / "docs" / "results_archive.md"]
# a results file as the pages name it: `name.json`, `results/name.log`, `docs/results/name.md`, with * and {a,b}
RESULT_NAME = r"(?:(?:docs/)?results/)?[A-Za-z0-9_.*{},-]+\.(?:json|log|png|md|jsonl)"


def _expand(pattern: str) -> list[str]:
    import re

    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _named_results(text: str) -> set[str]:
    """File names a page gives as results: whole `backticked` names and the targets of results/... links."""
    import re

    names = {m.group(1) for m in re.finditer(r"`(" + RESULT_NAME + r")`", text)}
    names |= {m.group(1) for m in re.finditer(r"\]\((results/[^)#\s]+)\)", text)}
    return {n.split("results/")[-1] for n in names}


def test_every_results_file_the_results_pages_name_exists():
    missing = []
    for page in RESULT_PAGES:
        for name in sorted(_named_results(page.read_text())):
            for pattern in _expand(name):
                if not list(RESULTS.glob(pattern)):
                    missing.append(f"{page.name}: {pattern}")
    assert not missing, "named in the results pages but not in docs/results/: " + ", ".join(missing)


def test_results_name_parser_sees_names_links_globs_and_braces():
    text = ("raw `bench_head_h200.json`; ![c](results/headline_decode_h200.png); `kernels_{4k,32k}.json`; "
            "`python3 tools/bench/x.py --out $OUT/a.json` is a command, not a name; `results/gpu_tests_h200_run6.log`")
    assert _named_results(text) == {"bench_head_h200.json", "headline_decode_h200.png", "kernels_{4k,32k}.json",
                                    "gpu_tests_h200_run6.log"}
    assert _expand("k_{4k,32k}_{a,b}.json") == ["k_4k_a.json", "k_4k_b.json", "k_32k_a.json", "k_32k_b.json"]


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_results_pages_and_the_readme_resolve():
    import re

    pages = RESULT_PAGES + [ROOT / "README.md"]
    headings = {p.resolve(): re.findall(r"^#+ (.*)$", p.read_text(), re.MULTILINE) for p in pages}
    anchors = {path: {_slug(h) for h in hs} for path, hs in headings.items()}
    bad = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest in anchors and anchor not in anchors[dest]:
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, bad


def test_headline_chart_and_tables_come_from_the_repository_json(tmp_path):
    pytest.importorskip("matplotlib")
    import plot_headline

    out = tmp_path / "headline.png"
    plot_headline.main(["--out", str(out), "--dpi", "40"])
    assert out.stat().st_size > 5_000
    # the summary's tables are the tool's output for the JSON of record, so the page and the files agree
    grid = plot_headline.records("bench_decode_grid_h200_run6.json")
    peers = plot_headline.load("headline_peers.json")
    page = (ROOT / "docs" / "results.md").read_text()
    for table in (plot_headline.decode_table(grid), plot_headline.peers_summary(peers),
                  plot_headline.peers_table(peers)):
        assert table in page, "docs/results.md is out of date: run python3 tools/plots/plot_headline.py --tables"


def test_peer_normalisation_is_the_stated_bandwidth_ratio():
    import plot_headline

    peers = plot_headline.load("headline_peers.json")
    assert plot_headline.normalise(peers, "H100 SXM", 1) == pytest.approx(4.8 / 3.35)
    assert plot_headline.normalise(peers, "H20", 8) == pytest.approx(4.8 / 32)
    for p in peers["peers"] + peers["not_plotted"]:
        assert p["source"], p
    for p in peers["peers"]:
        assert p["gpu"] in peers["hbm_tb_per_s"] and all(pt["tokens_per_s"] > 0 for pt in p["points"])


def test_e2e_ideal_rows_of_the_recorded_bench_reports(tmp_path):
    """The results page's ideal / share columns come from the recorded reports by tools/bench/e2e_ideal.py."""
    import json

    import e2e_ideal

    res = Path(__file__).resolve().parents[2] / "docs" / "results"
    rows = e2e_ideal.main(["--ceilings", str(res / "bench_e2e_ceilings_h200_s10.json"), "--decode",
                           str(res / "bench_decode_llada2_mini_16k_h200.json"), str(res / "bench_decode_balanced_h200.json"),
                           "--out", str(tmp_path / "r.json"),
                           "--", str(res / "bench_e2e_llada2_mini_32k512_h200.json")])
    assert [r["batch"] for r in rows] == [1, 8, 32, 73]
    for r in rows:  # the ideal is faster than the run, and its parts are below the measured parts
        assert r["prefill_roofline_s"] < r["prefill_s"] and r["step_roofline_ms"] < r["engine_step_ms"]
        assert 0 < r["share"] < 1 and r["ideal_tokens_per_s"] > r["output_tokens_per_s"]
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == rows
    recorded = json.loads((res / "bench_e2e_ideal_h200_s10.json").read_text())["rows"]
    assert [r for r in recorded if r["prompt"] == 32000 and r["model"] == "llada2.0-mini"] == rows


def test_bench_interleave_on_a_tiny_model(tmp_path):
    import json

    import bench_interleave

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {init: random, config: tiny-random-llada2, dtype: float32, device: cpu}\n"
                      "policy: {name: threshold, block_size: 8, threshold: 1.0, steps: 4}\n"
                      "prompts: [{ids: [1]}]\nbatch_size: 2\n")
    report = bench_interleave.main(["--recipe", str(recipe), "--prompt-len", "40", "--output-len", "8", "--batch",
                                    "2", "--requests", "4", "--rate", "100", "--configs", "8:8,16:32",
                                    "--out", str(tmp_path / "i.json")])
    assert [(p["chunk"], p["tokens"]) for p in report["points"]] == [(8, 8), (16, 32)]
    for p in report["points"]:  # 4 requests on 2 slots: later ones prefill while rows decode
        assert p["stalled_steps"] > 0 and 0 < p["stall_max_ms"] and p["first_block_p50_s"] <= p["latency_p50_s"]
    assert json.loads((tmp_path / "i.json").read_text()) == report


def test_quality_speed_chart_draws_an_eval_report(tmp_path):
    """tools/plots/plot_quality_speed.py on the recorded issue-28 grid: one point per policy and file, two panels."""
    pytest.importorskip("matplotlib")
    import plot_quality_speed

    out = tmp_path / "quality_speed.png"
    plot_quality_speed.main([str(ROOT / "docs" / "results" / "eval_flash_cpu_s12_run4.json"), "--out", str(out),
                             "--dpi", "40"])
    assert out.stat().st_size > 5_000


def test_kernel_groups_of_a_recorded_table():
    """kernel_table.py's groups on the twenty-second session's LLaDA2.0-mini B32 table: each kernel in the group its
    name says, and the groups add up to the table."""
    import json

    from kernel_table import kernel_groups

    path = Path(__file__).resolve().parents[2] / "docs" / "results" / "kernels_mini_b32_4k_h100_s22.json"
    rows = json.loads(path.read_text())["compiled+graphs"]["kernels"]
    groups = kernel_groups(rows)
    assert sum(g["ms"] for g in groups.values()) == pytest.approx(sum(r["ms_per_step"] for r in rows))

    def group_of(name):
        return next(g for g, v in kernel_groups([{"kernel": name, "ms_per_step": 1.0, "calls_per_step": 1}]).items()
                    if v["ms"])

    assert group_of("down_kernel") == group_of("gate_up_scan_kernel") == "routed experts (gate-up, down)"
    assert group_of("packed_attn_combine") == "attention" and group_of("combine_kernel") == "routing, sort, combine"
    assert group_of("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_TNT") == "GEMMs (cuBLAS)"
    assert group_of("triton_poi_fused__unsafe_view_add_view_8") == "Inductor's fused elementwise"
    assert group_of("void at::native::vectorized_elementwise_kernel<4>") == "other"
    assert groups["routed experts (gate-up, down)"]["ms"] == pytest.approx(11.54, abs=0.01)  # as docs/results.md says


def test_sync_points_counts_the_debug_modes_warnings_by_line(tmp_path):
    """sync_points.py groups torch's sync debug warnings by the line that made them, others left out; on the CPU a
    HERALD host-form session runs through it and finds none (nothing to synchronise with)."""
    import json
    import os
    import subprocess
    import warnings

    from sync_points import ROOT, count_sync_points

    def record(message, filename, lineno):
        return warnings.WarningMessage(message, UserWarning, filename, lineno)

    here = str(ROOT / "compiledllm" / "kv" / "offload.py")
    records = [record("called a synchronizing CUDA operation", here, 336),
               record("called a synchronizing CUDA operation", here, 336),
               record("called a synchronizing CUDA operation", "/elsewhere/x.py", 7),
               record("something else", here, 1)]
    assert count_sync_points(records) == {"compiledllm/kv/offload.py:336": 2, "/elsewhere/x.py:7": 1}
    out = tmp_path / "sp.json"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "sync_points.py"),
                          str(ROOT / "recipes" / "quickstart.yaml"), "--set", "policy.name=herald", "--set",
                          "policy.pool=host", "--set", "policy.retrieval=scan", "--set", "policy.budget=0.3",
                          "--prompt-len", "100", "--batch", "2", "--output-len", "16", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["decode_steps"] > 0 and report["sync_points"] == [] and report["device"] == "cpu"
