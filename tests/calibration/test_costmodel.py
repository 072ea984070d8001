import json
import math

import numpy as np
import pytest

from lightning_adaptiveload.calibration.costmodel import CostModel, MemoryModel
from lightning_adaptiveload.calibration.derive import policy_for_budget

# Wan-like sequence lengths: images (1,30,52) up to 81-frame 480p video (21,30,52).
SEQ = np.array([1560, 3120, 6240, 12480, 20280, 32760])
BATCH = np.array([1, 2, 4, 8])


def _grid():
    b, s = np.meshgrid(BATCH, SEQ)
    return b.ravel(), s.ravel()


def _power(b, s, a=0.01, k=2e-9, p=1.6):
    return a + k * b * s**p


def _quadratic(b, s, a=0.005, c1=3e-7, c2=1e-11):
    return a + b * (c1 * s + c2 * s * s)


def _noisy(t, rel=0.02, seed=0):
    return t * (1 + rel * np.random.default_rng(seed).standard_normal(t.shape))


def test_power_exact_recovery():
    b, s = _grid()
    cm = CostModel.fit(b, s, _power(b, s), form="power")
    assert cm.form == "power"
    assert cm.params["p"] == pytest.approx(1.6, rel=1e-5)
    assert cm.params["b"] == pytest.approx(2e-9, rel=1e-4)
    assert cm.params["a"] == pytest.approx(0.01, rel=1e-4)
    assert cm.quality["max_rel_error"] < 1e-6
    assert cm.quality["r2"] == pytest.approx(1.0, abs=1e-9)


def test_power_noisy_recovery():
    b, s = _grid()
    cm = CostModel.fit(b, s, _noisy(_power(b, s)), form="power")
    assert cm.params["p"] == pytest.approx(1.6, abs=0.03)
    assert cm.params["a"] == pytest.approx(0.01, rel=0.1)
    # Predictions, not the (correlated) b and p individually, are what the policy uses.
    assert np.allclose(cm.predict(b, s), _power(b, s), rtol=0.03)
    assert cm.quality["heldout_median_rel_error"] < 0.03
    assert cm.quality["r2"] > 0.99


def test_quadratic_exact_and_noisy_recovery():
    b, s = _grid()
    exact = CostModel.fit(b, s, _quadratic(b, s), form="quadratic")
    for name, true in (("a", 0.005), ("c1", 3e-7), ("c2", 1e-11)):
        assert exact.params[name] == pytest.approx(true, rel=1e-6)
    noisy = CostModel.fit(b, s, _noisy(_quadratic(b, s), seed=1), form="quadratic")
    assert noisy.params["c2"] == pytest.approx(1e-11, rel=0.05)
    assert noisy.params["c1"] == pytest.approx(3e-7, rel=0.1)
    assert np.allclose(noisy.predict(b, s), _quadratic(b, s), rtol=0.03)
    assert noisy.quality["heldout_median_rel_error"] < 0.03


def test_heldout_false_skips_only_the_held_out_error():
    b, s = _grid()
    t = _noisy(_quadratic(b, s), seed=1)
    full = CostModel.fit(b, s, t, form="saturating")
    quick = CostModel.fit(b, s, t, form="saturating", heldout=False)
    assert quick.params == full.params and math.isnan(quick.quality["heldout_median_rel_error"])
    assert math.isfinite(full.quality["heldout_median_rel_error"])
    assert {k: v for k, v in quick.quality.items() if k != "heldout_median_rel_error"} == {
        k: v for k, v in full.quality.items() if k != "heldout_median_rel_error"}
    # "auto" chooses its form by the held-out error, so it computes it anyway.
    assert math.isfinite(CostModel.fit(b, s, t, heldout=False).quality["heldout_median_rel_error"])


