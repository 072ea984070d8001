"""The fidelity benchmark's statistics: per-step and last-half relative loss differences, and the verdict
against the reference's run-to-run spread."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

bench = load_benchmark("bench_fidelity")


def test_compare_is_the_stated_statistics():
    ref = {0: 2.0, 1: 1.0, 2: 1.0, 3: 4.0}
    run = {0: 2.0, 1: 1.1, 2: 0.9, 3: 4.4, 7: 9.0}  # step 7 is not in ref: left out
    c = bench.compare(ref, run)
    assert c["steps"] == 4 and c["identical_steps"] == 1
    assert c["mean_rel_diff"] == pytest.approx((0 + 0.1 + 0.1 + 0.1) / 4)
    assert c["max_rel_diff"] == pytest.approx(0.1)
    assert c["first_quarter_mean_rel_diff"] == 0.0  # step 0 only
    # The last half is steps 2 and 3: means 2.5 and 2.65.
    assert c["tail_mean_rel_diff"] == pytest.approx(0.15 / 2.5)


def test_verdict_against_the_repeat_spread():
    near, far = {"mean_rel_diff": 1e-3, "tail_mean_rel_diff": 1e-3}, {"mean_rel_diff": 5e-3, "tail_mean_rel_diff": 1e-4}
    spread = {"mean_rel_diff": 2e-3, "tail_mean_rel_diff": 2e-3}
    assert bench.verdict([spread, near], ["sdpa", "sdpa", "fa4"])["within_spread"] is True
    # Both statistics must be within: a candidate far on the per-step mean fails.
    assert bench.verdict([spread, far], ["sdpa", "sdpa", "fa4"])["within_spread"] is False
    zero = {"mean_rel_diff": 0.0, "tail_mean_rel_diff": 0.0}
    v = bench.verdict([zero, near], ["sdpa", "sdpa", "fa4"])
    assert v["within_spread"] is False and "bit for bit" in v["why"]
    assert bench.verdict([near], ["sdpa", "fa4"])["within_spread"] is None  # no repeat: nothing to compare with


def test_pairwise_covers_every_pair():
    s = [{0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.2}, {0: 1.1, 1: 1.0}]
    pairs = bench.pairwise(s, ["sdpa", "sdpa", "fa4"])
    assert [p["runs"] for p in pairs] == [[0, 1], [0, 2], [1, 2]]
    assert pairs[0]["mean_rel_diff"] == pytest.approx(0.1) and pairs[1]["mean_rel_diff"] == pytest.approx(0.05)


def test_losses_reads_the_csv_log(tmp_path):
    d = tmp_path / "logs" / "version_0"
    d.mkdir(parents=True)
    (d / "metrics.csv").write_text("epoch,step,train/loss,other\n0,0,1.5,\n0,0,,3\n0,1,1.25,\n")
    assert bench.losses(tmp_path) == {0: 1.5, 1: 1.25}
    with pytest.raises(FileNotFoundError, match="logger=csv"):
        bench.losses(tmp_path / "missing")
