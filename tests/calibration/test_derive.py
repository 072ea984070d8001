import math

import numpy as np
import pytest

from lightning_adaptiveload.bucketing.policy import CostModelPolicy, DualConstraintPolicy, EqualTokenPolicy
from lightning_adaptiveload.calibration.costmodel import CostModel, MemoryModel
from lightning_adaptiveload.calibration.derive import (
    derive_policy,
    fit_models,
    memory_budget,
    pending_optimizer_bytes,
    policy_for_budget,
)
from lightning_adaptiveload.calibration.profile import Measurement
from lightning_adaptiveload.calibration.simulate import mixture_token_grids, simulate
from lightning_adaptiveload.data.mixtures import get_mixture

MIXED = get_mixture("wan_480p")  # images and 17-81-frame 480p clips


def test_power_policy_has_exact_m_comp():
    cm = CostModel("power", {"a": 0.01, "b": 2e-9, "p": 1.6})
    budget = 0.02
    policy = policy_for_budget(cm, 65520, budget)
    assert isinstance(policy, DualConstraintPolicy)
    assert policy.m_mem == 65520 and policy.p == 1.6
    assert policy.m_comp == (budget - 0.01) / 2e-9
    # B·S^p <= m_comp  <=>  predicted time <= budget, so every batch fits the budget.
    s = np.array([1560, 6240, 32760])
    bs = policy.batch_sizes(s)
    assert bs.tolist() == [38, 4, 1]
    assert np.all((cm.predict(bs, s) <= budget * (1 + 1e-12)) | (bs == 1))
    assert np.all((cm.predict(bs + 1, s) > budget) | ((bs + 1) * s > 65520))


def test_quadratic_policy_is_cost_model_policy():
    cm = CostModel("quadratic", {"a": 0.005, "c1": 3e-7, "c2": 1e-11})
    policy = policy_for_budget(cm, 65520, 0.2, oversize="skip")
    assert isinstance(policy, CostModelPolicy)
    assert policy.cost_model is cm and policy.m_mem == 65520 and policy.step_budget == 0.2
    assert policy.oversize == "skip"
    s = np.array([1560, 32760])
    bs = policy.batch_sizes(s)
    assert np.all(cm.predict(bs, s) <= 0.2)
    assert np.all((cm.predict(bs + 1, s) > 0.2) | ((bs + 1) * s > 65520))


@pytest.mark.parametrize("m_mem, budget, match", [(0, 1.0, "m_mem=0"), (1.5, 1.0, "m_mem=1.5"),
                                                   (100, 0.001, "overhead")])
def test_policy_rejects_bad_inputs(m_mem, budget, match):
    cm = CostModel("power", {"a": 0.01, "b": 2e-9, "p": 1.6})
    with pytest.raises(ValueError, match=match):
        policy_for_budget(cm, m_mem, budget)


def test_large_fixed_cost_gives_large_batches_and_beats_equal_token():
    # The CPU quickstart's regime: a fixed cost per step that dwarfs the per-token cost. "B = 1 at the
    # longest S" would run most buckets at B = 1; the throughput rule must not.
    shapes = np.array([(1, 4, 4)] * 300 + [(1, 8, 8)] * 200 + [(3, 4, 6)] * 300 + [(5, 4, 6)] * 200)
    cm = CostModel("quadratic", {"a": 0.0267, "c1": 3.7e-4, "c2": 5.9e-15})
    d = derive_policy(cm, shapes, 4096, world_size=2)
    b1_policy = policy_for_budget(cm, 4096, float(cm.predict(1, 120)))
    assert b1_policy.batch_size(120) == 1
    assert d.policy.batch_size(120) > 8 and d.policy.batch_size(16) > 64
    assert d.predicted["tokens_per_s"] >= d.baseline["tokens_per_s"]
    eq = simulate(shapes, EqualTokenPolicy(4096), 2, cost_model=cm, balance="none")
    assert d.baseline["tokens_per_s"] == pytest.approx(eq.tokens_per_s)
    assert d.budget_source == "max predicted throughput"


