"""Step-latency and memory models fitted from shape benchmarks.

A training step on a DiT costs ``t(B, S)`` seconds for a batch of ``B`` samples of ``S`` tokens each.
Three forms are supported:

- ``"power"``: ``t = a + b·B·S^p`` — the paper's form; it maps one-to-one onto
  :class:`~lightning_adaptiveload.bucketing.policy.DualConstraintPolicy` (``B·S^p ≤ M_comp``; see
  :mod:`lightning_adaptiveload.calibration.derive`, the one place a policy is derived).
- ``"quadratic"``: ``t = a + B·(c1·S + c2·S²)`` — linear layers cost ∝ S, attention ∝ S², so this
  form tracks the switch from projection-bound images to attention-bound videos better.
- ``"saturating"``: ``t = (a^k + w^k)^(1/k)`` with the same work ``w = B·(c1·S + c2·S²)`` — a smooth
  maximum of a latency floor and the work (``k = 1`` is the quadratic form, large ``k`` is
  ``max(a, w)``). A GPU running small batches is latency-bound, not work-bound: the floor is paid
  once, not on top of the work. On three recorded H200 profiles of the full-depth Wan 1.3B (eager,
  compiled, two GPUs) it cuts the held-out median error from 7.4–10.9% (quadratic) to 1.8–2.8%.

``"auto"`` fits all three and keeps the one with the lowest held-out median relative error; the
4-parameter saturating form must beat the better 3-parameter form's error by 20%. Fits minimise
*relative* residuals (``pred/t - 1``) because step times span orders of magnitude: an absolute loss
would fit the long videos and ignore the images. All parameters are kept non-negative.

A model corrected by training's own step times
(:func:`~lightning_adaptiveload.calibration.feedback.refit`) may carry per-length ``corrections``: a factor
on the form's prediction at a sequence length where training measured a step the form cannot follow (one
slow shape among smooth ones). Lengths without one are the form's.

Peak memory is modelled as ``m0 + m1·B·S`` bytes (:class:`MemoryModel`), which gives the token
budget ``M_mem`` for a device.

The tokens attention sees: a model whose attention runs over more tokens than the video's ``S`` (an MMDiT
joins ``L`` text tokens to every sample: ``S + L``) gives both models an ``attention_tokens`` table
``{S: S_attn}`` (the module's ``attention_tokens(seq_len)`` at every length of the corpus and the profile;
:func:`token_table`). Both then fit and predict in ``S_attn`` while every caller keeps asking for video
``S`` (buckets, policies and the sampler are keyed by it): ``predict(B, S)`` is the form at ``B``,
``S_attn(S)``. Lengths between or beyond the table's are interpolated linearly (an affine map such as
``S + L`` is exact everywhere); an empty table is the identity.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import least_squares, nnls

#: A negative per-length offset (:attr:`CostModel.offsets`) lowers a prediction to at most this fraction of
#: the corrected form: below the batch sizes training measured, the offset is extrapolated, and a step time
#: stays positive.
OFFSET_FLOOR = 0.5

FORMS: tuple[str, ...] = ("power", "quadratic", "saturating")
PARAM_NAMES: dict[str, tuple[str, ...]] = {
    "power": ("a", "b", "p"),
    "quadratic": ("a", "c1", "c2"),
    "saturating": ("a", "c1", "c2", "k"),
}
# The smoothness of the saturating form's maximum: 1 is a plain sum (the quadratic form), 8 is
# within 9% of a hard maximum where floor and work are equal.
_K_BOUNDS = (1.0, 8.0)
# "auto" takes the 4-parameter saturating form only if its held-out error is below this fraction of
# the best 3-parameter form's.
_PARSIMONY = 0.8
_JSON_FORMAT = "lightning_adaptiveload.CostModel"
_JSON_VERSION = 1
# The exponent is kept in a physically meaningful range: below 0.5 nothing in a transformer scales,
# above 3 the fit is chasing noise.
_P_BOUNDS = (0.5, 3.0)
# Floor of the per-token cost in normalised units (fraction of the median step time at the longest
# S): timings that do not grow with tokens (noise on a tiny model) then give a valid, nearly flat
# model whose policy is bounded by memory alone, instead of a model that predicts no cost.
_MIN_SLOPE = 1e-9
# Leave-one-out up to this many points, k-fold (deterministic folds) above.
_LOO_MAX_POINTS = 24
# A profiled step longer than a day is a broken clock or a unit error, not a measurement.
_MAX_STEP_SECONDS = 86_400.0
_KFOLD = 8


def token_table(attention_tokens: Any, seq_lens: Any = ()) -> dict[int, int]:
    """``{S: S_attn}`` of a model's ``attention_tokens``: a mapping (taken as is) or a callable evaluated at
    every distinct ``seq_lens``; ``{}`` (the identity) for ``None`` or a map that is the identity there.

    Raises:
        ValueError: a value is not an integer >= its S (attention sees at least the video's tokens).
    """
    if attention_tokens is None:
        return {}
    if isinstance(attention_tokens, dict):
        items = attention_tokens.items()
    else:
        items = ((int(v), attention_tokens(int(v))) for v in np.unique(np.asarray(seq_lens, dtype=np.int64)))
    table = {}
    for k, v in items:
        if isinstance(v, bool) or int(k) < 1 or int(v) != v or int(v) < int(k):
            raise ValueError(f"`attention_tokens({int(k)})` returned {v!r}. Expected an integer >= {int(k)} (the video "
                             "tokens plus any joint text tokens attention sees).")
        table[int(k)] = int(v)
    if all(k == v for k, v in table.items()):
        return {}
    return dict(sorted(table.items()))


def map_tokens(table: dict[int, int], seq_len: Any) -> np.ndarray:
    """``S_attn`` of every ``seq_len`` by ``table`` (:func:`token_table`): exact at its lengths, linear between
    them and beyond them (slope of the nearest two; a one-entry table shifts by its offset); identity if empty."""
    s = np.asarray(seq_len, dtype=np.float64)
    if not table:
        return s
    k = np.array(list(table), dtype=np.float64)
    v = np.array(list(table.values()), dtype=np.float64)
    if len(k) == 1:
        return s + (v[0] - k[0])
    out = np.interp(s, k, v)
    lo, hi = (v[1] - v[0]) / (k[1] - k[0]), (v[-1] - v[-2]) / (k[-1] - k[-2])
    out = np.where(s < k[0], v[0] + (s - k[0]) * lo, out)
    return np.where(s > k[-1], v[-1] + (s - k[-1]) * hi, out)


def _table_from_json(data: Any, what: str) -> dict[int, int]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{what} JSON has attention_tokens={data!r}. Expected an object of S: S_attn.")
    try:
        return token_table({int(k): v for k, v in data.items()})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} JSON has attention_tokens={str(data)[:200]!r}: {err}") from err


def _as_1d(name: str, values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` has shape {arr.shape}. Expected a 1-D sequence of numbers.")
    return arr


def _validate_points(batch_sizes: Any, seq_lens: Any, values: Any, value_name: str) -> tuple[np.ndarray, ...]:
    b = _as_1d("batch_sizes", batch_sizes)
    s = _as_1d("seq_lens", seq_lens)
    v = _as_1d(value_name, values)
    if not (len(b) == len(s) == len(v)):
        raise ValueError(
            f"`batch_sizes`, `seq_lens` and `{value_name}` have lengths {len(b)}, {len(s)}, {len(v)}. "
            "Expected one entry per measured shape in each."
        )
    for name, arr in (("batch_sizes", b), ("seq_lens", s), (value_name, v)):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr <= 0))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"`{name}[{i}]={arr[i]!r}` is not valid ({bad.size} bad entries). Expected finite positive "
                "values; drop failed or infeasible measurements before fitting."
            )
    return b, s, v


def _predict(form: str, theta: np.ndarray, b: np.ndarray, s: np.ndarray) -> np.ndarray:
    if form == "power":
        a, k, p = theta
        return a + k * b * s**p
    if form == "saturating":
        a, c1, c2, k = theta
        work = b * (c1 * s + c2 * s * s)
        # (a^k + w^k)^(1/k) computed as m·((a/m)^k + (w/m)^k)^(1/k), m = max(a, w): no overflow.
        m = np.maximum(np.maximum(a, work), 1e-300)
        return m * ((a / m) ** k + (work / m) ** k) ** (1.0 / k)
    a, c1, c2 = theta
    return a + b * (c1 * s + c2 * s * s)


def _fit_normalised(form: str, b: np.ndarray, s: np.ndarray, t: np.ndarray,
                    start: np.ndarray | None = None) -> np.ndarray:
    """Fits on S / S_ref and t / t_ref (well-conditioned) and returns parameters in those units. ``start``
    (in those units) replaces the power and saturating forms' several starting points with one."""

    def residuals(theta: np.ndarray) -> np.ndarray:
        return _predict(form, theta, b, s) / t - 1.0

    tmin = float(t.min())
    starts: list[np.ndarray] = []
    if form == "power":
        # Log-log regression of (t - a0)/B on S gives p and b for a few guesses of the overhead a0;
        # least_squares then refines the best of them.
        for frac in (0.0, 0.5, 0.9):
            a0 = frac * tmin
            y = np.log(np.maximum(t - a0, 1e-3 * tmin) / b)
            slope, intercept = np.polyfit(np.log(s), y, 1)
            p0 = float(np.clip(slope, *_P_BOUNDS))
            starts.append(np.array([a0, math.exp(intercept), p0]))
        lower, upper = [0.0, _MIN_SLOPE, _P_BOUNDS[0]], [np.inf, np.inf, _P_BOUNDS[1]]
    else:
        # The quadratic form is linear in its parameters: the non-negative least-squares solution of
        # the relative-error system is the optimum; least_squares only polishes it. The saturating
        # form starts from it (k = 1 is the quadratic form) and from sharper maxima of it.
        design = np.stack([np.ones_like(s), b * s, b * s * s], axis=1) / t[:, None]
        theta0, _ = nnls(design, np.ones_like(t))
        lower, upper = [0.0, 0.0, _MIN_SLOPE], [np.inf, np.inf, np.inf]
        if form == "saturating":
            a0 = max(float(theta0[0]), 0.5 * tmin)
            starts += [np.array([a0, theta0[1], theta0[2], k]) for k in (1.5, 3.0, 6.0)]
            lower, upper = [*lower, _K_BOUNDS[0]], [*upper, _K_BOUNDS[1]]
        else:
            starts.append(theta0)
    if start is not None and form != "quadratic":  # the quadratic form's start is its optimum already
        starts = [np.asarray(start, dtype=np.float64).copy()]
    best = None
    for x0 in starts:
        x0 = np.clip(x0, np.array(lower) + 1e-12, np.minimum(np.array(upper), 1e12))
        if form == "power":
            x0[2] = np.clip(x0[2], _P_BOUNDS[0] + 1e-6, _P_BOUNDS[1] - 1e-6)
        if form == "saturating":
            x0[3] = np.clip(x0[3], _K_BOUNDS[0] + 1e-6, _K_BOUNDS[1] - 1e-6)
        res = least_squares(residuals, x0, bounds=(lower, upper), method="trf", x_scale="jac", max_nfev=2000)
        if best is None or res.cost < best.cost:
            best = res
    assert best is not None
    return best.x


def _fit_params(form: str, b: np.ndarray, s: np.ndarray, t: np.ndarray,
                start: dict[str, float] | None = None) -> dict[str, float]:
    s_ref = float(s.max())
    t_ref = float(np.median(t))
    x0 = None
    if start is not None:  # ``start`` in seconds and tokens, as returned below, into this fit's units
        if form == "power":
            x0 = np.array([start["a"] / t_ref, start["b"] * s_ref ** start["p"] / t_ref, start["p"]])
        else:
            x0 = np.array([start["a"] / t_ref, start["c1"] * s_ref / t_ref, start["c2"] * s_ref**2 / t_ref,
                           *([start["k"]] if form == "saturating" else [])])
    theta = _fit_normalised(form, b, s / s_ref, t / t_ref, x0)
    if form == "power":
        a, k, p = theta
        return {"a": a * t_ref, "b": k * t_ref / s_ref**p, "p": float(p)}
    a, c1, c2 = theta[:3]
    params = {"a": a * t_ref, "c1": c1 * t_ref / s_ref, "c2": c2 * t_ref / s_ref**2}
    if form == "saturating":
        params["k"] = float(theta[3])
    return params


def _heldout_median_rel_error(form: str, b: np.ndarray, s: np.ndarray, t: np.ndarray,
                              start: dict[str, float] | None = None) -> float:
    """Median |pred/t - 1| on points left out of the fit; NaN when no fold has enough data. ``start``: the
    fit on all points, from which each fold's fit starts (one start instead of the form's several)."""
    n = len(t)
    folds = np.arange(n) if n <= _LOO_MAX_POINTS else np.arange(n) % _KFOLD
    errors: list[np.ndarray] = []
    for k in np.unique(folds):
        test = folds == k
        train = ~test
        if train.sum() < len(PARAM_NAMES[form]) + 1 or len(np.unique(s[train])) < 2:
            continue
        params = _fit_params(form, b[train], s[train], t[train], start)
        pred = _predict(form, np.array(list(params.values())), b[test], s[test])
        errors.append(np.abs(pred / t[test] - 1.0))
    if not errors:
        return float("nan")
    return float(np.median(np.concatenate(errors)))


def _quality(form: str, params: dict[str, float], b: np.ndarray, s: np.ndarray, t: np.ndarray,
             heldout: bool | str = True) -> dict[str, float]:
    pred = _predict(form, np.array(list(params.values())), b, s)
    rel = np.abs(pred / t - 1.0)
    ss_tot = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - float(((t - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return {
        "r2": r2,
        "median_rel_error": float(np.median(rel)),
        "max_rel_error": float(rel.max()),
        "heldout_median_rel_error": (_heldout_median_rel_error(form, b, s, t, params if heldout == "warm" else None)
                                     if heldout else float("nan")),
        "n_points": float(len(t)),
    }


def _length_table(table: Any, what: str, expected: str, valid: Any) -> dict[int, float]:
    """``{S: value}`` checked (``S`` a positive integer, the value finite and ``valid``) and sorted by ``S``."""
    out = {}
    for k, v in dict(table).items():
        if isinstance(k, bool) or int(k) != float(k) or int(k) < 1 or isinstance(v, bool) or not (
                isinstance(v, (int, float)) and math.isfinite(v) and valid(v)):
            raise ValueError(f"`CostModel` {what} {k!r}: {v!r} is not valid. Expected a sequence length "
                             f"(a positive integer) and {expected}.")
        out[int(k)] = float(v)
    return dict(sorted(out.items()))


def _at_lengths(table: dict[int, float], s: np.ndarray, default: float) -> np.ndarray | float:
    """``table[S]`` where ``s`` is exactly a key, ``default`` elsewhere (broadcast over ``s``)."""
    if not table:
        return default
    keys = np.array(list(table), dtype=np.float64)
    values = np.array(list(table.values()))
    idx = np.minimum(np.searchsorted(keys, s), len(keys) - 1)
    return np.where(keys[idx] == s, values[idx], default)


def _lengths_from_json(data: dict[str, Any], key: str, unit: str) -> dict[int, Any]:
    """``data[key]`` (``{"S": value}``, absent: empty) with integer keys, or a one-line error."""
    table = data.get(key) or {}
    if not isinstance(table, dict):
        raise ValueError(f"CostModel JSON has {key}={table!r}. Expected an object of S: {unit}.")
    try:
        return {int(k): v for k, v in table.items()}
    except ValueError as err:
        raise ValueError(f"CostModel JSON has {key}={table!r}. Expected integer keys.") from err


@dataclass(frozen=True)
class CostModel:
    """A fitted step-latency model ``t(B, S)`` in seconds.

    Args:
        form: ``"power"`` (``a + b·B·S^p``), ``"quadratic"`` (``a + B·(c1·S + c2·S²)``) or
            ``"saturating"`` (``(a^k + (B·(c1·S + c2·S²))^k)^(1/k)``).
        params: The parameters of that form (names in :data:`PARAM_NAMES`), non-negative.
        quality: Fit-quality metrics: ``r2``, ``median_rel_error``, ``max_rel_error``,
            ``heldout_median_rel_error`` (leave-one-out, or 8-fold above 24 points), ``n_points``, and
            for ``"auto"`` fits the held-out error of every form tried (``heldout_<form>``).
        corrections: ``{S: factor}``: the prediction at exactly sequence length ``S`` is the form's times
            ``factor`` (measured in training; see the module docstring). Empty for a profiled model.
        offsets: ``{S: seconds}``: added to the corrected prediction at exactly ``S``: where training measured
            a length at two or more batch sizes, its correction is ``factor·form + offset``. A positive offset
            is a fixed cost a small batch of that length pays that the form's one floor does not hold; a
            negative one, a floor the form holds too high there (a small batch faster than the form says). The
            prediction never goes below half of ``factor·form`` (:data:`OFFSET_FLOOR`), so a batch smaller
            than the measured ones keeps a positive time.
        attention_tokens: ``{S: S_attn}``: the form is in the tokens attention sees (see the module
            docstring; :func:`token_table`); empty: ``S`` itself.

    Raises:
        ValueError: If the form is unknown or the parameters are missing, negative or not finite.

    Example::

        cm = CostModel.fit([1, 2, 4, 1, 2], [1560, 1560, 1560, 32760, 32760], times)
        cm.predict(2, 8190)          # seconds
    """

    form: str
    params: dict[str, float]
    quality: dict[str, float] = field(default_factory=dict)
    corrections: dict[int, float] = field(default_factory=dict)
    attention_tokens: dict[int, int] = field(default_factory=dict)
    offsets: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention_tokens", token_table(dict(self.attention_tokens)))
        if self.form not in FORMS:
            raise ValueError(f"`CostModel(form={self.form!r})` is not valid. Expected one of {FORMS}.")
        names = PARAM_NAMES[self.form]
        if set(self.params) != set(names):
            raise ValueError(
                f"`CostModel(form={self.form!r}, params={self.params!r})` is not valid. "
                f"Expected exactly the parameters {names}."
            )
        for k in names:
            v = self.params[k]
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(
                    f"`CostModel` parameter {k}={v!r} is not valid. Expected a finite non-negative number."
                )
        slope = (self.params["b"],) if self.form == "power" else (self.params["c1"], self.params["c2"])
        if self.form == "saturating" and not _K_BOUNDS[0] <= self.params["k"] <= _K_BOUNDS[1]:
            raise ValueError(
                f"`CostModel` parameter k={self.params['k']!r} is not valid. Expected a number in {list(_K_BOUNDS)}."
            )
        if all(v == 0 for v in slope):
            raise ValueError(
                f"`CostModel(form={self.form!r}, params={self.params!r})` predicts a step time that does not "
                "grow with the batch; expected a positive per-token cost."
            )
        # Normalise order and types so equality and JSON are stable.
        object.__setattr__(self, "params", {k: float(self.params[k]) for k in names})
        object.__setattr__(self, "corrections", _length_table(self.corrections, "correction", "a positive finite factor",
                                                              lambda v: v > 0))
        object.__setattr__(self, "offsets", _length_table(self.offsets, "offset", "a finite number of seconds",
                                                          lambda v: True))

    @classmethod
    def fit(cls, batch_sizes: Any, seq_lens: Any, times: Any, form: str = "auto",
            attention_tokens: Any = None, heldout: bool | str = True) -> CostModel:
        """Fits the model to measured step times.

        Args:
            batch_sizes: Batch size ``B`` of each measurement.
            seq_lens: Tokens per sample ``S`` of each measurement (video tokens).
            times: Step time in seconds of each measurement (finite, > 0).
            form: ``"power"``, ``"quadratic"``, ``"saturating"`` or ``"auto"`` (lowest held-out median relative error;
                falls back to the lowest in-sample error, with a warning, when there are too few points
                to hold any out).
            attention_tokens: ``{S: S_attn}`` or a callable ``S -> S_attn`` (:func:`token_table`): the form is
                fitted in the tokens attention sees; ``None``: in ``S``.
            heldout: compute ``quality["heldout_median_rel_error"]`` (one refit per fold, most of the cost
                of a fit); ``False`` leaves it NaN, for intermediate fits of a fixed ``form`` whose held-out
                error nobody reads. ``form="auto"`` chooses by it and always computes it. ``"warm"``: each
                held-out fit starts from the fit on all points instead of the form's several starting points
                (about a third of the cost for the power and saturating forms; the closed loop's refit, which
                runs beside training).

        Raises:
            ValueError: On mismatched lengths, non-finite or non-positive entries, fewer than 4 points,
                or fewer than 2 distinct sequence lengths (the S-dependence is then not identifiable).
        """
        if form not in (*FORMS, "auto"):
            raise ValueError(f"`CostModel.fit(form={form!r})` is not valid. Expected one of {(*FORMS, 'auto')}.")
        b, s, t = _validate_points(batch_sizes, seq_lens, times, "times")
        table = token_table(attention_tokens, s)
        s_video, s = s, map_tokens(table, s)
        absurd = np.flatnonzero(t > _MAX_STEP_SECONDS)
        if absurd.size:
            i = int(absurd[0])
            raise ValueError(
                f"`times[{i}]={float(t[i])!r}` s (B={b[i]:g}, S={s_video[i]:g}) is not a plausible step time (above "
                f"{_MAX_STEP_SECONDS:g} s). Times are seconds per step; re-profile or drop that measurement."
            )
        n_params = 3
        if len(t) < n_params + 1:
            raise ValueError(
                f"`CostModel.fit` got {len(t)} measurements; a 3-parameter form needs at least {n_params + 1} "
                "(one more than its parameters, so the fit is not exact by construction). Profile more shapes."
            )
        if form == "saturating" and len(t) < len(PARAM_NAMES["saturating"]) + 1:
            raise ValueError(
                f"`CostModel.fit(form='saturating')` got {len(t)} measurements; its 4 parameters need at least 5. "
                "Profile more shapes, or use form='quadratic'."
            )
        if len(np.unique(s)) < 2:
            raise ValueError(
                f"`CostModel.fit` got a single sequence length S={s[0]:g}; the dependence on S cannot be "
                "fitted. Profile at least two distinct sequence lengths (three or more recommended)."
            )
        # "auto" tries a form only with more points than parameters (the saturating form needs 5).
        forms = tuple(f for f in FORMS if len(t) > len(PARAM_NAMES[f])) if form == "auto" else (form,)
        fits = {f: _fit_params(f, b, s, t) for f in forms}
        quals = {f: _quality(f, fits[f], b, s, t, heldout=True if form == "auto" else heldout) for f in forms}
        if form == "auto":
            held = {f: quals[f]["heldout_median_rel_error"] for f in forms}
            if all(math.isfinite(v) for v in held.values()):
                # Parsimony: a form with more parameters must predict held-out shapes clearly better
                # (by _PARSIMONY) than the best form with fewer, or noise would pick the superset.
                simple = [f for f in forms if len(PARAM_NAMES[f]) == 3]
                chosen = min(simple, key=lambda f: held[f])
                for f in forms:
                    if len(PARAM_NAMES[f]) > 3 and held[f] < _PARSIMONY * held[chosen]:
                        chosen = f
            else:
                chosen = min(forms, key=lambda f: quals[f]["median_rel_error"])
                warnings.warn(
                    f"`CostModel.fit(form='auto')` had too few points ({len(t)}) for a held-out comparison; "
                    f"chose {chosen!r} by in-sample error. Profile more shapes for a reliable choice.",
                    stacklevel=2,
                )
            quality = dict(quals[chosen])
            quality.update({f"heldout_{f}": held[f] for f in forms})
        else:
            chosen = form
            quality = quals[form]
        return cls(chosen, fits[chosen], quality, attention_tokens=table)

    def predict(self, batch_size: Any, seq_len: Any) -> np.ndarray | float:
        """Predicted step time in seconds of ``batch_size`` samples of ``seq_len`` video tokens (the form at
        their attention tokens); broadcasts over numpy arrays, returns a float for scalars."""
        b = np.asarray(batch_size, dtype=np.float64)
        s = np.asarray(seq_len, dtype=np.float64)
        out = _predict(self.form, np.array(list(self.params.values())), b, map_tokens(self.attention_tokens, s))
        out = out * _at_lengths(self.corrections, s, 1.0)
        if self.offsets:
            out = np.maximum(out + _at_lengths(self.offsets, s, 0.0), OFFSET_FLOOR * out)
        return float(out) if out.ndim == 0 else out

    def scaled(self, factor: float) -> CostModel:
        """This model with every step time multiplied by ``factor`` (e.g. the recomputation of an
        activation-checkpointing mode): the floor and the work coefficients scale, ``p`` and ``k`` stay
        (every form is homogeneous of degree 1 in them)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"`CostModel.scaled(factor={factor!r})` is not valid. Expected a positive finite number.")
        fixed = {"p", "k"}
        params = {k: v if k in fixed else v * float(factor) for k, v in self.params.items()}
        return CostModel(self.form, params, dict(self.quality), dict(self.corrections), dict(self.attention_tokens),
                         {k: v * float(factor) for k, v in self.offsets.items()})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`to_json`)."""
        return {
            "format": _JSON_FORMAT,
            "version": _JSON_VERSION,
            "form": self.form,
            "params": dict(self.params),
            "quality": {k: (v if math.isfinite(v) else None) for k, v in self.quality.items()},
            **({"corrections": {str(k): v for k, v in self.corrections.items()}} if self.corrections else {}),
            **({"attention_tokens": {str(k): v for k, v in self.attention_tokens.items()}}
               if self.attention_tokens else {}),
            **({"offsets": {str(k): v for k, v in self.offsets.items()}} if self.offsets else {}),
        }

    def to_json(self) -> str:
        """Serialises to JSON (never pickle: calibrations are shared between machines)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        """Inverse of :meth:`to_dict`; validates format, version, form and parameters."""
        if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT:
            raise ValueError(
                f"Not a serialised CostModel: expected a JSON object with format={_JSON_FORMAT!r}, got "
                f"{str(data)[:200]!r}."
            )
        if data.get("version") != _JSON_VERSION:
            raise ValueError(
                f"CostModel JSON version {data.get('version')!r} is not supported (this build reads version "
                f"{_JSON_VERSION}); re-run the shape benchmark."
            )
        params = data.get("params")
        if not isinstance(params, dict):
            raise ValueError(f"CostModel JSON has params={params!r}. Expected an object of numbers.")
        quality = data.get("quality") or {}
        if not isinstance(quality, dict):
            raise ValueError(f"CostModel JSON has quality={quality!r}. Expected an object of numbers.")
        quality = {k: float("nan") if v is None else float(v) for k, v in quality.items()}
        # absent: a profiled model, or a record before corrections (offsets: before that field)
        corrections = _lengths_from_json(data, "corrections", "factor")
        offsets = _lengths_from_json(data, "offsets", "seconds")
        # absent: attention sees the video tokens (every record before the field)
        return cls(data.get("form"), params, quality, corrections,
                   _table_from_json(data.get("attention_tokens"), "CostModel"), offsets)

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: If ``text`` is not valid JSON or not a supported CostModel record.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"CostModel JSON could not be parsed: {err}.") from err
        return cls.from_dict(data)

    def __str__(self) -> str:
        if self.form == "power":
            p = self.params
            expr = f"t = {p['a'] * 1e3:.3g} ms + {p['b']:.4g}·B·S^{p['p']:.3f} s"
        elif self.form == "saturating":
            p = self.params
            expr = (f"t = ({p['a'] * 1e3:.3g} ms^k + (B·({p['c1']:.4g}·S + {p['c2']:.4g}·S²) s)^k)^(1/k), "
                    f"k = {p['k']:.2f}")
        else:
            p = self.params
            expr = f"t = {p['a'] * 1e3:.3g} ms + B·({p['c1']:.4g}·S + {p['c2']:.4g}·S²) s"
        held = self.quality.get("heldout_median_rel_error", float("nan"))
        fixes = ""
        if self.corrections:
            fixes = ", measured in training at " + ", ".join(
                f"S={k:,} x{v:.2f}" + (f" {self.offsets[k] * 1e3:+.3g} ms" if self.offsets.get(k) else "")
                for k, v in self.corrections.items())
        attn = ""
        if self.attention_tokens:
            (s0, a0), (s1, a1) = next(iter(self.attention_tokens.items())), list(self.attention_tokens.items())[-1]
            attn = f", S = attention tokens ({s0:,} -> {a0:,} .. {s1:,} -> {a1:,})"
        return f"CostModel[{self.form}]: {expr} (held-out median rel. error {held:.1%}{fixes}{attn})"


@dataclass(frozen=True)
class MemoryModel:
    """Peak training-step memory ``m0 + m1·B·S + m2·B`` bytes.

    Args:
        m0: Fixed bytes (weights, gradients, optimizer state, workspace).
        m1: Bytes per token of the batch (activations).
        m2: Bytes per sample whatever its length (e.g. the text context and its cross-attention keys and
            values); 0 when the profile cannot separate it from the per-token memory.
        attention_tokens: ``{S: S_attn}``: ``S`` in the formula is the tokens attention sees (module
            docstring); empty: the video tokens.
    """

    m0: float
    m1: float
    m2: float = 0.0
    attention_tokens: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention_tokens", token_table(dict(self.attention_tokens)))
        for name, v in (("m0", self.m0), ("m1", self.m1), ("m2", self.m2)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"`MemoryModel({name}={v!r})` is not valid. Expected a finite non-negative number.")
        if self.m1 == 0:
            raise ValueError("`MemoryModel(m1=0)` is not valid: peak memory must grow with the number of tokens.")

    @classmethod
    def fit(cls, batch_sizes: Any, seq_lens: Any, peak_bytes: Any, attention_tokens: Any = None) -> MemoryModel:
        """Non-negative least squares of peak bytes on tokens ``B·S`` and samples ``B`` (``S`` in attention
        tokens with ``attention_tokens``, :func:`token_table`).

        The per-sample term is fitted only when the points separate it: some sequence length profiled at two
        batch sizes (otherwise ``B`` is a mix of the other two columns on the profiled points), and it stays 0
        unless it lowers the residual.

        Raises:
            ValueError: On bad inputs, fewer than two distinct token counts, or a peak that does not grow
                with tokens.
        """
        b, s, m = _validate_points(batch_sizes, seq_lens, peak_bytes, "peak_bytes")
        table = token_table(attention_tokens, s)
        s = map_tokens(table, s)
        tokens = b * s
        if len(np.unique(tokens)) < 2:
            raise ValueError(
                "`MemoryModel.fit` needs at least two distinct token counts B·S to separate the fixed and "
                f"per-token memory; got only {np.unique(tokens).tolist()}."
            )
        scale = float(m.max())
        y = m / scale
        two = np.stack([np.ones_like(tokens), tokens / tokens.max()], axis=1)
        (m0, m1n), rss2 = nnls(two, y)
        m2n = 0.0
        if any(len(np.unique(b[s == v])) > 1 for v in np.unique(s)):
            (c0, c1, c2), rss3 = nnls(np.column_stack([two, b / b.max()]), y)
            # Kept only when it explains a systematic part of the residual, not the noise an extra
            # column always absorbs (nnls returns residual norms).
            if rss2 - rss3 > 1e-6 * float(np.linalg.norm(y)) and rss3 < 0.5 * rss2:
                m0, m1n, m2n = c0, c1, c2
        if m1n <= 0:
            raise ValueError(
                "`MemoryModel.fit`: measured peak memory does not grow with B·S "
                f"(peaks {m.tolist()}); cannot derive a token budget from it. Pass `m_mem` explicitly."
            )
        return cls(float(m0 * scale), float(m1n * scale / tokens.max()), float(m2n * scale / b.max()), table)

    def predict(self, batch_size: Any, seq_len: Any) -> np.ndarray | float:
        """Predicted peak bytes of ``batch_size`` samples of ``seq_len`` video tokens; broadcasts over numpy arrays."""
        b = np.asarray(batch_size, dtype=np.float64)
        out = self.m0 + self.m1 * b * map_tokens(self.attention_tokens, seq_len) + self.m2 * b
        return float(out) if np.ndim(out) == 0 else out

    def max_batch_size(self, seq_len: int, device_memory: float, margin: float = 0.1) -> int:
        """Largest ``B`` whose predicted peak at ``seq_len`` leaves ``margin`` of ``device_memory`` free (0: none)."""
        if not 0 <= margin < 1:
            raise ValueError(f"`margin={margin!r}` is not valid. Expected a fraction in [0, 1).")
        free = device_memory * (1.0 - margin) - self.m0
        return max(0, math.floor(free / (self.m1 * float(map_tokens(self.attention_tokens, seq_len)) + self.m2)))

    def max_tokens(self, device_memory: float, margin: float = 0.1, oom_tokens: Any = None,
                   min_seq_len: int | None = None) -> int:
        """Token budget ``M_mem = floor((device_memory·(1 - margin) - m0) / (m1 + m2 / S_min))``.

        With the per-sample term, a batch of ``M_mem`` tokens holds the most samples at the shortest
        sequence length ``S_min``, so the budget is set there and holds for every longer one. With an
        ``attention_tokens`` table the budget stays in video tokens ``B·S`` (what policies bound) and is set
        at the length of the table (``>= S_min``) with the most bytes per video token.

        Args:
            device_memory: Usable bytes of the device.
            margin: Fraction held back for fragmentation and allocator slack, in ``[0, 1)``.
            oom_tokens: Token counts ``B·S`` that ran out of memory while profiling; the budget is kept
                below the smallest of them.
            min_seq_len: The shortest sequence length that will be batched; required when ``m2 > 0``.

        Raises:
            ValueError: If the margin is out of range, ``min_seq_len`` is missing, or no token fits.
        """
        if not 0 <= margin < 1:
            raise ValueError(f"`margin={margin!r}` is not valid. Expected a fraction in [0, 1).")
        per_token = self.m1
        if self.m2 > 0 or self.attention_tokens:
            if min_seq_len is None or min_seq_len < 1:
                raise ValueError(f"`max_tokens(min_seq_len={min_seq_len!r})`: this model has per-sample memory "
                                 f"(m2={self.m2:.0f} B, or joint tokens); pass the shortest sequence length (>= 1).")
            lengths = np.array([min_seq_len, *(k for k in self.attention_tokens if k >= min_seq_len)], np.float64)
            per_token = float(np.max((self.m1 * map_tokens(self.attention_tokens, lengths) + self.m2) / lengths))
        budget = math.floor((device_memory * (1.0 - margin) - self.m0) / per_token)
        if oom_tokens is not None and len(oom_tokens):
            budget = min(budget, int(min(oom_tokens)) - 1)
        if budget < 1:
            raise ValueError(
                f"No token fits: fixed memory {self.m0 / 2**30:.2f} GiB and {self.m1:.0f} B/token against "
                f"{device_memory / 2**30:.2f} GiB with margin {margin}. Shard the model (FSDP) or lower the margin."
            )
        return int(budget)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out: dict[str, Any] = {"m0": self.m0, "m1": self.m1, "m2": self.m2}
        if self.attention_tokens:
            out["attention_tokens"] = {str(k): v for k, v in self.attention_tokens.items()}
        return out

    @classmethod
    def from_dict(cls, data: Any) -> MemoryModel:
        """Inverse of :meth:`to_dict`."""
        if not isinstance(data, dict) or not {"m0", "m1"} <= set(data):
            raise ValueError(f"Not a serialised MemoryModel: {str(data)[:200]!r}. Expected keys m0 and m1.")
        return cls(float(data["m0"]), float(data["m1"]), float(data.get("m2", 0.0)),  # no m2: older records
                   _table_from_json(data.get("attention_tokens"), "MemoryModel"))
