"""The quickstart benchmark's helpers: the CPU-bound neighbour of ``--load`` and the calibration source it reads."""

from __future__ import annotations

import multiprocessing

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
