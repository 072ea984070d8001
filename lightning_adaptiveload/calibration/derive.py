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
  small ones.
- the form of the cost model (above).

Activation checkpointing, when the model leaves it to the calibration (``"auto"``), is chosen first
(:func:`choose_checkpointing`): the mode with the least recomputation (``none`` → ``selective`` →
``full``) under which one sample of the corpus's longest sequence trains within the device's memory
less the margin and the optimizer state still to come. The profile, the fits and ``M_mem`` above are
then those of that mode, so short buckets get the largest batches its memory allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_adaptiveload.bucketing.policy import (
    BatchSizePolicy,
    CostModelPolicy,
    DualConstraintPolicy,
    EqualTokenPolicy,
)
from lightning_adaptiveload.bucketing.sampler import count_buckets
from lightning_adaptiveload.calibration.costmodel import CostModel, MemoryModel
from lightning_adaptiveload.calibration.simulate import simulate

#: Bytes per parameter of optimizer state not yet allocated when profiling: Adam-style optimizers
#: create two fp32 moments on their first step, after the shape benchmark measured peak memory.
PENDING_OPTIMIZER_BYTES_PER_PARAM = 8
#: A budget within this fraction of the best predicted throughput counts as the best.
THROUGHPUT_TOLERANCE = 0.01
_DEFAULT_CANDIDATES = 24
# Budgets are compared on a corpus of at most this many samples (bucket proportions kept), so
# deriving a policy for 10^8 samples costs the same as for 10^5.
_MAX_SIMULATED_SAMPLES = 100_000


def policy_for_budget(
    cost_model: CostModel, m_mem: int, step_budget_s: float, oversize: str = "error"
) -> BatchSizePolicy:
    """The policy "largest B with ``B·S <= m_mem`` and ``t(B, S) <= step_budget_s``".

    Returns ``DualConstraintPolicy(m_mem, (τ - a) / b, p)`` for the ``"power"`` form (so
    ``B·S^p <= M_comp`` ⇔ predicted time <= τ), else ``CostModelPolicy(cost_model, m_mem, τ)``.

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
    if cost_model.form == "power":
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
        with_optimizer = MemoryModel(memory_model.m0 + pending_bytes, memory_model.m1, memory_model.m2)
        shortest = shortest_seq_len or min((m.seq_len for m in measurements), default=1)
        return with_optimizer.max_tokens(device_memory, margin, oom_tokens, min_seq_len=shortest), "memory model"
    ok_tokens = [m.batch_size * m.seq_len for m in measurements if m.status == "ok"]
    m_mem = max([int(longest_seq_len)] + ok_tokens)
    if oom_tokens:
        m_mem = min(m_mem, min(oom_tokens) - 1)
    return int(m_mem), "largest profiled batch"


@dataclass(frozen=True)
class CheckpointingChoice:
    """The activation-checkpointing mode chosen for a run and the probes it was chosen from.

    ``probes`` holds ``(mode, measurement)`` pairs in the order they ran; ``fits`` says whether the
    chosen mode passed (``False``: no mode fits, the last one tried is returned).
    """

    mode: str
    probes: tuple[tuple[str, Any], ...]
    fits: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "fits": self.fits, "reason": self.reason,
                "probes": [{"mode": m, **p.to_dict()} for m, p in self.probes]}


def probe_fits(measurement: Any, device_memory: int | None, margin: float, pending_bytes: int = 0) -> bool:
    """Whether a probe step ran and its peak (plus optimizer state still to come) leaves the margin free.

    Without a measured peak or device size (CPU), running without an out-of-memory error is enough.
    """
    if measurement.status != "ok":
        return False
    if measurement.peak_bytes is None or not device_memory:
        return True
    return measurement.peak_bytes + pending_bytes <= device_memory * (1.0 - margin)


def choose_checkpointing(
    modes: Sequence[str],
    probe: Any,
    device_memory: int | None,
    *,
    margin: float = 0.1,
    pending_bytes: int = 0,
) -> CheckpointingChoice:
    """The first of ``modes`` (least recomputation first) whose probe fits (:func:`probe_fits`).

    ``probe(mode)`` runs one training step of one sample of the longest sequence under ``mode`` and
    returns its :class:`~lightning_adaptiveload.calibration.profile.Measurement`. Modes after the
    first that fits are not probed. When none fits, the last mode is returned with ``fits=False``
    (the caller raises, or skips the samples that do not fit).

    Raises:
        ValueError: ``modes`` is empty.
    """
    modes = list(modes)
    if not modes:
        raise ValueError("`modes` is empty. Expected the modes the model supports, least recomputation first.")
    probes: list[tuple[str, Any]] = []
    for mode in modes:
        m = probe(mode)
        probes.append((mode, m))
        if probe_fits(m, device_memory, margin, pending_bytes):
            peak = "" if m.peak_bytes is None else f", peak {m.peak_bytes / 2**30:.1f} GiB"
            total = "" if not device_memory else f" of {device_memory / 2**30:.1f} GiB"
            return CheckpointingChoice(mode, tuple(probes), True,
                                       f"least recomputation that fits S={m.seq_len:,} at B=1{peak}{total}")
    return CheckpointingChoice(modes[-1], tuple(probes), False,
                               f"no mode fits S={probes[-1][1].seq_len:,} at B=1")


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.to_dict(), "m_mem": self.m_mem, "step_budget_s": self.step_budget_s,
            "budget_source": self.budget_source, "world_size": self.world_size,
            "predicted": dict(self.predicted), "baseline": dict(self.baseline),
            "candidates": [list(c) for c in self.candidates],
        }

    def summary(self) -> str:
        """One line: the policy's predicted throughput against the equal-token baseline."""
        p, b = self.predicted, self.baseline
        gain = p["tokens_per_s"] / b["tokens_per_s"] - 1 if b["tokens_per_s"] > 0 else float("nan")
        return (
            f"predicted on {self.world_size} rank(s): {p['tokens_per_s']:,.0f} tokens/s, compute CV "
            f"{p['compute_cv']:.1%} | equal-token (max_tokens={self.m_mem}, dealt at random): "
            f"{b['tokens_per_s']:,.0f} tokens/s, compute CV {b['compute_cv']:.1%} | {gain:+.1%}"
        )