@pytest.mark.parametrize("form", ["power", "saturating"])
def test_warm_held_out_fits_start_from_the_full_fit_and_agree_with_cold_ones(form, monkeypatch):
    from lightning_adaptiveload.calibration import costmodel

    b, s = _grid()
    t = _noisy(_quadratic(b, s), seed=1)
    calls = []
    real = costmodel.least_squares
    monkeypatch.setattr(costmodel, "least_squares", lambda *a, **k: calls.append(1) or real(*a, **k))
    cold = CostModel.fit(b, s, t, form=form)
    n_cold, calls[:] = len(calls), []
    warm = CostModel.fit(b, s, t, form=form, heldout="warm")
    assert warm.params == cold.params
    assert warm.quality["heldout_median_rel_error"] == pytest.approx(cold.quality["heldout_median_rel_error"], rel=1e-3)
    # One start per held-out fit instead of the form's three (the fit on all points keeps its three).
    folds = len(t) if len(t) <= costmodel._LOO_MAX_POINTS else costmodel._KFOLD
    assert n_cold == 3 * (folds + 1) and len(calls) == folds + 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_picks_generating_form(seed):
    b, s = _grid()
    by_quad = CostModel.fit(b, s, _noisy(_quadratic(b, s), seed=seed), form="auto")
    assert by_quad.form == "quadratic"
    assert by_quad.quality["heldout_quadratic"] < by_quad.quality["heldout_power"]
    by_power = CostModel.fit(b, s, _noisy(_power(b, s, p=1.6), seed=seed), form="auto")
    assert by_power.form == "power"
    assert by_power.quality["heldout_power"] < by_power.quality["heldout_quadratic"]


def test_kfold_used_for_many_points(monkeypatch):
    from lightning_adaptiveload.calibration import costmodel

    rng = np.random.default_rng(3)
    b = rng.integers(1, 16, size=60)
    s = rng.choice(SEQ, size=60)
    t = _noisy(_quadratic(b, s), seed=3)
    calls = []
    real = costmodel._fit_params
    monkeypatch.setattr(costmodel, "_fit_params", lambda *a: calls.append(len(a[1])) or real(*a))
    cm = CostModel.fit(b, s, t, form="quadratic")
    assert cm.quality["n_points"] == 60
    # 8 deterministic folds (index % 8) plus the full fit, not 60 leave-one-out fits.
    assert len(calls) == 1 + 8
    assert sorted(calls[1:]) == sorted((60 - np.bincount(np.arange(60) % 8)).tolist())
    folds = np.arange(60) % 8
    errors = []
    for k in range(8):
        test = folds == k
        fold = CostModel.fit(b[~test], s[~test], t[~test], form="quadratic")
        errors.append(np.abs(fold.predict(b[test], s[test]) / t[test] - 1))
    assert cm.quality["heldout_median_rel_error"] == pytest.approx(float(np.median(np.concatenate(errors))), rel=1e-6)
    assert 0 < cm.quality["heldout_median_rel_error"] < 0.03


def test_predict_vectorised_and_scalar():
    cm = CostModel("quadratic", {"a": 1.0, "c1": 2.0, "c2": 3.0})
    assert cm.predict(2, 5) == 1.0 + 2 * (2 * 5 + 3 * 25)
    assert isinstance(cm.predict(2, 5), float)
    out = cm.predict(np.array([[1], [2]]), np.array([1, 2, 3]))
    assert out.shape == (2, 3)
    assert out[1, 2] == 1.0 + 2 * (2 * 3 + 3 * 9)
    pw = CostModel("power", {"a": 0.5, "b": 2.0, "p": 1.5})
    assert pw.predict(3, 4) == 0.5 + 2.0 * 3 * 4**1.5


@pytest.mark.parametrize(
    "b, s, t, match",
    [
        ([1, 2, 3], [10, 20, 30], [1.0, 2.0], "lengths"),
        ([1, 2, 3, 4], [10, 20, 30, 40], [1.0, float("nan"), 3.0, 4.0], r"times\[1\]"),
        ([1, 2, 3, 4], [10, 20, 30, 40], [1.0, 2.0, float("inf"), 4.0], r"times\[2\]"),
        ([1, 2, 3, 4], [10, 20, 30, 40], [1.0, 2.0, 0.0, 4.0], r"times\[2\]"),
        ([1, 2, 3, 4], [10, 20, 30, 40], [1.0, -2.0, 3.0, 4.0], r"times\[1\]"),
        ([1, 0, 3, 4], [10, 20, 30, 40], [1.0, 2.0, 3.0, 4.0], r"batch_sizes\[1\]"),
        ([1, 2, 3], [10, 20, 30], [1.0, 2.0, 3.0], "at least 4"),
        ([1, 2, 4, 8], [50, 50, 50, 50], [1.0, 2.0, 3.0, 4.0], "single sequence length"),
        ([[1, 2], [3, 4]], [10, 20, 30, 40], [1.0, 2.0, 3.0, 4.0], "1-D"),
    ],
)
def test_degenerate_inputs_raise(b, s, t, match):
    with pytest.raises(ValueError, match=match):
        CostModel.fit(b, s, t)


