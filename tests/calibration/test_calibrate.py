"""calibrate(): what the conductor decides between profiling and the policy (flat profiles, pinned files of
another setup, what the cache keeps)."""

import dataclasses
import time
import warnings

import numpy as np
import pytest

from lightning_adaptiveload.calibration import derive, record
from lightning_adaptiveload.calibration.calibrate import (
    ProfileSettings,
    Trainee,
    calibrate,
    checkpoint_state,
    derive_for,
    key_diff,
    profile_modes,
    sustain_seconds,
    too_noisy,
)
from lightning_adaptiveload.calibration.costmodel import CostModel
from lightning_adaptiveload.calibration.profile import Measurement

# The CPU quickstart's corpus lengths: S = 16, 32, 64, 180.
GRIDS = np.array([(1, 4, 4), (1, 4, 8), (1, 8, 8), (5, 6, 6)])
COUNTS = np.array([100, 100, 100, 50])
KEY = {"model": "m", "device": "cpu:x86_64", "grid": [[1, 1, 4, 4]]}


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _flat_calibration(key=KEY):
    """The reported profile: five shapes at 104 ms each (the time does not grow with B·S)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # too few points for a held-out comparison: part of the report
        cm = CostModel.fit([1, 1, 1, 1, 22], [16, 32, 64, 180, 16], [0.104] * 5, form="auto")
    shapes = [(1, (1, 4, 4)), (1, (1, 4, 8)), (1, (1, 8, 8)), (1, (5, 6, 6)), (22, (1, 4, 4))]
    meas = [Measurement(b, g, int(np.prod(g)), 0.104, None, "ok", 3, 0.3) for b, g in shapes]
    return record.Calibration(dict(key), cm, meas)


def test_a_flat_profile_trains_every_bucket_at_its_memory_cap_with_one_warning():
    cal = _flat_calibration()
    # Before the fix the throughput rule's only candidate was the fixed overhead itself, which the one rule
    # refused: "`step_budget_s=0.104` is not valid ... Raise the budget", a setting the user never set.
    warned = []
    d = derive_for(cal, GRIDS, COUNTS, ProfileSettings(), warn=warned.append)
    assert d.budget_source == derive.MEMORY_CAPS_SOURCE
    seq = GRIDS.prod(axis=1)
    assert d.m_mem == 352  # CPU: the largest profiled batch (22 x 16)
    assert d.policy.batch_sizes(seq).tolist() == (d.m_mem // seq).tolist() == [22, 11, 5, 1]
    assert len(warned) == 1 and warned[0] == d.warning
    assert "hardly grows with the batch" in d.warning and "memory cap" in d.warning and "force=True" in d.warning
    assert d.to_dict()["warning"] == d.warning
    # A resumed run applies the recorded budget as given: the same batches, no error.
    resumed = derive_for(cal, GRIDS, COUNTS, ProfileSettings(), derived=checkpoint_state(cal, d)["derived"])
    assert resumed.budget_source == "given" and resumed.policy.batch_sizes(seq).tolist() == [22, 11, 5, 1]
    # A budget the user sets at the overhead is still their error to fix.
    with pytest.raises(ValueError, match="step_budget_s=0.1.*Raise the budget"):
        derive_for(cal, GRIDS, COUNTS, ProfileSettings(step_budget_s=0.1))


def test_a_profile_whose_costs_differ_keeps_the_throughput_rule():
    cm = CostModel("quadratic", {"a": 0.02, "c1": 1e-4, "c2": 1e-6})
    d = derive.derive_policy(cm, GRIDS, 352, counts=COUNTS)
    assert d.budget_source == "max predicted throughput" and d.warning == ""
    # Within the fit's own held-out error counts as flat too: the fit cannot rank the budgets.
    spread = float(cm.predict(22, 16)) / float(cm.predict(1, 16)) - 1
    noisy = CostModel("quadratic", dict(cm.params), {"heldout_median_rel_error": 2 * spread})
    assert derive.derive_policy(noisy, GRIDS, 352, counts=COUNTS).budget_source == derive.MEMORY_CAPS_SOURCE


def test_a_noisy_profile_trains_every_bucket_at_its_memory_cap_until_training_corrects_it():
    # Costs that differ (the throughput rule would pick a budget below the caps) from a profile whose repeated
    # steps spread 40%: too noisy to rank budgets, so the caps; a corrected calibration gets the rule back.
    cm = CostModel("quadratic", {"a": 0.02, "c1": 1e-3, "c2": 1e-6}, {"heldout_median_rel_error": 0.01})
    seq = GRIDS.prod(axis=1)
    ruled = derive.derive_policy(cm, GRIDS, 352, counts=COUNTS, world_size=2)
    assert ruled.budget_source == "max predicted throughput"
    assert ruled.policy.batch_sizes(seq).tolist() != (352 // seq).tolist()
    meas = [Measurement(b, g, int(np.prod(g)), float(cm.predict(b, int(np.prod(g)))), None, "ok", 3, spread=0.4)
            for b, g in [(1, (1, 4, 4)), (22, (1, 4, 4)), (1, (1, 8, 8)), (5, (1, 8, 8)), (1, (5, 6, 6))]]
    cal = record.Calibration(dict(KEY), cm, meas)
    warned = []
    d = derive_for(cal, GRIDS, COUNTS, ProfileSettings(m_mem=352), world_size=2, warn=warned.append)
    assert d.budget_source == derive.NOISY_CAPS_SOURCE and d.policy.batch_sizes(seq).tolist() == (352 // seq).tolist()
    assert warned == [d.warning] and "median spread of repeated steps 40% above 25%" in d.warning
    assert "force=True" in d.warning and "closed loop" in d.warning
    # A budget the user gives still wins; a calibration corrected from training's steps is ranked as usual.
    assert derive_for(cal, GRIDS, COUNTS, ProfileSettings(m_mem=352, step_budget_s=0.1),
                      world_size=2).budget_source == "given"
    cal.extra["provenance"] = {"source": "corrected", "training_steps": 100}
    again = derive_for(cal, GRIDS, COUNTS, ProfileSettings(m_mem=352), world_size=2)
    assert again.budget_source == "max predicted throughput"
    assert again.policy.batch_sizes(seq).tolist() == ruled.policy.batch_sizes(seq).tolist()


def test_a_flat_profile_through_the_conductor(monkeypatch):
    """End to end: every profiled step takes 104 ms on the clock; calibrate() derives, never refuses."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)

    def make_step(b, grid):
        def step():
            clock.t += 0.104

        return step

    warned = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = calibrate(GRIDS, COUNTS, ProfileSettings(repeats=2, warmup=0, converge_rel=0.0), Trainee(make_step),
                           key=dict(KEY), warn=warned.append)
    assert result.profiled and result.derivation.budget_source == derive.MEMORY_CAPS_SOURCE
    assert sum("hardly grows with the batch" in w for w in warned) == 1