def _simulation_corpus(grids: np.ndarray, counts: np.ndarray, max_samples: int) -> np.ndarray:
    """Distinct ``grids`` with their sample ``counts`` as a corpus: all of it, or the same buckets in
    the same proportions with about ``max_samples`` samples (every bucket keeps at least one)."""
    total = int(counts.sum())
    if total > max_samples:
        counts = np.maximum(1, np.round(counts * (max_samples / total))).astype(np.int64)
    return np.repeat(grids, counts, axis=0)


def _predict(grids: np.ndarray, policy: BatchSizePolicy, world_size: int, cost_model: CostModel,
             balance: str, seed: int) -> dict[str, float]:
    r = simulate(grids, policy, world_size, cost_model=cost_model, balance=balance, seed=seed)
    return {"tokens_per_s": r.tokens_per_s, "compute_cv": r.compute_cv, "bubble": r.bubble,
            "num_steps": float(r.num_steps)}


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
) -> Derivation:
    """Derive the policy for a corpus (see the module docstring).

    Args:
        cost_model: the fitted step-time model.
        grids: every sample's token grid ``[N, 3]`` — or, with ``counts``, the distinct grids (e.g.
            from :func:`~lightning_adaptiveload.bucketing.sampler.count_buckets`). Samples with
            ``S > m_mem`` are left out of the choice; the policy's ``oversize`` decides what training
            does with them.
        counts: samples per grid of ``grids`` (``None``: ``grids`` lists every sample).
        m_mem: tokens per batch that fit in memory.
        world_size: ranks the corpus is planned for.
        balance: the sampler's step grouping the run uses (``"cost"`` or ``"none"``).
        step_budget_s: a fixed budget; ``None`` picks the one with the highest predicted throughput.
        oversize: the policy's ``oversize`` (``"error"`` or ``"skip"``).
        seed: the plan seed of the simulated epochs.
        num_candidates: budgets tried between the two ends.

    Raises:
        ValueError: no sample fits ``m_mem``, or a given budget is not above the fixed overhead.
    """
    if counts is None:
        grids, counts = count_buckets(grids)
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    if isinstance(m_mem, bool) or int(m_mem) != m_mem or m_mem < 1:
        raise ValueError(f"`m_mem={m_mem!r}` is not valid. Expected a positive integer token count.")
    m_mem = int(m_mem)
    seq = grids.prod(axis=1)
    fits = seq <= m_mem
    if not fits.any():
        raise ValueError(
            f"No sample fits the memory budget m_mem={m_mem} tokens (the shortest has S={int(seq.min())}). "
            "Shard the model, enable activation checkpointing, or use shorter samples."
        )
    corpus = _simulation_corpus(grids[fits], counts[fits], _MAX_SIMULATED_SAMPLES)
    uniq = np.unique(corpus.prod(axis=1))
    baseline = _predict(corpus, EqualTokenPolicy(m_mem), world_size, cost_model, "none", seed)
    candidates: list[tuple[float, float]] = []
    if step_budget_s is not None:
        budget, source = float(step_budget_s), "given"
        policy = policy_for_budget(cost_model, m_mem, budget, oversize)
        predicted = _predict(corpus, policy, world_size, cost_model, balance, seed)
    else:
        lo = float(cost_model.predict(1, int(uniq.max())))
        hi = float(np.max(cost_model.predict(np.maximum(1, m_mem // uniq), uniq)))
        budgets = [lo] if hi <= lo * (1 + 1e-9) else np.geomspace(lo, hi, max(2, int(num_candidates))).tolist()
        results = []
        for b in budgets:
            pol = policy_for_budget(cost_model, m_mem, b, oversize)
            pred = _predict(corpus, pol, world_size, cost_model, balance, seed)
            results.append((b, pol, pred))
            candidates.append((float(b), pred["tokens_per_s"]))
        best = max(r[2]["tokens_per_s"] for r in results)
        budget, policy, predicted = next(r for r in results if r[2]["tokens_per_s"] >= (1 - THROUGHPUT_TOLERANCE) * best)
        source = "max predicted throughput"
    return Derivation(policy=policy, m_mem=m_mem, step_budget_s=float(budget), budget_source=source,
                      world_size=int(world_size), predicted=predicted, baseline=baseline, candidates=candidates)


#: Above this held-out median relative error a fit is reported as poor (reference fits: 4-10%).
POOR_FIT_REL_ERROR = 0.25


def fit_models(
    measurements: Sequence[Any], form: str = "auto", *, fit_memory: bool = True
) -> tuple[CostModel, MemoryModel | None, list[str]]:
    """Fit the cost model (and, with peaks, the memory model) to the feasible measurements.

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
    try:
        cost_model = CostModel.fit(bs, ss, [m.time_s for m in ok], form=form)
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
            memory_model = MemoryModel.fit(bs, ss, peaks)
        except ValueError as err:
            notes.append(f"no memory model ({err}); M_mem falls back to the largest token count profiled. "
                         "Pass `m_mem` to set it.")
    return cost_model, memory_model, notes