def test_unknown_form_raises():
    b, s = _grid()
    with pytest.raises(ValueError, match="form='cubic'"):
        CostModel.fit(b, s, _power(b, s), form="cubic")


def test_auto_with_too_few_points_warns_and_falls_back():
    # Four points: every leave-one-out fold has 3 points, one too few for a 3-parameter fit.
    b = [1, 2, 1, 2]
    s = [100, 100, 400, 400]
    t = _quadratic(np.array(b), np.array(s), a=0.01, c1=1e-4, c2=1e-7)
    with pytest.warns(UserWarning, match="too few points"):
        cm = CostModel.fit(b, s, t, form="auto")
    assert math.isnan(cm.quality["heldout_median_rel_error"])
    assert cm.quality["median_rel_error"] < 0.05


def test_json_round_trip_and_validation():
    b, s = _grid()
    cm = CostModel.fit(b, s, _noisy(_power(b, s)), form="auto")
    text = cm.to_json()
    back = CostModel.from_json(text)
    assert back == cm
    assert np.array_equal(back.predict(b, s), cm.predict(b, s))
    data = json.loads(text)
    assert data["version"] == 1 and data["format"] == "lightning_adaptiveload.CostModel"

    with pytest.raises(ValueError, match="could not be parsed"):
        CostModel.from_json("{not json")
    with pytest.raises(ValueError, match="Not a serialised CostModel"):
        CostModel.from_json(json.dumps({"form": "power"}))
    bad = dict(data, version=99)
    with pytest.raises(ValueError, match="version 99"):
        CostModel.from_json(json.dumps(bad))
    bad = dict(data, params={"a": 1.0, "b": -1.0, "p": 1.5}, form="power")
    with pytest.raises(ValueError, match="b=-1.0"):
        CostModel.from_json(json.dumps(bad))
    bad = dict(data, params={"a": 1.0, "c1": 1.0}, form="quadratic")
    with pytest.raises(ValueError, match="Expected exactly the parameters"):
        CostModel.from_json(json.dumps(bad))
    bad = dict(data, params={"a": 1.0, "b": 1.0, "p": 1.5}, form="cubic")
    with pytest.raises(ValueError, match="form='cubic'"):
        CostModel.from_json(json.dumps(bad))


def test_nan_quality_round_trips_as_null():
    cm = CostModel("power", {"a": 0.0, "b": 1.0, "p": 2.0}, {"heldout_median_rel_error": float("nan")})
    text = cm.to_json()
    assert "NaN" not in text
    assert math.isnan(CostModel.from_json(text).quality["heldout_median_rel_error"])


def test_zero_slope_rejected():
    with pytest.raises(ValueError, match="does not grow"):
        CostModel("quadratic", {"a": 1.0, "c1": 0.0, "c2": 0.0})


def test_memory_model_fit_and_budget():
    b, s = _grid()
    peak = 3e9 + 2e4 * b * s
    mm = MemoryModel.fit(b, s, _noisy(peak, rel=0.001))
    assert mm.m0 == pytest.approx(3e9, rel=0.01)
    assert mm.m1 == pytest.approx(2e4, rel=0.01)
    exact = MemoryModel.fit(b, s, peak)
    assert exact.m0 == pytest.approx(3e9, rel=1e-9) and exact.m1 == pytest.approx(2e4, rel=1e-9)
    mem = 80 * 2**30
    assert exact.max_tokens(mem, margin=0.1) == math.floor((mem * 0.9 - exact.m0) / exact.m1)
    # A shape that ran out of memory caps the budget below it.
    assert exact.max_tokens(mem, margin=0.1, oom_tokens=[100_000, 50_000]) == 49_999
    assert exact.predict(2, 10) == pytest.approx(3e9 + 2e4 * 20)


