"""Batch-size policies: how many samples of sequence length S fit one micro-batch.

Three policies share one interface, ``batch_size(seq_len) -> int`` and the vectorised
``batch_sizes(seq_lens) -> np.ndarray``:

- :class:`EqualTokenPolicy` — the common baseline, ``B = max(1, max_tokens // S)`` (B·S constant).
- :class:`DualConstraintPolicy` — the AdaptiveLoad rule
  ``B = max(1, min(m_mem // S, floor(m_comp / S**p)))``: a memory cap on tokens and a compute cap
  on ``B·S^p`` (self-attention makes long sequences super-linear in cost).
- :class:`CostModelPolicy` — the generalisation to any fitted cost model: the largest B with
  ``B·S <= m_mem`` and ``cost_model.predict(B, S) <= step_budget``.

A sample whose S alone exceeds the memory budget cannot be trained without running out of memory.
Policies with a memory budget report it: ``oversize="error"`` (default) raises, ``oversize="skip"``
makes ``batch_sizes`` return 0 for it so the sampler leaves it out and counts it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from lightning_adaptiveload._checks import ON_BAD, check_choice, check_positive


class CostPredictor(Protocol):
    """Anything with a vectorised ``predict(B, S) -> seconds`` (e.g. ``CostModel``)."""

    def predict(self, batch_size: Any, seq_len: Any) -> Any: ...


def _as_seq_lens(seq_lens: Any) -> np.ndarray:
    s = np.asarray(seq_lens)
    if s.dtype.kind not in "iu":
        if s.dtype.kind == "f" and np.all(np.isfinite(s)) and np.all(s == np.floor(s)):
            s = s.astype(np.int64)
        else:
            raise ValueError(f"`seq_lens` must be integers; got dtype {s.dtype}.")
    s = s.astype(np.int64, copy=False)
    if s.size and s.min() < 1:
        raise ValueError(f"`seq_lens` must be positive; got a minimum of {int(s.min())}.")
    return s


class BatchSizePolicy(ABC):
    """Maps a sequence length S (tokens per sample) to a micro-batch size B.

    Subclasses implement :meth:`_batch_sizes` on a 1-D int64 array of distinct, validated lengths.
    """

    #: Largest S a single sample may have (``None``: no limit). Longer samples are "oversize".
    max_seq_len: int | None = None
    #: ``"error"`` or ``"skip"``: what to do with oversize samples.
    oversize: str = "error"
    #: Exponent of S used to estimate a batch's compute when no cost model is given.
    cost_exponent: float = 2.0

    @abstractmethod
    def _batch_sizes(self, seq_lens: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """Plain-dict description (type + constructor arguments), e.g. for logs and checkpoints."""

    def batch_sizes(self, seq_lens: Any) -> np.ndarray:
        """Vectorised batch size for an array of sequence lengths (int64, same shape).

        Computed once per distinct length, so 10M samples with a few hundred distinct grids cost
        one ``np.unique``.

        Raises:
            ValueError: a length is not a positive integer, or exceeds ``max_seq_len`` with
                ``oversize="error"``.
        """
        s = _as_seq_lens(seq_lens)
        flat = s.reshape(-1)
        uniq, inverse = np.unique(flat, return_inverse=True)
        out = np.asarray(self._batch_sizes(uniq), dtype=np.int64)
        if self.max_seq_len is not None:
            over = uniq > self.max_seq_len
            if over.any():
                if self.oversize == "error":
                    raise ValueError(
                        f"A sample with S={int(uniq[over][0])} tokens exceeds the memory budget "
                        f"{self.max_seq_len} of {self!r}: it would run out of memory even alone. "
                        "Raise `m_mem`, crop such samples, or pass `oversize='skip'` to leave them out "
                        "(they are counted)."
                    )
                out = np.where(over, 0, out)
        return out[inverse].reshape(s.shape)

    def batch_size(self, seq_len: int) -> int:
        """Batch size for one sequence length S (0 only for an oversize S with ``oversize="skip"``)."""
        return int(self.batch_sizes(np.array([seq_len]))[0])

    def __repr__(self) -> str:
        d = self.to_dict()
        d.pop("type")
        args = ", ".join(f"{k}={v!r}" for k, v in d.items())
        return f"{type(self).__name__}({args})"


class EqualTokenPolicy(BatchSizePolicy):
    """The equal-token baseline: ``B = max(1, max_tokens // S)`` so that B·S stays about constant.

    It ignores that attention cost grows with S², so long-video batches become stragglers.

    Args:
        max_tokens: token budget per micro-batch (positive integer).

    Example::

        >>> EqualTokenPolicy(65520).batch_size(1560)
        42
    """

    def __init__(self, max_tokens: int) -> None:
        check_positive("EqualTokenPolicy", "max_tokens", max_tokens, integer=True)
        self.max_tokens = int(max_tokens)

    def _batch_sizes(self, seq_lens: np.ndarray) -> np.ndarray:
        return np.maximum(1, self.max_tokens // seq_lens)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "equal_token", "max_tokens": self.max_tokens}


class FixedBatchPolicy(BatchSizePolicy):
    """Batch sizes given per sequence length, e.g. to pin a previous run's or a benchmark's batches.

    Args:
        batch_sizes: ``{S: B}`` with positive integers (``None`` or empty: only ``default``).
        default: B for sequence lengths not listed; ``None`` makes an unlisted S an error.

    Example::

        >>> FixedBatchPolicy({32760: 1, 7800: 4, 1560: 16}).batch_size(7800)
        4
    """

    def __init__(self, batch_sizes: Mapping[int, int] | None, default: int | None = None) -> None:
        batch_sizes = {} if batch_sizes is None else batch_sizes
        if not isinstance(batch_sizes, Mapping) or (not batch_sizes and default is None):
            raise ValueError(
                f"`FixedBatchPolicy(batch_sizes={batch_sizes!r})` is not valid. Expected a mapping {{S: B}} of "
                "positive integers (non-empty unless `default` is given)."
            )
        table: dict[int, int] = {}
        for s, b in batch_sizes.items():
            # Keys may arrive as strings from a config file or command line: "32760" is S = 32760.
            key = int(s) if isinstance(s, str) and s.strip().isdigit() else s
            check_positive("FixedBatchPolicy", f"batch_sizes key {s!r}", key, integer=True)
            check_positive("FixedBatchPolicy", f"batch_sizes[{s!r}]", b, integer=True)
            table[int(key)] = int(b)
        if default is not None:
            check_positive("FixedBatchPolicy", "default", default, integer=True)
        self.table = dict(sorted(table.items()))
        self.default = None if default is None else int(default)

    def _batch_sizes(self, seq_lens: np.ndarray) -> np.ndarray:
        missing = sorted({int(s) for s in seq_lens if int(s) not in self.table})
        if missing and self.default is None:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            # The table to write, with <B> where a batch size is missing (up to 8 of them).
            example = ", ".join([f"{s}: {b}" for s, b in self.table.items()] + [f"{s}: <B>" for s in missing[:8]])
            raise ValueError(
                f"`FixedBatchPolicy` has no batch size for S={missing[0]} (unlisted sequence lengths of the data: "
                f"{missing[:8]}{more}; listed: {sorted(self.table)}). List every S, e.g. "
                f"`FixedBatchPolicy(batch_sizes={{{example}{', ...' if more else ''}}})`, "
                "or give one B for every unlisted S with `FixedBatchPolicy(default=<B>)`."
            )
        return np.array([self.table.get(int(s), self.default or 0) for s in seq_lens], dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "batch_sizes": dict(self.table), "default": self.default}


def _floor_div_power(m_comp: float, seq_lens: np.ndarray, p: float) -> np.ndarray:
    """``floor(m_comp / S**p)`` per S, robust to floating-point rounding.

    With an integral ``p`` and ``m_comp`` the result is exact (Python integers: ``S**p`` may pass
    2**63). Otherwise the float quotient is snapped to the nearest integer when it lies within a
    relative 1e-12 of it, so ``m_comp = 3 * S**p`` gives 3 and not 2.999999… → 2.
    """
    if float(p).is_integer() and float(m_comp).is_integer():
        mc, ip = int(m_comp), int(p)
        return np.array([mc // (int(s) ** ip) for s in seq_lens.tolist()], dtype=np.int64)
    q = float(m_comp) / np.power(seq_lens.astype(np.float64), float(p))
    nearest = np.round(q)
    snap = np.abs(q - nearest) <= 1e-12 * np.maximum(1.0, nearest)
    q = np.where(snap, nearest, np.floor(q))
    # int64 saturates only for absurd budgets; B is capped by m_mem // S anyway.
    return np.minimum(q, float(np.iinfo(np.int64).max // 2)).astype(np.int64)


class DualConstraintPolicy(BatchSizePolicy):
    """The AdaptiveLoad dual constraint: ``B = max(1, min(m_mem // S, floor(m_comp / S**p)))``.

    ``m_mem`` caps the tokens of a micro-batch (activation memory grows with B·S); ``m_comp`` caps
    its compute B·S^p (p≈2: self-attention). Short samples are memory-bound, long ones compute-bound,
    which levels the per-step cost across ranks.

    Args:
        m_mem: token budget per micro-batch (positive integer).
        m_comp: compute budget in units of tokens^p (positive finite number).
        p: exponent of S in the compute constraint (positive finite number).
        oversize: ``"error"`` (default) raises for a sample with S > m_mem; ``"skip"`` gives it
            batch size 0 so the sampler leaves it out and counts it.

    Raises:
        ValueError: a non-positive, NaN or infinite argument, or an unknown ``oversize``.

    Example::

        >>> DualConstraintPolicy(m_mem=65520, m_comp=65520 * 1560, p=2).batch_size(32760)
        1
    """

    def __init__(self, m_mem: int, m_comp: float, p: float = 2.0, oversize: str = "error") -> None:
        check_positive("DualConstraintPolicy", "m_mem", m_mem, integer=True)
        check_positive("DualConstraintPolicy", "m_comp", m_comp)
        check_positive("DualConstraintPolicy", "p", p)
        check_choice("DualConstraintPolicy", "oversize", oversize, ON_BAD)
        self.m_mem = int(m_mem)
        self.m_comp = int(m_comp) if float(m_comp).is_integer() else float(m_comp)
        self.p = float(p)
        self.oversize = oversize
        self.max_seq_len = self.m_mem
        self.cost_exponent = self.p

    def _batch_sizes(self, seq_lens: np.ndarray) -> np.ndarray:
        mem = self.m_mem // seq_lens
        comp = _floor_div_power(self.m_comp, seq_lens, self.p)
        return np.maximum(1, np.minimum(mem, comp))

    def to_dict(self) -> dict[str, Any]:
        return {"type": "dual_constraint", "m_mem": self.m_mem, "m_comp": self.m_comp, "p": self.p,
                "oversize": self.oversize}


class CostModelPolicy(BatchSizePolicy):
    """The largest B with ``B·S <= m_mem`` and ``cost_model.predict(B, S) <= step_budget`` (B >= 1).

    Found by a vectorised bisection over all distinct S at once, so the cost model must be
    non-decreasing in B (every physical step-time model is).

    Args:
        cost_model: object with a vectorised ``predict(B, S)`` in seconds (e.g. ``CostModel``).
        m_mem: token budget per micro-batch (positive integer).
        step_budget: target seconds per micro-batch step (positive finite number).
        oversize: ``"error"`` (default) or ``"skip"`` for a sample with S > m_mem (see
            :class:`DualConstraintPolicy`).

    Raises:
        ValueError: a non-positive, NaN or infinite budget, an unknown ``oversize``, or a
            ``cost_model`` without ``predict``.
    """

    def __init__(
        self, cost_model: CostPredictor, m_mem: int, step_budget: float, oversize: str = "error"
    ) -> None:
        if not callable(getattr(cost_model, "predict", None)):
            raise ValueError(
                f"`CostModelPolicy(cost_model={cost_model!r})` is not valid. Expected an object with "
                "a vectorised `predict(B, S)` method, e.g. `CostModel.fit(...)`."
            )
        check_positive("CostModelPolicy", "m_mem", m_mem, integer=True)
        check_positive("CostModelPolicy", "step_budget", step_budget)
        check_choice("CostModelPolicy", "oversize", oversize, ON_BAD)
        self.cost_model = cost_model
        self.m_mem = int(m_mem)
        self.step_budget = float(step_budget)
        self.oversize = oversize
        self.max_seq_len = self.m_mem

    def _batch_sizes(self, seq_lens: np.ndarray) -> np.ndarray:
        lo = np.ones_like(seq_lens)
        hi = np.maximum(1, self.m_mem // seq_lens)
        # Invariant: the answer lies in [lo, hi]; lo is always admissible (B >= 1 by definition).
        while np.any(lo < hi):
            mid = (lo + hi + 1) // 2
            t = np.asarray(self.cost_model.predict(mid, seq_lens), dtype=np.float64)
            ok = t <= self.step_budget
            lo = np.where(ok, mid, lo)
            hi = np.where(ok, hi, mid - 1)
        return lo

    def to_dict(self) -> dict[str, Any]:
        cm = self.cost_model
        cm_desc: Any = cm.to_json() if callable(getattr(cm, "to_json", None)) else repr(cm)
        return {"type": "cost_model", "cost_model": cm_desc, "m_mem": self.m_mem,
                "step_budget": self.step_budget, "oversize": self.oversize}

    def __repr__(self) -> str:
        return (f"CostModelPolicy(cost_model={type(self.cost_model).__name__}, m_mem={self.m_mem}, "
                f"step_budget={self.step_budget}, oversize={self.oversize!r})")


class TieredPolicy(BatchSizePolicy):
    """One policy per range of S, each with its own activation-checkpointing mode.

    Per-bucket checkpointing: short buckets train with the least recomputation (``"none"``), and only
    the sequence lengths that do not fit that way use a mode that recomputes (``"selective"``,
    ``"full"``). Each mode has its own memory budget and step cost, so each range of S gets its own
    policy; the ranges are ``(previous max_seq_len, max_seq_len]`` in order.

    Args:
        tiers: ``(mode, max_seq_len, policy)`` triples with strictly increasing ``max_seq_len``; the
            last tier's limit is the longest S that can be trained at all (longer samples are oversize).
        cost_model: ``predict(B, S)`` of the whole range (each S priced in its own mode), which the
            sampler balances on; ``None``: the sampler's default.
        oversize: ``"error"`` or ``"skip"`` for a sample above the last tier.

    Example::

        >>> TieredPolicy([("none", 46800, EqualTokenPolicy(60000)),
        ...               ("selective", 80000, EqualTokenPolicy(160000))]).batch_size(75600)
        2
    """

    def __init__(self, tiers: Any, cost_model: CostPredictor | None = None, oversize: str = "error") -> None:
        check_choice("TieredPolicy", "oversize", oversize, ON_BAD)
        checked: list[tuple[str, int, BatchSizePolicy]] = []
        for i, tier in enumerate(tiers or ()):
            if not (isinstance(tier, (tuple, list)) and len(tier) == 3 and isinstance(tier[0], str)
                    and isinstance(tier[2], BatchSizePolicy)):
                raise ValueError(f"`TieredPolicy(tiers[{i}]={tier!r})` is not valid. Expected a (mode, max_seq_len, "
                                 "BatchSizePolicy) triple.")
            check_positive("TieredPolicy", f"tiers[{i}] max_seq_len", tier[1], integer=True)
            if checked and int(tier[1]) <= checked[-1][1]:
                raise ValueError(f"`TieredPolicy(tiers=...)`: max_seq_len must increase from tier to tier; tier {i} "
                                 f"({tier[0]!r}) has {tier[1]} after {checked[-1][1]}.")
            checked.append((tier[0], int(tier[1]), tier[2]))
        if not checked:
            raise ValueError("`TieredPolicy(tiers=[])` is not valid. Expected at least one tier.")
        if cost_model is not None and not callable(getattr(cost_model, "predict", None)):
            raise ValueError(f"`TieredPolicy(cost_model={cost_model!r})` is not valid. Expected `predict(B, S)`.")
        self.tiers = checked
        self.cost_model = cost_model
        self.oversize = oversize
        self.max_seq_len = checked[-1][1]
        self.cost_exponent = max(float(getattr(p, "cost_exponent", 2.0)) for _, _, p in checked)

    def tier_index(self, seq_lens: Any) -> np.ndarray:
        """Index of the tier of each S (``len(tiers)`` above the last tier)."""
        limits = np.array([t[1] for t in self.tiers], dtype=np.int64)
        return np.searchsorted(limits, _as_seq_lens(seq_lens), side="left")

    def mode_for(self, seq_len: int) -> str | None:
        """The activation-checkpointing mode S trains with (``None``: above every tier)."""
        i = int(self.tier_index(np.array([seq_len]))[0])
        return self.tiers[i][0] if i < len(self.tiers) else None

    def memory_budgets(self, seq_lens: Any) -> np.ndarray:
        """Tokens one GPU holds for each S in the mode it trains with: its tier's policy's token budget
        (``m_mem``, or ``max_tokens`` of an equal-token policy; the tier's limit for a policy without one),
        the last tier's above every tier. A sequence-parallel group of k ranks holds k times that."""
        idx = np.minimum(self.tier_index(seq_lens), len(self.tiers) - 1)
        budgets = np.array([int(getattr(p, "m_mem", None) or getattr(p, "max_tokens", None) or s)
                            for _, s, p in self.tiers], dtype=np.int64)
        return budgets[idx]

    def _batch_sizes(self, seq_lens: np.ndarray) -> np.ndarray:
        idx = self.tier_index(seq_lens)
        out = np.ones_like(seq_lens)
        for i, (_, _, policy) in enumerate(self.tiers):
            mask = idx == i
            if mask.any():
                # Each tier's limit lies within its own policy's budget, so its oversize rule never fires.
                out[mask] = policy._batch_sizes(seq_lens[mask])
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"type": "tiered", "oversize": self.oversize,
                "tiers": [{"mode": m, "max_seq_len": s, "policy": p.to_dict()} for m, s, p in self.tiers]}

    def __repr__(self) -> str:
        inner = ", ".join(f"{m} S<={s:,}: {p!r}" for m, s, p in self.tiers)
        return f"TieredPolicy({inner}, oversize={self.oversize!r})"