def test_chosen_budget_is_the_smallest_within_tolerance_of_the_best():
    shapes = mixture_token_grids(MIXED, 4_000)
    cm = CostModel("quadratic", {"a": 0.01, "c1": 8.68e-6, "c2": 1.482e-9})
    d = derive_policy(cm, shapes, 65_520, world_size=8, num_candidates=12)
    budgets = [b for b, _ in d.candidates]
    tps = [t for _, t in d.candidates]
    assert budgets == sorted(budgets) and len(budgets) == 12
    assert budgets[0] == pytest.approx(float(cm.predict(1, 32760)))
    assert budgets[-1] == pytest.approx(float(np.max(cm.predict(65520 // np.array([1560, 7800, 14040, 20280, 32760]),
                                                                  np.array([1560, 7800, 14040, 20280, 32760])))))
    best = max(tps)
    i = budgets.index(d.step_budget_s)
    assert tps[i] >= 0.99 * best and all(t < 0.99 * best for t in tps[:i])
    # Re-simulating the chosen policy gives the recorded prediction.
    r = simulate(shapes, d.policy, 8, cost_model=cm, balance="cost")
    assert d.predicted["tokens_per_s"] == pytest.approx(r.tokens_per_s)


def test_given_budget_is_used_and_oversize_samples_are_left_out():
    shapes = np.array([(1, 30, 52)] * 10 + [(21, 30, 52)] * 5 + [(21, 45, 80)] * 2)
    truth = CostModel("power", {"a": 0.02, "b": 3e-9, "p": 1.7})
    budget = float(truth.predict(1, 32760))
    d = derive_policy(truth, shapes, 40_000, step_budget_s=budget, oversize="skip")
    assert d.budget_source == "given" and d.step_budget_s == budget and d.candidates == []
    assert d.policy.batch_size(32760) == 1 and d.policy.oversize == "skip"
    assert d.policy.batch_size(75600) == 0  # skipped
    with pytest.raises(ValueError, match="No sample fits the memory budget m_mem=100"):
        derive_policy(truth, shapes, 100)


def test_memory_budget_rules():
    ok = [Measurement(1, (1, 2, 2), 4, 0.1, 3_000, "ok"), Measurement(8, (1, 2, 2), 4, 0.2, 5_000, "ok"),
          Measurement(2, (4, 4, 4), 64, None, None, "oom")]
    mm = MemoryModel(1000.0, 10.0)
    m_mem, how = memory_budget(ok[:2], mm, 10_000, margin=0.1, pending_bytes=500)
    assert how == "memory model" and m_mem == math.floor((10_000 * 0.9 - 1500) / 10.0) == 750
    m_mem, _ = memory_budget(ok, mm, 10_000, margin=0.1, pending_bytes=500)
    assert m_mem == 127  # below the smallest B·S that ran out of memory (2 x 64)
    m_mem, how = memory_budget(ok[:2], None, None, longest_seq_len=20)
    assert how == "largest profiled batch" and m_mem == 32
    assert memory_budget(ok[:2], None, None, longest_seq_len=50)[0] == 50
    # With per-sample bytes the budget is set at the corpus's shortest length (given, else the shortest profiled).
    per_sample = MemoryModel(1000.0, 10.0, 40.0)
    assert memory_budget(ok[:2], per_sample, 10_000, margin=0.1, pending_bytes=500, shortest_seq_len=8)[0] == \
        math.floor((10_000 * 0.9 - 1500) / (10.0 + 40.0 / 8)) == 500
    assert memory_budget(ok[:2], per_sample, 10_000, margin=0.1, pending_bytes=500)[0] == \
        math.floor((10_000 * 0.9 - 1500) / (10.0 + 40.0 / 4))
    assert pending_optimizer_bytes(1000, has_state=False) == 8000
    assert pending_optimizer_bytes(1000, has_state=True) == 0


