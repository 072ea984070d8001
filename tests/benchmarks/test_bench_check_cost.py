"""The check-cost benchmark times both variants at each size and writes one record with a row per size."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark

bench = load_benchmark("bench_check_cost")


def test_writes_one_record_with_a_row_per_size(tmp_path):
    out = tmp_path / "check.json"
    assert bench.main(["--sizes", "300", "2000", "--repeats", "1", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert len(records) == 1 and records[0]["benchmark"] == "bench_check_cost.py"
    rows = records[0]["result"]["rows"]
    assert [r["samples"] for r in rows] == [300, 2000]
    assert all(0 < r["check_s"] <= r["check_median_s"] and 0 < r["recount_s"] <= r["recount_median_s"] for r in rows)
