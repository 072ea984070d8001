"""Time the real training step over a grid of (batch size, token grid) shapes.

Lightning-free: the caller hands in a step factory (``make_step(B, grid) -> step()``, one forward +
backward per call) and a :class:`Collectives` object, so the same loop serves the Lightning callback,
a plain torch loop or a test with a fake clock.

Per shape: ``warmup`` untimed steps, then up to ``repeats`` timed steps, the median kept, the
maximum over ranks recorded. With a ``compile_clock`` (cumulative seconds spent compiling), compile
time is never timed: a warm-up step in which nothing compiled is a steady-state step and counts as a
timed one (so a compiled model pays no extra step per shape once its graphs exist), and a timed step
in which something compiled is not counted. The seconds spent compiling are recorded per shape.
Every decision that ranks must share (out of memory, out of time) goes
through the collectives, so all ranks run the same steps. Bounds:

- a shape starts no step that its last timed step predicts would end past ``shape_time_s`` of its
  own time, compiling excluded (with a compile clock, the whole of a step in which something compiled:
  its first run loads kernels and sets up libraries too; at least one timed step is kept; a step in
  flight is never interrupted), or once two timed steps or more agree to
  within ``stable_rel`` of their median (more repetitions would not move the median by more);
- the run stops starting new shapes once ``time_budget_s`` is spent and every sequence length has one
  measurement (the first pass), and shapes after the first pass get at most the budget that is left;
- a shape that runs out of memory on any rank ends that sequence length's larger batches, and when
  it happens at B = 1 every longer sequence too (memory grows with tokens);
- with a ``memory_limit`` (bytes a step may peak at), every shape has its batch size capped at what a
  memory model fitted to the peaks measured so far
  (:class:`~lightning_adaptiveload.calibration.costmodel.MemoryModel`) predicts to fit (once two
  token counts are measured), so the largest batches profiled are the ones training will use (a
  measurement, not an extrapolation) and no time goes to compiling and running shapes that cannot
  fit: a sequence predicted not to fit even at B = 1 is recorded ``"too_large"`` (another
  activation-checkpointing mode may take it). A capped shape already measured is skipped;
- with ``converge_rel``, shapes after the first pass are predicted by a cost model fitted to the
  shapes measured so far before they run; once ``converge_after`` of them in a row were predicted
  within ``converge_rel``, the rest are skipped (the fit has stopped learning).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch

_STATUSES = ("ok", "oom", "skipped", "too_large")
# Batch sizes tried per sequence length when none are given: B = 1 and the largest that fits. Where
# B = 1 already fills the device, the large batch costs B times as much and teaches the fit little,
# so later rounds stop once the fit predicts them (``converge_rel``).
DEFAULT_BATCHES_PER_SEQ = 2
# A step slower than this reports each repetition, so a long shape never looks like a hang.
_SLOW_STEP_S = 2.0
#: Sequence lengths within this fraction of a longer one are profiled as that one (the fit interpolates
#: between them): a 1 % longer clip costs a full measurement and teaches the fit nothing new, and
#: profiling the longer of the two keeps the range a mode is measured to fit ending at a corpus length.
MERGE_REL = 0.05


def distinct_lengths(grids: Any, merge_rel: float = MERGE_REL) -> list[tuple[int, int, int]]:
    """One token grid per distinct sequence length of ``grids``, shortest first, where lengths within
    ``merge_rel`` below a longer one kept are merged into it (its grid stands for them)."""
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    seq = grids.prod(axis=1)
    uniq_s, first = np.unique(seq, return_index=True)
    kept: list[int] = []  # indices into uniq_s, longest first
    for i in range(len(uniq_s) - 1, -1, -1):
        if not kept or uniq_s[i] < uniq_s[kept[-1]] * (1.0 - merge_rel):
            kept.append(i)
    return [tuple(int(v) for v in grids[first[i]]) for i in reversed(kept)]  # type: ignore[misc]


class Collectives(Protocol):
    """What profiling needs from the process group."""

    def max(self, value: float) -> float:
        """All-reduce maximum of a float over ranks."""

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""


class LocalCollectives:
    """One process: every collective is the identity."""

    def max(self, value: float) -> float:
        return float(value)

    def broadcast(self, obj: Any) -> Any:
        return obj


@dataclass(frozen=True)
class Shape:
    """One profiled shape: ``batch_size`` samples of token grid ``grid``."""

    batch_size: int
    grid: tuple[int, int, int]

    @property
    def seq_len(self) -> int:
        return int(np.prod(self.grid))


@dataclass(frozen=True)
class Measurement:
    """What profiling one shape gave. ``time_s`` is the median over timed steps, max over ranks.

    ``status``: ``"ok"``, ``"oom"`` (some rank ran out of memory) or ``"skipped"`` (not run: a smaller
    batch or a shorter sequence already ran out of memory, or the time budget was spent).
    """

    batch_size: int
    grid: tuple[int, int, int]
    seq_len: int
    time_s: float | None
    peak_bytes: int | None
    status: str
    timed_steps: int = 0
    seconds: float = 0.0
    compile_s: float = 0.0
    #: The activation-checkpointing mode the shape ran in (``None``: the model's own setting).
    mode: str | None = None
    #: ``(max - min) / median`` of the timed steps, max over ranks (``None``: fewer than two timed steps, or
    #: a record from before spreads were kept).
    spread: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["grid"] = list(self.grid)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> Measurement:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError(f"a measurement is {type(data).__name__}, not an object")
        try:
            grid = tuple(int(v) for v in data["grid"])
            b, s, status = int(data["batch_size"]), int(data["seq_len"]), data["status"]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"a measurement lacks a valid batch_size, grid, seq_len or status ({err!r})") from err
        if len(grid) != 3 or min(grid) < 1 or b < 1 or s != math.prod(grid) or status not in _STATUSES:
            raise ValueError(f"measurement {data!r} is not consistent (grid, seq_len, batch_size, status)")
        t = data.get("time_s")
        if status == "ok" and not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"measurement {data!r} has status 'ok' but time_s={t!r}")
        peak = data.get("peak_bytes")
        mode = data.get("mode")
        spread = data.get("spread")
        if spread is not None and not (isinstance(spread, (int, float)) and math.isfinite(spread) and spread >= 0):
            raise ValueError(f"measurement {data!r} has spread={spread!r}, expected a fraction >= 0 or null")
        if mode is not None and not isinstance(mode, str):
            raise ValueError(f"measurement {data!r} has mode={mode!r}, expected a string or null")
        return cls(b, grid, s, None if t is None else float(t), None if peak is None else int(peak), status,
                   int(data.get("timed_steps", 0)), float(data.get("seconds", 0.0)),
                   float(data.get("compile_s", 0.0)), mode, None if spread is None else float(spread))


def plan_grid(
    grids: Any,
    batch_sizes: Sequence[int] | None = None,
    max_shapes: int = 8,
    max_seq_len: int | None = None,
    max_tokens: int | None = None,
) -> list[Shape]:
    """(B, grid) pairs to profile, the smallest batch of every sequence length first.

    Takes up to ``max_shapes`` distinct sequence lengths spread over the corpus's range (lengths within
    :data:`MERGE_REL` of a longer one count as that one, :func:`distinct_lengths`), and for each
    ``batch_sizes`` or, by default, up to three batch sizes from 1 to ``max_tokens / S`` (a known
    memory budget, so the fit covers every batch the policy may choose) or, without one,
    ``2·S_max / S``. Sequences above ``max_seq_len`` (samples training will skip) are never profiled. Ordering by round (all
    sequence lengths at their i-th batch size) means a time budget that runs out still leaves the
    whole range of S covered.

    Raises:
        ValueError: no grid is left to profile.
    """
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    if max_seq_len is not None:
        grids = grids[grids.prod(axis=1) <= max_seq_len]
    if len(grids) == 0:
        raise ValueError(
            "No sample is left to profile: every token grid is above the memory budget. Raise `m_mem` or use "
            "shorter samples."
        )
    reps = distinct_lengths(grids)
    uniq_s = np.array([int(np.prod(g)) for g in reps])
    if len(uniq_s) == 1:
        # A single sequence length cannot identify the S-dependence; add a grid with half the
        # tokens along the largest axis so the fit is defined (the policy only queries the real S).
        f, h, w = reps[0]
        axis = int(np.argmax([f, h, w]))
        half = [f, h, w]
        half[axis] = max(1, half[axis] // 2)
        if tuple(half) != reps[0]:
            reps.insert(0, tuple(half))
            uniq_s = np.array([int(np.prod(half)), int(uniq_s[0])])
    if len(reps) > max_shapes:
        idx = np.unique(np.round(np.linspace(0, len(reps) - 1, max_shapes)).astype(int))
        reps = [reps[i] for i in idx]
        uniq_s = uniq_s[idx]
    s_max = int(uniq_s.max())
    per_s: list[list[int]] = []
    for s in uniq_s:
        if batch_sizes is not None:
            per_s.append(sorted({int(b) for b in batch_sizes}))
        else:
            b_max = max(1, (max_tokens or 2 * s_max) // int(s))
            per_s.append(sorted({int(round(b)) for b in np.geomspace(1, b_max, DEFAULT_BATCHES_PER_SEQ)}))
    plan = []
    for r in range(max(len(bs) for bs in per_s)):
        for grid, bs in zip(reps, per_s, strict=True):
            if r < len(bs):
                plan.append(Shape(bs[r], grid))  # type: ignore[arg-type]
    return plan


@dataclass
class MemoryProbe:
    """Peak-memory hooks of a device (``None`` fields: not measured, e.g. on CPU)."""

    reset: Callable[[], None] | None = None
    peak: Callable[[], int] | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> MemoryProbe:
        if device.type != "cuda":
            return cls()
        return cls(lambda: torch.cuda.reset_peak_memory_stats(device),
                   lambda: int(torch.cuda.max_memory_allocated(device)))


def is_out_of_memory(err: BaseException) -> bool:
    """True for the errors a too-large batch raises (CUDA's OOM; a CPU allocator's failure)."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def profile(
    make_step: Callable[[int, tuple[int, int, int]], Callable[[], None]],
    plan: Sequence[Shape],
    *,
    collectives: Collectives | None = None,
    warmup: int = 1,
    repeats: int = 5,
    shape_time_s: float = 30.0,
    time_budget_s: float = 300.0,
    synchronize: Callable[[], None] | None = None,
    memory: MemoryProbe | None = None,
    on_oom: Callable[[], None] | None = None,
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] | None = None,
    compile_clock: Callable[[], float] | None = None,
    memory_limit: float | None = None,
    stable_rel: float = 0.0,
    converge_rel: float = 0.0,
    converge_after: int = 1,
    form: str = "auto",
    attention_tokens: Callable[[int], int] | None = None,
) -> list[Measurement]:
    """Profile ``plan`` (see the module docstring) and return one :class:`Measurement` per shape.

    Args:
        make_step: builds the batch for ``(B, grid)`` and returns a callable running one training
            step (forward + backward, no optimizer step) on it.
        plan: shapes in profiling order (:func:`plan_grid`).
        collectives: cross-rank max and broadcast; default: one process.
        warmup: untimed steps per shape.
        repeats: at most this many timed steps per shape (the median is kept).
        shape_time_s: a shape starts no step predicted to end after this many seconds of its own time.
        time_budget_s: no new shape after the first pass once this many seconds are spent.
        synchronize: waits for the device (called around every timed step).
        memory: peak-memory hooks; peaks are maxima over ranks.
        on_oom: frees memory after an out-of-memory error (e.g. ``torch.cuda.empty_cache``).
        progress: receives one line per shape (and per step of slow shapes); rank 0 prints it.
        clock: seconds; default ``time.perf_counter`` (read at call time, so tests can patch it).
        compile_clock: cumulative seconds spent compiling (e.g.
            :func:`lightning_adaptiveload.models.compiling.compile_seconds`); see the module docstring. ``None``:
            nothing compiles, warm-up steps are never timed.
        memory_limit: bytes a step may peak at (device memory less margin and optimizer state still to
            come); caps the batch sizes after the first pass (see the module docstring). Needs ``memory.peak``.
        stable_rel: stop a shape early once its timed steps (two or more) span at most this fraction of
            their median; 0 runs up to ``repeats``.
        converge_rel: skip the remaining shapes after the first pass once ``converge_after`` in a row
            were predicted within this relative error by the fit (``form``) of the shapes before
            them; 0 profiles every shape.
        attention_tokens: ``S -> S_attn``, the tokens attention sees (the module's ``attention_tokens``); the
            fits that cap batches and predict shapes are made in them (``None``: ``S``).

    Raises:
        ValueError: bad arguments.
    """
    for name, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or int(value) != value or value < low:
            raise ValueError(f"`{name}={value!r}` is not valid. Expected an integer >= {low}.")
    for name, value in (("shape_time_s", shape_time_s), ("time_budget_s", time_budget_s)):
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"`{name}={value!r}` is not valid. Expected seconds > 0.")
    for name, value in (("stable_rel", stable_rel), ("converge_rel", converge_rel)):
        if not (isinstance(value, (int, float)) and 0 <= value < 1):
            raise ValueError(f"`{name}={value!r}` is not valid. Expected a fraction in [0, 1).")
    clock = clock or time.perf_counter
    coll = collectives or LocalCollectives()
    memory = memory or MemoryProbe()
    sync = synchronize or (lambda: None)
    say = progress or (lambda line: None)
    n = len(plan)
    first_pass = len({s.grid for s in plan})
    oom_at: dict[int, int] = {}  # S -> smallest B that ran out of memory
    oom_b1_seq: int | None = None  # shortest S that ran out of memory at B = 1
    out: list[Measurement] = []
    start = clock()
    stopped = False
    converged = 0  # later-round shapes in a row that the fit predicted within converge_rel
    for i, shape in enumerate(plan):
        if memory_limit is not None and memory.peak is not None:
            capped = _cap_batch(shape, out, memory_limit, attention_tokens)
            if capped != shape.batch_size:
                say(f"shape {i + 1}/{n}: B={shape.batch_size} grid={shape.grid} is predicted above the memory "
                    f"limit; " + (f"B={capped} instead" if capped else "skipped"))
            if not capped:
                out.append(Measurement(shape.batch_size, shape.grid, shape.seq_len, None, None, "too_large"))
                continue
            if any(m.batch_size == capped and m.grid == shape.grid for m in out):
                out.append(Measurement(shape.batch_size, shape.grid, shape.seq_len, None, None, "skipped"))
                continue
            shape = Shape(capped, shape.grid)
        if i >= first_pass and converge_rel > 0 and not stopped and converged >= converge_after:
            what = "a shape" if converged == 1 else f"{converged} shapes in a row"
            say(f"the fit predicted {what} within {converge_rel:.0%}; skipping the {n - i} left")
            stopped = True
        predicted = _predict_next(out, shape, form, attention_tokens) if i >= first_pass and converge_rel > 0 else None
        b, grid, s = shape.batch_size, shape.grid, shape.seq_len
        elapsed = clock() - start
        if i >= first_pass and coll.broadcast(elapsed >= time_budget_s):
            if not stopped:
                say(f"time budget {time_budget_s:.0f} s spent after {i}/{n} shapes; fitting on those")
            stopped = True
        blocked = (s in oom_at and b >= oom_at[s]) or (oom_b1_seq is not None and s >= oom_b1_seq)
        if stopped or blocked:
            out.append(Measurement(b, grid, s, None, None, "skipped"))
            continue
        limit = shape_time_s if i < first_pass else max(1e-9, min(shape_time_s, time_budget_s - elapsed))
        m = _profile_one(make_step, shape, coll, warmup, repeats, limit, sync, memory, on_oom, say,
                         f"shape {i + 1}/{n}", clock, compile_clock, stable_rel)
        out.append(m)
        if predicted is not None and m.status == "ok":
            converged = converged + 1 if abs(predicted / m.time_s - 1) <= converge_rel else 0
        if m.status == "oom":
            oom_at[s] = min(b, oom_at.get(s, b))
            if b == 1:
                oom_b1_seq = s if oom_b1_seq is None else min(oom_b1_seq, s)
        done = clock() - start
        eta = done / (i + 1) * (n - i - 1)
        result = f"{m.time_s * 1e3:.1f} ms ({m.timed_steps} timed)" if m.status == "ok" else "out of memory"
        if m.compile_s >= 0.05:
            result += f", compiled {m.compile_s:.1f} s"
        say(f"shape {i + 1}/{n}: B={b} grid={grid} S={s:,}: {result} | elapsed {done:.0f} s, "
            f"ETA {min(eta, max(time_budget_s - done, 0.0)):.0f} s")
    return out


