"""Per-bucket sequence-parallel (Ulysses) planning: which buckets train on an SP group of k ranks.

A bucket planned with degree ``k > 1`` is cut into *SP batches*; each SP batch is one unit that
occupies ``k`` consecutive rank slots ``[g·k, (g+1)·k)`` of one global step (all inside one node),
and every rank of the group yields the same index list. Degree 1 is plain data parallel.

The decision per bucket (sequence length S) is a pure function of S, the policy's batch size, the
memory budget ``m_mem``, the usable degrees and the cost model, so every rank makes it alike:

1. A bucket that fits one GPU (``S <= m_mem``) and whose data-parallel batch is predicted to take at
   most ``target·(1 + tolerance)`` stays data parallel with the policy's batch size (unchanged).
2. Otherwise each usable degree k with ``S <= k·m_mem`` (activation memory per rank ≈ M(B, S)/k) is
   tried with the largest batch ``B_k`` such that ``B_k·S <= k·m_mem`` and
   ``t_sp(B_k, S, k) <= target`` (at least 1). The smallest k whose SP batch is within
   ``target·(1 + tolerance)`` is chosen; if none is, the option of lowest predicted time (data
   parallel included when it fits).
3. A bucket that no usable degree fits is oversize (the policy's ``oversize`` mode applies).

``target`` is :attr:`SequenceParallelConfig.target_step_time` when set. Otherwise it is the larger
of the policy's target — its ``step_budget`` (``CostModelPolicy``), else the slowest predicted
data-parallel batch of a bucket whose policy batch holds two or more samples (where the policy's
budget, not the one-sample floor, sets the time) — and the *floor*: the longest bucket's fastest
one-sample unit over every option that fits memory. No step can be shorter than the floor, so
splitting other buckets below it would only add all-to-all time.

Degrees used together must form a divisibility chain (each divides the next: 2, 4, 8): laying a
step's SP batches out by descending degree then puts every group at a multiple of its degree, and
a group never crosses a node because its degree divides ``ranks_per_node``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_adaptiveload._checks import check_positive_int

CostFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
SPCostFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


def allowed_sp_degrees(num_heads: int, ranks_per_node: int) -> list[int]:
    """SP degrees > 1 that divide both the attention heads and the ranks of a node."""
    return [k for k in range(2, min(num_heads, ranks_per_node) + 1) if num_heads % k == 0 and ranks_per_node % k == 0]


def check_sp_degree(degree: int, num_heads: int, ranks_per_node: int, world_size: int | None = None) -> int:
    """Validate a Ulysses sequence-parallel degree and return it as an int.

    Args:
        degree: ranks of one SP group (1: no sequence parallelism).
        num_heads: attention heads of the model (each rank of a group takes ``num_heads / degree``).
        ranks_per_node: ranks of one node (a group never crosses a node).
        world_size: total ranks, or ``None`` to skip the checks that need it.

    Raises:
        ValueError: the degree does not divide the heads or the node (the message names the allowed
            degrees), or the ranks do not tile into whole groups and nodes.
    """
    degree = check_positive_int("check_sp_degree", "degree", degree)
    num_heads = check_positive_int("check_sp_degree", "num_heads", num_heads)
    ranks_per_node = check_positive_int("check_sp_degree", "ranks_per_node", ranks_per_node)
    if degree == 1:
        return 1
    allowed = allowed_sp_degrees(num_heads, ranks_per_node)
    if num_heads % degree or ranks_per_node % degree:
        why = "the heads" if num_heads % degree else "the ranks of a node"
        raise ValueError(
            f"`check_sp_degree(degree={degree})` is not valid: {degree} does not divide {why} "
            f"(num_heads={num_heads}, ranks_per_node={ranks_per_node}). Expected one of {allowed} "
            "(divisors of both), or 1 for no sequence parallelism."
        )
    if world_size is not None:
        world_size = check_positive_int("check_sp_degree", "world_size", world_size)
        if world_size % degree:
            raise ValueError(
                f"`check_sp_degree(degree={degree}, world_size={world_size})` is not valid: {world_size} ranks "
                f"do not split into groups of {degree}. Use a world size that is a multiple of {degree}."
            )
        if world_size > ranks_per_node and world_size % ranks_per_node:
            raise ValueError(
                f"`check_sp_degree(degree={degree}, world_size={world_size})` is not valid: {world_size} ranks "
                f"are not whole nodes of ranks_per_node={ranks_per_node}, so a group could cross a node. Use a "
                f"multiple of {ranks_per_node} ranks or set `ranks_per_node` to the ranks of one node."
            )
    return degree


@dataclass(frozen=True)
class SequenceParallelConfig:
    """Which SP degrees the planner may give a bucket, and how it weighs step time.

    Args:
        degrees: SP degrees > 1 the planner may use; each checked by :func:`check_sp_degree`, and
            together a divisibility chain (e.g. ``(2, 4, 8)``).
        num_heads: attention heads of the model.
        ranks_per_node: ranks (GPUs) of one node.
        target_step_time: predicted seconds an SP batch aims at; ``None``: derived (module docstring).
        tolerance: a bucket uses SP for time only when its step is predicted above
            ``target·(1 + tolerance)``.

    Raises:
        ValueError: a degree that does not divide the heads or the node, degrees that are not a
            divisibility chain, or a bad target / tolerance.
    """

    degrees: tuple[int, ...]
    num_heads: int
    ranks_per_node: int
    target_step_time: float | None = None
    tolerance: float = 0.25

    def __post_init__(self) -> None:
        if isinstance(self.degrees, (str, bytes)) or not isinstance(self.degrees, Sequence) or not self.degrees:
            raise ValueError(
                f"`SequenceParallelConfig(degrees={self.degrees!r})` is not valid. Expected a non-empty list of "
                f"degrees, e.g. {allowed_sp_degrees(int(self.num_heads), int(self.ranks_per_node))}."
            )
        degrees = tuple(sorted({check_sp_degree(k, self.num_heads, self.ranks_per_node) for k in self.degrees}))
        degrees = tuple(k for k in degrees if k > 1)
        if not degrees:
            raise ValueError(
                f"`SequenceParallelConfig(degrees={list(self.degrees)!r})` has no degree above 1; disable sequence "
                "parallelism instead."
            )
        for a, b in zip(degrees, degrees[1:], strict=False):
            if b % a:
                raise ValueError(
                    f"`SequenceParallelConfig(degrees={list(degrees)})` is not valid: {a} does not divide {b}, so "
                    "groups of both sizes cannot share a step without crossing their alignment. Choose degrees "
                    "where each divides the next, e.g. [2, 4] or [3, 6]."
                )
        t = self.target_step_time
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t <= 0):
            raise ValueError(
                f"`SequenceParallelConfig(target_step_time={t!r})` is not valid. Expected positive seconds or None."
            )
        tol = self.tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not np.isfinite(tol) or tol < 0:
            raise ValueError(f"`SequenceParallelConfig(tolerance={tol!r})` is not valid. Expected a number >= 0.")
        object.__setattr__(self, "degrees", degrees)
        object.__setattr__(self, "num_heads", int(self.num_heads))
        object.__setattr__(self, "ranks_per_node", int(self.ranks_per_node))
        object.__setattr__(self, "tolerance", float(tol))
        if t is not None:
            object.__setattr__(self, "target_step_time", float(t))

    def usable_degrees(self, world_size: int) -> list[int]:
        """The configured degrees a plan on ``world_size`` ranks uses: those not above it, each checked.

        Raises:
            ValueError: a degree does not divide ``world_size``, or the ranks are not whole nodes.
        """
        usable = [k for k in self.degrees if k <= world_size]
        for k in usable:
            check_sp_degree(k, self.num_heads, self.ranks_per_node, world_size)
        return usable

    def to_dict(self) -> dict[str, Any]:
        return {"degrees": list(self.degrees), "num_heads": self.num_heads, "ranks_per_node": self.ranks_per_node,
                "target_step_time": self.target_step_time, "tolerance": self.tolerance}


def sp_cost_function(cost_model: Any, p: float) -> tuple[CostFn, SPCostFn]:
    """``(t(B, S), t_sp(B, S, k))`` from a cost model.

    ``t_sp`` is ``cost_model.predict_sp`` when the model has one (e.g.
    ``calibration.SequenceParallelCostModel``, which adds the all-to-all time); otherwise the
    compute is split k ways with no communication cost: ``t(0, S) + (t(B, S) - t(0, S)) / k``, or
    ``B·S^p / k`` without a cost model.
    """
    if cost_model is None:
        def t(b: np.ndarray, s: np.ndarray) -> np.ndarray:
            return np.asarray(b, np.float64) * np.power(np.asarray(s, np.float64), p)

        return t, lambda b, s, k: t(b, s) / k

    def t_model(b: np.ndarray, s: np.ndarray) -> np.ndarray:
        return np.asarray(cost_model.predict(b, s), dtype=np.float64) * np.ones(np.shape(b))

    predict_sp = getattr(cost_model, "predict_sp", None)
    if callable(predict_sp):
        return t_model, lambda b, s, k: np.asarray(predict_sp(b, s, k), np.float64) * np.ones(np.shape(b))

    def t_split(b: np.ndarray, s: np.ndarray, k: int) -> np.ndarray:
        fixed = t_model(np.zeros(np.shape(b)), s)
        return fixed + (t_model(b, s) - fixed) / k

    return t_model, t_split


def _largest_batch(seq_lens: np.ndarray, cap: np.ndarray, k: int, target: float, t_sp: SPCostFn) -> np.ndarray:
    """Largest B in [1, cap] with ``t_sp(B, S, k) <= target`` (1 when even B = 1 is slower)."""
    lo = np.ones_like(seq_lens)
    hi = np.maximum(cap, 1)
    while np.any(lo < hi):
        mid = (lo + hi + 1) // 2
        ok = t_sp(mid, seq_lens, k) <= target
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid - 1)
    return lo


def default_target(dp_batch_sizes: np.ndarray, dp_cost: np.ndarray, step_budget: float | None) -> float | None:
    """The step time SP batches aim at when none is configured (see the module docstring)."""
    if step_budget is not None:
        return float(step_budget)
    full = dp_batch_sizes >= 2
    if full.any():
        return float(dp_cost[full].max())
    fits = dp_batch_sizes >= 1
    return float(dp_cost[fits].min()) if fits.any() else None


def _time_floor(s: np.ndarray, dp_bs: np.ndarray, m_mem: int | None, usable: list[int], cost: CostFn,
                sp_cost: SPCostFn) -> float:
    """The largest, over buckets, of the fastest one-sample unit that fits memory (0 if none fits)."""
    ones = np.ones_like(s)
    best = np.where(dp_bs > 0, cost(ones, s), np.inf)
    for k in usable:
        fits = s <= k * m_mem if m_mem is not None else np.ones(len(s), bool)
        best = np.minimum(best, np.where(fits, sp_cost(ones, s, k), np.inf))
    finite = best[np.isfinite(best)]
    return float(finite.max()) if len(finite) else 0.0


def plan_bucket_layout(
    seq_lens: np.ndarray,
    dp_batch_sizes: np.ndarray,
    *,
    m_mem: int | np.ndarray | None,
    config: SequenceParallelConfig,
    world_size: int,
    cost: CostFn,
    sp_cost: SPCostFn,
    step_budget: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Batch size and SP degree of every bucket for ``world_size`` ranks (0, 0: cannot be planned).

    Args:
        seq_lens: S of every bucket (int64 ``[K]``).
        dp_batch_sizes: the policy's data-parallel batch size per bucket (0: above ``m_mem``).
        m_mem: tokens one GPU holds (``None``: no memory limit), or per bucket (an array like ``seq_lens``,
            e.g. each bucket's activation-checkpointing mode's budget).
        config: the SP degrees and target.
        world_size: ranks of the plan (degrees that do not divide it are not used).
        cost, sp_cost: ``t(B, S)`` and ``t_sp(B, S, k)`` (see :func:`sp_cost_function`).
        step_budget: the policy's own step budget, if it has one.
    """
    s = np.asarray(seq_lens, dtype=np.int64)
    dp_bs = np.asarray(dp_batch_sizes, dtype=np.int64)
    batch_sizes = dp_bs.copy()
    degrees = np.where(dp_bs > 0, 1, 0).astype(np.int64)
    usable = config.usable_degrees(world_size)
    if not usable or len(s) == 0:
        return batch_sizes, degrees
    dp_cost = np.where(dp_bs > 0, cost(np.maximum(dp_bs, 1), s), np.inf)
    target = config.target_step_time
    if target is None:
        floor = _time_floor(s, dp_bs, m_mem, usable, cost, sp_cost)
        target = max(default_target(dp_bs, dp_cost, step_budget) or 0.0, floor)
    limit = target * (1.0 + config.tolerance)
    needs = ~(dp_cost <= limit)
    if not needs.any():
        return batch_sizes, degrees
    best_cost = np.where(dp_bs > 0, dp_cost, np.inf)
    chosen = np.zeros(len(s), dtype=bool)
    for k in usable:
        cap = (k * m_mem) // s if m_mem is not None else np.full(len(s), np.iinfo(np.int32).max, np.int64)
        fits = needs & (cap >= 1)
        if not fits.any():
            continue
        b_k = np.ones_like(s)
        b_k[fits] = _largest_batch(s[fits], cap[fits], k, target, sp_cost)
        t_k = np.where(fits, sp_cost(b_k, s, k), np.inf)
        # First (smallest) degree within the limit wins; until one is, keep the fastest option.
        take = fits & ~chosen & ((t_k <= limit) | (t_k < best_cost))
        batch_sizes[take], degrees[take], best_cost[take] = b_k[take], k, t_k[take]
        chosen |= fits & (t_k <= limit)
    return batch_sizes, degrees
