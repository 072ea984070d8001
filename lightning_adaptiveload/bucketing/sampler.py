"""Rank-aware, cost-balanced bucket batch sampler with exact mid-epoch resume.

The epoch plan is a pure function of (shapes, policy, seed, epoch, num_replicas): every rank builds
the same plan from arrays alone (no communication, no per-sample Python objects) and takes its
column. A plan is a table ``steps[num_steps, num_replicas]`` of batch ids; a batch is a run of
sample indices that share one token grid.

Building a plan (all numpy, O(N) apart from one integer sort):

1. shuffle the sample indices, then stable-sort them by bucket (identical token grid) so each
   bucket's samples are contiguous and in random order;
2. cut every bucket into batches of the size the policy gives its sequence length (the last batch
   of a bucket may be smaller — no sample is dropped for not filling a batch);
3. make the number of batches a multiple of ``num_replicas``: pad by repeating the batches with the
   fewest samples (counted) or,
   with ``drop_last``, drop the batches with the fewest samples (counted);
4. arrange batches into global steps of ``num_replicas`` batches: ``balance="none"`` deals the
   shuffled batches to ranks (the paper's behaviour); ``balance="cost"`` sorts batches by predicted
   cost and takes consecutive runs, so the ranks of one step do nearly equal work, then shuffles
   the order of the steps.

Resume: the state records the epoch, the seed and, per world size the epoch has run under, the
number of global steps taken. Loading it under another world size re-plans exactly the samples
not yet seen (a new "segment" of the epoch); under the same world size it continues the same plan.

Re-planning (:meth:`AdaptiveBucketBatchSampler.replan`): a corrected policy takes over at an agreed
step of the epoch for the samples not planned before it, as a new segment. A segment planned with
settings other than the current ones carries them in the state (``spec``: the batch size of every
bucket and the predicted cost of every batch shape it planned), so its plan is rebuilt exactly on
resume without the policy or cost model objects that made it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from lightning_adaptiveload.bucketing.buckets import CHUNK as _CHUNK
from lightning_adaptiveload.bucketing.buckets import (
    _as_grids,
    _distinct,
    _packed_keys,
    _unpack,
    batch_costs,
)
from lightning_adaptiveload.bucketing.metrics import summarize_step_loads
from lightning_adaptiveload.bucketing.policy import BatchSizePolicy, CostPredictor
from lightning_adaptiveload.bucketing.sequence_parallel import (
    SequenceParallelConfig,
    plan_bucket_layout,
    sp_cost_function,
)
from lightning_adaptiveload.bucketing.steps import _stable_sort_by_bucket, arrange_steps

_BALANCE_MODES = ("cost", "none")
# Version 2 added the shapes to the fingerprint; version-1 states are read (without that check).
_STATE_VERSION = 2
_READABLE_STATE_VERSIONS = (1, 2)


class OversizeSampleError(ValueError):
    """A sample is longer than the policy's memory budget; ``index`` is its dataset index (0-based)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = int(index)


def _label(index: int, sample_label: Callable[[int], str] | None) -> str:
    """``sample_label(index)`` (e.g. ``manifest row 17 (clip_0042.mp4)``), else ``sample <index>``."""
    if sample_label is not None:
        try:
            return str(sample_label(int(index)))
        except Exception:  # noqa: BLE001 - a label is a courtesy; the error it decorates must still be raised
            pass
    return f"sample {int(index)}"


def oversize_error(
    seq_lens: np.ndarray,
    limit: int | None,
    oversize: str = "error",
    sample_label: Callable[[int], str] | None = None,
    *,
    grids: np.ndarray | None = None,
    budget: str = "",
    policy: str = "",
) -> OversizeSampleError | None:
    """The one rule for samples longer than the memory budget: the error to raise, or ``None``.

    ``None`` when every sample fits, ``limit`` is ``None`` or ``oversize != "error"`` (``"skip"``:
    leave them out, counted by the caller). The error names the first such sample in dataset order
    by ``sample_label(index)`` (a dataset's manifest row and file; ``sample <i>`` without one), its
    S and token grid, how many samples are too long, and the fixes.

    Args:
        seq_lens: tokens S per sample, in dataset order.
        limit: the longest S that fits one device (the policy's ``max_seq_len`` / ``m_mem``).
        oversize: the policy's ``oversize`` mode.
        sample_label: ``index -> str`` naming a sample's source (``dataset.sample_label``).
        grids: per-sample token grids ``[N, 3]`` for the message (optional).
        budget: what ``limit`` is, e.g. ``"of DualConstraintPolicy(m_mem=4096, ...)"``.
        policy: the policy's class name, to word the fix as ``Policy(oversize='skip')``.
    """
    if limit is None or oversize != "error":
        return None
    seq = np.asarray(seq_lens)
    over = seq > limit
    if not over.any():
        return None
    i = int(np.argmax(over))
    skip = f"`{policy}(oversize='skip')`" if policy else "`oversize='skip'` on the policy"
    grid = f" (token grid {tuple(int(v) for v in grids[i])})" if grids is not None else ""
    count = int(over.sum())
    return OversizeSampleError(
        i,
        f"{_label(i, sample_label)}: S={int(seq[i]):,} tokens{grid} is above the memory budget of {int(limit):,} "
        f"tokens{f' {budget}' if budget else ''}; it would run out of memory even alone "
        f"({count} sample{'s' if count > 1 else ''} in all {'are' if count > 1 else 'is'} that long). Raise "
        "`m_mem` (or enable activation checkpointing / shard the model), crop or remove such samples, or set "
        f"{skip} to leave them out (counted).",
    )