def test_fit_models_errors_and_notes():
    with pytest.raises(ValueError, match="every profiled shape ran out of memory"):
        fit_models([Measurement(1, (1, 2, 2), 4, None, None, "oom")])
    with pytest.raises(ValueError, match="could not fit the cost model on 1 feasible shapes"):
        fit_models([Measurement(1, (1, 2, 2), 4, 0.1, None, "ok")])
    rng = np.random.default_rng(0)
    noisy = [Measurement(int(b), (1, 1, int(s)), int(s), float(rng.uniform(0.1, 1.0)), None, "ok")
             for b in (1, 2, 4) for s in (10, 20, 40, 80)]
    cm, mm, notes = fit_models(noisy)
    assert mm is None and any("median error" in n for n in notes)


def test_bucket_counts_give_the_same_derivation_as_every_sample():
    from lightning_adaptiveload.bucketing.buckets import count_buckets

    shapes = mixture_token_grids(MIXED, 3_000)
    cm = CostModel("quadratic", {"a": 0.01, "c1": 8.68e-6, "c2": 1.482e-9})
    per_sample = derive_policy(cm, shapes, 65_520, world_size=4, num_candidates=8)
    grids, counts = count_buckets(shapes)
    bucketed = derive_policy(cm, grids, 65_520, counts=counts, world_size=4, num_candidates=8)
    assert bucketed.to_dict() == per_sample.to_dict()


def _m(b, s, t, peak, status="ok", mode=None):
    return Measurement(b, (1, 1, s), s, t if status == "ok" else None, peak, status, 1 if status == "ok" else 0,
                       mode=mode)


def test_fit_tiers_each_mode_takes_what_it_measured_to_fit_within_the_limit():
    from lightning_adaptiveload.calibration.derive import ModeTier, fit_tiers, fits_at_one

    gib = 2**30
    cm = CostModel("quadratic", {"a": 0.0, "c1": 1e-6, "c2": 0.0})
    limit = 80 * gib
    none = [_m(1, 1000, 1e-3, 10 * gib), _m(4, 1000, 4e-3, 40 * gib), _m(1, 5000, 5e-3, 50 * gib),
            _m(1, 8000, 8e-3, limit + 1), _m(1, 9000, None, None, "too_large")]
    selective = [_m(1, 8000, 9.6e-3, 30 * gib), _m(1, 9000, 10.8e-3, 33 * gib)]
    full = [_m(1, 12000, 20e-3, 20 * gib)]
    tiers = fit_tiers([("none", none), ("selective", selective), ("full", full)], cm,
                      MemoryModel(2 * gib, 1e7), limit)
    # 'none' ends at the longest it trained within the limit (8000 ran, but one byte over it).
    assert [(t.mode, t.max_seq_len) for t in tiers] == [("none", 5000), ("selective", 9000), ("full", 12000)]
    assert tiers[0].scale == 1.0 and tiers[1].scale == pytest.approx(1.2) and tiers[2].scale == pytest.approx(20 / 12)
    # Two token counts: fitted; one: the line through the base model's fixed bytes and the peak.
    assert tiers[1].memory_model.predict(1, 9000) == pytest.approx(33 * gib, rel=1e-6)
    assert tiers[2].memory_model == MemoryModel(2 * gib, 18 * gib / 12000)
    assert fits_at_one(_m(1, 1, 1.0, None), None) and not fits_at_one(_m(2, 1, 1.0, 1), 2)
    # A mode that adds nothing longer gets no tier; tiers round-trip through the record.
    assert [t.mode for t in fit_tiers([("none", none), ("selective", none)], cm, None, limit)] == ["none"]
    assert ModeTier.from_dict(tiers[1].to_dict()) == tiers[1]


