"""The quickstart benchmark's helpers: the CPU-bound neighbour of ``--load`` and the calibration source it reads."""

from __future__ import annotations

import multiprocessing

import pytest
from benchmark_scripts import load_benchmark

bench = load_benchmark("bench_quickstart")


def test_cpu_load_runs_a_process_only_inside_the_block():
    before = set(multiprocessing.active_children())
    with bench.cpu_load(True):
        burners = set(multiprocessing.active_children()) - before
        assert len(burners) == 1 and all(p.is_alive() for p in burners)
    assert not any(p.is_alive() for p in burners)
    with bench.cpu_load(False):
        assert set(multiprocessing.active_children()) == before


def test_the_calibration_source_is_read_from_the_table_title():
    assert bench._SOURCE.search("Shape benchmark (cache; profiled in 4 s) — quadratic")[1] == "cache"
    assert bench._SOURCE.search("Shape benchmark (profiled; profiled in 4 s)")[1] == "profiled"


def test_a_check_line_is_read_with_its_batch_size_changes():
    log = ("`ShapeBenchmarkCallback`: step 25: keep the plan: -1.2% predicted tokens/s under the corrected model "
           "(re-plan from 3%); B S=16 203->198, S=1,560 34->31; measured/predicted over 5 shape(s), 27 steps: "
           "1.33 (1.27-1.59) -> 1.00 (0.99-1.03); the plan now trains at 30,341 predicted tokens/s (0.25 s on a "
           "background thread, applied at step 26; training waited 0.02 s)\n"
           "`ShapeBenchmarkCallback`: step 50: re-plan: +4.0% predicted tokens/s under the corrected model "
           "(re-plan from 3%); no batch size changes; measured/predicted over 7 shape(s), 1,065 steps: "
           "1.23 (1.09-1.46) -> 1.00 (0.93-1.04); beyond ±5% after correction: 60 x 1,560 0.93 (9 steps); the plan "
           "now trains at 32,988 predicted tokens/s (0.16 s)")
    first, second = bench.parse_decisions(log)
    assert first == {"step": 25, "replan": False, "gain": -0.012, "ratio_before": [1.33, 1.27, 1.59],
                     "ratio_after": [1.0, 0.99, 1.03], "predicted_tokens_per_s": 30341.0,
                     "batch_changes": {"16": [203, 198], "1560": [34, 31]}, "off_after": []}
    assert second["replan"] and second["gain"] == 0.04 and second["batch_changes"] == {}
    assert second["off_after"] == [[60, 1560, 0.93, 9]] and second["ratio_after"] == [1.0, 0.93, 1.04]


def test_a_kept_plans_batch_sizes_are_read_as_changes_not_applied():
    log = ("`ShapeBenchmarkCallback`: step 50: keep the plan: +0.7% predicted tokens/s under the corrected model "
           "(re-plan from 3%); the corrected policy's B, not applied: S=16 256->150, S=64 64->52; measured/predicted "
           "over 7 shape(s), 58 steps: 1.11 (1.00-1.26) -> 1.00 (0.95-1.05); the plan now trains at 83,340 predicted "
           "tokens/s (0.02 s on a background thread, applied at step 51; training waited 0.00 s)")
    (decision,) = bench.parse_decisions(log)
    assert not decision["replan"] and decision["gain"] == pytest.approx(0.007)
    assert decision["batch_changes"] == {"16": [256, 150], "64": [64, 52]}
    assert decision["predicted_tokens_per_s"] == 83340.0
