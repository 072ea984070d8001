"""The one rule that turns a calibration into a batch-size policy.

Given a fitted :class:`~lightning_adaptiveload.calibration.costmodel.CostModel` ``t(B, S)``, the
corpus's token grids and a memory budget, the policy is

    ``B(S) = the largest B with B·S <= M_mem and t(B, S) <= τ``   (at least 1),

which for the ``"power"`` form ``t = a + b·B·S^p`` is exactly the paper's dual constraint
``B = max(1, min(M_mem // S, floor(M_comp / S^p)))`` with ``M_comp = (τ - a) / b``, and for any
other form a :class:`~lightning_adaptiveload.bucketing.policy.CostModelPolicy`.

Three numbers decide it:

- ``M_mem`` (:func:`memory_budget`): tokens per batch that fit. With a memory model and the device's
  memory: ``floor((memory·(1 - margin) - m0 - pending optimizer bytes) / m1)``, kept below the
  smallest profiled ``B·S`` that ran out of memory. Without one (CPU): the largest ``B·S`` profiled,
  at least the longest sequence.
- ``τ``, the step budget (:func:`derive_policy`): unless given, the budget with the highest predicted
  throughput for this corpus and world size. Every candidate budget between "B = 1 at the longest
  sequence" and "every bucket at its memory cap" is planned with the sampler exactly as training
  will plan it and timed with the cost model (:func:`~lightning_adaptiveload.calibration.simulate.simulate`:
  a step lasts as long as its slowest rank, so imbalance costs throughput there too); the smallest
  budget within 1% of the best wins (smaller batches: less memory, finer balance). A large fixed
  cost per step therefore gives large batches, and a steep attention cost gives the long videos
  small ones. A flat profile (the dearest batch at its memory cap predicted within
  :data:`FLAT_PROFILE_REL`, or within the fit's held-out error, of the cheapest batch of the corpus)
  has no cost to trade: every bucket trains at its memory cap, and the derivation says so
  (``Derivation.warning``).
- the form of the cost model (above).

Activation checkpointing, when the model leaves it to the calibration (``"auto"``), is chosen per
bucket: the profile runs least recomputation first (``none`` → ``selective`` → ``full``), and each mode
takes the sequence lengths above the previous mode's up to the longest it trained at B = 1 within the
device's memory less the margin and the optimizer state still to come (:func:`fit_tiers`). Each tier
gets its own ``M_mem`` (its memory model) and prices its steps with the cost model times its measured
recomputation scale; one step budget ``τ`` serves all tiers, and the policy is a
:class:`~lightning_adaptiveload.bucketing.policy.TieredPolicy`. So images and short clips train
without recomputation at the largest batches that fit, and only the clips that need it recompute.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.bucketing.buckets import count_buckets
from lightning_adaptiveload.bucketing.policy import (
    BatchSizePolicy,
    CostModelPolicy,
    DualConstraintPolicy,
    EqualTokenPolicy,
    TieredPolicy,
)
from lightning_adaptiveload.calibration.costmodel import CostModel, MemoryModel, map_tokens, token_table
from lightning_adaptiveload.calibration.simulate import CorpusSimulator

#: Bytes per parameter of optimizer state not yet allocated when profiling: Adam-style optimizers
#: create two fp32 moments on their first step, after the shape benchmark measured peak memory.
PENDING_OPTIMIZER_BYTES_PER_PARAM = 8
#: A budget within this fraction of the best predicted throughput counts as the best.
THROUGHPUT_TOLERANCE = 0.01
#: A profile is flat when the corpus's dearest batch (at its memory cap) is predicted within this fraction
#: (or within the fit's held-out error, if larger) of its cheapest (B = 1 at the shortest S): the budgets
#: between them then differ by less than profiling noise on a shared device (a 2-core CPU's tiny-model
#: profile shows 3-25% held-out error), so the fit cannot rank them. Such a profile gets every bucket at
#: its memory cap: the largest batches that fit, which under a flat step time also give the most tokens
#: per second, and which the closed loop or a new profile can then lower.
FLAT_PROFILE_REL = 0.05
#: ``Derivation.budget_source`` of the flat-profile rule.
MEMORY_CAPS_SOURCE = "memory caps (flat profile)"
#: ``Derivation.budget_source`` of a profile too noisy to rank budgets (``derive_policy(noisy=...)``).
NOISY_CAPS_SOURCE = "memory caps (noisy profile)"
_DEFAULT_CANDIDATES = 24
# Budgets are compared on a corpus of at most this many samples (bucket proportions kept), so
# deriving a policy for 10^8 samples costs the same as for 10^5.
_MAX_SIMULATED_SAMPLES = 100_000


def policy_for_budget(
    cost_model: CostModel, m_mem: int, step_budget_s: float, oversize: str = "error"
) -> BatchSizePolicy:
    """The policy "largest B with ``B·S <= m_mem`` and ``t(B, S) <= step_budget_s``".

    Returns ``DualConstraintPolicy(m_mem, (τ - a) / b, p)`` for the ``"power"`` form (so
    ``B·S^p <= M_comp`` ⇔ predicted time <= τ), else (or with per-length ``corrections``)
    ``CostModelPolicy(cost_model, m_mem, τ)``.

    Raises:
        ValueError: ``m_mem`` is not a positive integer or the budget does not exceed the fixed
            overhead ``a`` (no batch would fit).
    """
    if isinstance(m_mem, bool) or int(m_mem) != m_mem or m_mem < 1:
        raise ValueError(f"`m_mem={m_mem!r}` is not valid. Expected a positive integer token count.")
    a = cost_model.params["a"]
    if not math.isfinite(step_budget_s) or step_budget_s <= a:
        raise ValueError(
            f"`step_budget_s={step_budget_s!r}` is not valid: it must exceed the fixed step overhead "
            f"a={a:.6g} s of {cost_model}, or no batch fits. Raise the budget."
        )
    # B·S^p <= M_comp is in video tokens: it cannot hold per-length factors nor the tokens attention sees.
    if cost_model.form == "power" and not cost_model.corrections and not cost_model.attention_tokens:
        m_comp = (step_budget_s - a) / cost_model.params["b"]
        return DualConstraintPolicy(int(m_mem), m_comp, cost_model.params["p"], oversize=oversize)
    return CostModelPolicy(cost_model, int(m_mem), float(step_budget_s), oversize=oversize)


def pending_optimizer_bytes(num_parameters: int, has_state: bool) -> int:
    """Optimizer bytes that profiling could not see: :data:`PENDING_OPTIMIZER_BYTES_PER_PARAM` per
    parameter when the optimizer has no state yet, else 0."""
    return 0 if has_state else int(num_parameters) * PENDING_OPTIMIZER_BYTES_PER_PARAM


def memory_budget(
    measurements: Sequence[Any],
    memory_model: MemoryModel | None,
    device_memory: int | None,
    *,
    margin: float = 0.1,
    pending_bytes: int = 0,
    longest_seq_len: int = 1,
    shortest_seq_len: int | None = None,
) -> tuple[int, str]:
    """``(M_mem, how it was found)`` from a profile (see the module docstring).

    ``measurements`` have ``batch_size``, ``seq_len`` and ``status`` (``"ok"``, ``"oom"``, ...).
    """
    oom_tokens = [m.batch_size * m.seq_len for m in measurements if m.status == "oom"]
    if memory_model is not None and device_memory:
        with_optimizer = dataclasses.replace(memory_model, m0=memory_model.m0 + pending_bytes)
        shortest = shortest_seq_len or min((m.seq_len for m in measurements), default=1)
        return with_optimizer.max_tokens(device_memory, margin, oom_tokens, min_seq_len=shortest), "memory model"
    ok_tokens = [m.batch_size * m.seq_len for m in measurements if m.status == "ok"]
    m_mem = max([int(longest_seq_len)] + ok_tokens)
    if oom_tokens:
        m_mem = min(m_mem, min(oom_tokens) - 1)
    return int(m_mem), "largest profiled batch"


@dataclass(frozen=True)
class ModeTier:
    """Buckets of up to ``max_seq_len`` tokens (above the previous tier's) train in activation-checkpointing
    ``mode``; a step there takes ``scale`` times the calibration's cost model (its recomputation) and
    peaks at ``memory_model``.

    ``max_seq_len`` is the longest sequence measured to train at B = 1 in that mode within the memory
    limit, so every S of the tier is at or below a measurement, never an extrapolation.
    """

    mode: str
    max_seq_len: int
    scale: float = 1.0
    memory_model: MemoryModel | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "max_seq_len": int(self.max_seq_len), "scale": float(self.scale),
                "memory_model": None if self.memory_model is None else self.memory_model.to_dict()}

    @classmethod
    def from_dict(cls, data: Any) -> ModeTier:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError(f"a checkpointing tier is {type(data).__name__}, not an object")
        try:
            mode, limit, scale = data["mode"], int(data["max_seq_len"]), float(data.get("scale", 1.0))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"a checkpointing tier lacks a valid mode or max_seq_len ({err!r})") from err
        if not isinstance(mode, str) or limit < 1 or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"checkpointing tier {data!r} is not consistent (mode, max_seq_len, scale)")
        mm = data.get("memory_model")
        return cls(mode, limit, scale, None if mm is None else MemoryModel.from_dict(mm))


def tiers_from_record(extra: dict[str, Any]) -> list[ModeTier] | None:
    """The tiers a calibration record's ``extra["checkpointing"]`` holds (``None``: the model's own
    mode was profiled).

    Raises:
        ValueError: the field is malformed.
    """
    data = (extra or {}).get("checkpointing")
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("tiers"), list) or not data["tiers"]:
        raise ValueError(f"`checkpointing` is {str(data)[:200]!r}; expected an object with a non-empty `tiers` list")
    tiers = [ModeTier.from_dict(t) for t in data["tiers"]]
    if any(b.max_seq_len <= a.max_seq_len for a, b in zip(tiers, tiers[1:], strict=False)):
        raise ValueError("`checkpointing.tiers` must have increasing max_seq_len")
    return tiers


class TieredCostModel:
    """``predict(B, S)`` of a corpus trained in several activation-checkpointing modes: the base cost
    model times the scale of the tier S falls in (the last tier's above every limit)."""

    def __init__(self, base: CostModel, tiers: Sequence[ModeTier]) -> None:
        self.base = base
        self.tiers = list(tiers)
        self._limits = np.array([t.max_seq_len for t in self.tiers], dtype=np.float64)
        self._scales = np.array([t.scale for t in self.tiers], dtype=np.float64)

    def predict(self, batch_size: Any, seq_len: Any) -> np.ndarray | float:
        s = np.asarray(seq_len, dtype=np.float64)
        idx = np.minimum(np.searchsorted(self._limits, s, side="left"), len(self._limits) - 1)
        out = np.asarray(self.base.predict(batch_size, s)) * self._scales[idx]
        return float(out) if np.ndim(out) == 0 else out

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base.to_dict(), "tiers": [t.to_dict() for t in self.tiers]}

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), sort_keys=True)

    def __str__(self) -> str:
        scales = ", ".join(f"{t.mode} x{t.scale:.3f}" for t in self.tiers)
        return f"{self.base} [{scales}]"


