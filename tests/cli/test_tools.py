"""CPU checks of the benchmark tools' own logic (the measurements themselves run on the GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

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
