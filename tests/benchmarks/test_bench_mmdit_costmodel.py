"""bench_mmdit_costmodel profiles the doc's MMDiT through Trainer.fit and fits it with and without attention tokens."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark


@pytest.mark.slow
def test_one_profile_is_fitted_with_and_without_attention_tokens(tmp_path):
    out = tmp_path / "mmdit.json"
    bench = load_benchmark("bench_mmdit_costmodel")
    assert bench.main(["--text-lens", "16", "--time-budget", "3", "--repeats", "1", "--warmup", "0", "--dim", "16",
                       "--depth", "1", "--heads", "2", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    (run,) = record["result"]["runs"]
    assert run["text_len"] == 16 and run["shapes"] >= 4 and "load_average_1min" in run
    assert "S = attention tokens (16 -> 32" in run["with_attention_tokens"]["cost_model"]
    assert "attention tokens" not in run["video_tokens_only"]["cost_model"]
    lengths = {s for _, s, _ in run["points"]}
    assert set(map(int, run["with_attention_tokens"]["leave_one_length_out"]["per_length"])) == lengths


def test_a_bad_text_length_list_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        load_benchmark("bench_mmdit_costmodel").main(["--text-lens", "32,x"])
    assert "--text-lens" in capsys.readouterr().err
