"""benchmarks/bench_pairing.py: a two-rank history grouped by the pair of shapes each step trained."""

from __future__ import annotations

import numpy as np
import pytest
from benchmark_scripts import load_benchmark

from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor

bench = load_benchmark("bench_pairing")
COL = {name: i for i, name in enumerate(BalanceMonitor.FIELDS)}


def _step(a, b):
    """One two-rank step: per rank (B, S, step s, wait s, predicted)."""
    rows = np.zeros((2, len(BalanceMonitor.FIELDS)))
    for r, (bs, s, t, w, p) in enumerate((a, b)):
        rows[r, [COL["batch_size"], COL["seq_len"], COL["step_time"], COL["data_wait"], COL["compute"]]] = bs, s, t, w, p
    return rows


def test_each_shape_is_timed_by_its_partner_with_the_slowest_ranks_step_and_wait():
    steps = [_step((34, 120, 0.20, 0.01, 0.21), (34, 120, 0.21, 0.02, 0.21)) for _ in range(5)]
    # Beside a light batch: the largest over ranks of step + wait (0.14 + 0.03, not 0.15 + 0.01).
    steps += [_step((34, 120, 0.15, 0.01, 0.21), (32, 16, 0.14, 0.03, 0.06)) for _ in range(5)]
    steps += [_step((13, 120, 0.1, 0.0, 0.09), (32, 16, 0.1, 0.0, 0.06)) for _ in range(4)]  # too few: left out
    got = bench.pair_times(np.stack(steps))
    assert [(g["B"], g["S"], g["partner_B"], g["partner_S"], g["steps"]) for g in got] == [
        (32, 16, 34, 120, 5), (34, 120, 32, 16, 5), (34, 120, 34, 120, 10)]
    by = {(g["B"], g["partner_B"]): g for g in got}
    assert by[(34, 34)]["median_step_s"] == pytest.approx(0.23)
    assert by[(34, 32)]["median_step_s"] == pytest.approx(0.17) == by[(32, 34)]["median_step_s"]
    assert (by[(34, 32)]["predicted"], by[(34, 32)]["partner_predicted"]) == (0.21, 0.06)


def test_a_history_of_another_world_size_is_refused():
    with pytest.raises(ValueError, match="two-rank"):
        bench.pair_times(np.zeros((3, 1, len(BalanceMonitor.FIELDS))))