def sustained(make_step: Callable[[int, tuple[int, int, int]], Callable[[], None]], shape: Shape, *,
              settle_s: float, repeats: int, collectives: Collectives | None = None,
              synchronize: Callable[[], None] | None = None,
              clock: Callable[[], float] | None = None) -> tuple[float, float, int]:
    """Time ``shape`` under sustained load: back-to-back steps for at least ``settle_s`` seconds (at least one),
    untimed, then ``repeats`` timed ones. Returns ``(median step seconds, max over ranks; seconds spent; untimed
    steps)``.

    The profile times each shape right after compiling it, an idle device: a GPU at its power cap then runs its
    first seconds of work at a higher clock than training sustains (on one H100 at 700 W: 1,965 MHz against
    1,550-1,600 in training). Steps run back to back here, as training's do, so the clock has settled.
    """
    clock = clock or time.perf_counter
    coll = collectives or LocalCollectives()
    sync = synchronize or (lambda: None)
    step = make_step(shape.batch_size, shape.grid)
    start = clock()
    untimed = 0
    sync()
    # Rank 0's clock decides, so every rank runs as many steps.
    while untimed < 1 or coll.broadcast(clock() - start < settle_s):
        step()
        sync()  # the host waits for the step, so the clock counts device time (no gap to speak of: the next launches at once)
        untimed += 1
    times = []
    for _ in range(repeats):
        t0 = clock()
        step()
        sync()
        times.append(clock() - t0)
    del step
    return coll.max(float(np.median(times))), clock() - start, untimed


