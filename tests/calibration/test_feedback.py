"""The closed loop's Lightning-free half: refit a calibration with training's step times, decide on a re-plan."""

import dataclasses
import math

import numpy as np
import pytest

from lightning_adaptiveload.bucketing.buckets import count_buckets
from lightning_adaptiveload.calibration import record
from lightning_adaptiveload.calibration.calibrate import (
    ProfileSettings,
    calibrate,
    checkpoint_state,
    derive_for,
    read_checkpoint_state,
    trained_plan,
    with_trained_plan,
)
from lightning_adaptiveload.calibration.costmodel import CostModel
from lightning_adaptiveload.calibration.derive import ModeTier
from lightning_adaptiveload.calibration.feedback import REPLAN_GAIN, Decision, Observation, compare, refit
from lightning_adaptiveload.calibration.profile import Measurement
from lightning_adaptiveload.calibration.simulate import mixture_token_grids
from lightning_adaptiveload.data.mixtures import get_mixture

TRUTH = CostModel("quadratic", {"a": 0.01, "c1": 8.68e-6, "c2": 1.482e-9})  # the H200-like default
M_MEM = 65_520
SETTINGS = ProfileSettings(m_mem=M_MEM)
GRIDS, COUNTS = count_buckets(mixture_token_grids(get_mixture("wan_480p"), 4_000))
SEQ = np.unique(GRIDS.prod(axis=1))  # 1,560 / 7,800 / 14,040 / 20,280 / 32,760
WORLD = 8