def test_key_diff_names_fields_and_both_values():
    a = {**KEY, "device": "NVIDIA H100", "seq_lens": list(range(100))}
    b = {**KEY, "device": "NVIDIA H200", "seq_lens": list(range(101)), "profile": 3}
    assert key_diff(a, b) == "device, profile, seq_lens differ"
    text = key_diff(a, b, values=True)
    assert "device (device): 'NVIDIA H100' in the calibration, 'NVIDIA H200' in this run" in text
    assert "profile (profile): (absent) in the calibration, 3 in this run" in text
    assert "seq_lens (seq_lens): [0, 1, 2," in text and "..." in text and len(text) < 400
    assert key_diff(a, a, values=True) == "same key"


def test_a_pinned_calibration_of_another_setup_is_used_with_a_warning_naming_the_fields(tmp_path):
    cm = CostModel("quadratic", {"a": 0.02, "c1": 1e-4, "c2": 1e-6})
    meas = [Measurement(b, (1, 4, 4), 16, float(cm.predict(b, 16)), None, "ok", 3, 0.1) for b in (1, 22)]
    pinned = tmp_path / "shape_benchmark.json"
    pinned.write_text(record.Calibration({**KEY, "device": "NVIDIA H100"}, cm, meas).to_json())

    def never():
        raise AssertionError("a pinned calibration is not profiled")

    warned = []
    result = calibrate(GRIDS, COUNTS, ProfileSettings(), never, key={**KEY, "device": "NVIDIA H200"}, pinned=pinned,
                       warn=warned.append)
    assert result.source == f"file {pinned}" and result.calibration.cost_model == cm
    assert len(warned) == 1
    assert "'NVIDIA H100' in the calibration, 'NVIDIA H200' in this run" in warned[0] and "calibration=" in warned[0]
    # The same setup: no warning.
    warned.clear()
    calibrate(GRIDS, COUNTS, ProfileSettings(), never, key={**KEY, "device": "NVIDIA H100"}, pinned=pinned,
              warn=warned.append)
    assert warned == []


