"""Load-imbalance metrics as the AdaptiveLoad paper defines them (numpy only, imports nothing of the package).

Per synchronous training step over the ranks of a job:

- compute imbalance rate = coefficient of variation (population std / mean) of per-rank compute load;
- synchronisation overhead = coefficient of variation of per-rank step time;
- bubble fraction = ``1 - mean / max`` of per-rank step time: the share of rank-time spent waiting
  for the slowest rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _cv(x: Any) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=-1)
    std = x.std(axis=-1)
    return np.divide(std, mean, out=np.zeros_like(mean), where=mean > 0)


def compute_imbalance_rate(loads: Any) -> np.ndarray | float:
    """CV of per-rank compute load in a step; ``loads`` is ``[ranks]`` or ``[steps, ranks]``."""
    out = _cv(loads)
    return float(out) if out.ndim == 0 else out


def sync_overhead(step_times: Any) -> np.ndarray | float:
    """CV of per-rank step time in a step; ``step_times`` is ``[ranks]`` or ``[steps, ranks]``."""
    out = _cv(step_times)
    return float(out) if out.ndim == 0 else out


def bubble_fraction(step_times: Any) -> np.ndarray | float:
    """``1 - mean / max`` of per-rank step time; ``[ranks]`` or ``[steps, ranks]``."""
    t = np.asarray(step_times, dtype=np.float64)
    mx = t.max(axis=-1)
    out = 1.0 - np.divide(t.mean(axis=-1), mx, out=np.ones_like(mx), where=mx > 0)
    return float(out) if out.ndim == 0 else out


def summarize_step_loads(loads: Any) -> dict[str, float]:
    """Aggregate per-step metrics of ``loads[steps, ranks]``.

    Returns ``compute_cv`` (mean over steps of the per-step CV), ``max_compute_cv`` and ``bubble``
    (``1 - sum_s mean_s / sum_s max_s``: the fraction of all rank-time spent waiting).
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.size == 0:
        return {"compute_cv": 0.0, "max_compute_cv": 0.0, "bubble": 0.0}
    cv = _cv(loads)
    total_max = float(loads.max(axis=1).sum())
    bubble = 1.0 - float(loads.mean(axis=1).sum()) / total_max if total_max > 0 else 0.0
    return {"compute_cv": float(cv.mean()), "max_compute_cv": float(cv.max()), "bubble": bubble}
