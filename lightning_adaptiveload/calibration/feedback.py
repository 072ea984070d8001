"""The closed loop, Lightning-free: correct a calibration with the step times training measured
(:func:`refit`), and decide whether the corrected calibration's policy is worth a re-plan (:func:`compare`).

The profile times forward + backward on burst clocks; training also pays the optimizer step, the loader
hand-over, callbacks and logging, on sustained clocks (on one H200: 1.08-1.19x the profiled time of the same
shape). :func:`refit` therefore does not only put training's points in place of the profile's: it fits
how training's step relates to the profiled one, ``t_train = overhead + clock · t_profiled`` (robustly, so
one slow shape does not move it), maps every profile point through it, lets training's own points replace
the profile's at the same (B, S, mode), and refits the cost model in the calibration's form on the union.
A uniform slowdown then scales the model and changes no batch size; a shape slower than the model
predicted shows as that shape's own point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import least_squares, lsq_linear

import lightning_adaptiveload.calibration.derive as derive
import lightning_adaptiveload.calibration.record as record
from lightning_adaptiveload.calibration.calibrate import REPLAN_GAIN, ProfileSettings, weigh_plans
from lightning_adaptiveload.calibration.costmodel import OFFSET_FLOOR, PARAM_NAMES, CostModel

__all__ = ["REPLAN_GAIN", "Decision", "Observation", "compare", "refit"]

#: The per-step overhead is fitted apart from the clock factor only when the observed shapes' profiled
#: times span at least this factor; closer together the two are one unknown, and the clock factor alone
#: (the documented effect of the power cap) is fitted.
_SPAN_FOR_OVERHEAD = 2.0
#: Scale of the transfer fit's robust (arctan) loss on relative residuals: a shape off by much more than
#: this (a slow bucket) barely pulls the overhead and the clock factor.
_ROBUST_REL = 0.05
#: A length whose training median stays more than this fraction off the refitted form gets a correction of
#: its own. Below it, the form's own error (held-out 1-3% on the reference H200 fits) and run-to-run noise:
#: a correction there would fit noise.
CORRECTION_REL = 0.05


@dataclass(frozen=True)
class Observation:
    """What training measured for one shape: ``steps`` steps of ``batch_size`` samples of ``seq_len`` tokens,
    their median ``median_seconds`` (max over ranks), in activation-checkpointing ``mode`` (``None``: the
    module's own, or the tier the calibration gives ``seq_len``).

    Raises:
        ValueError: a field out of range, naming it.
    """

    batch_size: int
    seq_len: int
    median_seconds: float
    steps: int
    mode: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"`Observation({name}={v!r})` is not valid. Expected a positive integer.")
            object.__setattr__(self, name, int(v))
        t = self.median_seconds
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"`Observation(median_seconds={t!r})` is not valid. Expected finite seconds > 0.")
        object.__setattr__(self, "median_seconds", float(t))
        if self.mode is not None and not isinstance(self.mode, str):
            raise ValueError(f"`Observation(mode={self.mode!r})` is not valid. Expected a mode name or None.")

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "seq_len": self.seq_len, "median_seconds": self.median_seconds,
                "steps": self.steps, "mode": self.mode}

    @classmethod
    def from_dict(cls, data: Any) -> Observation:
        if not isinstance(data, dict):
            raise ValueError(f"an observation is {type(data).__name__}, not an object")
        try:
            return cls(data["batch_size"], data["seq_len"], data["median_seconds"], data["steps"], data.get("mode"))
        except KeyError as err:
            raise ValueError(f"observation {data!r} lacks {err}") from err


def _as_observation(o: Any) -> Observation:
    return o if isinstance(o, Observation) else Observation(*o)


class _Pricing:
    """A calibration's step time of ``(B, S, mode)``: the cost model times the scale of the mode's tier (the
    tier ``S`` falls in, where ``mode`` is ``None`` or not a tier's), as :class:`derive.TieredCostModel` prices."""

    def __init__(self, cost_model: CostModel, tiers: Sequence[derive.ModeTier] | None) -> None:
        self.cost_model, self.tiers = cost_model, list(tiers or [])

    def mode_of(self, seq_len: int, mode: str | None) -> str | None:
        if not self.tiers:
            return None  # one mode for the run: points match on (B, S)
        if mode is not None and any(t.mode == mode for t in self.tiers):
            return mode
        limits = [t.max_seq_len for t in self.tiers]
        return self.tiers[min(int(np.searchsorted(limits, seq_len, side="left")), len(self.tiers) - 1)].mode

    def scale(self, mode: str | None) -> float:
        return next((t.scale for t in self.tiers if t.mode == mode), 1.0)

    def predict(self, batch_size: int, seq_len: int, mode: str | None) -> float:
        mode = self.mode_of(seq_len, mode)
        return float(self.cost_model.predict(batch_size, seq_len)) * self.scale(mode)


def _tiers(cal: record.Calibration) -> list[derive.ModeTier] | None:
    try:
        return derive.tiers_from_record(cal.extra)
    except ValueError as err:
        raise record.CalibrationError(f"calibration ({cal.key.get('model', '?')}): {err}. Profile again.") from err


def _fit_transfer(predicted: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    """``(overhead_s, clock)`` with ``measured ≈ overhead + clock · predicted`` (see the module docstring)."""
    ratio = measured / predicted
    clock0 = float(np.median(ratio))
    if predicted.max() < _SPAN_FOR_OVERHEAD * predicted.min():
        return 0.0, clock0

    def residuals(theta: np.ndarray) -> np.ndarray:
        return (theta[0] + theta[1] * predicted) / measured - 1.0

    scale = float(np.median(measured))
    res = least_squares(residuals, np.array([0.0, clock0]), bounds=([0.0, 1e-9], [np.inf, np.inf]),
                        loss="arctan", f_scale=_ROBUST_REL, x_scale=np.array([scale, 1.0]), method="trf")
    return float(res.x[0]), float(res.x[1])


def _fit_with_corrections(merged: dict[tuple[int, int, str | None], float],
                          points: dict[tuple[int, int, str | None], Observation], form: str, base_mode: str | None,
                          tiers: Sequence[derive.ModeTier],
                          attention_tokens: dict[int, int] | None = None) -> tuple[CostModel, dict[str, float]]:
    """The form fitted to the base mode's points, the tiers' scales (the median ratio of a tier's points to
    it, as :func:`derive.fit_tiers` has them) and per-length corrections.

    A length where a training point stays more than :data:`CORRECTION_REL` off the fit gets a correction
    and its training points leave the fit, so one slow length does not bend the form for the others (the
    profile's points of that length stay); repeated until the set of corrected lengths settles. Where
    leaving them out would leave too few points to fit, they stay. The correction is the median of
    measured / fitted, or, where training measured the length at two or more batch sizes, ``factor · fitted
    + offset`` fitted to them (:func:`_affine_correction`)."""
    n_min = len(PARAM_NAMES[form]) + 1
    corrected: set[int] = set()
    for _ in range(len({k[1] for k in points}) + 1):
        used = {k: t for k, t in merged.items() if not (k in points and k[1] in corrected)}
        base = [(k, t) for k, t in used.items() if k[2] == base_mode]
        if len(base) < n_min or len({k[1] for k, _ in base}) < 2:
            used = merged
            base = [(k, t) for k, t in merged.items() if k[2] == base_mode]
        try:
            # The held-out error (a refit per point, most of the cost) only of the fit the loop settles on.
            fitted = CostModel.fit([k[0] for k, _ in base], [k[1] for k, _ in base], [t for _, t in base], form=form,
                                   attention_tokens=attention_tokens, heldout=False)
        except ValueError as err:
            raise ValueError(f"refit: the corrected points do not fit the {form!r} form ({err})") from err
        scales = {}
        for t in tiers:
            own = [(k, v) for k, v in used.items() if k[2] == t.mode]
            scales[t.mode] = 1.0 if t.mode == base_mode or not own else float(
                np.median([v / float(fitted.predict(k[0], k[1])) for k, v in own]))
        by_len: dict[int, list[tuple[int, float, float, int]]] = {}  # S -> (B, priced, measured, steps)
        for k, o in points.items():
            priced = float(fitted.predict(k[0], k[1])) * scales.get(k[2], 1.0)  # type: ignore[arg-type]
            by_len.setdefault(k[1], []).append((k[0], priced, o.median_seconds, o.steps))
        found = {s for s, r in by_len.items() if max(abs(t / p - 1) for _, p, t, _ in r) > CORRECTION_REL}
        if found == corrected:
            break
        corrected = found
    # Beside training (its GIL, its cores): the held-out fits start from this one.
    fitted = CostModel.fit([k[0] for k, _ in base], [k[1] for k, _ in base], [t for _, t in base], form=form,
                           attention_tokens=attention_tokens, heldout="warm")
    fixes = {s: _affine_correction(by_len[s]) for s in sorted(found)}
    return CostModel(fitted.form, fitted.params, fitted.quality, {s: f for s, (f, _) in fixes.items()},
                     fitted.attention_tokens, {s: o for s, (_, o) in fixes.items() if o != 0}), scales


def _affine_correction(points: Sequence[tuple[int, float, float, int]]) -> tuple[float, float]:
    """``(factor, offset_s)`` for one length from its training points ``(B, priced, measured, steps)``: where they
    hold one batch size, measured over priced (their sums weighted by steps); with two or more,
    ``measured ≈ factor · priced + offset`` in relative least squares. A positive offset is a small batch's
    fixed cost the form's floor does not hold (with two ranks on a CPU, 32 and 256 images of one length ran 1.6x
    and 1.1x the fit); a negative one, a floor the form holds too high at this length (107 and 181 samples of 16
    tokens ran 0.90x and 1.14x). A negative offset may take at most ``1 - OFFSET_FLOOR`` of the smallest measured
    batch's ``factor · priced`` (:data:`~lightning_adaptiveload.calibration.costmodel.OFFSET_FLOOR`), so the
    floor the prediction keeps does not bind where training measured; a larger one falls back to one factor,
    ``Σ steps · measured / Σ steps · priced``: the time training spent at the length is predicted right, and
    the batch sizes trained least carry the error (the median ratio of two left a CPU quickstart's 34 x 120,
    68 steps, and its 13 x 120 remainder, 5 bounding steps, at 1.21x and 0.79x)."""
    steps = np.array([max(1, n) for _, _, _, n in points], dtype=float)
    priced = np.array([p for _, p, _, _ in points])
    measured = np.array([t for _, _, t, _ in points])
    pooled = float((steps * measured).sum() / (steps * priced).sum())
    if len({b for b, _, _, _ in points}) < 2:
        return pooled, 0.0
    fit = lsq_linear(np.stack([priced / measured, 1.0 / measured], axis=1), np.ones(len(points)),
                     bounds=([1e-9, -np.inf], [np.inf, np.inf]))
    factor, offset = (float(v) for v in fit.x)
    if not 0.5 * pooled <= factor <= 2.0 * pooled:  # the offset would stand for the length's whole cost
        return pooled, 0.0
    if offset < -(1.0 - OFFSET_FLOOR) * factor * float(priced.min()):  # it would take most of a small batch's time
        return pooled, 0.0
    return factor, offset if abs(offset) > 1e-12 else 0.0


def refit(cal: record.Calibration, observed: Sequence[Observation], *,
          overhead_s: float | None = None) -> record.Calibration:
    """``cal`` corrected by what training measured (see the module docstring).

    The cost model keeps ``cal``'s form; the tiers of per-bucket activation checkpointing keep their modes,
    ranges and memory models, and a tier other than the base mode gets its scale refitted from its own
    points (observations in its mode replace its profile points); the memory model, the measurements and
    the key are kept. Observations of an earlier correction (``cal.extra["feedback"]``) are kept at the
    lengths (and modes) the new ones do not measure, and the transfer is always fitted against the
    profile's own fit, so corrections do not compound. The result's ``extra["provenance"]`` is ``{"source": "corrected", "training_steps",
    "profiled_points", "training_points"}`` and ``extra["feedback"]`` holds the observations, the transfer
    (``overhead_s``, ``clock``) and the profile's own fit.

    Args:
        cal: the calibration training ran with (profiled, cached, pinned or already corrected).
        observed: per shape, the median of training's steps (max over ranks); ``(batch_size, seq_len,
            median_seconds, steps, mode)`` tuples are taken too.
        overhead_s: the per-step time training spends outside the profiled forward + backward, when it was
            measured (``BalanceMonitor.overhead_s``); ``None``: fitted with the clock factor where the
            observed shapes' times allow it.

    Raises:
        ValueError: no observation, or an invalid one.
        CalibrationError: the record's tiers are malformed.
    """
    new_obs = [_as_observation(o) for o in observed]
    if not new_obs:
        raise ValueError("`refit(observed=[])` has nothing to correct with. Expected at least one Observation.")
    tiers = _tiers(cal)
    fb = dict(cal.extra.get("feedback") or {})
    if "profile" in fb:
        profile_cm = CostModel.from_dict(fb["profile"]["cost_model"])
        scales = {str(k): float(v) for k, v in fb["profile"].get("scales", {}).items()}
        profile_tiers = [derive.ModeTier(t.mode, t.max_seq_len, scales.get(t.mode, t.scale)) for t in tiers or []]
    else:
        profile_cm, profile_tiers = cal.cost_model, list(tiers or [])
    profile = _Pricing(profile_cm, profile_tiers)

    # Training's points, the newest per (B, S, mode); an earlier run's points at a length this run measured
    # are dropped (a batch size the plan no longer uses, timed under another run's conditions, would pull that
    # length's correction).
    fresh = {(o.seq_len, profile.mode_of(o.seq_len, o.mode)) for o in new_obs}
    earlier = [o for o in (Observation.from_dict(d) for d in fb.get("observations", []))
               if (o.seq_len, profile.mode_of(o.seq_len, o.mode)) not in fresh]
    points: dict[tuple[int, int, str | None], Observation] = {}
    for o in earlier + new_obs:
        mode = profile.mode_of(o.seq_len, o.mode)
        points[(o.batch_size, o.seq_len, mode)] = Observation(o.batch_size, o.seq_len, o.median_seconds, o.steps, mode)
    obs = list(points.values())
    measured = {(m.batch_size, m.seq_len, profile.mode_of(m.seq_len, m.mode) if tiers else None): float(m.time_s)
                for m in cal.measurements if m.status == "ok"}  # type: ignore[arg-type]
    # Like for like: the profile's own measurement of a shape training ran (the profile measures the memory-cap
    # batches training uses), else its fit, so the fit's error is not taken for a clock difference.
    predicted = np.array([measured.get((o.batch_size, o.seq_len, o.mode)) or profile.predict(o.batch_size, o.seq_len,
                                                                                               o.mode) for o in obs])
    trained = np.array([o.median_seconds for o in obs])
    if overhead_s is not None:
        # Measured in training (the time outside forward + backward): only the clock factor is fitted. The
        # balanced plan gives every batch nearly the same predicted time, so the two are rarely separable.
        overhead = float(overhead_s)
        clock = float(np.median(np.maximum(trained - overhead, 1e-12) / predicted))
    else:
        overhead, clock = _fit_transfer(predicted, trained)

    # The profile's points through the transfer; training's replace them at the same (B, S, mode).
    merged = {k: overhead + clock * t for k, t in measured.items()}
    profiled_points = sum(k not in points for k in merged)
    merged.update({k: o.median_seconds for k, o in points.items()})

    base_mode = (cal.extra.get("checkpointing") or {}).get("base_mode") if tiers else None
    if tiers and base_mode is None:
        base_mode = tiers[0].mode
    form = cal.cost_model.form
    cost_model, scales = _fit_with_corrections(merged, points, form, base_mode, tiers or [],
                                               cal.cost_model.attention_tokens)

    extra = dict(cal.extra)
    if tiers:
        new_tiers = [derive.ModeTier(t.mode, t.max_seq_len, scales[t.mode], t.memory_model) for t in tiers]
        extra["checkpointing"] = {**cal.extra["checkpointing"], "tiers": [t.to_dict() for t in new_tiers]}
    extra["feedback"] = {
        "observations": [o.to_dict() for o in obs], "transfer": {"overhead_s": overhead, "clock": clock},
        "profile": {"cost_model": profile_cm.to_dict(), "scales": {t.mode: t.scale for t in profile_tiers}},
    }
    extra["provenance"] = {"source": "corrected", "training_steps": int(sum(o.steps for o in obs)),
                           "profiled_points": int(profiled_points), "training_points": len(obs)}
    return record.Calibration(key=dict(cal.key), cost_model=cost_model, measurements=list(cal.measurements),
                              memory_model=cal.memory_model, device_memory=cal.device_memory,
                              optimizer_bytes=cal.optimizer_bytes, profile_seconds=cal.profile_seconds,
                              world_size=cal.world_size, extra=extra)


@dataclass(frozen=True)
class Decision:
    """Whether a corrected calibration's policy is worth a re-plan (:func:`compare`).

    Attributes:
        derivation: the policy derived from the corrected calibration (the running policy's memory budgets,
            the step budget derived again).
        gain: predicted tokens/s of the new policy over the old policy's, both simulated under the corrected
            cost model, minus 1.
        replan: ``gain >= REPLAN_GAIN`` and some bucket's batch size differs.
        batch_changes: ``{S: (old B, new B)}`` of the corpus's buckets whose batch size differs.
        old_tokens_per_s, new_tokens_per_s: the two simulated throughputs ``gain`` compares.
        observed: the observations the ratios are of.
        ratio_before, ratio_after: measured / predicted per observation, under the old and the corrected
            calibration (in the observation's mode).
        corrected: the corrected calibration the decision weighed (:func:`refit`'s result).
    """

    derivation: derive.Derivation
    gain: float
    replan: bool
    batch_changes: dict[int, tuple[int, int]] = field(default_factory=dict)
    old_tokens_per_s: float = 0.0
    new_tokens_per_s: float = 0.0
    observed: tuple[Observation, ...] = ()
    ratio_before: tuple[float, ...] = ()
    ratio_after: tuple[float, ...] = ()
    corrected: record.Calibration | None = None

    def tokens_per_s(self, replanned: bool) -> float:
        """The simulated tokens/s (under the corrected cost model) of the plan training runs after this
        decision: the new policy's where it ``replanned``, else the running one's."""
        return self.new_tokens_per_s if replanned else self.old_tokens_per_s

    def gain_over_baseline(self, replanned: bool) -> float:
        """:meth:`tokens_per_s` over the equal-token baseline's (``B = m_mem // S``, dealt at random), both
        under the corrected cost model, minus 1; NaN without a baseline."""
        base = float(self.derivation.baseline.get("tokens_per_s", 0.0))
        return self.tokens_per_s(replanned) / base - 1 if base > 0 else float("nan")

    def summary(self) -> str:
        """One line: the verdict, the batch sizes that change (on a re-plan) or that the corrected policy would
        change (kept: "not applied"), measured/predicted before and after, and the shapes still more than
        :data:`CORRECTION_REL` off after correction (the worst three)."""
        verdict = "re-plan" if self.replan else "keep the plan"
        line = f"{verdict}: {self.gain:+.1%} predicted tokens/s under the corrected model (re-plan from {REPLAN_GAIN:.0%})"
        if self.batch_changes:
            # Kept, the corrected policy's batch sizes are only what a re-plan would have trained.
            line += ("; B " if self.replan else "; the corrected policy's B, not applied: ") + ", ".join(
                f"S={s:,} {a}->{b}" for s, (a, b) in sorted(self.batch_changes.items()))
        else:
            line += "; no batch size changes"
        if self.observed:
            steps = sum(o.steps for o in self.observed)

            def spread(r: tuple[float, ...]) -> str:
                return f"{np.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"

            line += (f"; measured/predicted over {len(self.observed)} shape(s), {steps:,} steps: "
                     f"{spread(self.ratio_before)} -> {spread(self.ratio_after)}")
            off = sorted(((o, r) for o, r in zip(self.observed, self.ratio_after, strict=True)
                          if abs(r - 1.0) > CORRECTION_REL), key=lambda p: -abs(p[1] - 1.0))
            if off:  # what the corrected model still cannot follow, worst first
                line += f"; beyond ±{CORRECTION_REL:.0%} after correction: " + ", ".join(
                    f"{o.batch_size} x {o.seq_len:,} {r:.2f} ({o.steps} steps)" for o, r in off[:3]) + (
                    f" and {len(off) - 3} more" if len(off) > 3 else "")
        return line


def compare(old_cal: record.Calibration, old_derivation: derive.Derivation, new_cal: record.Calibration,
            grids: np.ndarray, counts: np.ndarray, settings: ProfileSettings, *, world_size: int = 1,
            balance: str = "cost", seed: int = 0, oversize: str = "error", sp_degree: int = 1,
            samples: tuple[np.ndarray, Any] | None = None,
            observed: Sequence[Observation] | None = None) -> Decision:
    """Derive the corrected calibration's policy and weigh it against the running one (:class:`Decision`).

    The new policy comes from :func:`~lightning_adaptiveload.calibration.calibrate.derive_for` (the rule
    every calibration goes through) with ``old_derivation``'s memory budgets (the memory model is the same,
    and training has run with them) and the step budget derived again (``settings.step_budget_s``, else the
    throughput rule). Both policies are simulated on the same corpus under the corrected cost model.

    Args:
        old_cal, old_derivation: what training runs with.
        new_cal: :func:`refit`'s result.
        grids, counts, settings, world_size, balance, seed, oversize, sp_degree, samples: as for
            :func:`~lightning_adaptiveload.calibration.calibrate.calibrate`.
        observed: the observations to report measured/predicted for; ``None``: those ``new_cal`` was
            refitted with (``new_cal.extra["feedback"]``).
    """
    new, old_tps, new_tps, changes = weigh_plans(old_derivation, new_cal, grids, counts, settings,
                                                 world_size=world_size, balance=balance, seed=seed,
                                                 oversize=oversize, sp_degree=sp_degree, samples=samples)
    gain = new_tps / old_tps - 1 if old_tps > 0 else float("inf")
    new_tiers = _tiers(new_cal)

    if observed is None:
        observed = [Observation.from_dict(d) for d in (new_cal.extra.get("feedback") or {}).get("observations", [])]
    obs = tuple(_as_observation(o) for o in observed)
    old_price, new_price = _Pricing(old_cal.cost_model, _tiers(old_cal)), _Pricing(new_cal.cost_model, new_tiers)
    ratio_before = tuple(o.median_seconds / old_price.predict(o.batch_size, o.seq_len, o.mode) for o in obs)
    ratio_after = tuple(o.median_seconds / new_price.predict(o.batch_size, o.seq_len, o.mode) for o in obs)
    return Decision(derivation=new, gain=float(gain), replan=bool(gain >= REPLAN_GAIN and changes),
                    batch_changes=changes, old_tokens_per_s=float(old_tps), new_tokens_per_s=float(new_tps),
                    observed=obs, ratio_before=ratio_before, ratio_after=ratio_after, corrected=new_cal)