def _timed_trainee(clock, seconds):
    """A trainee whose step takes seconds(B, S) on the fake clock."""

    def make_step(b, grid):
        s = int(np.prod(grid))

        def step():
            clock.t += seconds(b, s)

        return step

    return Trainee(make_step)


MIXED = np.array([(1, 4, 4), (1, 4, 8), (1, 8, 8), (3, 4, 6), (5, 6, 6)])
MIXED_COUNTS = np.array([50, 50, 50, 50, 50])
QUIET = CostModel("quadratic", {"a": 0.02, "c1": 1e-4, "c2": 1e-6})


def test_a_noisy_profile_serves_its_run_but_the_next_run_profiles_again(monkeypatch, tmp_path):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    rng = np.random.default_rng(0)
    settings = ProfileSettings(repeats=3, warmup=0, converge_rel=0.0, stable_rel=0.0)
    key = dict(KEY)

    def run(seconds):
        said, warned = [], []
        result = calibrate(MIXED, MIXED_COUNTS, settings, _timed_trainee(clock, seconds), key=key, cache_dir=tmp_path,
                           say=said.append, warn=warned.append)
        return result, said, warned

    # A busy device: every step 0.5-2x what the shape costs.
    noisy, _, warned = run(lambda b, s: float(QUIET.predict(b, s)) * rng.uniform(0.5, 2.0))
    assert noisy.profiled and noisy.derivation.policy is not None  # this run trains with it
    assert record.is_provisional(noisy.calibration)
    why = noisy.calibration.extra["provenance"]["provisional"]
    assert "median spread of repeated steps" in why and "above 25%" in why
    (keep,) = [w for w in warned if "too noisy to keep" in w]
    assert "next run profiles again" in keep
    # ... at the memory caps: a profile this noisy cannot rank step budgets (one more warning says so).
    assert noisy.derivation.budget_source == derive.NOISY_CAPS_SOURCE and noisy.derivation.warning in warned
    assert record.is_provisional(record.read_cache(tmp_path, key))  # cached, but marked
    # The next run profiles again (a quiet device this time), and that profile is kept.
    quiet, said, warned = run(lambda b, s: float(QUIET.predict(b, s)))
    assert quiet.profiled and any("provisional" in line and "profiling again" in line for line in said)
    assert quiet.calibration.extra["provenance"] == {"source": "profiled"} and not warned
    # ... and served from the cache from then on, saying where its numbers come from.
    third, said, _ = run(lambda b, s: 1.0)
    assert not third.profiled and third.source == "cache"
    assert any(line.startswith("calibration from cache") and line.endswith("(profiled)") for line in said)


def test_a_noisy_fit_alone_is_provisional_too():
    cal = _flat_calibration()
    assert too_noisy(cal) == ""  # held-out error unknown (five points), spreads unknown: nothing to hold against it
    noisy = record.Calibration(cal.key, CostModel("quadratic", QUIET.params, {"heldout_median_rel_error": 0.4}),
                               cal.measurements)
    assert too_noisy(noisy) == "held-out median error 40% above 25%"
    spread = [dataclasses.replace(m, spread=0.3) for m in cal.measurements]
    assert too_noisy(dataclasses.replace(cal, measurements=spread)) == "median spread of repeated steps 30% above 25%"


def test_a_corrected_calibration_replaces_the_cache_entry_and_says_so(monkeypatch, tmp_path):
    from lightning_adaptiveload.calibration.feedback import Observation, refit

    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    settings = ProfileSettings(repeats=2, warmup=0, converge_rel=0.0)
    first = calibrate(MIXED, MIXED_COUNTS, settings, _timed_trainee(clock, lambda b, s: float(QUIET.predict(b, s))),
                      key=dict(KEY), cache_dir=tmp_path)
    seq = MIXED.prod(axis=1)
    observed = [Observation(int(b), int(s), 1.1 * float(QUIET.predict(b, s)), 20)
                for b, s in zip(first.derivation.policy.batch_sizes(seq), seq, strict=True)]
    corrected = refit(first.calibration, observed)
    record.write_cache(tmp_path, corrected)
    said = []
    again = calibrate(MIXED, MIXED_COUNTS, settings, lambda: pytest.fail("profiled"), key=dict(KEY),
                      cache_dir=tmp_path, say=said.append)
    assert again.source == "cache" and again.calibration.to_json() == corrected.to_json()
    assert any(line.startswith("calibration from cache") and "(corrected from 100 training steps)" in line
               for line in said)
    # write_cache(provenance=...) stamps a record's provenance as it writes it.
    record.write_cache(tmp_path, first.calibration, provenance={"source": "profiled", "provisional": "a test"})
    assert record.describe_provenance(record.read_cache(tmp_path, KEY)) == "profiled, provisional (a test)"


