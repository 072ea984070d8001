"""The end-to-end benchmark runs the product (adaptiveload-train's config, Trainer, callbacks)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "e2e.json"
    bench = load_benchmark("bench_e2e")
    assert bench.main(["--model", "tiny", "--mixture", "tiny", "--num-samples", "200", "--accelerator", "cpu",
                       "--devices", "1", "--steps", "3", "--warmup", "1", "--workers", "0", "--m-mem", "0",
                       "--configs", "dual_cost,equal_token", "--profile-budget", "10", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())  # a result file: one record per run
    assert record["benchmark"] == "bench_e2e.py" and record["hardware"].startswith("CPU")
    assert record["commit"] and record["date"]
    return record["result"]


@pytest.mark.slow  # the result fixture runs the benchmark: ~11 s
def test_each_configuration_is_one_plugin_run(result):
    runs = result["runs"]
    assert set(runs) == {"dual_cost", "equal_token"}
    assert result["meta"]["full_depth"] is True and result["meta"]["blocks"] == "all (preset depth)"
    dual, eq = runs["dual_cost"], runs["equal_token"]
    assert "bucketing=dual_constraint" in dual["overrides"] and "bucketing.balance=cost" in dual["overrides"]
    assert "bucketing=equal_token" in eq["overrides"]
    # The dual run profiled; the baseline used the budget that calibration derived.
    assert dual["calibration_source"] == "profiled" and dual["profile_seconds"] > 0
    assert eq["policy"] == f"EqualTokenPolicy(max_tokens={dual['m_mem']})"
    assert result["meta"]["m_mem"] == dual["m_mem"]
    for r in runs.values():
        assert len(r["losses"]) == 4  # warm-up + measured steps, same for every configuration
        assert len(r["per_step"]) == 3 and r["summary"]["steps"] == 3


@pytest.mark.slow  # the result fixture runs the benchmark: ~11 s
def test_numbers_are_balance_monitor_means(result):
    for r in result["runs"].values():
        rows = np.asarray(r["per_step"])  # [step, rank, field]
        tokens, step_time = rows[:, :, 3].sum(), rows[:, :, 0].max(axis=1).sum()
        assert r["summary"]["tokens_per_s"] == pytest.approx(tokens / step_time)
        assert r["summary"]["tflops_per_gpu"] == pytest.approx(rows[:, :, 5].sum() / step_time / 1e12)
        sim = r["simulated_tokens_per_s"]
        assert r["simulation_error"] == pytest.approx(sim / r["summary"]["tokens_per_s"] - 1)


def test_fewer_blocks_are_stated(tmp_path):
    bench = load_benchmark("bench_e2e")
    args = bench._parse_args(["--blocks", "2"])
    overrides = bench._overrides(args, "dual_cost", tmp_path, 65_520, None)
    assert "++model.model.num_layers=2" in overrides
    with pytest.raises(SystemExit):
        bench._parse_args(["--configs", "nope"])


@pytest.mark.slow  # the result fixture runs the benchmark: ~11 s
def test_plots(result, tmp_path):
    paths = load_benchmark("plot_e2e").plot(result, tmp_path / "e2e")
    assert [p.name for p in paths] == ["e2e_tokens_per_s.png", "e2e_step_times.png", "e2e_loss.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