def fits_at_one(measurement: Any, memory_limit: float | None) -> bool:
    """Whether a measurement is one sample that trained and peaked within ``memory_limit`` bytes
    (without a measured peak or limit, e.g. on CPU, training without an out-of-memory error is enough)."""
    if measurement.status != "ok" or measurement.batch_size != 1:
        return False
    return measurement.peak_bytes is None or memory_limit is None or measurement.peak_bytes <= memory_limit


def fit_tiers(by_mode: Sequence[tuple[str, Sequence[Any]]], cost_model: CostModel, base_memory: MemoryModel | None,
              memory_limit: float | None, base_mode: str | None = None) -> list[ModeTier]:
    """The tiers of a per-mode profile: ``by_mode`` holds ``(mode, measurements)`` least recomputation
    first. A mode takes the sequence lengths above the previous mode's, up to the longest it trained at
    B = 1 within ``memory_limit`` (:func:`fits_at_one`); a mode that adds none gets no tier. Its scale is
    the median ratio of its measured step times to ``cost_model``'s (1 for ``base_mode``, the mode
    ``cost_model`` was fitted to; the first when not given); its memory model is fitted to its
    peaks, or, with one token count only, the line through the base model's fixed bytes and its peak.
    """
    tiers: list[ModeTier] = []
    for mode, meas in by_mode:
        limit = max([m.seq_len for m in meas if fits_at_one(m, memory_limit)], default=0)
        if limit <= (tiers[-1].max_seq_len if tiers else 0):
            continue
        ok = [m for m in meas if m.status == "ok"]
        scale = float(np.median([m.time_s / float(cost_model.predict(m.batch_size, m.seq_len)) for m in ok]))
        if mode == (base_mode if base_mode is not None else by_mode[0][0]):
            scale = 1.0  # the fit itself
        tiers.append(ModeTier(mode, int(limit), scale, _tier_memory(ok, base_memory, cost_model.attention_tokens)))
    return tiers


