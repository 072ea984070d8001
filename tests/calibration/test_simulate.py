import json

import numpy as np
import pytest

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.calibration.derive import derive_policy
from lightning_adaptiveload.calibration.simulate import (
    compare_policies,
    default_cost_model,
    mixture_token_grids,
    simulate,
)
from lightning_adaptiveload.cli.simulate import main
from lightning_adaptiveload.data.mixtures import get_mixture

MIXED = get_mixture("wan_480p")  # images and 17-81-frame 480p clips


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
        policy = derive_policy(default_cost_model(), shapes, 65_520, world_size=world).policy
        eq, dual, bal = compare_policies(shapes, [world], dual=policy, m_mem=65_520)
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


def test_cli_prints_m_mem_policies_and_warns_for_tiny_plans(capsys):
    assert main(["--mixture", "wan_480p", "--num-samples", "64", "--world-sizes", "16",
                 "--patch-size", "1,4,4"]) == 0
    text = capsys.readouterr().out
    assert "M_mem = 65,520 tokens (default: max(65520, longest S))" in text
    assert "EqualTokenPolicy(max_tokens=65520)" in text and "dual constraint: " in text
    assert "warning: 16 ranks plan only" in text
    # The patch is applied: (21, 30, 52) latents-per-patch (1, 4, 4) is 21*15*26 tokens at most.
    assert main(["--mixture", "wan_480p", "--num-samples", "64", "--world-sizes", "1", "--patch-size", "1,4,4",
                 "--json", "/dev/null"]) == 0
    with pytest.raises(SystemExit):
        main(["--mixture", "wan_480p", "--patch-size", "1,2"])


@pytest.mark.parametrize("balance", ["cost", "none"])
def test_a_corpus_simulator_gives_what_a_fresh_simulation_gives_for_each_policy_in_turn(balance):
    # The corpus is indexed once and the policies swapped; each result must equal simulate()'s for the same
    # arguments, whatever came before it: cost-model policies of several budgets, a policy without a cost model
    # after one with (the sampler's cost model must not linger), one that skips oversize samples, then a
    # cost-model policy again.
    from lightning_adaptiveload.bucketing.policy import EqualTokenPolicy
    from lightning_adaptiveload.calibration.derive import policy_for_budget
    from lightning_adaptiveload.calibration.simulate import CorpusSimulator

    shapes = mixture_token_grids(MIXED, 3_000)
    cm = default_cost_model()
    policies = [(policy_for_budget(cm, 65_520, budget), cm) for budget in (0.5, 2.0, 8.0)]
    policies += [(DualConstraintPolicy(65_520, 20_000.0, 1.5), None), (EqualTokenPolicy(65_520), cm),
                 (policy_for_budget(cm, 20_000, 1.0, oversize="skip"), None), (policy_for_budget(cm, 65_520, 3.0), None)]
    sim = CorpusSimulator(shapes, 8, balance=balance, seed=3)
    for policy, model in policies:
        got = sim(policy, cost_model=model, name="x")
        want = simulate(shapes, policy, 8, cost_model=model, balance=balance, seed=3, name="x")
        assert got.to_dict() == want.to_dict(), policy
        assert np.array_equal(got.step_times, want.step_times)
    assert sim(policies[-2][0]).skipped_samples > 0  # the skipping policy did skip


def test_derive_policy_is_unchanged_by_simulating_its_candidates_on_one_corpus(monkeypatch):
    # derive_policy simulates every candidate on one CorpusSimulator; with a fresh simulation per candidate
    # (as before) its derivation is the same.
    import lightning_adaptiveload.calibration.derive as derive

    shapes = mixture_token_grids(MIXED, 3_000)
    shared = derive_policy(default_cost_model(), shapes, 65_520, world_size=8)

    class Fresh:  # a CorpusSimulator that simulates each policy from scratch
        def __init__(self, corpus, world_size, *, balance, seed):
            self.args = (corpus, world_size, balance, seed)

        def __call__(self, policy, *, cost_model=None, name=None):
            corpus, world_size, balance, seed = self.args
            return simulate(corpus, policy, world_size, cost_model=cost_model, balance=balance, seed=seed, name=name)

    monkeypatch.setattr(derive, "CorpusSimulator", Fresh)
    fresh = derive_policy(default_cost_model(), shapes, 65_520, world_size=8)
    assert fresh.candidates == shared.candidates and fresh.predicted == shared.predicted
    assert fresh.step_budget_s == shared.step_budget_s and repr(fresh.policy) == repr(shared.policy)