def test_tiered_derivation_prices_and_sizes_each_bucket_in_its_own_mode():
    from lightning_adaptiveload.bucketing.policy import TieredPolicy
    from lightning_adaptiveload.calibration.derive import ModeTier, TieredCostModel

    cm = CostModel("quadratic", {"a": 0.01, "c1": 1e-6, "c2": 1e-10})
    tiers = [ModeTier("none", 32760, 1.0), ModeTier("selective", 75600, 1.25)]
    grids = np.array([(1, 30, 52), (21, 30, 52), (21, 45, 80)])  # 1,560 / 32,760 / 75,600
    counts = np.array([400, 100, 50])
    d = derive_policy(cm, grids, [65_520, 160_000], counts=counts, tiers=tiers, num_candidates=8)
    assert isinstance(d.policy, TieredPolicy)
    assert [d.policy.mode_for(s) for s in (1560, 32760, 75600)] == ["none", "none", "selective"]
    assert d.mode_for(75600) == "selective" and d.mode_for(1560) == "none"
    b = d.policy.batch_sizes(np.array([1560, 32760, 75600]))
    # Memory caps are each tier's own: images under none's 65,520, the 720p clip under selective's 160,000.
    assert b[0] <= 65_520 // 1560 and b[1] <= 2 and 1 <= b[2] <= 160_000 // 75600
    # The sampler prices each bucket in its mode; the budget bounds every bucket's predicted step.
    priced = TieredCostModel(cm, tiers)
    assert priced.predict(1, 75600) == pytest.approx(1.25 * cm.predict(1, 75600))
    assert priced.predict(3, 1560) == pytest.approx(cm.predict(3, 1560))
    assert d.cost_model is d.policy.cost_model
    assert max(priced.predict(bb, s) for bb, s in zip(b, (1560, 32760, 75600), strict=True)) <= max(
        d.step_budget_s, priced.predict(1, 75600))
    assert [t["m_mem"] for t in d.tiers] == [65_520, 160_000] and d.m_mem == 160_000
    # The baseline is one mode for the run: equal tokens at the last tier's budget, all priced in it.
    assert "all in 'selective'" in d.summary()
    with pytest.raises(ValueError, match="one token budget per tier"):
        derive_policy(cm, grids, 65_520, counts=counts, tiers=tiers)
    # One tier: the plain rule in that mode (a power model keeps the paper's dual constraint).
    single = derive_policy(CostModel("power", {"a": 0.01, "b": 1e-9, "p": 1.6}), grids[:2], [65_520],
                           counts=counts[:2], tiers=[ModeTier("none", 32760, 1.0)], num_candidates=4)
    assert isinstance(single.policy, DualConstraintPolicy) and single.mode_for(32760) == "none"


def test_scaled_cost_model_multiplies_every_prediction():
    for cm in (CostModel("power", {"a": 0.01, "b": 1e-9, "p": 1.6}),
               CostModel("quadratic", {"a": 0.01, "c1": 1e-6, "c2": 1e-10}),
               CostModel("saturating", {"a": 0.01, "c1": 1e-6, "c2": 1e-10, "k": 3.0})):
        b, s = np.array([1, 4, 1]), np.array([1560, 7800, 75600])
        assert np.allclose(cm.scaled(1.3).predict(b, s), 1.3 * cm.predict(b, s), rtol=1e-12)
    with pytest.raises(ValueError, match="factor"):
        cm.scaled(0.0)


def test_tiers_beyond_the_base_mode_keep_their_budget_at_what_they_measured():
    from lightning_adaptiveload.calibration.derive import ModeTier, tier_memory_budgets

    gib = 2**30
    none = [_m(1, 1000, 1e-3, 10 * gib, mode="none"), _m(8, 1000, 8e-3, 26 * gib, mode="none")]
    selective = [_m(1, 8000, 9.6e-3, 20 * gib, mode="selective")]
    tiers = [ModeTier("none", 5000, 1.0, MemoryModel(8 * gib, 2 * gib / 1000)),
             ModeTier("selective", 8000, 1.2, MemoryModel(8 * gib, 12 * gib / 8000))]
    (m_none, _), (m_sel, how) = tier_memory_budgets(tiers, none + selective, 100 * gib, margin=0.1, pending_bytes=0,
                                                    seq_lens=[1000, 5000, 8000])
    assert m_none == (90 - 8) * 1000 // 2  # the base mode: its fitted model
    # selective's one-point line would allow (90 - 8) / 12 * 8000 = 54,666 tokens; it keeps 8,000, measured.
    assert m_sel == 8000 and "largest batch measured" in how


