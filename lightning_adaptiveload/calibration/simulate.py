"""Predict an epoch on a cluster: plan it with the sampler exactly as training would, time every
rank's batch of every step with a cost model, and report the paper's imbalance metrics and the
predicted throughput (a step lasts as long as its slowest rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.bucketing.metrics import summarize_step_loads
from lightning_adaptiveload.bucketing.policy import BatchSizePolicy, CostPredictor, EqualTokenPolicy
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler
from lightning_adaptiveload.bucketing.sequence_parallel import SequenceParallelConfig
from lightning_adaptiveload.calibration.costmodel import CostModel
from lightning_adaptiveload.calibration.sequence_parallel import SequenceParallelCostModel, UlyssesCommModel
from lightning_adaptiveload.geometry import PATCH_SIZE, VAE_STRIDE, pixel_token_grids

# An H200-like full-model step-time model for a Wan 2.1 1.3B-like DiT, t = a + B·(c1·S + c2·S²)
# seconds. Derived from one block measured at B·S = 65,520 tokens (~24 ms for 42 images of
# S = 1,560; ~125 ms for 2 clips of S = 32,760), times 30 blocks, plus 10 ms per step of fixed
# overhead. Illustrative: fit your own with the shape benchmark for real planning.
DEFAULT_COST_PARAMS: dict[str, float] = {"a": 0.01, "c1": 8.68e-6, "c2": 1.482e-9}


def default_cost_model() -> CostModel:
    """The documented H200-like quadratic model (:data:`DEFAULT_COST_PARAMS`) as a ``CostModel``."""
    return CostModel(form="quadratic", params=dict(DEFAULT_COST_PARAMS))


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
    #: Samples left out as oversize (above one GPU's budget, and above every SP group's with SP).
    skipped_samples: int = 0
    #: ``(S, B, k)`` of every bucket planned on an SP group (k > 1); empty without SP.
    sp_buckets: list[tuple[int, int, int]] = field(default_factory=list)

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
                "dropped_samples": self.dropped_samples, "skipped_samples": self.skipped_samples,
                "sp_buckets": [list(b) for b in self.sp_buckets]}


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
    sequence_parallel: SequenceParallelConfig | None = None,
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
        sequence_parallel: SP degrees the planner may give the longest buckets (``None``: data
            parallel only). An SP batch's time is ``cost_model.predict_sp`` (e.g. a
            :class:`~lightning_adaptiveload.calibration.sequence_parallel.SequenceParallelCostModel`),
            counted on each of its k ranks; its tokens count once.
    """
    sim = CorpusSimulator(shapes, world_size, balance=balance, seed=seed, drop_last=drop_last,
                          sequence_parallel=sequence_parallel)
    return sim(policy, cost_model=cost_model, name=name)


class CorpusSimulator:
    """:func:`simulate` for many policies on one corpus: the samples are indexed into buckets once (at 10^6
    samples that is ~40% of a simulated epoch; :func:`~lightning_adaptiveload.calibration.derive.derive_policy`
    simulates ~25 step budgets, and the closed loop derives again at every check). Each call gives exactly
    what :func:`simulate` gives for the same arguments."""

    def __init__(self, shapes: np.ndarray | Sequence[Sequence[int]], world_size: int, *, balance: str = "cost",
                 seed: int = 0, drop_last: bool = False,
                 sequence_parallel: SequenceParallelConfig | None = None) -> None:
        self._shapes: np.ndarray | Sequence[Sequence[int]] | None = shapes
        self._settings = {"num_replicas": world_size, "rank": 0, "seed": seed, "drop_last": drop_last,
                          "balance": balance, "sequence_parallel": sequence_parallel}
        self._sampler: AdaptiveBucketBatchSampler | None = None

    def __call__(self, policy: BatchSizePolicy, *, cost_model: CostPredictor | None = None,
                 name: str | None = None) -> SimulationResult:
        if self._sampler is None:
            self._sampler = AdaptiveBucketBatchSampler(self._shapes, policy, cost_model=cost_model, **self._settings)
            self._shapes = None  # the sampler holds the bucket of every sample
        else:  # as a new sampler would: the given cost model, else the policy's own, else none
            self._sampler.set_cost_model(None)
            self._sampler.set_policy(policy, cost_model)
        sampler, world_size, balance = self._sampler, self._settings["num_replicas"], self._settings["balance"]
        plan = sampler.plan()
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
            skipped_samples=sampler.skipped_oversize,
            sp_buckets=sorted((int(s), int(b), int(k)) for s, b, k in
                              zip(sampler.bucket_seq_lens, sampler.bucket_batch_sizes, sampler.bucket_degrees,
                                  strict=True) if k > 1),
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


def compare_policies(
    shapes: np.ndarray,
    world_sizes: Sequence[int],
    *,
    dual: BatchSizePolicy,
    m_mem: int | None = None,
    cost_model: CostPredictor | None = None,
    seed: int = 0,
    sequence_parallel: SequenceParallelConfig | None = None,
    sp_comm: UlyssesCommModel | None = None,
) -> list[SimulationResult]:
    """Equal-token vs dual-constraint (balance ``"none"``) vs dual-constraint + ``balance="cost"``,
    and with ``sequence_parallel`` a fourth row, ``dual-constraint + balance + SP``.

    Equal-token uses ``max_tokens = m_mem``; ``m_mem`` defaults to ``max(65,520, longest S)``
    (Wan 2.1 1.3B on an H200); ``cost_model`` defaults to :func:`default_cost_model` (H200-like).
    ``dual`` is the dual-constraint policy to compare, e.g. ``derive_policy(...).policy`` (the rule
    the shape benchmark applies). Samples longer than ``m_mem`` are left out of all three
    configurations so they plan the same data; the SP row plans every sample (those above ``m_mem``
    train on SP groups; ``dual`` must then say ``oversize="skip"`` for any SP cannot hold either).
    Its SP batches cost ``SequenceParallelCostModel(cost_model, sp_comm)`` (``sp_comm`` required
    unless ``cost_model`` already has ``predict_sp``).
    """
    all_shapes = np.asarray(shapes, dtype=np.int64)
    seq = all_shapes.prod(axis=1)
    m_mem = max(65_520, int(seq.max())) if m_mem is None else int(m_mem)
    shapes = all_shapes[seq <= m_mem]
    if len(shapes) == 0 and sequence_parallel is None:
        raise ValueError(f"Every sample is longer than `m_mem={m_mem}` tokens; raise `m_mem`.")
    cm = cost_model if cost_model is not None else default_cost_model()
    sp_cm: CostPredictor | None = None
    if sequence_parallel is not None:
        if callable(getattr(cm, "predict_sp", None)):
            sp_cm = cm
        elif sp_comm is None:
            raise ValueError("`compare_policies(sequence_parallel=...)` needs `sp_comm` (a UlyssesCommModel) for "
                             "the all-to-all time, or a cost model with `predict_sp`.")
        else:
            sp_cm = SequenceParallelCostModel(cm, sp_comm)
    configs = [
        ("equal-token", EqualTokenPolicy(m_mem), "none"),
        ("dual-constraint", dual, "none"),
        ("dual-constraint + balance", dual, "cost"),
    ]
    results = []
    for w in world_sizes:
        if len(shapes):
            for name, policy, balance in configs:
                results.append(simulate(shapes, policy, int(w), cost_model=cm, balance=balance, seed=seed, name=name))
        if sequence_parallel is not None:
            results.append(simulate(all_shapes, dual, int(w), cost_model=sp_cm, balance="cost", seed=seed,
                                    name="dual-constraint + balance + SP", sequence_parallel=sequence_parallel))
    return results
