"""The speed benchmark runs adaptiveload-train with pinned batches and reports per-shape steady-state steps."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark


@pytest.mark.slow  # 23 s on a 2-core CPU under load: off the quick path
def test_runs_pinned_shapes_through_the_product_and_records_losses(tmp_path):
    bench = load_benchmark("bench_speed")
    out = tmp_path / "speed.json"
    assert bench.main(["--model", "tiny", "--shapes", "2x1x4x4,1x3x4x6", "--accelerator", "cpu",
                       "--settings", "eager_full,eager_full_fused", "--steps", "2", "--warmup", "1",
                       "--loss-steps", "4", "--loss-shape", "2x1x4x4", "--loss-settings", "eager_full,eager_full_fused",
                       "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())  # saved after every setting: one record for the run, replaced
    assert {"hardware", "commit", "date"} <= set(record)
    result = record["result"]
    for name in ("eager_full", "eager_full_fused"):
        entry = result["settings"][name]
        assert "error" not in entry, entry.get("error")
        rows = entry["rows"]
        # Every step is one pinned shape: (2, 16) or (1, 72).
        assert {(r["batch_size"], r["seq_len"]) for r in rows} <= {(2, 16), (1, 72)}
        shape = entry["per_shape"]["2x16"]
        steady = [r for i, r in enumerate(rows) if i >= 1 and (r["batch_size"], r["seq_len"]) == (2, 16)]
        assert shape["steps"] == len(steady) > 0
        assert shape["tokens_per_s"] == 32 / shape["step_s"]
    # Same seed, same model, fused AdaLN falls back to the reference op on CPU: identical losses.
    curves = result["loss_curves"]["curves"]
    assert len(curves["eager_full"]) == 4 and curves["eager_full"] == curves["eager_full_fused"]


def test_per_shape_leaves_out_warmup_and_compiling_steps():
    bench = load_benchmark("bench_speed")
    rows = [
        {"batch_size": 1, "seq_len": 8, "seconds": 9.0, "compile_s": 0.0, "tflops": 1.0, "peak_gib": 1.0},
        {"batch_size": 1, "seq_len": 8, "seconds": 5.0, "compile_s": 4.0, "tflops": 1.0, "peak_gib": 2.0},
        {"batch_size": 1, "seq_len": 8, "seconds": 2.0, "compile_s": 0.0, "tflops": 2.0, "peak_gib": 1.5},
        {"batch_size": 1, "seq_len": 8, "seconds": 4.0, "compile_s": 0.0, "tflops": 1.0, "peak_gib": 1.0},
    ]
    out = bench._per_shape(rows, 1, [(1, (1, 2, 4))], 100.0)["1x8"]
    assert out["steps"] == 2 and out["step_s"] == 3.0 and out["compile_s"] == 4.0 and out["peak_gib"] == 2.0
    # 4 TFLOP a step (2 TFLOP/s for 2 s) over the median 3 s.
    assert abs(out["tflops_per_gpu"] - 4.0 / 3.0) < 1e-12 and abs(out["mfu"] - 4.0 / 300.0) < 1e-12


def test_shapes_with_the_same_sequence_length_are_refused():
    # bucketing=fixed pins one batch size per S: 1x5x30x52 and 2x5x30x52 would train only one of them.
    import pytest

    bench = load_benchmark("bench_speed")
    assert bench._parse_shapes("1x5x30x52,2x13x30x52") == [(1, (5, 30, 52)), (2, (13, 30, 52))]
    with pytest.raises(SystemExit, match="more than one shape with S = 7,800 tokens"):
        bench._parse_shapes("1x5x30x52,2x5x30x52")
