import json

import numpy as np
import pytest

from lightning_adaptiveload.bucketing.balance import (
    bubble_fraction,
    compare_policies,
    compute_imbalance_rate,
    fitted_dual_constraint,
    mixture_token_grids,
    simulate,
    summarize_step_loads,
    sync_overhead,
)
from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.bucketing.simulate import main

MIXED = [
    {"num_frames": 1, "height": 480, "width": 832, "weight": 0.4},
    {"num_frames": 17, "height": 480, "width": 832, "weight": 0.15},
    {"num_frames": 33, "height": 480, "width": 832, "weight": 0.15},
    {"num_frames": 49, "height": 480, "width": 832, "weight": 0.1},
    {"num_frames": 81, "height": 480, "width": 832, "weight": 0.2},
]


def test_metrics_match_definitions():
    x = np.array([1.0, 2.0, 3.0, 6.0])
    cv = np.sqrt(((x - 3.0) ** 2).mean()) / 3.0
    assert compute_imbalance_rate(x) == pytest.approx(cv)
    assert sync_overhead(x) == pytest.approx(cv)
    assert bubble_fraction(x) == pytest.approx(1 - 3.0 / 6.0)
    steps = np.array([[1.0, 1.0], [1.0, 3.0]])
    assert compute_imbalance_rate(steps).tolist() == pytest.approx([0.0, 0.5])
    s = summarize_step_loads(steps)
    assert s["compute_cv"] == pytest.approx(0.25)
    assert s["bubble"] == pytest.approx(1 - (1 + 2) / (1 + 3))


def test_mixture_token_grids_counts():
    g = mixture_token_grids(MIXED, 1001)
    assert g.shape == (1001, 3)
    seq, counts = np.unique(g.prod(1), return_counts=True)
    assert seq.tolist() == [1560, 7800, 14040, 20280, 32760]
    # largest remainder: the extra sample goes to the entry with the largest fractional share (400.4)
    assert counts.tolist() == [401, 150, 150, 100, 200]


def test_simulator_cost_beats_none_and_dual_beats_equal_token():
    shapes = mixture_token_grids(MIXED, 20_000)
    for world in (8, 64):
        eq, dual, bal = compare_policies(shapes, [world], m_mem=65_520)
        assert dual.compute_cv < eq.compute_cv
        assert dual.tokens_per_s > eq.tokens_per_s
        assert bal.compute_cv < 0.05 < dual.compute_cv
        assert bal.bubble < dual.bubble
        assert bal.tokens_per_s > dual.tokens_per_s
        assert eq.tokens == dual.tokens == bal.tokens == int(shapes.prod(1).sum())


def test_simulate_without_cost_model_uses_b_s_p():
    shapes = np.array([(1, 2, 2)] * 4 + [(1, 4, 4)] * 2)
    r = simulate(shapes, DualConstraintPolicy(64, 64, 2), 2, balance="none", seed=0)
    # S=4: B=min(16, 4)=4 -> one batch cost 4*16=64; S=16: B=min(4,0)->1 -> two batches cost 256
    assert sorted(r.step_times.ravel().tolist()) == [64.0, 256.0, 256.0, 256.0]
    assert r.samples == 6


def test_cli_prints_table_and_writes_json(tmp_path, capsys):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"mixture": MIXED}))
    out = tmp_path / "out.json"
    assert main(["--mixture", str(mix), "--num-samples", "5000", "--world-sizes", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "equal-token" in text and "dual-constraint + balance" in text
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == ["equal-token", "dual-constraint", "dual-constraint + balance"]
    with pytest.raises(SystemExit):
        main(["--mixture", "no_such_mixture"])


def test_fitted_dual_constraint_recovers_a_power_law_and_runs_the_longest_sample_alone():
    from lightning_adaptiveload.costmodel import CostModel

    shapes = mixture_token_grids(MIXED, 2_000)
    seq = np.unique(shapes.prod(axis=1))
    truth = CostModel(form="power", params={"a": 0.02, "b": 3e-9, "p": 1.7})
    policy = fitted_dual_constraint(shapes, truth, m_mem=131_040)
    assert isinstance(policy, DualConstraintPolicy)
    assert policy.p == pytest.approx(1.7, rel=1e-3)
    # The budget is one sample of the longest S: that bucket runs at B = 1, shorter ones fill it.
    assert policy.batch_size(int(seq.max())) == 1
    budget = float(truth.predict(1, int(seq.max())))
    for s_len in seq:
        b = policy.batch_size(int(s_len))
        assert b == 1 or float(truth.predict(b, int(s_len))) <= budget * (1 + 1e-3)
        assert b * s_len <= 131_040 or b == 1