def _tier_memory(ok: Sequence[Any], base: MemoryModel | None, attention_tokens: dict[int, int]) -> MemoryModel | None:
    peaks = [m for m in ok if m.peak_bytes is not None]
    if not peaks:
        return None
    try:
        return MemoryModel.fit([m.batch_size for m in peaks], [m.seq_len for m in peaks], [m.peak_bytes for m in peaks],
                               attention_tokens)
    except ValueError:
        pass
    if base is None:
        return None
    # One token count: the weights, gradients and workspace (m0) are the base mode's; the rest is per token.
    top = max(peaks, key=lambda m: m.batch_size * m.seq_len)
    per_token = (top.peak_bytes - base.m0) / (top.batch_size * float(map_tokens(attention_tokens, top.seq_len)))
    return MemoryModel(base.m0, per_token, attention_tokens=attention_tokens) if per_token > 0 else None


def tier_memory_budgets(tiers: Sequence[ModeTier], measurements: Sequence[Any], device_memory: int | None, *,
                        margin: float, pending_bytes: int, seq_lens: Any,
                        base_mode: str | None = None) -> list[tuple[int, str]]:
    """``(M_mem, how)`` of every tier (:func:`memory_budget` on its own measurements and memory model,
    with the corpus's sequence lengths of that tier), never below the tier's measured ``max_seq_len``.

    A tier other than ``base_mode`` (the first when not given) was profiled at B = 1 only, so its
    memory model is a line through one or two points: its budget is kept at the largest ``B·S`` it
    measured (a measurement, not an extrapolation to batches it never ran)."""
    seq = np.unique(np.asarray(seq_lens, dtype=np.int64))
    base_mode = base_mode if base_mode is not None else (tiers[0].mode if tiers else None)
    out, lower = [], 0
    for t in tiers:
        own = [m for m in measurements if m.mode == t.mode] or list(measurements)
        in_tier = seq[(seq > lower) & (seq <= t.max_seq_len)]
        m_mem, how = memory_budget(own, t.memory_model, device_memory, margin=margin, pending_bytes=pending_bytes,
                                   longest_seq_len=t.max_seq_len,
                                   shortest_seq_len=int(in_tier.min()) if in_tier.size else t.max_seq_len)
        if t.mode != base_mode:
            measured = max([m.batch_size * m.seq_len for m in own if m.status == "ok"], default=t.max_seq_len)
            if measured < m_mem:
                m_mem, how = measured, f"largest batch measured in '{t.mode}'; its model gives {int(m_mem):,}"
        out.append((max(int(m_mem), t.max_seq_len), how))
        lower = t.max_seq_len
    return out


