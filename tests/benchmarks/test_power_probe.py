"""The power probe trains one shape through adaptiveload-train and poisons the weights part-way."""

from __future__ import annotations

import json
import math

import pytest
from benchmark_scripts import load_benchmark


@pytest.mark.slow  # 21 s on a 2-core CPU under load: off the quick path
def test_poisoned_phase_is_recorded_apart_from_training(tmp_path):
    bench = load_benchmark("power_probe")
    out = tmp_path / "probe.json"
    assert bench.main(["--model", "tiny", "--shapes", "2x1x4x4", "--accelerator", "cpu", "--steps", "6",
                       "--poison-step", "3", "--settle", "1", "--poison", "nan,zero", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())  # saved after every run: one record, replaced
    runs = record["result"]["runs"]
    nan_rows = runs["nan"]["rows"]
    assert [r["step"] for r in nan_rows] == list(range(6))
    # Steps before the poisoning train; from it on, every weight is NaN and so is the loss.
    assert all(math.isfinite(r["loss"]) for r in nan_rows[:3]) and all(math.isnan(r["loss"]) for r in nan_rows[3:])
    assert runs["nan"]["before"]["finite_loss_steps"] == 2 and runs["nan"]["after"]["finite_loss_steps"] == 0
    assert runs["nan"]["before"]["steps"] == runs["nan"]["after"]["steps"] == 2  # the first of each phase settles
    assert runs["zero"]["after"]["finite_loss_steps"] == 2  # zero weights still train
    assert runs["nan"]["before"]["sm_clock_mhz"] is None  # no GPU: no clock, and no error either


@pytest.mark.parametrize("argv, msg", [(["--poison", "inf"], "--poison"), (["--shapes", "1x1x4x4,2x1x4x6"], "one shape"),
                                       (["--steps", "4", "--poison-step", "3", "--settle", "1"], "--settle")])
def test_bad_arguments_name_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("power_probe").main(argv)
    assert msg in capsys.readouterr().err