def _predict_next(done: Sequence[Measurement], shape: Shape, form: str,
                  attention_tokens: Callable[[int], int] | None = None) -> float | None:
    """The step time of ``shape`` predicted by the cost model of the shapes measured so far (``None``:
    too few to fit)."""
    import warnings

    from lightning_adaptiveload.calibration.costmodel import CostModel, token_table

    ok = [m for m in done if m.status == "ok"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "too few points for a held-out comparison": expected here
            table = token_table(attention_tokens, [*(m.seq_len for m in ok), shape.seq_len])
            model = CostModel.fit([m.batch_size for m in ok], [m.seq_len for m in ok], [m.time_s for m in ok],
                                  form=form, attention_tokens=table)
    except ValueError:
        return None
    return float(model.predict(shape.batch_size, shape.seq_len))


def _cap_batch(shape: Shape, done: Sequence[Measurement], memory_limit: float,
               attention_tokens: Callable[[int], int] | None = None) -> int:
    """``shape``'s batch size, lowered to what the peaks measured so far predict to fit (0: none fits).

    Kept as is while no memory model can be fitted (fewer than two token counts measured)."""
    from lightning_adaptiveload.calibration.costmodel import MemoryModel, token_table

    ok = [m for m in done if m.status == "ok" and m.peak_bytes is not None]
    try:
        model = MemoryModel.fit([m.batch_size for m in ok], [m.seq_len for m in ok], [m.peak_bytes for m in ok],
                                token_table(attention_tokens, [*(m.seq_len for m in ok), shape.seq_len]))
    except ValueError:
        return shape.batch_size
    # Never above a batch measured to fit at this length (the fit may undershoot a point).
    fits = max([0] + [m.batch_size for m in ok if m.seq_len == shape.seq_len])
    return min(shape.batch_size, max(fits, model.max_batch_size(shape.seq_len, memory_limit, margin=0.0)))


def _profile_one(make_step, shape: Shape, coll: Collectives, warmup: int, repeats: int, limit: float,
                 sync, memory: MemoryProbe, on_oom, say, label: str, clock, compile_clock=None,
                 stable_rel: float = 0.0) -> Measurement:
    b, grid, s = shape.batch_size, shape.grid, shape.seq_len
    compiled = compile_clock or (lambda: 0.0)
    times: list[float] = []
    oom = False
    t_shape = clock()
    c_shape = compiled()
    # Wall time of the steps in which something compiled, beyond what the compile clock counted.
    one_off = 0.0
    if memory.reset is not None:
        memory.reset()
    try:
        step = make_step(b, grid)
        # With a compile clock, up to two extra steps make up for steps in which something compiled.
        max_steps = warmup + repeats + (2 if compile_clock is not None else 0)
        last = None
        for k in range(max_steps):
            if len(times) >= repeats:
                break
            # Ranks agree on whether to start another step: rank 0's clock decides. Compiling does not
            # count against the shape's time (it is paid once, and training would pay it anyway).
            # A step predicted to end past the limit is not started (at least one timed step is kept):
            # at a few seconds a step, one timed step is already within a percent of the median.
            if times and coll.broadcast(clock() - t_shape - (compiled() - c_shape) - one_off + times[-1] > limit):
                break
            if stable_rel > 0 and len(times) >= 2 and coll.broadcast(
                    max(times) - min(times) <= stable_rel * float(np.median(times))):
                break
            sync()
            c0 = compiled()
            t0 = clock()
            step()
            sync()
            dt = last = clock() - t0
            if compile_clock is None:
                steady = k >= warmup
            else:
                # Every rank compiles the same graphs, but the decision must be shared all the same.
                # A warm-up step in which nothing compiled is already a steady-state step.
                steady = not coll.max(float(compiled() > c0))
                if not steady:
                    one_off += max(0.0, dt - (compiled() - c0))
            if steady:
                times.append(dt)
            if dt >= _SLOW_STEP_S:
                if steady:
                    kind = f"timed {len(times)}/{repeats}"
                else:
                    kind = "compiling" if compile_clock is not None else f"warm-up {k + 1}/{warmup}"
                say(f"  {label}: B={b} S={s:,} {kind}: {dt:.1f} s")
        if not times and last is not None:
            times.append(last)  # something compiled in every step: the last step is the best estimate
        del step
    except Exception as err:  # noqa: BLE001 - only out-of-memory is recovered, the rest re-raised
        if not is_out_of_memory(err):
            raise
        oom = True
    if oom:
        gc.collect()
        if on_oom is not None:
            on_oom()
    seconds = clock() - t_shape
    compile_s = compiled() - c_shape
    if coll.max(float(oom)) > 0:
        return Measurement(b, grid, s, None, None, "oom", 0, seconds, compile_s)
    median = float(np.median(times))
    t = coll.max(median)
    peak = None if memory.peak is None else int(coll.max(float(memory.peak())))
    # Every rank ran the same number of timed steps (the decisions are shared), so all take this branch.
    spread = coll.max((max(times) - min(times)) / median) if len(times) >= 2 else None
    return Measurement(b, grid, s, t, peak, "ok", len(times), seconds, compile_s, spread=spread)