def test_a_profile_where_no_mode_fits_one_sample_is_an_error_naming_the_fix():
    import time

    from lightning_adaptiveload.calibration.calibrate import ProfileSettings, Trainee, profile_modes
    from lightning_adaptiveload.calibration.profile import MemoryProbe

    def make_step(b, grid):
        return lambda: time.sleep(1e-4 * b * int(np.prod(grid)))

    # Every step runs, but peaks at 1,000 bytes where 90 are allowed (100 less the 10% margin).
    trainee = Trainee(make_step=make_step, modes=("none", "full"), set_mode=lambda mode: None, device_memory=100,
                      memory=MemoryProbe(reset=lambda: None, peak=lambda: 1000))
    grids = np.array([(1, 2, 2), (1, 4, 4), (2, 4, 4), (3, 4, 6), (5, 6, 6)])
    with pytest.raises(ValueError, match=r"no sequence length trains one sample .* \(none, full; the shortest is S=4\)"):
        profile_modes(grids, ProfileSettings(repeats=1, warmup=0, converge_rel=0.0), trainee, {"model": "x"})


def test_samples_a_sequence_parallel_group_holds_are_not_oversize():
    """With SP the planner trains a sample longer than one rank's budget on a group of k ranks (each with
    1/k of its tokens): the calibration's derivation refuses only samples above k times the budget."""
    from lightning_adaptiveload.bucketing.sampler import OversizeSampleError
    from lightning_adaptiveload.calibration.calibrate import ProfileSettings, derive_for
    from lightning_adaptiveload.calibration.record import Calibration

    cm = CostModel("quadratic", {"a": 0.001, "c1": 1e-4, "c2": 1e-5})
    cal = Calibration({"model": "x"}, cm, [Measurement(1, (1, 4, 4), 16, 0.005, None, "ok", 3, 0.1)])
    grids, counts = np.array([(1, 4, 4), (5, 4, 6)]), np.array([3, 2])  # S = 16 and 120
    settings = ProfileSettings(m_mem=100)
    with pytest.raises(OversizeSampleError, match=r"S=120 tokens .* above the memory budget of 100 tokens"):
        derive_for(cal, grids, counts, settings, world_size=2)
    d = derive_for(cal, grids, counts, settings, world_size=2, sp_degree=2)
    assert d.m_mem == 100 and d.policy.batch_size(16) >= 1  # the budget of one rank is unchanged
    with pytest.raises(OversizeSampleError, match=r"above the memory budget of 100 tokens \(sequence-parallel "
                                                  r"degree 2 × 50 tokens that fit one device\)"):
        derive_for(cal, grids, counts, ProfileSettings(m_mem=50), world_size=2, sp_degree=2)


@pytest.mark.parametrize("tiered", [False, True])
def test_budgets_that_give_the_same_plan_are_simulated_once_with_the_same_result(monkeypatch, tiered):
    import lightning_adaptiveload.calibration.derive as derive
    from lightning_adaptiveload.calibration.derive import ModeTier

    cm = CostModel("quadratic", {"a": 0.01, "c1": 8.68e-6, "c2": 1.482e-9})
    if tiered:
        grids, counts = np.array([(1, 30, 52), (21, 30, 52), (21, 45, 80)]), np.array([400, 100, 50])
        args = dict(counts=counts, tiers=[ModeTier("none", 32760, 1.0), ModeTier("selective", 75600, 1.25)])
        m_mem = [65_520, 160_000]
    else:
        grids, args, m_mem = mixture_token_grids(MIXED, 4_000), {}, 65_520
    calls = []
    real = derive._predict
    monkeypatch.setattr(derive, "_predict", lambda *a: calls.append(a[1]) or real(*a))
    d = derive_policy(cm, grids, m_mem, world_size=8, num_candidates=24, **args)
    uniq = np.unique(grids.prod(axis=1))
    plans = {derive._plan_key(p, uniq) for p in calls[1:]}  # calls[0]: the equal-token baseline
    assert len(calls) - 1 == len(plans) < 24  # one simulation per distinct plan, fewer than the budgets
    # Every budget simulated anew gives the same derivation.
    keys = iter(range(10**6))
    monkeypatch.setattr(derive, "_plan_key", lambda policy, seq: next(keys))
    again = derive_policy(cm, grids, m_mem, world_size=8, num_candidates=24, **args)
    assert again.to_dict() == d.to_dict()