@dataclass(frozen=True)
class Derivation:
    """A derived policy and why: the budgets, the candidates tried and their predicted throughput.

    ``predicted`` and ``baseline`` are simulated epochs of the corpus (``tokens_per_s``,
    ``compute_cv``, ``bubble``) under the derived policy and under the equal-token baseline with
    ``max_tokens = m_mem`` dealt at random.
    """

    policy: BatchSizePolicy
    m_mem: int
    step_budget_s: float
    budget_source: str
    world_size: int
    predicted: dict[str, float]
    baseline: dict[str, float]
    candidates: list[tuple[float, float]] = field(default_factory=list)
    #: Per-bucket checkpointing: ``{mode, max_seq_len, scale, m_mem}`` per tier (empty: one mode).
    tiers: list[dict[str, Any]] = field(default_factory=list)
    #: Why the policy is not the throughput rule's (a flat profile: every bucket at its memory cap); "" if it is.
    warning: str = ""

    @property
    def cost_model(self) -> Any:
        """What the sampler balances on: the tiered cost model, or ``None`` (the calibration's own)."""
        return getattr(self.policy, "cost_model", None) if self.tiers else None

    def mode_for(self, seq_len: int) -> str | None:
        """The activation-checkpointing mode of a bucket (``None``: no tiers, or S above every tier): the
        policy's own rule (:meth:`TieredPolicy.mode_for`), or the one tier's mode."""
        mode_for = getattr(self.policy, "mode_for", None)
        if mode_for is not None:
            return mode_for(seq_len)
        return self.tiers[0]["mode"] if self.tiers else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.to_dict(), "m_mem": self.m_mem, "step_budget_s": self.step_budget_s,
            "budget_source": self.budget_source, "world_size": self.world_size,
            "predicted": dict(self.predicted), "baseline": dict(self.baseline),
            "candidates": [list(c) for c in self.candidates], "tiers": [dict(t) for t in self.tiers],
            **({"warning": self.warning} if self.warning else {}),
        }

    @property
    def baseline_gain(self) -> float:
        """Predicted tokens/s over the equal-token baseline's, minus 1 (NaN without a baseline)."""
        base = float(self.baseline.get("tokens_per_s", 0.0))
        return float(self.predicted["tokens_per_s"]) / base - 1 if base > 0 else float("nan")

    def summary(self) -> str:
        """One line: the policy's predicted throughput against the equal-token baseline."""
        p, b, gain = self.predicted, self.baseline, self.baseline_gain
        mode = f", all in '{self.tiers[-1]['mode']}'" if len(self.tiers) > 1 else ""
        return (
            f"predicted on {self.world_size} rank(s): {p['tokens_per_s']:,.0f} tokens/s, compute CV "
            f"{p['compute_cv']:.1%} | equal-token (max_tokens={self.m_mem}{mode}, dealt at random): "
            f"{b['tokens_per_s']:,.0f} tokens/s, compute CV {b['compute_cv']:.1%} | {gain:+.1%}"
        )