def _calibration():
    """A profile of TRUTH as the profiler plans it: B = 1 and the memory cap at every length, exact times."""
    meas = []
    for g in GRIDS:
        s = int(np.prod(g))
        for b in sorted({1, M_MEM // s}):
            meas.append(Measurement(b, tuple(int(v) for v in g), s, float(TRUTH.predict(b, s)), None, "ok", 3, 0.1))
    cm = CostModel.fit([m.batch_size for m in meas], [m.seq_len for m in meas], [m.time_s for m in meas],
                       form="quadratic")
    return record.Calibration({"model": "x"}, cm, meas)


def _running(cal, balance="cost"):
    return derive_for(cal, GRIDS, COUNTS, SETTINGS, world_size=WORLD, balance=balance)


def _observed(derivation, factor, steps=50):
    """What training measures: every bucket at the running policy's batch size, ``factor(S)`` x TRUTH."""
    b = derivation.policy.batch_sizes(SEQ)
    return [Observation(int(bb), int(s), factor(int(s)) * float(TRUTH.predict(bb, s)), steps) for bb, s in zip(b, SEQ, strict=True)]


def _compare(cal, derivation, new, balance="cost"):
    return compare(cal, derivation, new, GRIDS, COUNTS, SETTINGS, world_size=WORLD, balance=balance, seed=0,
                   oversize="error", sp_degree=1, samples=None)


def test_a_uniform_slowdown_corrects_the_predictions_and_changes_no_batch_size():
    cal = _calibration()
    running = _running(cal)
    observed = _observed(running, lambda s: 1.1)  # a GPU under its power cap: every shape 10% slower
    new = refit(cal, observed)
    assert new.cost_model.form == cal.cost_model.form and not new.cost_model.corrections
    # The refit's intermediate fits skip the held-out error; the one it keeps has it.
    assert math.isfinite(new.cost_model.quality["heldout_median_rel_error"])
    assert new.extra["feedback"]["transfer"]["clock"] == pytest.approx(1.1)
    for o in observed:
        assert float(new.cost_model.predict(o.batch_size, o.seq_len)) == pytest.approx(o.median_seconds, rel=1e-6)
    decision = _compare(cal, running, new)
    assert not decision.replan and decision.batch_changes == {} and abs(decision.gain) < 1e-6
    assert np.allclose(decision.ratio_before, 1.1) and np.allclose(decision.ratio_after, 1.0)
    # The budget is derived again under the corrected model, not carried over.
    assert decision.derivation.step_budget_s == pytest.approx(1.1 * running.step_budget_s, rel=1e-6)
    assert "keep the plan" in decision.summary() and "no batch size changes" in decision.summary()
    assert "1.10 (1.10-1.10) -> 1.00 (1.00-1.00)" in decision.summary()
    assert "after correction:" not in decision.summary()  # nothing is left outside the band


def test_the_summary_names_the_shapes_the_correction_leaves_outside_the_band():
    obs = (Observation(34, 120, 0.121, 12), Observation(13, 120, 0.079, 5), Observation(56, 72, 0.104, 40),
           Observation(256, 16, 0.137, 22), Observation(64, 64, 0.094, 22), Observation(60, 64, 0.093, 9))
    after = (1.21, 0.79, 1.04, 1.37, 0.94, 1.06)
    decision = Decision(derivation=None, gain=0.0, replan=False, observed=obs, ratio_before=after,  # type: ignore[arg-type]
                        ratio_after=after)
    line = decision.summary()
    # Worst first, at most three, the rest counted; 56 x 72 (1.04) is inside the band and not named.
    assert line.endswith("; beyond ±5% after correction: 256 x 16 1.37 (22 steps), 34 x 120 1.21 (12 steps), "
                         "13 x 120 0.79 (5 steps) and 2 more")


def test_the_summary_says_whether_the_batch_size_changes_it_lists_were_applied():
    changes = {16: (256, 150), 1560: (34, 25)}
    kept = Decision(derivation=None, gain=0.007, replan=False, batch_changes=changes).summary()  # type: ignore[arg-type]
    assert kept.startswith("keep the plan: +0.7% predicted tokens/s")
    assert "; the corrected policy's B, not applied: S=16 256->150, S=1,560 34->25" in kept
    replanned = Decision(derivation=None, gain=0.04, replan=True, batch_changes=changes).summary()  # type: ignore[arg-type]
    assert replanned.startswith("re-plan: +4.0%") and "; B S=16 256->150, S=1,560 34->25" in replanned
    assert "not applied" not in replanned


def test_a_slow_bucket_gets_a_smaller_batch_and_a_replan_where_it_costs_throughput():
    cal = _calibration()
    running = _running(cal, balance="none")  # batches dealt at random: a slow batch holds its step up
    observed = _observed(running, lambda s: 2.0 if s == 7800 else 1.0)
    new = refit(cal, observed)
    # One length the form cannot follow gets a correction of its own; the others keep the profile's account.
    assert new.cost_model.corrections == {7800: pytest.approx(2.0, rel=1e-3)}
    assert np.allclose(new.cost_model.predict(1, SEQ[SEQ != 7800]), TRUTH.predict(1, SEQ[SEQ != 7800]), rtol=1e-3)
    decision = _compare(cal, running, new, balance="none")
    old_b, new_b = decision.batch_changes[7800]
    assert list(decision.batch_changes) == [7800] and new_b < old_b == 8
    assert decision.replan and decision.gain >= REPLAN_GAIN
    assert "re-plan" in decision.summary() and f"S=7,800 {old_b}->{new_b}" in decision.summary()
    # Cost-balanced steps group the slow bucket's batches: the same correction buys no throughput there.
    grouped = _running(cal)
    kept = _compare(cal, grouped, refit(cal, _observed(grouped, lambda s: 2.0 if s == 7800 else 1.0)))
    assert kept.batch_changes and not kept.replan and kept.gain < REPLAN_GAIN


def test_training_points_replace_the_profiles_and_a_second_correction_does_not_compound():
    good = _calibration()
    # A busy device disturbed one profiled shape (the memory cap at S = 7,800: 1.5x); training measured the
    # profile's memory-cap shapes as they are.
    meas = [m if (m.batch_size, m.seq_len) != (8, 7800) else dataclasses.replace(m, time_s=1.5 * m.time_s)
            for m in good.measurements]
    cm = CostModel.fit([m.batch_size for m in meas], [m.seq_len for m in meas], [m.time_s for m in meas],
                       form="quadratic")
    cal = record.Calibration({"model": "x"}, cm, meas)
    caps = [(M_MEM // int(s), int(s)) for s in SEQ]
    new = refit(cal, [Observation(b, s, float(TRUTH.predict(b, s)), 40) for b, s in caps])
    # Training's point took the disturbed one's place: the fit is the truth again, at every shape.
    assert not new.cost_model.corrections
    assert np.allclose(new.cost_model.predict(1, SEQ), TRUTH.predict(1, SEQ), rtol=1e-3)
    assert float(new.cost_model.predict(8, 7800)) == pytest.approx(float(TRUTH.predict(8, 7800)), rel=1e-3)
    assert float(cal.cost_model.predict(8, 7800)) > 1.03 * float(TRUTH.predict(8, 7800))  # the profile's fit was off
    assert new.extra["provenance"] == {"source": "corrected", "training_steps": 40 * len(caps),
                                       "profiled_points": len(meas) - len(caps), "training_points": len(caps)}
    assert new.measurements == cal.measurements and new.memory_model == cal.memory_model
    # One shape only: the clock factor is all the transfer can tell (no per-step overhead from one point).
    one = refit(good, [Observation(8, 7800, 1.5 * float(TRUTH.predict(8, 7800)), 40)])
    assert one.extra["feedback"]["transfer"] == {"overhead_s": 0.0, "clock": pytest.approx(1.5)}
    # Corrected twice by the same measurements: still 1.1x the profile, not 1.21x; the newest point wins.
    running = _running(good)
    once = refit(good, _observed(running, lambda s: 1.1))
    twice = refit(once, _observed(running, lambda s: 1.1))
    assert np.allclose(twice.cost_model.predict(1, SEQ), 1.1 * TRUTH.predict(1, SEQ), rtol=1e-6)
    later = refit(once, _observed(running, lambda s: 1.2)[:1])
    assert len(later.extra["feedback"]["observations"]) == len(SEQ)
    (first,) = [o for o in later.extra["feedback"]["observations"] if (o["batch_size"], o["seq_len"]) == (42, 1560)]
    assert first["median_seconds"] == pytest.approx(1.2 * TRUTH.predict(42, 1560))
    # A later run that measured a length at another batch size: the earlier run's point of that length goes.
    other = refit(once, [Observation(40, 1560, 1.2 * float(TRUTH.predict(40, 1560)), 40)])
    kept = [(o["batch_size"], o["seq_len"]) for o in other.extra["feedback"]["observations"]]
    assert (40, 1560) in kept and (42, 1560) not in kept and len(kept) == len(SEQ)


def test_a_per_step_overhead_of_training_moves_the_intercept_only():
    cal = _calibration()
    # The optimizer step, the loader hand-over and logging: 25 ms a step whatever its shape.
    observed = [Observation(o.batch_size, o.seq_len, o.median_seconds + 0.025, o.steps)
                for o in _observed(_running(cal), lambda s: 1.0)]
    new = refit(cal, observed)
    assert new.extra["feedback"]["transfer"]["overhead_s"] == pytest.approx(0.025, rel=1e-4)
    assert new.cost_model.params["a"] == pytest.approx(TRUTH.params["a"] + 0.025, rel=1e-4)
    assert new.cost_model.params["c2"] == pytest.approx(TRUTH.params["c2"], rel=1e-4)


def test_refit_round_trips_through_the_record_and_the_checkpoint():
    cal = _calibration()
    running = _running(cal)
    new = refit(cal, _observed(running, lambda s: 2.0 if s == 14040 else 1.1))
    assert new.cost_model.corrections  # the round trip carries them
    again = record.Calibration.from_json(new.to_json())
    assert again.to_json() == new.to_json() and again.extra["provenance"]["source"] == "corrected"
    assert np.array_equal(again.cost_model.predict(2, SEQ), new.cost_model.predict(2, SEQ))
    decision = _compare(cal, running, new)
    state = read_checkpoint_state(checkpoint_state(new, decision.derivation))
    restored = record.Calibration.from_json(state["calibration"])
    assert restored.to_json() == new.to_json()
    resumed = derive_for(restored, GRIDS, COUNTS, SETTINGS, derived=state["derived"], world_size=WORLD)
    assert np.array_equal(resumed.policy.batch_sizes(SEQ), decision.derivation.policy.batch_sizes(SEQ))


def _tiered():
    """'none' up to S = 20,280; the 32,760 clip in 'selective' (profiled at B = 1, 1.25x the base model)."""
    meas = []
    for g in GRIDS:
        s = int(np.prod(g))
        if s < 32760:
            for b in sorted({1, M_MEM // s}):
                meas.append(Measurement(b, tuple(int(v) for v in g), s, float(TRUTH.predict(b, s)), None, "ok", 3,
                                        0.1, mode="none"))
        else:
            meas.append(Measurement(1, tuple(int(v) for v in g), s, 1.25 * float(TRUTH.predict(1, s)), None, "ok", 3,
                                    0.1, mode="selective"))
    base = [m for m in meas if m.mode == "none"]
    cm = CostModel.fit([m.batch_size for m in base], [m.seq_len for m in base], [m.time_s for m in base],
                       form="quadratic")
    tiers = [ModeTier("none", 20280, 1.0), ModeTier("selective", 32760, 1.25)]
    extra = {"checkpointing": {"tiers": [t.to_dict() for t in tiers], "base_mode": "none",
                               "modes": ["none", "selective"]}}
    return record.Calibration({"model": "x"}, cm, meas, extra=extra)


def test_observations_in_a_tiers_mode_refit_its_scale_not_the_base_model():
    cal = _tiered()
    running = _running(cal)
    b = running.policy.batch_sizes(SEQ)

    def observed(selective, base=1.0):
        return [Observation(int(bb), int(s), (1.25 * selective if s == 32760 else base) * float(TRUTH.predict(bb, s)),
                            30, "selective" if s == 32760 else "none") for bb, s in zip(b, SEQ, strict=True)]

    slower = refit(cal, observed(1.3))  # recomputation costs more in training than profiled
    tiers = slower.extra["checkpointing"]["tiers"]
    assert tiers[1]["scale"] == pytest.approx(1.25 * 1.3, rel=1e-3) and tiers[0]["scale"] == 1.0
    assert np.allclose(slower.cost_model.predict(1, SEQ), TRUTH.predict(1, SEQ), rtol=1e-3)
    assert not slower.cost_model.corrections
    decision = _compare(cal, running, slower)
    assert np.allclose(decision.ratio_after, 1.0, atol=1e-3) and max(decision.ratio_before) == pytest.approx(1.3)
    # A uniform slowdown: every mode's scale as profiled, the base model 1.1x.
    uniform = refit(cal, observed(1.1, 1.1))
    assert uniform.extra["checkpointing"]["tiers"][1]["scale"] == pytest.approx(1.25)
    assert not _compare(cal, running, uniform).batch_changes


@pytest.mark.parametrize("args, match", [
    ((0, 16, 0.1, 3), r"Observation\(batch_size=0\)"),
    ((1, 16, float("nan"), 3), r"Observation\(median_seconds=nan\)"),
    ((1, 16, 0.1, 0), r"Observation\(steps=0\)"),
    ((1, 16, 0.1, 3, 5), r"Observation\(mode=5\)"),
])
def test_bad_observations_are_refused_naming_the_field(args, match):
    with pytest.raises(ValueError, match=match):
        Observation(*args)


def test_refit_needs_an_observation_and_takes_plain_tuples():
    cal = _calibration()
    with pytest.raises(ValueError, match=r"refit\(observed=\[\]\)"):
        refit(cal, [])
    assert refit(cal, [(42, 1560, 0.8, 10, None)]).extra["provenance"]["training_points"] == 1


def _two_sizes_at(length, divisor, seconds, steps=(50, 50)):
    """Training's points: TRUTH at the running policy's batch sizes, except ``length``, measured at its full
    batch size and at 1/``divisor`` of it, ``seconds(B, is_full)`` each, over ``steps``. Returns the calibration, the
    observations and the two batch sizes."""
    cal = _calibration()
    observed = _observed(_running(cal), lambda s: 1.0)
    full = next(o.batch_size for o in observed if o.seq_len == length)
    small = full // divisor
    assert small >= 1
    return cal, [o for o in observed if o.seq_len != length] + [
        Observation(b, length, seconds(b, b == full), n) for b, n in zip((full, small), steps, strict=True)], full, small


def test_a_length_measured_at_two_batch_sizes_gets_a_factor_and_an_offset():
    # One length paid a fixed cost the form's single floor does not hold (a remainder batch beside the full
    # ones): 1.1 x TRUTH + 30 ms at both of its batch sizes. A factor alone would leave the two ratios apart.
    slow = int(SEQ[0])
    cal, observed, _, small = _two_sizes_at(slow, 8, lambda b, _: 1.1 * float(TRUTH.predict(b, slow)) + 0.03)
    # The time outside forward + backward is measured (as BalanceMonitor.overhead_s gives it), so the one
    # length's fixed cost is not taken for every step's.
    new = refit(cal, observed, overhead_s=0.0).cost_model
    assert set(new.corrections) == {slow} == set(new.offsets)
    assert new.corrections[slow] == pytest.approx(1.1, rel=1e-3) and new.offsets[slow] == pytest.approx(0.03, rel=1e-3)
    for o in observed:
        assert float(new.predict(o.batch_size, o.seq_len)) == pytest.approx(o.median_seconds, rel=1e-3)
    assert f"S={slow:,} x1.10 +30 ms" in str(new)
    again = CostModel.from_dict(new.to_dict())
    assert again == new and float(new.scaled(2.0).predict(small, slow)) == pytest.approx(
        2 * float(new.predict(small, slow)))
    # One batch size at a length: a factor only, as before; a fit whose factor would leave the length's cost to
    # the offset falls back to the factor.
    from lightning_adaptiveload.calibration.feedback import _affine_correction

    assert _affine_correction([(8, 0.5, 0.6, 9), (8, 0.5, 0.7, 9)]) == (pytest.approx(1.3), 0.0)
    assert _affine_correction([(8, 0.5, 0.6, 9), (64, 4.0, 0.61, 9)]) == (pytest.approx(1.21 / 4.5), 0.0)


def test_a_length_whose_small_batch_is_faster_than_the_form_gets_a_negative_offset():
    # The form's floor is too high at one length: its small batch runs faster than the form says, its full
    # batch slower (0.90x and 1.14x on a CPU quickstart). 1.2 x TRUTH - 30 ms at both batch sizes: a factor
    # alone, or a non-negative offset, would leave the two ratios apart.
    fast = int(SEQ[0])
    cal, observed, _, _ = _two_sizes_at(fast, 8, lambda b, _: 1.2 * float(TRUTH.predict(b, fast)) - 0.03)
    new = refit(cal, observed, overhead_s=0.0).cost_model
    assert new.corrections[fast] == pytest.approx(1.2, rel=1e-3) and new.offsets[fast] == pytest.approx(-0.03, rel=1e-3)
    for o in observed:
        assert float(new.predict(o.batch_size, o.seq_len)) == pytest.approx(o.median_seconds, rel=1e-3)
    assert f"S={fast:,} x1.20 -30 ms" in str(new)
    assert CostModel.from_dict(new.to_dict()) == new
    # Below the measured batch sizes the prediction keeps half of factor x form: positive, never the offset's.
    huge = CostModel(new.form, new.params, corrections={fast: 1.0}, offsets={fast: -1e3})
    assert float(huge.predict(1, fast)) == pytest.approx(0.5 * float(CostModel(new.form, new.params).predict(1, fast)))
    # An offset that would take more than half of the smallest batch's time falls back to the median ratio.
    from lightning_adaptiveload.calibration.feedback import _affine_correction

    assert _affine_correction([(1, 1.0, 0.2, 9), (100, 10.0, 8.0, 9)]) == (pytest.approx(8.2 / 11.0), 0.0)
    # ... one factor for the length's time over the steps trained at each batch size, not the ratios' median.
    assert _affine_correction([(1, 1.0, 0.2, 5), (100, 10.0, 8.0, 68)]) == (pytest.approx(545 / 685), 0.0)
    with pytest.raises(ValueError, match="offset"):
        CostModel(new.form, new.params, offsets={fast: float("nan")})


def test_a_length_whose_batch_sizes_disagree_beyond_an_offset_keeps_its_trained_time():
    # One length's full batch ran 1.2x the form over 68 steps, its remainder 0.35x over 5: no offset within the
    # floor joins them, so one factor for the length, which predicts the time trained there: the full batch
    # nearly right, the remainder carrying the error (the median of the two ratios put the full batch at 1.55x).
    length = int(SEQ[0])
    cal, observed, full, _ = _two_sizes_at(
        length, 4, lambda b, is_full: (1.2 if is_full else 0.35) * float(TRUTH.predict(b, length)), steps=(68, 5))
    new = refit(cal, observed, overhead_s=0.0).cost_model
    assert length not in new.offsets
    mine = observed[-2:]
    assert sum(o.steps * float(new.predict(o.batch_size, length)) for o in mine) == pytest.approx(
        sum(o.steps * o.median_seconds for o in mine), rel=1e-3)
    assert float(new.predict(full, length)) == pytest.approx(mine[0].median_seconds, rel=0.02)
    for o in observed[:-2]:
        assert float(new.predict(o.batch_size, o.seq_len)) == pytest.approx(o.median_seconds, rel=2e-2)


def _cached_correction(tmp_path, balance):
    """A run's closed loop as the cache keeps it: the profile ``cal``, the plan derived from it, and the
    correction from training's steps (S = 7,800 twice its profiled time) carrying that plan."""
    cal = _calibration()
    running = _running(cal, balance)
    corrected = refit(cal, _observed(running, lambda s: 2.0 if s == 7800 else 1.0))
    record.write_cache(tmp_path, with_trained_plan(corrected, cal, running))
    return cal, running, corrected


def _from_cache(tmp_path, balance, said, settings=SETTINGS):
    def never():
        raise AssertionError("profiled although the cache holds the calibration")

    return calibrate(GRIDS, COUNTS, settings, never, key={"model": "x"}, cache_dir=tmp_path, world_size=WORLD,
                     balance=balance, say=said.append)


def test_a_cached_correction_trains_the_plan_its_run_measured_unless_a_new_one_pays(tmp_path):
    # Cost-balanced steps: the correction's new plan changes batch sizes for less than REPLAN_GAIN.
    cal, running, corrected = _cached_correction(tmp_path, "cost")
    decision = _compare(cal, running, corrected)
    assert decision.batch_changes and not decision.replan
    said: list[str] = []
    result = _from_cache(tmp_path, "cost", said)
    # The plan that ran, from its own calibration and budgets, as a resume would derive it ...
    assert result.source == "cache" and not result.profiled
    assert result.calibration.to_json() == cal.to_json()
    assert np.array_equal(result.derivation.policy.batch_sizes(SEQ), running.policy.batch_sizes(SEQ))
    fresh = derive_for(corrected, GRIDS, COUNTS, SETTINGS, world_size=WORLD, balance="cost")
    assert not np.array_equal(fresh.policy.batch_sizes(SEQ), running.policy.batch_sizes(SEQ))
    # ... priced by the corrected model: training's step times, the slow length included.
    for o in _observed(running, lambda s: 2.0 if s == 7800 else 1.0):
        assert float(result.predict_with.predict(o.batch_size, o.seq_len)) == pytest.approx(o.median_seconds, rel=1e-3)
    (line,) = [x for x in said if x.startswith("training the plan the cached calibration's run measured")]
    assert f"a new plan predicts {decision.gain:+.1%} tokens/s" in line
    assert f"{decision.old_tokens_per_s:,.0f} predicted tokens/s" in line


def test_a_cached_correction_whose_new_plan_pays_derives_it(tmp_path):
    # Batches dealt at random: the slow length holds its steps up, and a smaller batch there pays.
    cal, running, corrected = _cached_correction(tmp_path, "none")
    decision = _compare(cal, running, corrected, balance="none")
    assert decision.replan
    said: list[str] = []
    result = _from_cache(tmp_path, "none", said)
    assert result.predict_with is None and result.calibration.extra["provenance"]["source"] == "corrected"
    assert np.array_equal(result.derivation.policy.batch_sizes(SEQ), decision.derivation.policy.batch_sizes(SEQ))
    assert any(f"new plan predicts {decision.gain:+.1%} tokens/s over the plan its run measured" in x
               and x.endswith("training it") for x in said)


def test_a_cached_correction_serves_settings_its_plan_did_not_train_with_as_a_fresh_derivation(tmp_path):
    _cached_correction(tmp_path, "cost")
    cached = record.read_cache(tmp_path, {"model": "x"})
    for settings in (ProfileSettings(m_mem=M_MEM // 2), ProfileSettings(m_mem=M_MEM, step_budget_s=1.0)):
        assert trained_plan(cached, GRIDS, COUNTS, settings, world_size=WORLD) is None
    said: list[str] = []
    result = _from_cache(tmp_path, "cost", said, ProfileSettings(m_mem=M_MEM // 2))
    assert result.predict_with is None and result.derivation.m_mem == M_MEM // 2
    assert not any("trained" in x or "measured" in x for x in said)


def test_the_trained_plan_a_correction_carries_does_not_nest():
    cal = _calibration()
    running = _running(cal)
    once = with_trained_plan(refit(cal, _observed(running, lambda s: 1.1)), cal, running)
    twice = with_trained_plan(refit(once, _observed(running, lambda s: 1.2)), once, running)
    inner = record.Calibration.from_json(twice.extra["feedback"]["trained"]["calibration"])
    assert "trained" not in inner.extra["feedback"] and inner.extra["provenance"]["source"] == "corrected"
    assert twice.extra["feedback"]["trained"]["derived"] == checkpoint_state(once, running)["derived"]
    assert record.Calibration.from_json(twice.to_json()).to_json() == twice.to_json()
