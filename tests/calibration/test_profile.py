import numpy as np
import pytest
import torch

from lightning_adaptiveload.calibration.profile import (
    MERGE_REL,
    Measurement,
    MemoryProbe,
    Shape,
    distinct_lengths,
    plan_grid,
    profile,
)


class Clock:
    """A fake clock that steps advance by a chosen duration."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _stepper(clock, seconds, calls=None, oom=()):
    """make_step whose step takes seconds(B, S) on the fake clock; OOM for (B, S) in `oom`."""

    def make_step(b, grid):
        s = int(np.prod(grid))
        if (b, s) in oom:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

        def step():
            if calls is not None:
                calls.append((b, s))
            clock.t += seconds(b, s)

        return step

    return make_step


class ScaledCollectives:
    """Stands in for a second rank that is slower by `factor`: max() sees both."""

    def __init__(self, factor):
        self.factor = factor

    def max(self, value):
        return max(value, value * self.factor)

    def broadcast(self, obj):
        return obj


def test_plan_grid_rounds_spread_single_seq_and_max_seq_len():
    grids = np.array([(1, 2, 2), (1, 4, 4), (2, 4, 4), (3, 4, 6), (5, 6, 6)] * 3)
    plan = plan_grid(grids, max_shapes=3)
    seqs = [s.seq_len for s in plan]
    # Round 1: the smallest batch of every chosen S (spread over the range), then larger batches.
    assert seqs[:3] == [4, 32, 180] and all(s.batch_size == 1 for s in plan[:3])
    assert max(s.batch_size for s in plan if s.seq_len == 4) == 2 * 180 // 4
    assert [s.batch_size for s in plan if s.seq_len == 180] == [1, 2]
    assert 180 not in [s.seq_len for s in plan_grid(grids, max_seq_len=100)]
    single = plan_grid(np.array([(2, 4, 6)]), batch_sizes=[1, 2])
    assert sorted({s.grid for s in single}) == [(2, 4, 3), (2, 4, 6)]
    with pytest.raises(ValueError, match="No sample is left to profile"):
        plan_grid(grids, max_seq_len=3)


def test_near_duplicate_lengths_are_profiled_as_the_longer_one():
    # The mixed 480p+720p corpus: 32,400 (9x45x80) is 1.1% below 32,760 (21x30x52); 18,000 is 11% below 20,280.
    grids = [(1, 30, 52), (9, 45, 80), (21, 30, 52), (5, 45, 80), (13, 30, 52), (21, 30, 52)]
    assert distinct_lengths(grids) == [(1, 30, 52), (5, 45, 80), (13, 30, 52), (21, 30, 52)]
    assert distinct_lengths(grids, merge_rel=0.0) == [(1, 30, 52), (5, 45, 80), (13, 30, 52), (9, 45, 80), (21, 30, 52)]
    # Merging walks down from the longest: each kept length absorbs those within MERGE_REL below it only.
    s = 1000
    chain = [(1, 1, s), (1, 1, int(s * (1 - MERGE_REL / 2))), (1, 1, int(s * (1 - MERGE_REL * 1.5)))]
    assert distinct_lengths(chain) == [chain[2], chain[0]]
    plan = plan_grid(np.array(grids), batch_sizes=[1])
    assert [p.seq_len for p in plan] == [1560, 18000, 20280, 32760]


def test_median_of_timed_steps_max_over_ranks():
    clock = Clock()
    durations = iter([9.0, 1.0, 3.0, 2.0])  # warm-up, then three timed steps
    calls = []
    m = profile(_stepper(clock, lambda b, s: next(durations), calls), [Shape(2, (1, 2, 2))],
                warmup=1, repeats=3, shape_time_s=100, clock=clock, collectives=ScaledCollectives(1.5))
    assert calls == [(2, 4)] * 4
    assert m[0].status == "ok" and m[0].timed_steps == 3
    assert m[0].time_s == pytest.approx(2.0 * 1.5)  # median 2.0 on this rank, the slower rank's 3.0


def test_shape_time_bound_keeps_one_timed_step_and_reports_slow_steps():
    clock = Clock()
    lines = []
    m = profile(_stepper(clock, lambda b, s: 10.0), [Shape(1, (1, 1, 7))], warmup=1, repeats=5,
                shape_time_s=15.0, clock=clock, progress=lines.append)
    assert m[0].timed_steps == 1 and m[0].time_s == 10.0
    assert m[0].seconds == pytest.approx(20.0)  # one warm-up + one timed step, then the bound stops it
    assert any("warm-up 1/1: 10.0 s" in line for line in lines)
    assert any("timed 1/5: 10.0 s" in line for line in lines)


def test_a_step_that_would_end_past_the_shape_time_is_not_started():
    # 6 s steps under a 10 s bound: after the first timed step (6 s) a second would end at 12 s.
    clock = Clock()
    m = profile(_stepper(clock, lambda b, s: 6.0), [Shape(1, (1, 1, 7))], warmup=0, repeats=5,
                shape_time_s=10.0, clock=clock)
    assert m[0].timed_steps == 1 and m[0].seconds == pytest.approx(6.0)
    # 4 s steps: a second one ends at 8 s (started), a third would end at 12 s (not started).
    clock = Clock()
    m = profile(_stepper(clock, lambda b, s: 4.0), [Shape(1, (1, 1, 7))], warmup=0, repeats=5,
                shape_time_s=10.0, clock=clock)
    assert m[0].timed_steps == 2 and m[0].seconds == pytest.approx(8.0)


def test_total_budget_stops_after_the_first_pass():
    clock = Clock()
    plan = plan_grid(np.array([(1, 1, 10), (1, 1, 20), (1, 1, 40)]), batch_sizes=[1, 2, 4])
    lines = []
    m = profile(_stepper(clock, lambda b, s: 1.0), plan, warmup=0, repeats=2, time_budget_s=5.0,
                clock=clock, progress=lines.append)
    assert [x.status for x in m[:3]] == ["ok"] * 3  # the first pass always completes (6 s > budget)
    assert [x.status for x in m[3:]] == ["skipped"] * 6
    assert any("time budget 5 s spent after 3/9 shapes" in line for line in lines)


def test_out_of_memory_skips_larger_batches_and_longer_sequences():
    clock = Clock()
    plan = plan_grid(np.array([(1, 1, 10), (1, 1, 20), (1, 1, 40)]), batch_sizes=[1, 2, 4])
    calls = []
    m = profile(_stepper(clock, lambda b, s: 0.01, calls, oom={(2, 10), (1, 20)}), plan, warmup=0, repeats=1,
                clock=clock)
    status = {(x.batch_size, x.seq_len): x.status for x in m}
    assert status[(1, 10)] == "ok" and status[(2, 10)] == "oom" and status[(4, 10)] == "skipped"
    assert status[(1, 20)] == "oom"
    # Memory grows with tokens: every batch of a longer sequence is skipped, never run.
    assert all(status[(b, 40)] == "skipped" for b in (1, 2, 4)) and all(s != 40 for _, s in calls)
    assert status[(2, 20)] == status[(4, 20)] == "skipped"


def test_other_errors_propagate():
    def make_step(b, grid):
        raise KeyError("latents")

    with pytest.raises(KeyError):
        profile(make_step, [Shape(1, (1, 2, 2))])


def test_measurement_round_trip_and_validation():
    m = Measurement(2, (1, 2, 3), 6, 0.5, 123, "ok", 3, 1.5)
    assert Measurement.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="not consistent"):
        Measurement.from_dict({**m.to_dict(), "seq_len": 7})
    with pytest.raises(ValueError, match="time_s=None"):
        Measurement.from_dict({**m.to_dict(), "time_s": None})
    with pytest.raises(ValueError, match="lacks"):
        Measurement.from_dict({"batch_size": 1})


class CompileClock:
    """Cumulative compile seconds: each step in ``compiling`` (0-based call index) adds 5 s."""

    def __init__(self, compiling):
        self.compiling, self.calls, self.total = set(compiling), 0, 0.0

    def step_hook(self):
        if self.calls in self.compiling:
            self.total += 5.0
        self.calls += 1

    def __call__(self):
        return self.total


def _compiling_stepper(clock, durations, compile_clock, calls):
    def make_step(b, grid):
        def step():
            calls.append(b)
            compile_clock.step_hook()
            clock.t += next(durations)
        return step
    return make_step


def test_compile_clock_times_steady_warmup_steps_and_never_a_compiling_one():
    clock, calls = Clock(), []
    # Shape 1: the first step compiles (warm-up, not timed), then two timed steps.
    # Shape 2: nothing compiles, so its "warm-up" step is timed and two steps suffice.
    # Shape 3: a recompile in the second step: that step is dropped and an extra one runs.
    cc = CompileClock({0, 6})
    durations = iter([30.0, 1.0, 3.0, 2.0, 4.0, 9.0, 5.0, 6.0])
    plan = [Shape(1, (1, 1, 4)), Shape(1, (1, 1, 8)), Shape(2, (1, 1, 8))]
    lines = []
    m = profile(_compiling_stepper(clock, durations, cc, calls), plan, warmup=1, repeats=2, shape_time_s=100,
                clock=clock, compile_clock=cc, progress=lines.append)
    assert calls == [1, 1, 1, 1, 1, 2, 2, 2]
    assert any("compiling: 30.0 s" in line for line in lines) and any("timed 2/2: 3.0 s" in line for line in lines)
    assert [x.timed_steps for x in m] == [2, 2, 2]
    assert [x.time_s for x in m] == [2.0, 3.0, 7.5]
    assert [x.compile_s for x in m] == [5.0, 0.0, 5.0]
    assert Measurement.from_dict(m[0].to_dict()) == m[0]


def test_compile_clock_keeps_a_time_when_every_step_compiles():
    clock, calls = Clock(), []
    cc = CompileClock(range(100))
    m = profile(_compiling_stepper(clock, iter([7.0, 6.0, 5.0, 4.0, 3.0]), cc, calls), [Shape(1, (1, 1, 4))],
                warmup=1, repeats=2, shape_time_s=100, clock=clock, compile_clock=cc)
    assert len(calls) == 5 and m[0].timed_steps == 1 and m[0].time_s == 3.0


def _memory_stepper(clock, peak_of, oom_above, calls):
    """make_step whose step's peak is peak_of(B, S) bytes and which runs out of memory above `oom_above`."""
    state = {"peak": 0}

    def make_step(b, grid):
        s = int(np.prod(grid))

        def step():
            calls.append((b, s))
            if peak_of(b, s) > oom_above:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            state["peak"] = max(state["peak"], peak_of(b, s))
            clock.t += 0.01 * b * s

        return step

    probe = MemoryProbe(reset=lambda: state.update(peak=0), peak=lambda: state["peak"])
    return make_step, probe