def _simulation_corpus(grids: np.ndarray, counts: np.ndarray, max_samples: int) -> np.ndarray:
    """Distinct ``grids`` with their sample ``counts`` as a corpus: all of it, or the same buckets in
    the same proportions with about ``max_samples`` samples (every bucket keeps at least one)."""
    total = int(counts.sum())
    if total > max_samples:
        counts = np.maximum(1, np.round(counts * (max_samples / total))).astype(np.int64)
    return np.repeat(grids, counts, axis=0)


def _predict(sim: CorpusSimulator, policy: BatchSizePolicy, cost_model: Any) -> dict[str, float]:
    """A simulated epoch's figures: ``policy`` on ``sim``'s corpus, timed by ``cost_model``."""
    r = sim(policy, cost_model=cost_model)
    return {"tokens_per_s": r.tokens_per_s, "compute_cv": r.compute_cv, "bubble": r.bubble,
            "num_steps": float(r.num_steps)}


def price_model(cost_model: CostModel, tiers: Sequence[ModeTier] | None = None) -> Any:
    """What :func:`derive_policy` times a policy with: the cost model (in the one tier's mode), or, with two
    tiers or more, the :class:`TieredCostModel` the sampler balances on."""
    tiers = list(tiers or [])
    if len(tiers) > 1:
        return TieredCostModel(cost_model, tiers)
    return cost_model.scaled(tiers[0].scale) if tiers and tiers[0].scale != 1.0 else cost_model


def predict_policy(policy: BatchSizePolicy, price: Any, grids: Any, counts: Any, m_mem: int, *, world_size: int = 1,
                   balance: str = "cost", seed: int = 0) -> dict[str, float]:
    """A policy's simulated epoch (``tokens_per_s``, ``compute_cv``, ``bubble``, ``num_steps``) of the distinct
    ``grids`` with sample ``counts``, timed by ``price`` (:func:`price_model`): the corpus :func:`derive_policy`
    compares its budgets on (samples up to ``m_mem`` tokens, at most ``_MAX_SIMULATED_SAMPLES``), so a policy
    derived elsewhere compares with its ``predicted`` like for like."""
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    fits = grids.prod(axis=1) <= int(m_mem)
    corpus = _simulation_corpus(grids[fits], counts[fits], _MAX_SIMULATED_SAMPLES)
    return _predict(CorpusSimulator(corpus, world_size, balance=balance, seed=seed), policy, price)