def test_memory_model_degenerate():
    with pytest.raises(ValueError, match="two distinct token counts"):
        MemoryModel.fit([1, 2], [20, 10], [5.0, 5.0])
    with pytest.raises(ValueError, match="does not grow"):
        MemoryModel.fit([1, 2, 4], [10, 10, 10], [9.0, 5.0, 1.0])
    mm = MemoryModel(1e9, 1e4)
    with pytest.raises(ValueError, match="No token fits"):
        mm.max_tokens(1e9, margin=0.1)
    with pytest.raises(ValueError, match="margin=1.0"):
        mm.max_tokens(1e10, margin=1.0)
    assert MemoryModel.from_dict(mm.to_dict()) == mm


@pytest.mark.parametrize("form", ["power", "quadratic", "auto"])
def test_flat_timings_give_a_valid_nearly_flat_model(form):
    # Timings that do not grow with tokens (noise on a tiny model) must not produce an invalid model.
    b, s = _grid()
    t = _noisy(np.full(b.shape, 0.01), rel=0.05, seed=4)
    cm = CostModel.fit(b, s, t, form=form)
    assert np.all(np.abs(cm.predict(b, s) / 0.01 - 1) < 0.2)
    assert policy_for_budget(cm, 65520, 0.02).batch_size(1560) == 42  # memory alone binds


def test_absurd_timings_get_a_clear_error():
    b, s = _grid()
    t = _power(b, s)
    t[3] = 1e308
    with pytest.raises(ValueError, match=r"times\[3\]=1e\+308.*not a plausible step time"):
        CostModel.fit(b, s, t)


def _saturating(b, s, a=0.3, c1=2e-5, c2=1.4e-9, k=3.0):
    work = b * (c1 * s + c2 * s * s)
    return (a**k + work**k) ** (1.0 / k)


def test_saturating_form_recovers_and_predicts_like_the_float64_formula():
    b = np.array([1, 6, 42, 1, 3, 8, 1, 2, 4, 1, 2, 3, 1, 2], dtype=float)
    s = np.array([1560, 1560, 1560, 7800, 7800, 7800, 14040, 14040, 14040, 20280, 20280, 20280, 32760, 32760.0])
    t = _saturating(b, s)
    cm = CostModel.fit(b, s, t, form="saturating")
    assert cm.quality["max_rel_error"] < 1e-4 and cm.params["k"] == pytest.approx(3.0, rel=1e-3)
    # The overflow-safe evaluation equals the plain formula, also far from the floor and at k = 8.
    sharp = CostModel("saturating", {"a": 0.5, "c1": 1e-5, "c2": 1e-9, "k": 8.0})
    bb, ss = np.array([1.0, 100.0, 1e4]), np.array([100.0, 32760.0, 75600.0])
    work = bb * (1e-5 * ss + 1e-9 * ss * ss)
    assert np.allclose(sharp.predict(bb, ss), (0.5**8 + work**8) ** (1 / 8), rtol=1e-12)
    assert sharp.predict(1e4, 75600) == pytest.approx(float(work[-1]), rel=1e-12)  # the work dominates
    assert CostModel.from_json(cm.to_json()) == cm
    with pytest.raises(ValueError, match=r"k=9.0 is not valid. Expected a number in \[1.0, 8.0\]"):
        CostModel("saturating", {"a": 0.5, "c1": 1e-5, "c2": 1e-9, "k": 9.0})
    with pytest.raises(ValueError, match="its 4 parameters need at least 5"):
        CostModel.fit(b[:4], s[:4], t[:4], form="saturating")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_takes_the_saturating_form_only_when_it_is_clearly_better(seed):
    b = np.array([1, 6, 42, 1, 3, 8, 1, 2, 4, 1, 2, 3, 1, 2], dtype=float)
    s = np.array([1560, 1560, 1560, 7800, 7800, 7800, 14040, 14040, 14040, 20280, 20280, 20280, 32760, 32760.0])
    by_floor = CostModel.fit(b, s, _noisy(_saturating(b, s), seed=seed), form="auto")
    assert by_floor.form == "saturating"
    assert by_floor.quality["heldout_saturating"] < 0.8 * by_floor.quality["heldout_quadratic"]