def test_memory_limit_caps_later_batches_at_the_fitted_model():
    m0, m1, m2 = 1_000, 10, 50  # bytes: fixed, per token, per sample
    peak_of = lambda b, s: m0 + m1 * b * s + m2 * b  # noqa: E731
    limit = 12_000
    cap = lambda s: (limit - m0) // (m1 * s + m2)  # noqa: E731  # 73, 24, 10 at S = 10, 40, 100
    plan = [Shape(1, (1, 1, 10)), Shape(1, (1, 1, 40)), Shape(1, (1, 1, 100)),  # first pass: never capped
            Shape(8, (1, 1, 10)),   # fits as planned; with it the per-sample term is separable
            Shape(50, (1, 1, 40)), Shape(200, (1, 1, 10)), Shape(30, (1, 1, 100)),  # capped
            Shape(10, (1, 1, 100))]  # the capped B=10 at S=100 already ran: skipped
    clock, calls, lines = Clock(), [], []
    make_step, probe = _memory_stepper(clock, peak_of, limit, calls)
    out = profile(make_step, plan, warmup=0, repeats=1, memory=probe, memory_limit=limit, clock=clock,
                  progress=lines.append)
    got = [(x.batch_size, x.seq_len, x.status) for x in out]
    assert got == [(1, 10, "ok"), (1, 40, "ok"), (1, 100, "ok"), (8, 10, "ok"), (cap(40), 40, "ok"),
                   (cap(10), 10, "ok"), (cap(100), 100, "ok"), (10, 100, "skipped")]
    assert (cap(40), cap(10), cap(100)) == (24, 73, 10)
    assert all(peak_of(b, s) <= limit for b, s in calls)  # nothing ran out of memory
    assert any("B=50 grid=(1, 1, 40) is predicted above the memory limit; B=24 instead" in line for line in lines)
    # Without the limit the same plan runs into out-of-memory errors.
    clock, calls = Clock(), []
    make_step, probe = _memory_stepper(clock, peak_of, limit, calls)
    plain = profile(make_step, plan, warmup=0, repeats=1, memory=probe, clock=clock)
    assert [x.status for x in plain][4:7] == ["oom", "oom", "oom"]