def derive_policy(
    cost_model: CostModel,
    grids: Any,
    m_mem: int,
    *,
    counts: Any = None,
    world_size: int = 1,
    balance: str = "cost",
    step_budget_s: float | None = None,
    oversize: str = "error",
    seed: int = 0,
    num_candidates: int = _DEFAULT_CANDIDATES,
    tiers: Sequence[ModeTier] | None = None,
    noisy: str = "",
) -> Derivation:
    """Derive the policy for a corpus (see the module docstring).

    Args:
        cost_model: the fitted step-time model.
        grids: every sample's token grid ``[N, 3]`` — or, with ``counts``, the distinct grids (e.g.
            from :func:`~lightning_adaptiveload.bucketing.sampler.count_buckets`). Samples with
            ``S > m_mem`` are left out of the choice; the policy's ``oversize`` decides what training
            does with them.
        counts: samples per grid of ``grids`` (``None``: ``grids`` lists every sample).
        m_mem: tokens per batch that fit in memory; with ``tiers``, one per tier.
        world_size: ranks the corpus is planned for.
        balance: the sampler's step grouping the run uses (``"cost"`` or ``"none"``).
        step_budget_s: a fixed budget; ``None`` picks the one with the highest predicted throughput.
        oversize: the policy's ``oversize`` (``"error"`` or ``"skip"``).
        seed: the plan seed of the simulated epochs.
        num_candidates: budgets tried between the two ends.
        tiers: per-bucket activation checkpointing (:func:`fit_tiers`); two or more give a
            :class:`~lightning_adaptiveload.bucketing.policy.TieredPolicy`, one prices the corpus in its mode.
        noisy: why the profile behind ``cost_model`` is too noisy to rank step budgets (e.g.
            :func:`~lightning_adaptiveload.calibration.calibrate.too_noisy`), ``""`` when it is not. A noisy
            profile gets every bucket at its memory cap, as a flat one does (on a 2-core CPU beside another job
            a noisy profile priced small batches as cheap and the run trained at 0.70x the equal-token baseline);
            a given ``step_budget_s`` still wins.

    Raises:
        ValueError: no sample fits ``m_mem``, or a given budget is not above the fixed overhead.
    """
    if counts is None:
        grids, counts = count_buckets(grids)
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    tiers = list(tiers or [])
    budgets_mem = [m_mem] if np.ndim(m_mem) == 0 else list(m_mem)
    if tiers and len(budgets_mem) != len(tiers):
        raise ValueError(f"`m_mem={m_mem!r}` is not valid with {len(tiers)} tiers. Expected one token budget per tier.")
    for m in budgets_mem:
        if isinstance(m, bool) or int(m) != m or m < 1:
            raise ValueError(f"`m_mem={m_mem!r}` is not valid. Expected a positive integer token count.")
    budgets_mem = [int(m) for m in budgets_mem]
    m_mem = budgets_mem[-1]
    make_policy = _policy_maker(cost_model, tiers, budgets_mem, oversize)
    heldout = cost_model.quality.get("heldout_median_rel_error", float("nan"))
    price = price_model(cost_model, tiers)
    if len(tiers) == 1:
        cost_model = price
    seq = grids.prod(axis=1)
    fits = seq <= m_mem
    if not fits.any():
        raise ValueError(
            f"No sample fits the memory budget m_mem={m_mem} tokens (the shortest has S={int(seq.min())}). "
            "Shard the model, enable activation checkpointing, or use shorter samples."
        )
    corpus = _simulation_corpus(grids[fits], counts[fits], _MAX_SIMULATED_SAMPLES)
    uniq = np.unique(corpus.prod(axis=1))
    # The baseline is one mode for the whole run: with tiers, the last (most recomputation) one.
    one_mode = cost_model.scaled(tiers[-1].scale) if len(tiers) > 1 else cost_model
    baseline = _predict(CorpusSimulator(corpus, world_size, balance="none", seed=seed), EqualTokenPolicy(m_mem),
                        one_mode)
    sim = CorpusSimulator(corpus, world_size, balance=balance, seed=seed)  # every policy below plans this corpus
    candidates: list[tuple[float, float]] = []
    warning = ""
    # The one-tier rule refuses a budget at or below the fixed overhead; a latency-bound fit (the saturating
    # form) can predict a step at exactly the overhead in floating point.
    above_fixed = float(getattr(price, "params", {}).get("a", 0.0)) * (1 + 1e-9)
    if step_budget_s is not None:
        budget, source = float(step_budget_s), "given"
        policy = make_policy(budget)
        predicted = _predict(sim, policy, price)
    else:
        lo = max(above_fixed, float(price.predict(1, int(uniq.max()))))
        caps = np.maximum(1, make_policy(float("inf")).batch_sizes(uniq)) if tiers else np.maximum(1, m_mem // uniq)
        hi = float(np.max(price.predict(caps, uniq)))
        warning = _flat_profile(price, uniq, caps, hi, heldout, m_mem)
        source = MEMORY_CAPS_SOURCE
        if noisy and not warning and np.any(caps > 1):
            warning = (f"the profile is too noisy to rank step budgets ({noisy}): every bucket trains at its memory "
                       f"cap (M_mem = {m_mem:,} tokens). The closed loop corrects the cost model from training's own "
                       "steps and re-plans where that pays; to profile again, use `force=True` on an otherwise idle "
                       "device, or more `repeats`.")
            source = NOISY_CAPS_SOURCE
        if warning:
            # Above the dearest cap batch's predicted step: every bucket at its memory cap.
            budget = max(hi, above_fixed) * (1 + 1e-6)
            policy = make_policy(budget)
            predicted = _predict(sim, policy, price)
        else:
            budgets = [lo] if hi <= lo * (1 + 1e-9) else np.geomspace(lo, hi, max(2, int(num_candidates))).tolist()
            results = []
            # Neighbouring budgets often give every bucket the same B: their epochs are the same plan, so each
            # distinct plan is simulated once (the closed loop derives again at every check).
            simulated: dict[tuple, dict[str, float]] = {}
            for b in budgets:
                pol = make_policy(b)
                key = _plan_key(pol, uniq)
                if key not in simulated:
                    simulated[key] = _predict(sim, pol, price)
                pred = dict(simulated[key])
                results.append((b, pol, pred))
                candidates.append((float(b), pred["tokens_per_s"]))
            best = max(r[2]["tokens_per_s"] for r in results)
            budget, policy, predicted = next(r for r in results
                                             if r[2]["tokens_per_s"] >= (1 - THROUGHPUT_TOLERANCE) * best)
            source = "max predicted throughput"
    return Derivation(policy=policy, m_mem=m_mem, step_budget_s=float(budget), budget_source=source,
                      world_size=int(world_size), predicted=predicted, baseline=baseline, candidates=candidates,
                      tiers=[{"mode": t.mode, "max_seq_len": t.max_seq_len, "scale": t.scale, "m_mem": m}
                             for t, m in zip(tiers, budgets_mem, strict=False)], warning=warning)


def _flat_profile(price: Any, uniq: np.ndarray, caps: np.ndarray, hi: float, heldout: float, m_mem: int) -> str:
    """Why the corpus's batches cannot be told apart by cost (:data:`FLAT_PROFILE_REL`), or "".

    Only where the policy has a choice: a corpus whose every bucket holds one sample at its cap has none."""
    if not np.any(caps > 1):
        return ""
    floor = float(price.predict(1, int(uniq.min())))
    bound = max(FLAT_PROFILE_REL, heldout if math.isfinite(heldout) else 0.0)
    if hi > floor * (1 + bound):
        return ""
    what = "the fit's held-out error" if bound > FLAT_PROFILE_REL else "FLAT_PROFILE_REL"
    return (f"the profiled step time hardly grows with the batch: the cost model predicts {floor * 1e3:.4g} ms for "
            f"the cheapest batch of this corpus (B=1, S={int(uniq.min()):,}) and {hi * 1e3:.4g} ms for the dearest at "
            f"its memory cap, {hi / floor - 1:.1%} apart, within {bound:.0%} ({what}), so the profile cannot rank step "
            f"budgets. Every bucket trains at its memory cap (M_mem = {m_mem:,} tokens: the largest batches that fit, "
            "which also give the most tokens per second when a step costs the same whatever its size). To profile "
            "again, use `force=True` on an otherwise idle device with larger shapes (`batch_sizes`) or more "
            "`repeats`; or set `step_budget_s`.")


def _plan_key(policy: BatchSizePolicy, seq_lens: np.ndarray) -> tuple:
    """What a simulated epoch depends on of ``policy``: the batch size (and, per-bucket checkpointing, the
    mode) of every sequence length of the corpus."""
    sizes = tuple(int(b) for b in np.asarray(policy.batch_sizes(seq_lens)).reshape(-1))
    mode_for = getattr(policy, "mode_for", None)
    modes = tuple(mode_for(int(s)) for s in seq_lens) if callable(mode_for) else ()
    return sizes, modes


def _policy_maker(cost_model: CostModel, tiers: Sequence[ModeTier], m_mem: Sequence[int], oversize: str) -> Any:
    """``budget -> policy``: the one rule (:func:`policy_for_budget`) per tier. With two or more tiers, a
    :class:`TieredPolicy` whose tiers are cost-model policies in their own mode's cost and memory (the last
    tier reaching to its ``M_mem``); an infinite budget gives the memory caps."""
    if len(tiers) <= 1:
        scaled = cost_model.scaled(tiers[0].scale) if tiers and tiers[0].scale != 1.0 else cost_model

        def single(budget: float) -> BatchSizePolicy:
            if not math.isfinite(budget):
                return EqualTokenPolicy(m_mem[0])  # memory caps only (used for the candidate range)
            return policy_for_budget(scaled, m_mem[0], budget, oversize)

        return single
    priced = TieredCostModel(cost_model, tiers)

    def tiered(budget: float) -> BatchSizePolicy:
        parts = []
        for i, (t, m) in enumerate(zip(tiers, m_mem, strict=True)):
            limit = m if i == len(tiers) - 1 else t.max_seq_len
            cm = cost_model.scaled(t.scale)
            inner: BatchSizePolicy = (EqualTokenPolicy(m) if not math.isfinite(budget)
                                      else CostModelPolicy(cm, m, budget, oversize="skip"))
            parts.append((t.mode, limit, inner))
        return TieredPolicy(parts, cost_model=priced, oversize=oversize)

    return tiered


#: Above this held-out median relative error a fit is reported as poor (reference fits: 4-10%).
POOR_FIT_REL_ERROR = 0.25


def fit_models(
    measurements: Sequence[Any], form: str = "auto", *, fit_memory: bool = True, attention_tokens: Any = None
) -> tuple[CostModel, MemoryModel | None, list[str]]:
    """Fit the cost model (and, with peaks, the memory model) to the feasible measurements, both in the tokens
    attention sees when ``attention_tokens`` (``{S: S_attn}`` or ``S -> S_attn``) is given; the table covers
    the measured lengths (pass a mapping to cover the corpus's too).

    Returns the two models and the warnings to show (a poor fit, no memory model).

    Raises:
        ValueError: nothing was feasible, or too few shapes to fit (the message says what to raise).
    """
    ok = [m for m in measurements if m.status == "ok"]
    if not ok:
        raise ValueError(
            "every profiled shape ran out of memory. Shard the model (FSDP), enable activation "
            "checkpointing, or profile smaller shapes via `batch_sizes=[1]`."
        )
    bs = [m.batch_size for m in ok]
    ss = [m.seq_len for m in ok]
    table = token_table(attention_tokens, ss)
    try:
        cost_model = CostModel.fit(bs, ss, [m.time_s for m in ok], form=form, attention_tokens=table)
    except ValueError as err:
        raise ValueError(
            f"could not fit the cost model on {len(ok)} feasible shapes: {err} Raise `time_budget_s` or "
            "`max_shapes`, or pass more `batch_sizes`."
        ) from err
    notes = []
    held = cost_model.quality.get("heldout_median_rel_error", float("nan"))
    if held > POOR_FIT_REL_ERROR:
        notes.append(
            f"the cost model predicts held-out shapes with a median error of {held:.0%}; timings are noisy "
            "(a busy device?) or the shapes too small. Raise `repeats` and `warmup`, or profile larger shapes."
        )
    memory_model = None
    peaks = [m.peak_bytes for m in ok]
    if fit_memory and all(p is not None for p in peaks) and len({b * s for b, s in zip(bs, ss, strict=True)}) > 1:
        try:
            memory_model = MemoryModel.fit(bs, ss, peaks, table)
        except ValueError as err:
            notes.append(f"no memory model ({err}); M_mem falls back to the largest token count profiled. "
                         "Pass `m_mem` to set it.")
    return cost_model, memory_model, notes