@dataclass
class EpochPlan:
    """One epoch segment's plan. ``steps[s, r]`` is the batch id rank r runs at step s."""

    order: np.ndarray  # sample indices, batch after batch
    batch_start: np.ndarray  # offset of each batch in `order`
    batch_len: np.ndarray  # samples per batch
    batch_bucket: np.ndarray  # bucket id of each batch
    batch_cost: np.ndarray  # predicted cost of each batch
    steps: np.ndarray  # [num_steps, num_replicas] batch ids (pads repeat ids)
    padded_batches: int
    padded_samples: int
    dropped_batches: int
    dropped_samples: int
    #: SP degree of each batch (``None``: every batch is data parallel). An SP batch of degree k
    #: fills k consecutive columns ``[g·k, (g+1)·k)`` of its step.
    batch_degree: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        return int(self.steps.shape[0])

    def samples_of(self, batch_ids: np.ndarray) -> np.ndarray:
        """Sample indices of the given batches, concatenated (vectorised slice gather)."""
        lens = self.batch_len[batch_ids]
        total = int(lens.sum())
        if total == 0:
            return np.empty(0, dtype=np.int64)
        shift = self.batch_start[batch_ids] - (np.cumsum(lens) - lens)
        return self.order[np.repeat(shift, lens) + np.arange(total, dtype=np.int64)]


class AdaptiveBucketBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches (lists of dataset indices) of one epoch plan.

    Samples batch together only with an identical token grid; the batch size of a grid comes from
    ``policy``. Every rank yields the same number of batches, and across ranks every sample appears
    exactly once per epoch apart from explicit, counted padding (``drop_last=False``) or counted
    drops (``drop_last=True``). See :attr:`plan_stats`.

    Args:
        shapes: per-sample token grids (f, h, w) after patchify, int array-like ``[N, 3]``.
        policy: a :class:`~lightning_adaptiveload.bucketing.policy.BatchSizePolicy`.
        num_replicas: world size (number of ranks that each take one batch per step).
        rank: this rank, ``0 <= rank < num_replicas``.
        seed: base seed; the plan of epoch e uses ``(seed, epoch, segment)``.
        shuffle: shuffle samples within buckets and the order of batches / steps.
        drop_last: drop (and count) batches instead of padding with repeats to equalise ranks.
        balance: ``"cost"`` (default): group batches of nearly equal predicted cost into each step;
            ``"none"``: deal shuffled batches to ranks as they come.
        cost_model: object with a vectorised ``predict(B, S)``; used by ``balance="cost"``. Without
            one, the cost of a batch is ``B * S**p`` with ``p = policy.cost_exponent`` (2.0 by
            default); a ``CostModelPolicy`` lends its own cost model. With sequence parallelism its
            ``predict_sp(B, S, k)`` (if any) gives an SP batch's time.
        sequence_parallel: a :class:`~lightning_adaptiveload.bucketing.sequence_parallel.SequenceParallelConfig`
            to let the longest buckets train on SP groups of k ranks inside a node (see
            :mod:`lightning_adaptiveload.bucketing.sequence_parallel`); every rank of a group yields the
            same batch at the same step. ``None`` (default): data parallel only, the plan unchanged.
        sample_label: ``index -> str`` naming a sample's source in errors (a dataset's ``sample_label``,
            e.g. ``manifest row 17 (clip_0042.mp4)``); ``None``: ``sample <index>``.

    Raises:
        ValueError: bad arguments, an empty dataset, a grid that is not three positive integers, or
            an oversize sample when the policy says ``oversize="error"``.

    Example::

        sampler = AdaptiveBucketBatchSampler(dataset.token_grids(), DualConstraintPolicy(65520, 1.0e8, 2),
                                             num_replicas=world_size, rank=rank, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_batch)
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]] | np.ndarray,
        policy: BatchSizePolicy,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        balance: str = "cost",
        cost_model: CostPredictor | None = None,
        sequence_parallel: SequenceParallelConfig | None = None,
        sample_label: Callable[[int], str] | None = None,
    ) -> None:
        name = type(self).__name__
        if not callable(getattr(policy, "batch_sizes", None)):
            raise ValueError(f"`{name}(policy={policy!r})` is not valid. Expected a BatchSizePolicy.")
        if not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
            raise ValueError(f"`{name}(num_replicas={num_replicas!r})` is not valid. Expected an integer >= 1.")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"`{name}(rank={rank!r})` is not valid. Expected an integer in [0, num_replicas={num_replicas})."
            )
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"`{name}(seed={seed!r})` is not valid. Expected a non-negative integer.")
        if balance not in _BALANCE_MODES:
            raise ValueError(f"`{name}(balance={balance!r})` is not valid. Expected one of {_BALANCE_MODES}.")
        if cost_model is not None and not callable(getattr(cost_model, "predict", None)):
            raise ValueError(
                f"`{name}(cost_model={cost_model!r})` is not valid. Expected an object with `predict(B, S)`."
            )
        self.policy = policy
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.balance = balance
        self.cost_model = cost_model if cost_model is not None else getattr(policy, "cost_model", None)
        if sequence_parallel is not None and not isinstance(sequence_parallel, SequenceParallelConfig):
            raise ValueError(
                f"`{name}(sequence_parallel={sequence_parallel!r})` is not valid. Expected a SequenceParallelConfig "
                "or None."
            )
        self.sequence_parallel = sequence_parallel
        self.sample_label = sample_label
        self._index_shapes(shapes)

        self.epoch = 0
        # Closed segments: (num_replicas, steps, spec or None). `spec` (see `_spec_of`) rebuilds a segment
        # planned with other settings than the sampler's; None: planned with the current ones.
        self._segments: list[tuple[int, int, dict | None]] = []
        self._position = 0  # epoch steps taken before the current iteration (closed segments included)
        self._yielded = 0  # steps yielded by the current iteration (counts prefetch too)
        self._finished = False  # the epoch was iterated to the end
        self._version = 0  # bumped whenever the segments change (the plan cache's key)
        self._cache: tuple[tuple, EpochPlan] | None = None
        self._closed_plans: list[EpochPlan] = []
        #: Re-plans applied in this epoch: ``(epoch step, {bucket S: (old B, new B)})`` (for reports).
        self.replans: list[tuple[int, dict[int, tuple[int, int]]]] = []
        #: Epoch plans built so far (a plan is cached until the epoch, policy or progress changes).
        self.plans_built = 0

    # ------------------------------------------------------------------ shapes and buckets
    def _index_shapes(self, shapes: Sequence[Sequence[int]] | np.ndarray) -> None:
        grids = _as_grids(shapes)
        n = int(grids.shape[0])
        packed = _packed_keys(grids)
        keys = _distinct(packed)
        # uint16 bucket ids let numpy's stable argsort use radix sort (O(N)) in every epoch plan.
        self._bucket_of = np.empty(n, dtype=np.uint16 if len(keys) <= 1 << 16 else np.int32)
        for start in range(0, n, _CHUNK):
            self._bucket_of[start:start + _CHUNK] = np.searchsorted(keys, packed[start:start + _CHUNK])
        del packed
        counts = np.bincount(self._bucket_of, minlength=len(keys))
        self.bucket_grids = _unpack(keys)
        self.bucket_counts = counts.astype(np.int64)
        self.bucket_seq_lens = self.bucket_grids.prod(axis=1)
        # Sample indices fit 32 bits below 2^31 samples: half the memory of every plan array.
        self._index_dtype = np.int32 if n < 2**31 else np.int64
        self._shapes_digest: str | None = None
        self.num_samples = n
        self._set_batch_sizes()

    def _set_batch_sizes(self) -> None:
        policy = self.policy
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if self.sequence_parallel is not None:
            self._set_sp_batch_sizes()
            return
        limit = getattr(policy, "max_seq_len", None)
        over = (self.bucket_seq_lens > limit) if limit is not None else np.zeros(len(self.bucket_seq_lens), bool)
        if over.any():
            # Per-sample arrays only on this (rare) path: the error names the first such sample.
            err = oversize_error(self.bucket_seq_lens[self._bucket_of], limit, getattr(policy, "oversize", "error"),
                                 self.sample_label, grids=self.bucket_grids[self._bucket_of], budget=f"of {policy!r}",
                                 policy=type(policy).__name__)
            if err is not None:
                raise err
        self.bucket_batch_sizes = np.asarray(policy.batch_sizes(self.bucket_seq_lens), dtype=np.int64)
        self.bucket_batch_sizes[over] = 0
        self.bucket_degrees = np.ones(len(self.bucket_seq_lens), dtype=np.int64)
        self.skipped_oversize = int(self.bucket_counts[over].sum())
        self._cache = None

    # ------------------------------------------------------------------ sequence parallelism
    def _set_sp_batch_sizes(self) -> None:
        limit = getattr(self.policy, "max_seq_len", None)
        fits = self.bucket_seq_lens <= limit if limit is not None else np.ones(len(self.bucket_seq_lens), bool)
        self._dp_batch_sizes = np.zeros(len(self.bucket_seq_lens), dtype=np.int64)
        if fits.any():
            self._dp_batch_sizes[fits] = self.policy.batch_sizes(self.bucket_seq_lens[fits])
        self._cache = None
        bs, deg = self._layout(self.num_replicas)
        unplanned = bs == 0
        if unplanned.any() and getattr(self.policy, "oversize", "error") == "error":
            raise self._unplannable(int(np.flatnonzero(unplanned)[0]), self.num_replicas)
        self.bucket_batch_sizes, self.bucket_degrees = bs, deg
        self.skipped_oversize = int(self.bucket_counts[unplanned].sum())

    def _layout(self, num_replicas: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch size and SP degree per bucket when planning for ``num_replicas`` ranks."""
        if self.sequence_parallel is None:
            return self.bucket_batch_sizes, self.bucket_degrees
        if num_replicas not in self._layouts:
            cost, sp_cost = sp_cost_function(self.cost_model, self._cost_exponent())
            # Per-bucket checkpointing: each bucket's group holds what its own mode allows per rank.
            budgets = getattr(self.policy, "memory_budgets", None)
            limit = budgets(self.bucket_seq_lens) if callable(budgets) else getattr(self.policy, "max_seq_len", None)
            self._layouts[num_replicas] = plan_bucket_layout(
                self.bucket_seq_lens, self._dp_batch_sizes, m_mem=limit, config=self.sequence_parallel,
                world_size=num_replicas, cost=cost, sp_cost=sp_cost,
                step_budget=getattr(self.policy, "step_budget", None))
        return self._layouts[num_replicas]

    def _unplannable(self, bucket: int, num_replicas: int) -> OversizeSampleError:
        i = int(np.flatnonzero(self._bucket_of == bucket)[0])
        cfg = self.sequence_parallel
        usable = cfg.usable_degrees(num_replicas) if cfg is not None else []
        return OversizeSampleError(
            i,
            f"{_label(i, self.sample_label)} has token grid {tuple(self.bucket_grids[bucket].tolist())} (S="
            f"{int(self.bucket_seq_lens[bucket])} tokens), above the memory budget "
            f"{getattr(self.policy, 'max_seq_len', None)} of {self.policy!r} even split over the sequence-parallel "
            f"degrees usable on {num_replicas} ranks ({usable or 'none'}; configured {list(cfg.degrees) if cfg else []}). "
            "Add a larger degree, train on more ranks, raise `m_mem`, crop or remove such samples, or build the "
            "policy with `oversize='skip'` to leave them out (counted).",
        )

    def set_policy(self, policy: BatchSizePolicy, cost_model: CostPredictor | None = None) -> None:
        """Swap the policy (and optionally the cost model) and rebuild the plan.

        Only valid between epochs: a mid-epoch resume state refers to the old policy's plan.
        """
        self.policy = policy
        if cost_model is not None:
            self.cost_model = cost_model
        elif hasattr(policy, "cost_model"):
            self.cost_model = policy.cost_model
        self._set_batch_sizes()

    def set_cost_model(self, cost_model: CostPredictor | None) -> None:
        """Use ``cost_model`` for ``balance="cost"`` grouping and plan statistics."""
        self.cost_model = cost_model
        self._cache = None
        if self.sequence_parallel is not None:  # the SP layout is chosen with the cost model
            self._set_batch_sizes()

    # ------------------------------------------------------------------ planning
    def _cost_exponent(self) -> float:
        return float(getattr(self.policy, "cost_exponent", 2.0))

    def _build_plan(self, base: np.ndarray | None, num_replicas: int, segment: int,
                    spec: dict | None = None) -> EpochPlan:
        """Plan the samples ``base`` (sorted indices; ``None``: every eligible sample), with the current
        settings or those of ``spec``."""
        rng = np.random.default_rng([self.seed, self.epoch, segment])
        bs_of_bucket, degree_of_bucket = self._layout(num_replicas)
        costs_of = None
        if spec is not None:
            bs_of_bucket = np.asarray(spec["batch_sizes"], dtype=np.int64)
            table = np.asarray(spec["costs"], dtype=np.float64).reshape(-1, 3)
            table_keys = table[:, 0].astype(np.int64) * (1 << 32) + table[:, 1].astype(np.int64)
            order = np.argsort(table_keys)
            table_keys, table_cost = table_keys[order], table[order, 2]

            def costs_of(bucket: np.ndarray, length: np.ndarray) -> np.ndarray:
                keys = bucket.astype(np.int64) * (1 << 32) + length.astype(np.int64)
                pos = np.minimum(np.searchsorted(table_keys, keys), len(table_keys) - 1)
                if len(table_keys) == 0 or not (table_keys[pos] == keys).all():
                    raise ValueError(f"The sampler state's segment {segment} of epoch {self.epoch} has no cost for "
                                     "some of its batches. The state does not belong to this dataset and settings.")
                return table_cost[pos]
        if base is None:
            base = np.arange(self.num_samples, dtype=self._index_dtype)
            if self.skipped_oversize or self.sequence_parallel is not None:
                base = base[bs_of_bucket[self._bucket_of] > 0]
        elif self.sequence_parallel is not None and getattr(self.policy, "oversize", "error") == "skip":
            base = base[bs_of_bucket[self._bucket_of[base]] > 0]
        idx = rng.permutation(base) if self.shuffle else base
        base = None  # the permutation is a copy: free the sorted indices before the sort below
        num_buckets = len(bs_of_bucket)
        idx, counts = _stable_sort_by_bucket(idx, self._bucket_of, num_buckets)
        bsz = np.maximum(bs_of_bucket, 1)
        nb = -(-counts // bsz)
        total = int(nb.sum())
        # Per-batch arrays in 32 bits where the values fit: a 10^8-sample epoch has ~3.5e7 batches.
        batch_bucket = np.repeat(np.arange(num_buckets, dtype=np.int32), nb)
        first, first_batch = np.cumsum(counts) - counts, np.cumsum(nb) - nb
        batch_start = np.empty(total, dtype=self._index_dtype)
        batch_len = np.empty(total, dtype=np.int32)
        cost = np.empty(total, dtype=np.float64)
        for lo in range(0, total, _CHUNK):  # int64 / float64 temporaries of one chunk of batches, not of all
            k = batch_bucket[lo:lo + _CHUNK]
            sl = slice(lo, lo + len(k))
            within = np.arange(lo, sl.stop, dtype=np.int64) - first_batch[k]
            batch_start[sl] = first[k] + within * bsz[k]
            batch_len[sl] = np.minimum(bsz[k], counts[k] - within * bsz[k])
            if costs_of is not None:
                cost[sl] = costs_of(k, batch_len[sl])
            else:
                cost[sl] = batch_costs(batch_len[sl], self.bucket_seq_lens[k], self.cost_model,
                                       self._cost_exponent())

        ids = np.arange(total, dtype=self._index_dtype)
        if self.shuffle:
            ids = rng.permutation(ids)
        degree = None
        if self.sequence_parallel is not None:
            missing = (counts > 0) & (bs_of_bucket == 0)
            if missing.any():  # a resume under a world size whose degrees cannot hold these samples
                raise self._unplannable(int(np.flatnonzero(missing)[0]), num_replicas)
            degree = degree_of_bucket[batch_bucket]
            if (degree > 1).any():  # an SP batch costs t_sp and fills k slots
                _, sp_cost = sp_cost_function(self.cost_model, self._cost_exponent())
                seq = self.bucket_seq_lens[batch_bucket]
                for k in np.unique(degree[degree > 1]).tolist():
                    sel = degree == k
                    cost[sel] = sp_cost(batch_len[sel].astype(np.int64), seq[sel], int(k))
            else:
                degree = None
        steps, padded_b, padded_s, dropped_b, dropped_s = arrange_steps(
            ids, batch_len, cost, num_replicas, degree, drop_last=self.drop_last, balance=self.balance,
            shuffle=self.shuffle, rng=rng)
        return EpochPlan(idx, batch_start, batch_len, batch_bucket, cost, steps, padded_b, padded_s, dropped_b,
                         dropped_s, batch_degree=None if degree is None else degree.astype(np.int32))

    def _remaining_after(self, plan: EpochPlan, steps_taken: int) -> np.ndarray:
        """Sorted indices planned after step ``steps_taken`` and not seen before it."""
        rest = np.zeros(self.num_samples, dtype=bool)
        rest[plan.samples_of(plan.steps[steps_taken:].reshape(-1))] = True
        rest[plan.samples_of(plan.steps[:steps_taken].reshape(-1))] = False
        return np.flatnonzero(rest).astype(self._index_dtype)

    def plan(self) -> EpochPlan:
        """The plan this rank iterates now: the whole epoch, or after a resume under another world
        size or a re-plan the part not planned before. Built once and cached until the epoch, the
        policy or the segments change."""
        key = (self.epoch, self._version, self.num_replicas, self.seed)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        base, closed_plans = None, []
        for i, (w, k, spec) in enumerate(self._segments):
            closed = self._build_plan(base, w, i, spec)
            if k > closed.num_steps:
                raise ValueError(
                    f"The sampler state says {k} steps were taken in segment {i} of epoch {self.epoch} under "
                    f"{w} ranks, but that segment's plan has {closed.num_steps}. The state does not belong to "
                    "this dataset and settings."
                )
            closed_plans.append(closed)
            base = self._remaining_after(closed, k)
        plan = self._build_plan(base, self.num_replicas, len(self._segments))
        total = self._closed_steps() + plan.num_steps
        if self._position > total:
            raise ValueError(
                f"The sampler state says {self._position} steps were taken in epoch {self.epoch}, but its plan "
                f"has {total}. The state does not belong to this dataset and settings."
            )
        self.plans_built += 1
        self._cache, self._closed_plans = (key, plan), closed_plans
        return plan

    def _closed_steps(self) -> int:
        return sum(k for _, k, _ in self._segments)

    def _locate(self, step: int) -> tuple[EpochPlan, int]:
        """The plan holding epoch step ``step`` and its row there (a closed segment of this world size after
        a re-plan, or the active plan)."""
        plan = self.plan()
        start = 0
        for (w, k, _), closed in zip(self._segments, self._closed_plans, strict=True):
            if step < start + k:
                if w != self.num_replicas:
                    raise RuntimeError(f"epoch step {step} lies in a segment planned for {w} ranks")
                return closed, step - start
            start += k
        return plan, step - start

    def _spec_of(self, plan: EpochPlan) -> dict:
        """What rebuilds ``plan`` without the settings that made it: each bucket's batch size and the cost of
        each (bucket, batch length) it holds."""
        if plan.batch_degree is not None or self.sequence_parallel is not None:
            raise ValueError("re-planning is not supported with sequence parallelism")
        sizes = np.zeros(len(self.bucket_seq_lens), dtype=np.int64)
        pairs = np.unique(np.stack([plan.batch_bucket.astype(np.int64), plan.batch_len.astype(np.int64)]), axis=1)
        costs = []
        for bucket, length in pairs.T.tolist():
            first = int(np.flatnonzero((plan.batch_bucket == bucket) & (plan.batch_len == length))[0])
            costs.append([bucket, length, float(plan.batch_cost[first])])
        bs, _ = self._layout(self.num_replicas)
        sizes[:] = bs
        return {"batch_sizes": sizes.tolist(), "costs": costs}

    def replan(self, policy: BatchSizePolicy, cost_model: CostPredictor | None, at_step: int) -> None:
        """Plan the samples not planned before epoch step ``at_step`` with ``policy`` from that step on.

        Every rank must call it with the same ``at_step`` (e.g. the largest number of steps any rank has
        drawn: a rank that drew fewer yields the old plan up to it). The steps before ``at_step`` keep the
        plan they had, so every sample still appears exactly once in the epoch; later epochs are planned
        with ``policy``. The state after a re-plan rebuilds the old part from its recorded ``spec``.

        Raises:
            ValueError: ``at_step`` is before the steps this rank has drawn or after the epoch's end, or
                the sampler uses sequence parallelism.
        """
        if self.sequence_parallel is not None:
            raise ValueError(f"`{type(self).__name__}.replan` is not supported with sequence parallelism.")
        drawn = self._drawn_steps()
        if not drawn <= int(at_step) <= len(self):
            raise ValueError(
                f"`{type(self).__name__}.replan(at_step={at_step!r})` is not valid: this rank has drawn {drawn} steps "
                f"of epoch {self.epoch}, which has {len(self)}. Expected {drawn} <= at_step <= {len(self)}."
            )
        active = self.plan()
        closed = self._closed_steps()
        frozen = [(w, k, spec if spec is not None else self._spec_of(p))
                  for (w, k, spec), p in zip(self._segments, self._closed_plans, strict=True)]
        old_sizes = dict(zip(self.bucket_seq_lens.tolist(), self.bucket_batch_sizes.tolist(), strict=True))
        frozen.append((self.num_replicas, int(at_step) - closed, self._spec_of(active)))
        self.set_policy(policy, cost_model)
        self._segments = frozen
        self._version += 1
        self._cache = None
        changed = {s: (old_sizes[s], int(b)) for s, b in zip(self.bucket_seq_lens.tolist(),
                                                              self.bucket_batch_sizes.tolist(), strict=True)
                   if old_sizes[s] != int(b)}
        self.replans.append((int(at_step), changed))
        self.plan()

    @property
    def drawn_steps(self) -> int:
        """Epoch steps this rank has drawn (taken before this iteration plus yielded by it, prefetch included)."""
        return self._drawn_steps()

    def _drawn_steps(self) -> int:
        """Epoch steps this rank has drawn (taken before this iteration plus yielded by it)."""
        return len(self) if self._finished else self._position + self._yielded

    # ------------------------------------------------------------------ sampler protocol
    def set_epoch(self, epoch: int) -> None:
        """Select epoch ``epoch``'s plan. Keeps a loaded resume state if it is for this epoch."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._reset_progress()

    def _reset_progress(self) -> None:
        self._segments, self._position, self._yielded, self._finished = [], 0, 0, False
        self.replans = []
        self._version += 1

    @property
    def sampler(self) -> _EpochHook:
        """Lightning calls ``set_epoch`` on ``loader.batch_sampler.sampler`` (not on the batch sampler)."""
        return _EpochHook(self)

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch, counting those taken before a resume.

        Lightning's loop counters continue across a resume, so they need the epoch total.
        """
        plan = self.plan()
        return self._closed_steps() + plan.num_steps

    def __iter__(self) -> Iterator[list[int]]:
        if self._finished:
            self._reset_progress()
        plan = self.plan()
        if len(self) == 0:
            warnings.warn(
                f"{type(self).__name__} plans 0 steps for {self.num_samples} samples on {self.num_replicas} "
                "ranks: every batch was dropped to keep ranks even. Use `drop_last=False` (pads with counted "
                "repeats) or more data.",
                stacklevel=2,
            )
        self._yielded = 0
        # Steps are located afresh each time: a re-plan between two steps changes the plans after it.
        while self._position + self._yielded < len(self):
            plan, row = self._locate(self._position + self._yielded)
            b = int(plan.steps[row, self.rank])
            self._yielded += 1
            lo = int(plan.batch_start[b])
            yield plan.order[lo: lo + int(plan.batch_len[b])].tolist()
        self._finished = True

    # ------------------------------------------------------------------ state
    def _settings(self) -> dict[str, Any]:
        cm = self.cost_model
        settings = {
            "policy": self.policy.to_dict(), "balance": self.balance, "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "cost_model": cm.to_json() if callable(getattr(cm, "to_json", None)) else type(cm).__name__,
        }
        if self.sequence_parallel is not None:  # absent without SP: older states keep their fingerprint
            settings["sequence_parallel"] = self.sequence_parallel.to_dict()
        return settings

    def _fingerprint(self) -> str:
        return hashlib.sha1(json.dumps(self._settings(), sort_keys=True, default=str).encode()).hexdigest()[:16]

    def shapes_fingerprint(self) -> str:
        """Hash of every sample's token grid, in dataset order (cheap: 2 bytes a sample)."""
        if self._shapes_digest is None:
            h = hashlib.blake2b(digest_size=8)
            h.update(np.ascontiguousarray(self.bucket_grids).tobytes())
            h.update(np.ascontiguousarray(self._bucket_of).tobytes())
            self._shapes_digest = h.hexdigest()
        return self._shapes_digest

    def state_dict(self, steps_taken: int | None = None) -> dict[str, Any]:
        """Resume state.

        Args:
            steps_taken: global steps (= batches per rank) actually trained in this epoch,
                counting those before earlier resumes — e.g. Lightning's
                ``fit_loop.epoch_loop.batch_progress.current.processed``. Without it the sampler
                counts what it has yielded, which runs ahead of training when DataLoader workers
                prefetch.
        """
        plan = self.plan()
        closed = self._closed_steps()
        position = self._drawn_steps() if steps_taken is None else int(steps_taken)
        if not 0 <= position <= closed + plan.num_steps:
            raise ValueError(
                f"`state_dict(steps_taken={steps_taken!r})` is not valid: epoch {self.epoch} has "
                f"{closed + plan.num_steps} steps ({closed} before the current plan and {plan.num_steps} in it)."
            )
        segments = [[w, k] if spec is None else [w, k, spec] for w, k, spec in self._segments]
        segments.append([self.num_replicas, max(0, position - closed)])
        state = {"version": _STATE_VERSION, "epoch": self.epoch, "seed": self.seed, "segments": segments,
                 "num_samples": self.num_samples, "fingerprint": self._fingerprint(),
                 "settings": json.loads(json.dumps(self._settings(), default=str)),
                 "shapes": self.shapes_fingerprint()}
        if position < closed:  # inside the old plan of a re-plan that has not taken over yet
            state["position"] = position
        return state

    @property
    def steps_taken(self) -> int:
        """Global steps of the current epoch taken before this iteration (a loaded state's count)."""
        return self._position

    def load_state_dict(self, state: dict[str, Any], *, allow_unverified: bool = False) -> None:
        """Resume from :meth:`state_dict`, possibly saved under a different ``num_replicas``.

        Every field is type- and range-checked before anything changes.

        Args:
            state: a :meth:`state_dict`.
            allow_unverified: load a state without the ``shapes`` or ``fingerprint`` fields (written
                by an older release), whose dataset and settings cannot be checked. Off by default: such
                a state resumed on a changed dataset or policy silently loses and repeats samples.

        Raises:
            ValueError: a field is missing, of the wrong type or out of range; or the dataset (its size
                or any sample's token grid), the seed or the plan settings (policy, balance, shuffle,
                drop_last, cost model) differ from those at save time, so the samples already seen
                cannot be reconstructed; or the state cannot be checked and ``allow_unverified`` is
                off. The message names the field that differs and both values.
        """
        if not isinstance(state, dict):
            raise ValueError(f"The sampler state is a {type(state).__name__}, not a dict.")
        version = state.get("version")
        if version not in _READABLE_STATE_VERSIONS:
            raise ValueError(
                f"The sampler state has version={version!r}; this release reads versions {_READABLE_STATE_VERSIONS}."
            )
        unchecked = [k for k in ("shapes", "fingerprint") if state.get(k) is None]
        if unchecked and not allow_unverified:
            raise ValueError(
                f"The sampler state has no {' or '.join(f'`{k}`' for k in unchecked)} (written by an older release), "
                "so a changed dataset or policy cannot be detected and would silently skip and repeat samples. "
                "Resume from an end-of-epoch checkpoint, or, if the dataset and settings are unchanged, allow it "
                "with `allow_unverified_resume=True`."
            )

        def _int(name: str, value: Any, low: int) -> int:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"The sampler state has {name}={value!r}; expected an integer >= {low}.")
            return int(value)

        n = _int("num_samples", state.get("num_samples"), 1)
        if n != self.num_samples:
            raise ValueError(
                f"The sampler state has num_samples={n} but the dataset has {self.num_samples}. "
                "Resume with the same dataset, or from an end-of-epoch checkpoint without the loader state."
            )
        shapes = state.get("shapes")
        if shapes is not None and shapes != self.shapes_fingerprint():
            raise ValueError(
                f"The sampler state has shapes={shapes!r} but the dataset has shapes={self.shapes_fingerprint()!r} "
                "(a hash of every token grid): the dataset has as many samples as at save time, but some token "
                "grids changed, so the samples already seen this epoch cannot be reconstructed. Resume with the "
                "same dataset, or from an end-of-epoch checkpoint."
            )
        epoch = _int("epoch", state.get("epoch"), 0)
        seed = _int("seed", state.get("seed"), 0)
        if seed != self.seed:
            raise ValueError(
                f"The sampler state has seed={seed} but this run has seed={self.seed}; a mid-epoch resume "
                f"needs the seed the epoch was planned with. Set the seed back to {seed} (`seed={seed}`), or "
                "resume from an end-of-epoch checkpoint to change it."
            )
        fp = state.get("fingerprint")
        if fp is not None and fp != self._fingerprint():
            saved = state.get("settings") or {}
            now = json.loads(json.dumps(self._settings(), default=str))
            differ = [k for k in now if k in saved and saved[k] != now[k]] or ["policy/cost model"]
            detail = "; ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in differ if k in saved)
            raise ValueError(
                f"The sampler state was saved with a different {', '.join(differ)} ({detail or 'not recorded'}); "
                "the samples already seen this epoch cannot be reconstructed. Resume with the same settings."
            )
        raw = state.get("segments")
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"The sampler state has segments={raw!r}; expected a non-empty list of [ranks, steps].")
        segments = []
        for i, seg in enumerate(raw):
            last = i == len(raw) - 1
            if not isinstance(seg, (list, tuple)) or len(seg) not in ((2,) if last else (2, 3)) or (
                    len(seg) == 3 and not _valid_spec(seg[2], len(self.bucket_seq_lens))):
                raise ValueError(f"The sampler state has segments[{i}]={str(seg)[:200]}; expected [ranks, steps]"
                                 + ("" if last else " or [ranks, steps, spec]") + ".")
            segments.append((_int(f"segments[{i}][0] (ranks)", seg[0], 1), _int(f"segments[{i}][1] (steps)", seg[1], 0),
                             seg[2] if len(seg) == 3 else None))
        *closed, (w, k, _) = segments
        total = sum(s[1] for s in closed)
        position = state.get("position", total + k)
        if "position" in state and (k != 0 or not 0 <= _int("position", position, 0) < total):
            raise ValueError(f"The sampler state has position={position!r} with segments={str(raw)[:200]}; expected a "
                             f"step before the last segment's start ({total}) and no step in it.")
        self.epoch = epoch
        self._reset_progress()
        start = 0
        for j, (wj, kj, _) in enumerate(closed):
            if position < start + kj and any(s[0] != self.num_replicas for s in closed[j:]):
                # Inside an old plan whose re-plan has not taken over, on another world size: that plan
                # ends here, and the rest is planned for this world size with the current settings.
                closed = closed[:j] + [(wj, position - start, closed[j][2])]
                w, k = self.num_replicas, 0
                break
            start += kj
        if w == self.num_replicas:
            self._segments = closed
        else:
            # A segment that took no step consumed nothing: leave it out.
            self._segments = closed + ([(w, k, None)] if k else [])
        self._position = position
        self._cache = None
        # Range-check the steps against the plans they refer to now, not at the first batch.
        self.plan()

    # ------------------------------------------------------------------ reporting
    @property
    def plan_stats(self) -> dict[str, Any]:
        """Statistics of the current plan (the remaining part of the epoch after a resume).

        Keys: ``num_samples``, ``num_steps``, ``num_batches`` (real, per plan), ``padded_batches``,
        ``padded_samples``, ``dropped_batches``, ``dropped_samples``, ``skipped_oversize``,
        ``compute_cv`` (mean over steps of the CV of predicted per-rank cost), ``bubble``
        (1 - sum of step means / sum of step maxima), ``balance``, ``num_replicas``.
        """
        plan = self.plan()
        loads = plan.batch_cost[plan.steps] if plan.num_steps else np.zeros((0, self.num_replicas))
        summary = summarize_step_loads(loads)
        return {
            "num_samples": self.num_samples,
            "num_steps": plan.num_steps,
            "num_batches": int(len(plan.batch_len) - plan.dropped_batches),
            "padded_batches": plan.padded_batches,
            "padded_samples": plan.padded_samples,
            "dropped_batches": plan.dropped_batches,
            "dropped_samples": plan.dropped_samples,
            "skipped_oversize": self.skipped_oversize,
            "compute_cv": summary["compute_cv"],
            "bubble": summary["bubble"],
            "balance": self.balance,
            "num_replicas": self.num_replicas,
        }

    def bucket_table(self) -> list[dict[str, Any]]:
        """One row per distinct token grid: grid, S, samples, batch size (0: skipped), batches, and with
        sequence parallelism ``sp_degree`` (ranks per batch; 1: data parallel)."""
        bs = self.bucket_batch_sizes
        nb = np.where(bs > 0, -(-self.bucket_counts // np.maximum(bs, 1)), 0)
        rows = [
            {"grid": tuple(int(v) for v in g), "seq_len": int(s), "samples": int(c), "batch_size": int(b),
             "batches": int(n)}
            for g, s, c, b, n in zip(self.bucket_grids, self.bucket_seq_lens, self.bucket_counts, bs, nb, strict=True)
        ]
        if self.sequence_parallel is not None:
            for row, k in zip(rows, self.bucket_degrees.tolist(), strict=True):
                row["sp_degree"] = int(k)
        return rows

    def degree_by_grid(self) -> dict[tuple[int, int, int], int]:
        """Token grid → SP degree of its batches on this sampler's world size (1: data parallel)."""
        return {tuple(int(v) for v in g): int(k) for g, k in zip(self.bucket_grids, self.bucket_degrees, strict=True)
                if k > 0}


def _valid_spec(spec: Any, num_buckets: int) -> bool:
    """A segment ``spec`` of :meth:`AdaptiveBucketBatchSampler._spec_of` for ``num_buckets`` buckets."""
    if not isinstance(spec, dict):
        return False
    sizes, costs = spec.get("batch_sizes"), spec.get("costs")
    return (isinstance(sizes, list) and len(sizes) == num_buckets and all(isinstance(b, int) and b >= 0 for b in sizes)
            and isinstance(costs, list) and all(isinstance(c, list) and len(c) == 3 for c in costs))


class _EpochHook:
    """Forwards ``set_epoch`` to the batch sampler (see :attr:`AdaptiveBucketBatchSampler.sampler`)."""

    def __init__(self, batch_sampler: AdaptiveBucketBatchSampler) -> None:
        self._batch_sampler = batch_sampler

    def set_epoch(self, epoch: int) -> None:
        self._batch_sampler.set_epoch(epoch)
