"""benchmarks/render_tables.py: the AdaLN table from the latest run in adaln.csv, for each kind of run
bench_adaln.py has written (warm only, before the cold columns; warm and cold; one mode with --l2)."""

from __future__ import annotations

import math

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture
def render(tmp_path, monkeypatch):
    module = load_benchmark("render_tables")
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    from _results import write_csv_run  # benchmarks/ is on sys.path once render_tables is loaded

    def write(rows: list[dict], **meta) -> list[str]:
        # An older run first: the table shows only the latest run's rows.
        old = {"hardware": "1x GPU", "commit": "a" * 40, "date": "2026-01-01T00:00:00+00:00", "torch": "2.x",
               "copy_bandwidth_gbps": 1.0}  # fmt: skip
        run = {**old, "commit": "b" * 40, "date": "2026-02-01T00:00:00+00:00", "copy_bandwidth_gbps": 4000.0, **meta}
        write_csv_run(tmp_path / "adaln.csv", old, [_row("old")])
        write_csv_run(tmp_path / "adaln.csv", run, rows)
        return [line for line in module.adaln().splitlines() if line.startswith("| (")]

    return write


def _row(provider: str, cold: bool = True, failed: bool = False, **over) -> dict:
    nan = math.nan
    r = {
        "B": 4, "N": 1560, "D": 1536, "x_dtype": "bf16", "provider": provider,
        "fwd_ms": nan if failed else 0.010, "fwd_bwd_ms": nan if failed else 0.044,
        "fwd_frac_copy_bw": nan if failed else 0.896, "fwd_bwd_frac_copy_bw": nan if failed else 0.512,
        "activation_mb": nan if failed else 0.1, "fwd_ms_host": 0.07, "fwd_bwd_ms_host": 0.4,
        "error": "RuntimeError: boom" if failed else "",
    }  # fmt: skip
    if cold:
        r.update(
            fwd_ms_cold=nan if failed else 0.013, fwd_bwd_ms_cold=nan if failed else 0.047,
            fwd_frac_copy_bw_cold=nan if failed else 0.700, fwd_bwd_frac_copy_bw_cold=nan if failed else 0.485,
        )  # fmt: skip
    r.update(over)
    return r


def test_warm_and_cold_columns(render):
    lines = render([_row("ours"), _row("compile", failed=True)], l2="both", l2_cache_mb=60.0)
    assert lines[0] == "| (4, 1560, 1536) | bf16 | ours | 0.010 | 89.6% | 0.044 | 51.2% | 70.0% | 48.5% | 0.1 |"
    assert lines[1] == "| (4, 1560, 1536) | bf16 | compile | failed | failed | failed | failed | failed | failed | - |"


def test_files_from_before_the_cold_columns_show_dashes(render):
    lines = render([_row("ours", cold=False)])
    assert lines == ["| (4, 1560, 1536) | bf16 | ours | 0.010 | 89.6% | 0.044 | 51.2% | - | - | 0.1 |"]


def test_a_mode_left_out_shows_dashes_not_failed(render):
    nan = math.nan
    warm_only = _row("ours", fwd_ms_cold=nan, fwd_bwd_ms_cold=nan, fwd_frac_copy_bw_cold=nan,
                     fwd_bwd_frac_copy_bw_cold=nan)  # fmt: skip
    assert render([warm_only], l2="warm")[0].endswith("| 51.2% | - | - | 0.1 |")
    cold_only = _row("ours", fwd_ms=nan, fwd_bwd_ms=nan, fwd_frac_copy_bw=nan, fwd_bwd_frac_copy_bw=nan)
    assert render([cold_only], l2="cold")[0] == "| (4, 1560, 1536) | bf16 | ours | - | - | - | - | 70.0% | 48.5% | 0.1 |"


def test_same_bytes_reference_is_labelled_as_a_reference(render):
    lines = render([_row("ours"), _row("same_bytes", activation_mb=0.0)], l2="both", l2_cache_mb=60.0)
    assert lines[0].split(" | ")[2] == "ours"
    assert lines[1].split(" | ")[2] == "same bytes, no math (reference)"
    assert lines[1].endswith("| 0.0 |")