def test_memory_limit_skips_a_length_where_nothing_fits_and_never_caps_below_a_measured_fit():
    from lightning_adaptiveload.calibration.profile import _cap_batch

    done = [Measurement(1, (1, 1, 10), 10, 0.1, 1_100, "ok"), Measurement(1, (1, 1, 20), 20, 0.1, 1_200, "ok"),
            Measurement(4, (1, 1, 20), 20, 0.1, 2_000, "ok")]  # above the linear model's line
    assert _cap_batch(Shape(9, (1, 1, 20)), done, memory_limit=1_500) == 4  # measured to fit
    assert _cap_batch(Shape(9, (1, 1, 50)), done, memory_limit=1_000) == 0  # nothing fits
    assert _cap_batch(Shape(9, (1, 1, 50)), done[:1], memory_limit=1_000) == 9  # no model from one point


def test_shape_time_excludes_every_step_that_compiled():
    clock, calls = Clock(), []
    cc = CompileClock({0, 2})  # steps 0 and 2 compile for 5 s on the compile clock ...
    durations = iter([40.0, 2.0, 9.0, 2.0, 2.0, 2.0])  # ... and take 40 s and 9 s of wall time
    m = profile(_compiling_stepper(clock, durations, cc, calls), [Shape(1, (1, 1, 4))], warmup=1, repeats=3,
                shape_time_s=5.0, clock=clock, compile_clock=cc)
    # Neither compiling step counts against the 5 s (their first runs load kernels: one-off time too):
    # timed steps of 2 s end at 2 s and 4 s; a third would end at 6 s > 5 s, so the shape stops there.
    assert m[0].timed_steps == 2 and len(calls) == 4 and m[0].time_s == 2.0
    assert m[0].compile_s == 10.0 and m[0].seconds == 53.0


