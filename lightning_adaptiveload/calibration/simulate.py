"""Load-imbalance metrics (as the AdaptiveLoad paper defines them) and a cluster simulator.

Metrics, per synchronous training step over the ranks of the job:

- compute imbalance rate = coefficient of variation (population std / mean) of per-rank compute load;
- synchronisation overhead = coefficient of variation of per-rank step time;
- bubble fraction = ``1 - mean / max`` of per-rank step time: the share of rank-time spent waiting
  for the slowest rank.

The simulator plans an epoch with :class:`~lightning_adaptiveload.bucketing.sampler.AdaptiveBucketBatchSampler`
exactly as training would, predicts every rank's time for every step with a cost model, and reports
those metrics and the predicted throughput (a step lasts as long as its slowest rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.bucketing.policy import (
    BatchSizePolicy,
    CostPredictor,
    DualConstraintPolicy,
    EqualTokenPolicy,
)
from lightning_adaptiveload.bucketing.shapes import PATCH_SIZE, VAE_STRIDE, pixel_token_grids

# An H200-like full-model step-time model for a Wan 2.1 1.3B-like DiT, t = a + B·(c1·S + c2·S²)
# seconds. Derived from one block measured at B·S = 65,520 tokens (~24 ms for 42 images of
# S = 1,560; ~125 ms for 2 clips of S = 32,760), times 30 blocks, plus 10 ms per step of fixed
# overhead. Illustrative: fit your own with the shape benchmark for real planning.
DEFAULT_COST_PARAMS: dict[str, float] = {"a": 0.01, "c1": 8.68e-6, "c2": 1.482e-9}


def default_cost_model() -> CostPredictor:
    """The documented H200-like quadratic model (:data:`DEFAULT_COST_PARAMS`) as a ``CostModel``."""
    from lightning_adaptiveload.costmodel import CostModel

    return CostModel(form="quadratic", params=dict(DEFAULT_COST_PARAMS))


def _cv(x: np.ndarray) -> np.ndarray:
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


def summarize_step_loads(loads: np.ndarray) -> dict[str, float]:
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


@dataclass
class SimulationResult:
    """Predicted behaviour of one epoch plan on a cluster.

    ``step_times[s, r]`` is rank r's predicted time for step s (seconds with a cost model, else
    units of ``B·S^p``); a step lasts ``step_times[s].max()``.
    """

    name: str
    world_size: int
    balance: str
    policy: str
    step_times: np.ndarray = field(repr=False)
    compute_cv: float
    bubble: float
    num_steps: int
    tokens: int
    samples: int
    epoch_time: float
    padded_samples: int
    dropped_samples: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.epoch_time if self.epoch_time > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.epoch_time if self.epoch_time > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "world_size": self.world_size, "balance": self.balance,
                "policy": self.policy, "compute_cv": self.compute_cv, "bubble": self.bubble,
                "num_steps": self.num_steps, "tokens": self.tokens, "samples": self.samples,
                "epoch_time": self.epoch_time, "tokens_per_s": self.tokens_per_s,
                "samples_per_s": self.samples_per_s, "padded_samples": self.padded_samples,
                "dropped_samples": self.dropped_samples}


def simulate(
    shapes: np.ndarray | Sequence[Sequence[int]],
    policy: BatchSizePolicy,
    world_size: int,
    *,
    cost_model: CostPredictor | None = None,
    balance: str = "cost",
    seed: int = 0,
    drop_last: bool = False,
    name: str | None = None,
) -> SimulationResult:
    """Plan one epoch of ``shapes`` on ``world_size`` ranks and predict per-step, per-rank times.

    Args:
        shapes: token grids ``[N, 3]``.
        policy: batch-size policy.
        world_size: number of ranks.
        cost_model: ``predict(B, S)`` in seconds, used both to balance (``balance="cost"``) and to
            predict times; ``None``: ``B·S^p`` with the policy's exponent (relative units).
        balance: ``"cost"`` or ``"none"`` (see the sampler).
        seed: plan seed.
        drop_last: as in the sampler.
        name: label for reports.
    """
    from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler

    sampler = AdaptiveBucketBatchSampler(shapes, policy, num_replicas=world_size, rank=0, seed=seed,
                                         drop_last=drop_last, balance=balance, cost_model=cost_model)
    plan = sampler._active_plan()
    times = plan.batch_cost[plan.steps]
    summary = summarize_step_loads(times)
    # Tokens and samples of distinct batches: padded repeats cost time but add no new data.
    used = np.unique(plan.steps)
    seq = sampler.bucket_seq_lens[plan.batch_bucket[used]]
    samples = int(plan.batch_len[used].sum())
    return SimulationResult(
        name=name or f"{type(policy).__name__}/{balance}", world_size=int(world_size), balance=balance,
        policy=repr(policy), step_times=times, compute_cv=summary["compute_cv"], bubble=summary["bubble"],
        num_steps=plan.num_steps, tokens=int((plan.batch_len[used] * seq).sum()), samples=samples,
        epoch_time=float(times.max(axis=1).sum()) if plan.num_steps else 0.0,
        padded_samples=plan.padded_samples, dropped_samples=plan.dropped_samples,
    )


def mixture_token_grids(
    mixture: Sequence[dict[str, Any]],
    num_samples: int,
    vae_stride: Sequence[int] = VAE_STRIDE,
    patch_size: Sequence[int] = PATCH_SIZE,
) -> np.ndarray:
    """Token grids ``[num_samples, 3]`` in the proportions of a pixel-shape mixture.

    Counts are allotted by largest remainder so they sum exactly to ``num_samples``; order does not
    matter to the sampler (it shuffles).

    Raises:
        ValueError: an entry without ``num_frames``/``height``/``width`` or with a non-positive weight.
    """
    if not mixture:
        raise ValueError("`mixture` is empty. Expected a list of {num_frames, height, width, weight}.")
    for i, m in enumerate(mixture):
        missing = [k for k in ("num_frames", "height", "width") if k not in m]
        if missing or not float(m.get("weight", 1.0)) > 0:
            raise ValueError(
                f"mixture entry {i} ({m!r}) is not valid. Expected keys num_frames, height, width and a "
                "positive weight."
            )
    w = np.array([float(m.get("weight", 1.0)) for m in mixture])
    share = w / w.sum() * num_samples
    counts = np.floor(share).astype(np.int64)
    counts[np.argsort(-(share - counts), kind="stable")[: num_samples - int(counts.sum())]] += 1
    grids = pixel_token_grids(np.array([m["num_frames"] for m in mixture]),
                              np.array([m["height"] for m in mixture]),
                              np.array([m["width"] for m in mixture]), vae_stride, patch_size)
    return np.repeat(grids, counts, axis=0)


def fitted_dual_constraint(shapes: np.ndarray, cost_model: CostPredictor, m_mem: int) -> DualConstraintPolicy:
    """The paper's policy for a corpus, derived from a cost model the way the shape benchmark does.

    A power law ``a + b·B·S^p`` is fitted to ``cost_model``'s predictions on the corpus's sequence
    lengths (B = 1 up to the memory limit), and the step budget is the predicted time of one sample
    of the longest S, so the longest samples run at B = 1 and every bucket is capped at that time.
    """
    from lightning_adaptiveload.costmodel import CostModel

    seq = np.unique(np.asarray(shapes, dtype=np.int64).prod(axis=1))
    b_grid, s_grid = [], []
    for s_len in seq:
        top = max(1, m_mem // int(s_len))
        bs = np.unique(np.geomspace(1, top, num=min(top, 6)).round().astype(np.int64))
        b_grid += bs.tolist()
        s_grid += [int(s_len)] * len(bs)
    b_arr, s_arr = np.asarray(b_grid), np.asarray(s_grid)
    power = CostModel.fit(b_arr, s_arr, np.asarray(cost_model.predict(b_arr, s_arr), dtype=float), form="power")
    return power.policy(m_mem, float(power.predict(1, int(seq.max()))))


def compare_policies(
    shapes: np.ndarray,
    world_sizes: Sequence[int],
    *,
    m_mem: int | None = None,
    m_comp: float | None = None,
    p: float = 2.0,
    cost_model: CostPredictor | None = None,
    seed: int = 0,
) -> list[SimulationResult]:
    """Equal-token vs dual-constraint (balance ``"none"``) vs dual-constraint + ``balance="cost"``.

    Equal-token uses ``max_tokens = m_mem``; ``m_mem`` defaults to ``max(65,520, longest S)``
    (Wan 2.1 1.3B on an H200); ``cost_model`` defaults to :func:`default_cost_model` (H200-like).
    Without ``m_comp`` the dual constraint comes from :func:`fitted_dual_constraint` (``p`` is then
    fitted too); with it, ``DualConstraintPolicy(m_mem, m_comp, p)``. Samples longer than ``m_mem``
    are left out of all three configurations so they plan the same data.
    """
    shapes = np.asarray(shapes, dtype=np.int64)
    seq = shapes.prod(axis=1)
    m_mem = max(65_520, int(seq.max())) if m_mem is None else int(m_mem)
    shapes = shapes[seq <= m_mem]
    if len(shapes) == 0:
        raise ValueError(f"Every sample is longer than `m_mem={m_mem}` tokens; raise `m_mem`.")
    cm = cost_model if cost_model is not None else default_cost_model()
    if m_comp is None:
        dual = fitted_dual_constraint(shapes, cm, m_mem)
    else:
        dual = DualConstraintPolicy(m_mem, m_comp, p, oversize="skip")
    configs = [
        ("equal-token", EqualTokenPolicy(m_mem), "none"),
        ("dual-constraint", dual, "none"),
        ("dual-constraint + balance", dual, "cost"),
    ]
    results = []
    for w in world_sizes:
        for name, policy, balance in configs:
            results.append(simulate(shapes, policy, int(w), cost_model=cm, balance=balance, seed=seed, name=name))
    return results
