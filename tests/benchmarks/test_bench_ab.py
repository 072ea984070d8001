"""The A/B benchmark's run order (ABBA from either arm), its overrides per arm and its pairing of the runs."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark

bench = load_benchmark("bench_ab")


def test_abba_order_from_either_arm():
    assert bench.order(3, "a") == ["a", "b", "b", "a", "a", "b"]
    assert bench.order(2, "b") == ["b", "a", "a", "b"]


def test_each_run_gets_the_common_and_its_arms_overrides_and_pairs_are_the_ith_runs(tmp_path, monkeypatch):
    seen: list[tuple[str, list[str]]] = []
    tokens = {"a": [100.0, 200.0], "b": [110.0, 150.0]}

    def run_train(kind, overrides, work, cache, timeout, code=None):
        value = tokens[kind][sum(k == kind for k, _ in seen)]
        seen.append((kind, overrides))
        return {"kind": kind, "tokens_per_s": value, "epoch_tokens_per_s": value / 2, "wall_s": 1.0}

    monkeypatch.setattr(bench, "run_train", run_train)
    out = tmp_path / "ab.json"
    bench.main(["--name", "x", "--a", "m=1", "--b", "m=2", "n=3", "--pairs", "2", "--out", str(out),
                "--work", str(tmp_path / "w"), "--", "common=1"])
    assert [k for k, _ in seen] == ["a", "b", "b", "a"]
    assert all(o == (["common=1", "m=1"] if k == "a" else ["common=1", "m=2", "n=3"]) for k, o in seen)
    result = json.loads(out.read_text())[-1]["result"]
    assert result["b_over_a_tokens_per_s_pairs"] == pytest.approx([1.1, 0.75])
    assert result["b_over_a_tokens_per_s"] == pytest.approx(0.925)
    assert result["b_over_a_epoch_tokens_per_s_pairs"] == pytest.approx([1.1, 0.75])
    assert result["a"] == ["m=1"] and result["b"] == ["m=2", "n=3"] and result["overrides"] == ["common=1"]


def test_a_third_arm_in_a_given_order_and_the_ratios_of_every_pair_of_arms(tmp_path, monkeypatch):
    seen: list[str] = []
    tokens = {"a": 100.0, "b": 120.0, "c": 110.0}

    def run_train(kind, overrides, work, cache, timeout, code=None):
        seen.append(kind)
        return {"kind": kind, "tokens_per_s": tokens[kind], "epoch_tokens_per_s": tokens[kind], "wall_s": 1.0,
                "overrides": overrides}

    monkeypatch.setattr(bench, "run_train", run_train)
    out = tmp_path / "ab.json"
    bench.main(["--name", "x", "--a", "m=1", "--b", "m=2", "--c", "m=3", "--order", "b", "c", "a", "--out", str(out),
                "--work", str(tmp_path / "w")])
    assert seen == ["b", "c", "a"]
    result = json.loads(out.read_text())[-1]["result"]
    assert result["order"] == ["b", "c", "a"] and result["c"] == ["m=3"]
    assert [r["overrides"] for r in result["runs"]] == [["m=2"], ["m=3"], ["m=1"]]
    assert {k: v for k, v in result["ratios"].items()} == {"b/a": [pytest.approx(1.2)], "c/a": [pytest.approx(1.1)],
                                                          "b/c": [pytest.approx(120 / 110)]}
    with pytest.raises(SystemExit):
        bench.main(["--name", "x", "--a", "m=1", "--b", "m=2", "--order", "c", "a", "--out", str(out)])


def test_arm_a_runs_another_copy_of_the_package_and_the_others_the_checkout(tmp_path, monkeypatch):
    codes: list[tuple[str, object]] = []

    def run_train(kind, overrides, work, cache, timeout, code=None):
        codes.append((kind, code))
        return {"kind": kind, "tokens_per_s": 1.0, "epoch_tokens_per_s": 1.0, "wall_s": 1.0}

    monkeypatch.setattr(bench, "run_train", run_train)
    out = tmp_path / "ab.json"
    bench.main(["--name", "x", "--a-code", str(tmp_path / "old"), "--pairs", "1", "--out", str(out),
                "--work", str(tmp_path / "w")])
    assert codes == [("a", tmp_path / "old"), ("b", None)]
    assert json.loads(out.read_text())[-1]["result"]["a_code"] == str(tmp_path / "old")


def test_a_run_from_another_copy_puts_it_first_on_the_path_and_refuses_a_directory_without_it(tmp_path, monkeypatch):
    quickstart = load_benchmark("bench_quickstart")
    with pytest.raises(FileNotFoundError, match="git archive"):
        quickstart.run_train("a", [], tmp_path / "w", tmp_path / "c", 10, code=tmp_path)
    (tmp_path / "old" / "lightning_adaptiveload").mkdir(parents=True)
    (tmp_path / "old" / "lightning_adaptiveload" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    seen = {}

    class Stop(Exception):
        pass

    def run(args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(quickstart.subprocess, "run", run)
    with pytest.raises(Stop):
        quickstart.run_train("a", [], tmp_path / "w", tmp_path / "c", 10, code=tmp_path / "old")
    assert seen["env"]["PYTHONPATH"].split(":") == [str((tmp_path / "old").resolve()), "/elsewhere"]
