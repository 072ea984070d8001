"""The closed-loop benchmark's run order (ABBA, from either side) and its pairing of off and on runs."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark

bench = load_benchmark("bench_closed_loop")


def _fake_runs(monkeypatch, tokens: dict[str, list[float]]):
    """``run_train`` replaced: each call takes the next tokens/s of its kind and records the order."""
    order: list[str] = []

    def run_train(name, overrides, work, cache, timeout):
        kind = name.removeprefix("closed_loop_")
        assert ("callbacks.shape_benchmark.closed_loop=false" in overrides) == (kind == "off")
        cache.mkdir(parents=True, exist_ok=True)
        value = tokens[kind][sum(k == kind for k in order)]
        order.append(kind)
        return {"kind": name, "tokens_per_s": value, "epoch_tokens_per_s": value, "mfu": None, "wall_s": 1.0,
                "decisions": []}

    monkeypatch.setattr(bench, "run_train", run_train)
    return order


@pytest.mark.parametrize(("first", "expected"), [("off", ["off", "on", "on", "off"]), ("on", ["on", "off", "off", "on"])])
def test_pairs_alternate_from_the_first_side(tmp_path, monkeypatch, first, expected):
    order = _fake_runs(monkeypatch, {"off": [100.0, 200.0], "on": [110.0, 180.0]})
    out = tmp_path / "cl.json"
    bench.main(["--name", "x", "--out", str(out), "--pairs", "2", "--first", first, "--work", str(tmp_path / "w"),
                "--", "callbacks.shape_benchmark.force=true"])
    assert order == expected
    result = json.loads(out.read_text())[-1]["result"]
    # Pair i is the i-th off run beside the i-th on run, whichever came first.
    assert result["on_over_off_tokens_per_s_pairs"] == pytest.approx([1.1, 0.9])
    assert result["first"] == first and result["on_over_off_tokens_per_s"] == pytest.approx(1.0)


def test_first_on_needs_every_run_to_profile(tmp_path, monkeypatch, capsys):
    _fake_runs(monkeypatch, {"off": [1.0], "on": [1.0]})
    with pytest.raises(SystemExit):
        bench.main(["--name", "x", "--out", str(tmp_path / "cl.json"), "--first", "on"])
    assert "callbacks.shape_benchmark.force=true" in capsys.readouterr().err