def test_policy_from_a_saturating_model_is_the_largest_batch_within_the_budget():
    from lightning_adaptiveload.calibration.derive import policy_for_budget

    cm = CostModel("saturating", {"a": 0.3, "c1": 2e-5, "c2": 1.4e-9, "k": 3.0})
    policy = policy_for_budget(cm, m_mem=500_000, step_budget_s=2.0)
    for seq in (1560, 7800, 32760):
        bsz = policy.batch_size(seq)
        assert bsz == 1 or cm.predict(bsz, seq) <= 2.0  # B = 1 is always allowed
        assert cm.predict(bsz + 1, seq) > 2.0 or (bsz + 1) * seq > 500_000
    # By hand: B = 57 at S = 1,560 gives t = (0.3³ + 1.9726³)^(1/3) = 1.975 s; B = 58 has work 2.007 s.
    assert [policy.batch_size(seq) for seq in (1560, 7800, 32760)] == [57, 8, 1]


def test_memory_model_per_sample_term():
    # Two batch sizes at one length separate the per-sample bytes (text context, cross-attention K/V).
    b = np.array([1, 1, 1, 6, 3, 2])
    s = np.array([1560, 7800, 32760, 1560, 7800, 14040])
    m0, m1, m2 = 14e9, 3e6, 1.5e8
    mm = MemoryModel.fit(b, s, m0 + m1 * b * s + m2 * b)
    assert (mm.m0, mm.m1, mm.m2) == pytest.approx((m0, m1, m2), rel=1e-9)
    # At B = 1 only, B is the constant column: no per-sample term, the same line as before.
    only_b1 = MemoryModel.fit(b[:3], s[:3], (m0 + m1 * b * s + m2 * b)[:3])
    assert only_b1.m2 == 0.0 and only_b1.m0 == pytest.approx(m0 + m2, rel=1e-9)
    assert mm.predict(23, 1560) == pytest.approx(m0 + m1 * 23 * 1560 + m2 * 23)
    mem, margin = 150e9, 0.1
    # The token budget holds at the shortest length, where a budget of tokens is the most samples.
    t = mm.max_tokens(mem, margin, min_seq_len=1560)
    assert t == math.floor((mem * 0.9 - m0) / (m1 + m2 / 1560))
    assert mm.predict(t // 1560, 1560) <= mem * 0.9 < mm.predict(t // 1560 + 2, 1560)
    assert mm.max_batch_size(1560, mem, margin) == math.floor((mem * 0.9 - m0) / (m1 * 1560 + m2))
    assert mm.max_batch_size(10**9, mem, margin) == 0
    with pytest.raises(ValueError, match="pass the shortest sequence length"):
        mm.max_tokens(mem, margin)
    assert MemoryModel.from_dict(mm.to_dict()) == mm
    assert MemoryModel.from_dict({"m0": 1.0, "m1": 2.0}) == MemoryModel(1.0, 2.0, 0.0)  # an older record
    with pytest.raises(ValueError, match="m2=-1"):
        MemoryModel(1.0, 2.0, -1.0)


def test_per_length_corrections_apply_at_their_length_only_and_round_trip():
    from lightning_adaptiveload.bucketing.policy import CostModelPolicy
    from lightning_adaptiveload.calibration.derive import policy_for_budget

    plain = CostModel("power", {"a": 0.01, "b": 1e-9, "p": 1.6})
    fixed = CostModel("power", dict(plain.params), corrections={7800: 2.0})
    s = np.array([1560, 7800, 7801])
    assert np.allclose(fixed.predict(3, s), plain.predict(3, s) * np.array([1.0, 2.0, 1.0]))
    assert fixed.predict(3, 7800) == pytest.approx(2 * plain.predict(3, 7800))
    assert fixed.scaled(1.5).predict(1, 7800) == pytest.approx(3 * plain.predict(1, 7800))
    again = CostModel.from_json(fixed.to_json())
    assert again == fixed and "S=7,800 x2.00" in str(fixed)
    # A record without corrections (every profiled model, older files) reads as before.
    assert "corrections" not in plain.to_dict() and CostModel.from_dict(plain.to_dict()) == plain
    # B·S^p <= M_comp has no room for a factor at one length: the policy prices the model itself.
    assert isinstance(policy_for_budget(fixed, 65520, 0.5), CostModelPolicy)
    with pytest.raises(ValueError, match=r"correction 0: 2.0 is not valid"):
        CostModel("power", dict(plain.params), corrections={0: 2.0})
    with pytest.raises(ValueError, match=r"correction 7800: -1.0 is not valid"):
        CostModel("power", dict(plain.params), corrections={7800: -1.0})