def test_stable_timings_stop_a_shape_early():
    clock, calls = Clock(), []
    durations = iter([5.0, 2.0, 2.02, 9.0, 1.0, 1.5, 1.2, 8.0])
    plan = [Shape(1, (1, 1, 4)), Shape(2, (1, 1, 4))]
    m = profile(_stepper(clock, lambda b, s: next(durations), calls), plan, warmup=1, repeats=4,
                shape_time_s=100, clock=clock, stable_rel=0.02)
    # Shape 1: 2.0 and 2.02 agree within 2% of their median: two timed steps suffice.
    # Shape 2: 1.0, 1.5, 1.2, 8.0 never agree: all 4 repeats run.
    assert [x.timed_steps for x in m] == [2, 4] and len(calls) == 8
    assert m[0].time_s == pytest.approx(2.01) and m[1].time_s == pytest.approx(1.35)
    with pytest.raises(ValueError, match="stable_rel=1.5"):
        profile(_stepper(clock, lambda b, s: 1.0), plan, stable_rel=1.5)


def test_later_shapes_stop_once_the_fit_predicts_one_within_converge_rel():
    # Step times exactly in the quadratic family: the fit of the first pass (B = 1 over S) predicts the
    # first later shape exactly; it is still measured (a shape is judged by its measurement), and the
    # rest are skipped.
    a, c1, c2 = 0.05, 1e-4, 1e-8

    def seconds(b, s):
        return a + b * (c1 * s + c2 * s * s)

    grids = np.array([(1, 1, 100), (1, 1, 400), (1, 1, 900), (1, 1, 1600)])
    plan = plan_grid(grids, batch_sizes=[1, 2, 4])
    first_pass = 4

    def run(**kwargs):
        clock, calls, lines = Clock(), [], []
        m = profile(_stepper(clock, seconds, calls), plan, warmup=0, repeats=1, clock=clock, form="quadratic",
                    progress=lines.append, **kwargs)
        return m, calls, lines

    m, calls, lines = run(converge_rel=0.03)
    later = m[first_pass:]
    assert [x.status for x in later] == ["ok"] + ["skipped"] * (len(later) - 1)
    assert len(calls) == first_pass + 1
    assert any(f"skipping the {len(later) - 1} left" in line for line in lines)
    m, calls, _ = run(converge_rel=0.03, converge_after=2)
    assert [x.status for x in m[first_pass:]] == ["ok", "ok"] + ["skipped"] * (len(later) - 2)
    # A later shape the fit predicted badly (3x off) does not count: the next one is measured too.
    clock = Clock()
    m = profile(_stepper(clock, lambda b, s: seconds(b, s) * (3.0 if (b, s) == (2, 100) else 1.0)), plan,
                warmup=0, repeats=1, clock=clock, form="quadratic", converge_rel=0.03)
    assert [x.status for x in m[first_pass:first_pass + 2]] == ["ok", "ok"]
    m, calls, _ = run(converge_rel=0.0)
    assert all(x.status == "ok" for x in m) and len(calls) == len(plan)