class PowerCappedDevice:
    """A fake GPU at its power cap: a step starting after an idle gap (the profile compiles each shape first) runs at
    the burst clock, and ``slow`` times longer once the device has been busy for ``settle`` seconds without one."""

    def __init__(self, clock, seconds, slow=1.15, settle=1.0, compile_s=2.0):
        self.clock, self.seconds, self.slow, self.settle, self.compile_s = clock, seconds, slow, settle, compile_s
        self.busy_since = self.last_end = -1e9

    def make_step(self, b, grid):
        self.clock.t += self.compile_s  # compiling: the device idles
        s = int(np.prod(grid))

        def step():
            if self.clock.t - self.last_end > 0.1:
                self.busy_since = self.clock.t
            hot = self.clock.t - self.busy_since >= self.settle
            self.clock.t += self.seconds(b, s) * (self.slow if hot else 1.0)
            self.last_end = self.clock.t

        return step


def _profile_capped(monkeypatch, sustain_s, slow=1.15, device_memory=None):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    device = PowerCappedDevice(clock, lambda b, s: float(QUIET.predict(b, s)), slow=slow)
    said = []
    settings = ProfileSettings(repeats=3, warmup=0, converge_rel=0.0, stable_rel=0.0, sustain_s=sustain_s)
    cal = profile_modes(MIXED, settings, Trainee(device.make_step, device_memory=device_memory), dict(KEY),
                        say=said.append)
    return cal, said


def test_a_power_capped_device_is_timed_under_sustained_load_and_every_profiled_time_scaled(monkeypatch):
    burst, _ = _profile_capped(monkeypatch, 0.0)
    assert "sustained" not in burst.extra
    ok = [m for m in burst.measurements if m.status == "ok"]
    # The profile's bursts: every shape at the idle device's clock.
    assert all(m.time_s == pytest.approx(float(QUIET.predict(m.batch_size, m.seq_len))) for m in ok)
    cal, said = _profile_capped(monkeypatch, 5.0)
    rec = cal.extra["sustained"]
    longest = max(ok, key=lambda m: m.time_s)
    assert (rec["batch_size"], rec["seq_len"]) == (longest.batch_size, longest.seq_len)
    assert rec["applied"] and rec["factor"] == pytest.approx(1.15) and rec["untimed_steps"] >= 2
    assert rec["seconds"] >= 5.0
    for m in (m for m in cal.measurements if m.status == "ok"):
        assert m.time_s == pytest.approx(1.15 * float(QUIET.predict(m.batch_size, m.seq_len)))
    seq = MIXED.prod(axis=1)
    assert np.allclose(cal.cost_model.predict(2, seq), 1.15 * QUIET.predict(2, seq), rtol=1e-3)
    (line,) = [x for x in said if x.startswith("sustained load:")]
    assert f"B={longest.batch_size} S={longest.seq_len:,}" in line and "every profiled step time x1.150" in line


def test_a_device_without_a_cap_keeps_its_profiled_times(monkeypatch):
    cal, said = _profile_capped(monkeypatch, 5.0, slow=1.01)  # within SUSTAIN_MIN_REL: the repeat spread
    rec = cal.extra["sustained"]
    assert not rec["applied"] and rec["factor"] == pytest.approx(1.01)
    ok = [m for m in cal.measurements if m.status == "ok"]
    assert all(m.time_s == pytest.approx(float(QUIET.predict(m.batch_size, m.seq_len))) for m in ok)
    assert any("within 2%: the profiled times are kept" in x for x in said)


def test_sustained_timing_is_off_by_default_and_its_setting_is_checked(monkeypatch):
    assert sustain_seconds(ProfileSettings()) == 0.0
    assert sustain_seconds(ProfileSettings(sustain_s=5)) == 5.0
    assert sustain_seconds(ProfileSettings(sustain_s=0)) == 0.0
    # A power-capped device with measured memory (a GPU) is not timed under sustained load by default either.
    cal, said = _profile_capped(monkeypatch, None, device_memory=80 * 2**30)
    assert "sustained" not in cal.extra and not [x for x in said if x.startswith("sustained load:")]
    with pytest.raises(ValueError, match="sustain_s"):
        ProfileSettings(sustain_s=-1.0)
