"""The calibration conductor: where a calibration comes from, and everything that turns it into a policy.

:func:`calibrate` resolves the source (a pinned file → the checkpoint being resumed → the cache →
a fresh profile), profiles when it must (per activation-checkpointing mode when the model leaves the
mode to it), fits the cost and memory models, sizes each mode's memory budget and derives the policy
by the one rule of :mod:`~lightning_adaptiveload.calibration.derive`. It knows nothing of Lightning:
the caller hands in a :class:`Trainee` (the real training step, the collectives, the device), as
Lightning's ``BatchSizeFinder`` hands its trial loop the trainer. The shape-benchmark callback, the
benchmarks and a plain torch loop all calibrate through it, so each rule is written once.

Per-bucket activation checkpointing (``Trainee.modes``): the profile runs in the mode with the least
recomputation first. Shapes whose predicted peak does not fit are not run (``"too_large"``); the
longest sequence predicted to fit is always measured at B = 1, so a mode's range ends at a
measurement. The sequence lengths left over are profiled at B = 1 in the next mode (on long sequences
one sample already fills the device, and the cost model's S-dependence is known from the first mode):
its measured step times give its recomputation scale, its peaks its memory model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import lightning_adaptiveload.calibration.derive as derive
import lightning_adaptiveload.calibration.record as record
from lightning_adaptiveload._checks import check_choice, check_positive
from lightning_adaptiveload.bucketing.sampler import oversize_error
from lightning_adaptiveload.calibration.costmodel import FORMS, token_table
from lightning_adaptiveload.calibration.profile import (
    Collectives,
    LocalCollectives,
    Measurement,
    MemoryProbe,
    Shape,
    distinct_lengths,
    is_out_of_memory,
    plan_grid,
    profile,
    sustained,
)

__all__ = [
    "NOISY_PROFILE_REL", "REPLAN_GAIN", "CalibrationResult", "ProfileSettings", "Trainee", "calibrate", "check_oversize",
    "checkpoint_state", "metrics", "out_of_memory_advice", "profile_modes", "read_checkpoint_state", "too_noisy",
    "trained_plan", "weigh_plans", "with_trained_plan",
]

#: Re-plan only for at least this predicted gain in tokens/s (the closed loop within a run, :mod:`feedback`, and a
#: run reading a corrected cache entry, :func:`trained_plan`). A re-plan is not free (new batch shapes compile
#: again under torch.compile and map new memory; a plan change mid-epoch re-deals the rest), and a smaller gain
#: is within what the model itself gets wrong (held-out errors of 1-3% on the reference H200 fits, on top of the
#: 1% throughput tolerance the budget is chosen with).
REPLAN_GAIN = 0.03
#: A sustained step this much slower than the same shape's profiled one scales every profiled time (a clock the
#: power cap lowers slows every shape alike); below it the difference is within a profile's repeat spread.
SUSTAIN_MIN_REL = 0.02
#: Version of :func:`checkpoint_state`; a state of another version is ignored (the run profiles or reads the cache).
STATE_VERSION = 2
#: A profile is too noisy to cache as final when its fit's held-out median error, or the median over shapes
#: of its timed steps' spread ((max - min) / median), is above this: the bound at which the fit is already
#: reported poor (``derive.POOR_FIT_REL_ERROR``). Reference H200 profiles sit at 1-11% held-out error with
#: steps within ``stable_rel`` (2%) of each other; a tiny model's sub-millisecond CPU steps on a busy 2-core
#: machine measure 17-99% and 5-70%. Such a profile serves its own run (with a warning) and is cached as
#: provisional, so the next run profiles again (or the closed loop's correction replaces it).
NOISY_PROFILE_REL = derive.POOR_FIT_REL_ERROR


@dataclass(frozen=True)
class ProfileSettings:
    """How to profile and derive (the arguments of
    :class:`~lightning_adaptiveload.callbacks.shape_benchmark.ShapeBenchmarkCallback`, documented there).

    Checked and normalised on construction; ``owner`` names the call in the errors.

    Raises:
        ValueError: a setting out of range, naming it and what is expected.
    """

    batch_sizes: Sequence[int] | None = None
    max_shapes: int = 8
    repeats: int = 3
    stable_rel: float = 0.02
    warmup: int = 1
    shape_time_s: float = 5.0
    time_budget_s: float = 120.0
    converge_rel: float = 0.03
    form: str = "auto"
    memory_margin: float = 0.1
    step_budget_s: float | None = None
    m_mem: int | None = None
    sustain_s: float | None = None
    owner: InitVar[str] = "ProfileSettings"

    def __post_init__(self, owner: str) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.batch_sizes is not None:
            sizes = list(self.batch_sizes)
            if not sizes:
                raise ValueError(f"`{owner}(batch_sizes=[])` is not valid. Expected positive integers, or None.")
            put("batch_sizes", sorted({int(check_positive(owner, "batch_sizes", b, integer=True)) for b in sizes}))
        for name in ("max_shapes", "repeats"):
            put(name, int(check_positive(owner, name, getattr(self, name), integer=True)))
        put("warmup", int(check_positive(owner, "warmup", self.warmup, integer=True, zero=True)))
        for name in ("time_budget_s", "shape_time_s"):
            put(name, check_positive(owner, name, getattr(self, name)))
        if self.step_budget_s is not None:
            put("step_budget_s", check_positive(owner, "step_budget_s", self.step_budget_s))
        if self.m_mem is not None:
            put("m_mem", int(check_positive(owner, "m_mem", self.m_mem, integer=True)))
        if self.sustain_s is not None:
            put("sustain_s", float(check_positive(owner, "sustain_s", self.sustain_s, zero=True)))
        for name in ("stable_rel", "converge_rel", "memory_margin"):
            value = getattr(self, name)
            if check_positive(owner, name, value, zero=True) >= 1:
                raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected a fraction in [0, 1).")
            put(name, float(value))
        check_choice(owner, "form", self.form, (*FORMS, "auto"))


@dataclass
class Trainee:
    """What the conductor drives: the real training step and the device it runs on.

    Attributes:
        make_step: ``(B, grid) -> step``; ``step()`` runs one forward + backward (no optimizer step).
        modes: activation-checkpointing modes to choose per bucket, least recomputation first; empty:
            the model's own setting is profiled.
        set_mode: switches the model to a mode (needed with ``modes``).
        device_memory: bytes of the device (``None``: not measured, e.g. CPU).
        pending_bytes: optimizer state not yet allocated while profiling.
        isolation: a context manager factory that leaves no trace of profiling (weights, RNG, modes).
        attention_tokens: ``S -> S_attn``, the tokens one sample of ``S`` video tokens has in attention (the
            module's ``attention_tokens``, :func:`~lightning_adaptiveload.models.protocol.attention_tokens_of`);
            the cost and memory models are fitted in them. ``None``: ``S``.
    """

    make_step: Callable[[int, tuple[int, int, int]], Callable[[], None]]
    collectives: Collectives = field(default_factory=LocalCollectives)
    modes: tuple[str, ...] = ()
    set_mode: Callable[[str], None] | None = None
    device_memory: int | None = None
    pending_bytes: int = 0
    memory: MemoryProbe = field(default_factory=MemoryProbe)
    synchronize: Callable[[], None] | None = None
    on_oom: Callable[[], None] | None = None
    compile_clock: Callable[[], float] | None = None
    isolation: Callable[[], Any] = contextlib.nullcontext
    device_name: str = "cpu"
    world_size: int = 1
    attention_tokens: Callable[[int], int] | None = None


@dataclass
class CalibrationResult:
    """A calibration, the policy derived from it, and where it came from."""

    calibration: record.Calibration
    derivation: derive.Derivation
    source: str
    profiled: bool = False
    #: The cost model the run's predictions use where it is not the derivation's: a corrected calibration's,
    #: when the run trains the plan its last run measured (:func:`trained_plan`); ``None`` otherwise.
    predict_with: Any = None


def check_oversize(grids: np.ndarray, counts: np.ndarray, limit: int, oversize: str, budget: str = "",
                   samples: tuple[np.ndarray, Any] | None = None, sp_degree: int = 1) -> None:
    """Raise :func:`~lightning_adaptiveload.bucketing.sampler.oversize_error` (the one rule for samples
    that cannot train even alone) for a corpus of distinct ``grids`` with ``counts``; ``samples``
    (every sample's token grid in dataset order and the dataset's ``sample_label``) names the first
    such sample's source. With ``sp_degree`` k > 1 (the largest sequence-parallel degree the planner may
    use), a sample is oversize only above ``k · limit``: the planner gives a longer one a group of k
    ranks, each holding 1/k of its tokens (``plan_bucket_layout``'s rule)."""
    if sp_degree > 1:
        # "(m_mem=100)" -> "(sequence-parallel degree 2 × 100 tokens, m_mem=100)"; a phrase follows the tokens.
        note = budget[1:-1] if budget.startswith("(") and budget.endswith(")") else None
        per_rank = f"{limit:,} tokens" + (f", {note}" if note is not None else f" {budget}".rstrip())
        budget, limit = f"(sequence-parallel degree {sp_degree} × {per_rank})", limit * sp_degree
    if oversize != "error" or not (np.asarray(grids).reshape(-1, 3).prod(axis=1) > limit).any():
        return  # no error to raise: the per-sample scan below only finds and names the first such sample
    if samples is not None:
        per_sample, label = samples
        per_sample = np.asarray(per_sample, dtype=np.int64).reshape(-1, 3)
    else:
        per_sample, label = np.repeat(grids, counts, axis=0), None
    err = oversize_error(per_sample.prod(axis=1), limit, oversize, label, grids=per_sample, budget=budget)
    if err is not None:
        raise err


def calibrate(
    grids: np.ndarray,
    counts: np.ndarray,
    settings: ProfileSettings,
    trainee: Trainee | Callable[[], Trainee],
    *,
    key: dict[str, Any],
    pinned: str | Path | None = None,
    restored: dict[str, Any] | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
    is_global_zero: bool = True,
    broadcast: Callable[[Any], Any] = lambda obj: obj,
    world_size: int = 1,
    balance: str = "cost",
    seed: int = 0,
    oversize: str = "error",
    sp_degree: int = 1,
    samples: tuple[np.ndarray, Any] | None = None,
    say: Callable[[str], None] = lambda line: None,
    warn: Callable[[str], None] = lambda line: None,
) -> CalibrationResult:
    """Calibrate a corpus of distinct token ``grids`` with sample ``counts`` (see the module docstring).

    Args:
        settings: profiling and derivation settings.
        trainee: the step to profile, or a factory called only when profiling is needed.
        key: what determines a step's cost; a checkpoint's or the cache's calibration is used only when
            its key is equal.
        pinned: a calibration file used as is.
        restored: the shape benchmark's checkpoint state (``{"calibration": json, "derived": {...}}``);
            its budgets are applied as they were, so a resumed epoch plans the same batches.
        cache_dir: the calibration cache (``None``: off); read on rank 0 and broadcast, written on rank 0. A
            profile too noisy to keep (:func:`too_noisy`) is cached as provisional, which the next run profiles again.
        force: profile even when the checkpoint or the cache holds a matching calibration.
        broadcast: rank 0's object on every rank.
        world_size, balance, seed, oversize: the run's sampler settings (the derivation plans with them).
        sp_degree: the largest sequence-parallel degree the run's planner may give a bucket (1: none);
            samples up to ``sp_degree`` times the memory budget train on a group of ranks (:func:`check_oversize`).
        samples: every sample's token grid and the dataset's ``sample_label`` (names an oversize sample).

    Raises:
        ValueError: samples that fit no mode, even on the largest sequence-parallel group, with
            ``oversize="error"``; nothing could be fitted.
        CalibrationError: the pinned file is not a calibration.
    """
    cal, derived, source = None, None, None
    if pinned is not None:
        cal, source = record.load_calibration(pinned), f"file {pinned}"
        if cal.key != key:
            # Pinned means used as is, but a calibration of another setup prices its steps wrongly: say where.
            warn(f"the pinned calibration {pinned} was made for another setup ({key_diff(cal.key, key, values=True)}); "
                 "using it as pinned. Its step times and memory budgets may not hold for this run: drop "
                 "`calibration=` to profile this setup (or pin a calibration this setup wrote).")
    elif not force and restored is not None:
        candidate = record.Calibration.from_json(restored["calibration"], source="the checkpoint")
        if candidate.key == key:
            cal, derived, source = candidate, restored.get("derived"), "checkpoint"
        else:
            warn(f"the checkpoint's calibration was made for another setup ({key_diff(candidate.key, key)}); "
                 "profiling again.")
    if cal is None and not force and cache_dir is not None:
        text = None
        if is_global_zero:
            hit = record.read_cache(cache_dir, key)
            if hit is not None and record.is_provisional(hit):
                say(f"the cached calibration {record.cache_path(cache_dir, key)} is "
                    f"{record.describe_provenance(hit)}; profiling again")
            elif hit is not None:
                say(f"calibration from cache {record.cache_path(cache_dir, key)} ({record.describe_provenance(hit)})")
                text = hit.to_json()
        text = broadcast(text)
        if text is not None:
            cal, source = record.Calibration.from_json(text), "cache"
    if source == "cache":
        kept = trained_plan(cal, grids, counts, settings, world_size=world_size, balance=balance, seed=seed,
                            oversize=oversize, sp_degree=sp_degree, samples=samples, say=say, warn=warn)
        if kept is not None:
            return kept
    profiled = cal is None
    if cal is None:
        if settings.m_mem is not None:
            check_oversize(grids, counts, settings.m_mem, oversize, f"(m_mem={settings.m_mem:,})", samples,
                           sp_degree)
        target = trainee() if callable(trainee) and not isinstance(trainee, Trainee) else trainee
        cal = profile_modes(grids, settings, target, key, say=say, warn=warn)
        # Timings are maxima over ranks, so every rank fits the same models; broadcasting rank 0's
        # record makes agreement exact regardless of floating-point reduction order.
        cal = record.Calibration.from_json(broadcast(cal.to_json()))
        source = "profiled"
        noise = too_noisy(cal)
        cal.extra["provenance"] = {"source": "profiled", **({"provisional": noise} if noise else {})}
        if noise:
            warn(f"the profile is too noisy to keep ({noise}); this run uses it, "
                 + ("the cache keeps it as provisional and the next run profiles again. " if cache_dir is not None
                    else "") + "For a profile to keep: an otherwise idle device, more `repeats` and `warmup`, or "
                 "larger shapes (`batch_sizes`).")
        if cache_dir is not None and is_global_zero:
            record.write_cache(cache_dir, cal)
    derivation = derive_for(cal, grids, counts, settings, derived=derived, world_size=world_size, balance=balance,
                            seed=seed, oversize=oversize, sp_degree=sp_degree, say=say, samples=samples, warn=warn)
    return CalibrationResult(cal, derivation, str(source), profiled)


def with_trained_plan(corrected: record.Calibration, running: record.Calibration,
                      derivation: derive.Derivation) -> record.Calibration:
    """``corrected`` (a closed-loop refit, for the cache) carrying the plan training ran when it was made, as a
    :func:`checkpoint_state` in ``extra["feedback"]["trained"]``: the running calibration (without a plan of
    its own, so records do not nest) and the budgets its policy was derived with. :func:`trained_plan` reads it."""
    state = checkpoint_state(running, derivation)
    inner = json.loads(state["calibration"])
    (inner.get("extra", {}).get("feedback") or {}).pop("trained", None)
    state["calibration"] = json.dumps(inner, sort_keys=True)
    out = json.loads(corrected.to_json())
    out["extra"]["feedback"] = {**(out["extra"].get("feedback") or {}), "trained": state}
    return record.Calibration.from_dict(out, source="the corrected calibration")


def trained_plan(cal: record.Calibration, grids: np.ndarray, counts: np.ndarray, settings: ProfileSettings, *,
                 world_size: int = 1, balance: str = "cost", seed: int = 0, oversize: str = "error",
                 sp_degree: int = 1, samples: tuple[np.ndarray, Any] | None = None,
                 say: Callable[[str], None] = lambda line: None,
                 warn: Callable[[str], None] = lambda line: None) -> CalibrationResult | None:
    """A cached calibration the closed loop corrected, read back as the plan training measured.

    A correction refits the cost model from the step times of the plan that ran; the policy derived afresh
    from it can differ from that plan on a gain the correction cannot vouch for (batch sizes it never timed).
    So a later run weighs the two as the closed loop does within a run (:func:`weigh_plans`): it trains the
    measured plan again (its calibration and budgets, as on resume) unless the new policy predicts at least
    :data:`REPLAN_GAIN` more tokens/s under the corrected model, and then trains the new one (with the measured
    plan's memory budgets, as a re-plan does); a kept plan's steps are still priced by the corrected model
    (:attr:`CalibrationResult.predict_with`).

    Returns ``None`` (derive from ``cal`` as usual) where ``cal`` records no trained plan (a profile, an
    older record) or the settings pin budgets the trained plan did not use (``m_mem``, ``step_budget_s``).
    """
    state = read_checkpoint_state((cal.extra.get("feedback") or {}).get("trained"))
    if state is None or settings.step_budget_s is not None:
        return None
    derived = state["derived"]
    if settings.m_mem is not None and int(derived["m_mem"]) != int(settings.m_mem):
        return None
    trained = record.Calibration.from_json(state["calibration"], source="the cached calibration's trained plan")
    if trained.key != cal.key:
        return None
    sampler = dict(world_size=world_size, balance=balance, seed=seed, oversize=oversize, sp_degree=sp_degree,
                   samples=samples)
    running = derive_for(trained, grids, counts, settings, derived=derived, warn=warn, **sampler)
    new, old_tps, new_tps, changes = weigh_plans(running, cal, grids, counts, settings, **sampler)
    gain = new_tps / old_tps - 1 if old_tps > 0 else float("inf")
    if gain >= REPLAN_GAIN and changes:
        say(f"the cached calibration's new plan predicts {gain:+.1%} tokens/s over the plan its run "
            f"measured (re-plan from {REPLAN_GAIN:.0%}): training it")
        return CalibrationResult(cal, new, "cache", False)  # already derived: not a second time in calibrate
    say(f"training the plan the cached calibration's run measured: a new plan predicts {gain:+.1%} "
        f"tokens/s under the corrected model (re-plan from {REPLAN_GAIN:.0%}); {old_tps:,.0f} predicted tokens/s")
    return CalibrationResult(trained, running, "cache", False, predict_with=new.cost_model or cal.cost_model)


def weigh_plans(old: derive.Derivation, new_cal: record.Calibration, grids: np.ndarray, counts: np.ndarray,
                settings: ProfileSettings, *, world_size: int = 1, balance: str = "cost", seed: int = 0,
                oversize: str = "error", sp_degree: int = 1, samples: tuple[np.ndarray, Any] | None = None
                ) -> tuple[derive.Derivation, float, float, dict[int, tuple[int, int]]]:
    """The policy ``new_cal`` derives with ``old``'s memory budgets (the memory model is the same, and training has
    run with them) and the step budget derived again (``settings.step_budget_s``, else the throughput rule), and
    both plans simulated on the corpus under ``new_cal``'s cost model: ``(new derivation, old tokens/s, new
    tokens/s, {S: (old B, new B)} where they differ)``. The closed loop's comparison
    (:func:`~lightning_adaptiveload.calibration.feedback.compare`) and :func:`trained_plan` weigh plans with it."""
    derived: dict[str, Any] = {"m_mem": old.m_mem, "step_budget_s": None}
    if old.tiers:
        derived["tier_m_mem"] = [t["m_mem"] for t in old.tiers]
    new = derive_for(new_cal, grids, counts, settings, derived=derived, world_size=world_size, balance=balance,
                     seed=seed, oversize=oversize, sp_degree=sp_degree, samples=samples)
    price = derive.price_model(new_cal.cost_model, derive.tiers_from_record(new_cal.extra))  # derive_for checked them
    old_pred = derive.predict_policy(old.policy, price, grids, counts, new.m_mem, world_size=world_size,
                                     balance=balance, seed=seed)
    seq = np.unique(np.asarray(grids, dtype=np.int64).reshape(-1, 3).prod(axis=1))
    seq = seq[seq <= new.m_mem]
    before, after = old.policy.batch_sizes(seq), new.policy.batch_sizes(seq)
    changes = {int(s): (int(a), int(b)) for s, a, b in zip(seq, before, after, strict=True) if a != b}
    return new, float(old_pred["tokens_per_s"]), float(new.predicted["tokens_per_s"]), changes


def too_noisy(cal: record.Calibration) -> str:
    """Why a profile is too noisy to cache as final (:data:`NOISY_PROFILE_REL`), or "" when it is not."""
    why = []
    held = cal.cost_model.quality.get("heldout_median_rel_error", float("nan"))
    if math.isfinite(held) and held > NOISY_PROFILE_REL:
        why.append(f"held-out median error {held:.0%}")
    spreads = [m.spread for m in cal.measurements if m.status == "ok" and m.spread is not None]
    if spreads and float(np.median(spreads)) > NOISY_PROFILE_REL:
        why.append(f"median spread of repeated steps {float(np.median(spreads)):.0%}")
    return " and ".join(why) + f" above {NOISY_PROFILE_REL:.0%}" if why else ""


def derive_for(cal: record.Calibration, grids: np.ndarray, counts: np.ndarray, settings: ProfileSettings, *,
               derived: dict[str, Any] | None = None, world_size: int = 1, balance: str = "cost", seed: int = 0,
               oversize: str = "error", sp_degree: int = 1, say: Callable[[str], None] = lambda line: None,
               samples: tuple[np.ndarray, Any] | None = None,
               warn: Callable[[str], None] = lambda line: None) -> derive.Derivation:
    """The policy of a calibration for this corpus: the memory budget of each mode's tier (or the budgets
    ``derived`` records, on resume), the oversize rule, then :func:`~lightning_adaptiveload.calibration.derive.derive_policy`.

    ``derived`` holds ``m_mem`` (and ``tier_m_mem``) and ``step_budget_s``; a ``step_budget_s`` of ``None``
    keeps the memory budgets and derives the step budget (``settings.step_budget_s``, else the throughput
    rule), as a re-plan with a corrected cost model does. ``warn`` receives the derivation's warning (a flat
    profile), once."""
    try:
        tiers = derive.tiers_from_record(cal.extra)
    except ValueError as err:
        raise record.CalibrationError(f"calibration ({cal.key.get('model', '?')}): {err}. Profile again.") from err
    seq = grids.prod(axis=1)
    if derived is not None:
        # A resumed run applies the budgets its checkpoint was trained with, whatever the world size now.
        m_mem: Any = derived.get("tier_m_mem") or int(derived["m_mem"])
        given = derived.get("step_budget_s")
        budget: float | None = settings.step_budget_s if given is None else float(given)
    else:
        budget = settings.step_budget_s
        if settings.m_mem is not None:
            m_mem = [settings.m_mem] * len(tiers) if tiers else settings.m_mem
        elif tiers:
            found = derive.tier_memory_budgets(tiers, cal.measurements, cal.device_memory,
                                               margin=settings.memory_margin, pending_bytes=cal.optimizer_bytes,
                                               seq_lens=seq, base_mode=cal.extra["checkpointing"].get("base_mode"))
            m_mem = [m for m, _ in found]
            for t, (m, how) in zip(tiers, found, strict=True):
                say(f"'{t.mode}' for S <= {t.max_seq_len:,}: M_mem = {m:,} tokens ({how})")
        else:
            m_mem, how = derive.memory_budget(
                cal.measurements, cal.memory_model, cal.device_memory, margin=settings.memory_margin,
                pending_bytes=cal.optimizer_bytes, longest_seq_len=int(seq.max()), shortest_seq_len=int(seq.min()))
            say(f"M_mem = {m_mem:,} tokens ({how})")
    limit = int(m_mem[-1]) if isinstance(m_mem, list) else int(m_mem)
    tried = (cal.extra.get("checkpointing") or {}).get("modes") or [t.mode for t in tiers or ()]
    why = f"that fit one device even with '{tried[-1]}' activation checkpointing" if tried else "that fit one device"
    check_oversize(grids, counts, limit, oversize, why, samples, sp_degree)
    # A profile too noisy to rank budgets trains at the memory caps; a calibration the closed loop corrected
    # from training's steps is priced by those steps, whatever the spread of the profile it started from.
    corrected = (cal.extra.get("provenance") or {}).get("source") == "corrected"
    derivation = derive.derive_policy(cal.cost_model, grids, m_mem, counts=counts, world_size=world_size,
                                      balance=balance, step_budget_s=budget, oversize=oversize, seed=seed, tiers=tiers,
                                      noisy="" if corrected else too_noisy(cal))
    if derivation.warning:
        warn(derivation.warning)
    return derivation


def profile_modes(grids: np.ndarray, settings: ProfileSettings, trainee: Trainee,
                  key: dict[str, Any], *, say: Callable[[str], None] = lambda line: None,
                  warn: Callable[[str], None] = lambda line: None) -> record.Calibration:
    """Profile the corpus (per mode with ``trainee.modes``), fit the models and return the record."""
    limit = None
    if trainee.device_memory:
        limit = trainee.device_memory * (1.0 - settings.memory_margin) - trainee.pending_bytes
    modes: tuple[str | None, ...] = trainee.modes or (None,)
    seq_all = seq_all_corpus = grids.prod(axis=1)
    if settings.m_mem is not None:
        grids, seq_all = grids[seq_all <= settings.m_mem], seq_all[seq_all <= settings.m_mem]
    say(f"profiling {len(np.unique(seq_all))} sequence lengths on {trainee.device_name} x {trainee.world_size}"
        + (f", per-bucket activation checkpointing {' -> '.join(trainee.modes)}" if trainee.modes else "")
        + f" (at most {settings.shape_time_s:.0f} s a shape, budget {settings.time_budget_s:.0f} s)")
    common = dict(collectives=trainee.collectives, synchronize=trainee.synchronize, memory=trainee.memory,
                  on_oom=trainee.on_oom, compile_clock=trainee.compile_clock, warmup=settings.warmup,
                  repeats=settings.repeats, shape_time_s=settings.shape_time_s, memory_limit=limit,
                  stable_rel=settings.stable_rel, form=settings.form, attention_tokens=trainee.attention_tokens)
    clock = time.perf_counter
    start = clock()
    compile_start = trainee.compile_clock() if trainee.compile_clock else 0.0
    by_mode: list[tuple[str | None, list[Measurement]]] = []
    remaining = grids
    with trainee.isolation():
        for k, mode in enumerate(modes):
            if not len(remaining):
                break
            if mode is not None:
                trainee.set_mode(mode)  # type: ignore[misc]
            left = max(1e-3, settings.time_budget_s - (clock() - start))
            tag = f"[{mode}] " if mode else ""

            def run(plan: list[Shape], tag: str = tag, left: float = left, converge: float = 0.0) -> list[Measurement]:
                return profile(trainee.make_step, plan, time_budget_s=left, converge_rel=converge,
                               progress=lambda line: say(tag + line), **common)

            if k == 0:
                plan = plan_grid(remaining, settings.batch_sizes, settings.max_shapes, max_tokens=settings.m_mem)
                meas = run(plan, converge=settings.converge_rel)
            else:
                # Longer sequences only: B = 1 fills the device, and the S-dependence is the first mode's.
                meas = run([Shape(1, g) for g in _spread(remaining, settings.max_shapes)])
            meas += _measure_longest_fit(remaining, meas, run, limit)
            meas = [dataclasses.replace(m, mode=mode) for m in meas]
            by_mode.append((mode, meas))
            fit_s = max([m.seq_len for m in meas if derive.fits_at_one(m, limit)], default=0)
            remaining = remaining[remaining.prod(axis=1) > fit_s]
            if len(remaining) and k + 1 < len(modes):
                say(f"{len(np.unique(remaining.prod(axis=1)))} sequence lengths above S={fit_s:,} do not fit in "
                    f"'{mode}'; trying '{modes[k + 1]}'")
        by_mode, sustained_record = _sustain(trainee, by_mode, sustain_seconds(settings), settings.repeats,
                                             say, warn)
    measurements = [m for _, ms in by_mode for m in ms]
    base_mode, base = max(by_mode, key=lambda mm: sum(m.status == "ok" for m in mm[1]))
    # Every corpus and profiled length, so the models price each bucket at its own attention tokens.
    table = token_table(trainee.attention_tokens, [*seq_all_corpus, *(m.seq_len for m in measurements)])
    try:
        cost_model, memory_model, notes = derive.fit_models(base, settings.form, attention_tokens=table,
                                                            fit_memory=trainee.device_memory is not None)
    except ValueError as err:
        raise RuntimeError(f"calibration: {err}") from err
    for note in notes:
        warn(note)
    extra: dict[str, Any] = {}
    if sustained_record is not None:
        extra["sustained"] = sustained_record
    if trainee.modes:
        tiers = derive.fit_tiers(by_mode, cost_model, memory_model, limit, base_mode)  # type: ignore[arg-type]
        if not tiers:
            raise ValueError(
                f"no sequence length trains one sample within the memory limit in any activation-checkpointing mode "
                f"({', '.join(trainee.modes)}; the shortest is S={int(seq_all.min()):,}). Shard the model (FSDP) or "
                f"lower `memory_margin` ({settings.memory_margin}).")
        extra["checkpointing"] = {"tiers": [t.to_dict() for t in tiers], "base_mode": base_mode,
                                  "modes": list(trainee.modes)}
        say("activation checkpointing per bucket: " + ", ".join(
            f"'{t.mode}' up to S={t.max_seq_len:,} (x{t.scale:.2f} step time)" for t in tiers))
    extra["compile_seconds"] = (trainee.compile_clock() - compile_start) if trainee.compile_clock else 0.0
    if extra["compile_seconds"] > 0:
        say(f"{extra['compile_seconds']:.1f} s of the profile went to torch.compile (never timed).")
    elapsed = clock() - start
    skipped = sum(m.status == "skipped" for m in measurements)
    if elapsed >= settings.time_budget_s and skipped:
        warn(f"time budget {settings.time_budget_s:.0f} s reached; {skipped} of {len(measurements)} shapes were "
             "not profiled. Fitting on the rest; raise `time_budget_s` to profile them.")
    return record.Calibration(
        key=key, cost_model=cost_model, measurements=measurements, memory_model=memory_model,
        device_memory=trainee.device_memory, optimizer_bytes=trainee.pending_bytes, profile_seconds=elapsed,
        world_size=trainee.world_size, extra=extra)


def _spread(grids: np.ndarray, max_shapes: int) -> list[tuple[int, int, int]]:
    """Up to ``max_shapes`` grids of distinct S spread over the range, the shortest and longest included
    (lengths within ``MERGE_REL`` of a longer one count as that one: :func:`distinct_lengths`)."""
    reps = distinct_lengths(grids)
    if len(reps) > max_shapes:
        idx = np.unique(np.round(np.linspace(0, len(reps) - 1, max_shapes)).astype(int))
        reps = [reps[i] for i in idx]
    return reps  # type: ignore[return-value]


def sustain_seconds(settings: ProfileSettings) -> float:
    """``settings.sustain_s``; ``None`` (the default): 0, no sustained timing, on every device.

    Off by default: on one H100 (the 480p recipe from scratch) the longest shape took 1.85 s a step after 5 s and
    after 20 s of back-to-back steps, against 1.91 s in its profile and 2.08 s in training; the profile's gap to
    training came from the zero head (:func:`~lightning_adaptiveload.callbacks._trainee._no_trace`), not from the
    clock settling."""
    return settings.sustain_s if settings.sustain_s is not None else 0.0


def _sustain(trainee: Trainee, by_mode: list[tuple[str | None, list[Measurement]]], settle_s: float, repeats: int,
             say: Callable[[str], None], warn: Callable[[str], None]
             ) -> tuple[list[tuple[str | None, list[Measurement]]], dict[str, Any] | None]:
    """Time the profile's longest step again under sustained load (``settle_s`` seconds of back-to-back steps); where
    it is :data:`SUSTAIN_MIN_REL` or more slower than profiled, scale every profiled time by the ratio. Returns the
    measurements and the record kept in ``extra["sustained"]`` (``None``: not measured)."""
    ok = [(mode, m) for mode, ms in by_mode for m in ms if m.status == "ok"]
    if settle_s <= 0 or not ok:
        return by_mode, None
    mode, ref = max(ok, key=lambda mm: mm[1].time_s)
    if mode is not None:
        trainee.set_mode(mode)  # type: ignore[misc]
    try:
        t, seconds, untimed = sustained(trainee.make_step, Shape(ref.batch_size, ref.grid), settle_s=settle_s,
                                        repeats=repeats, collectives=trainee.collectives,
                                        synchronize=trainee.synchronize)
    except Exception as err:  # noqa: BLE001 - only out-of-memory is recovered, the rest re-raised
        if not is_out_of_memory(err):
            raise
        if trainee.on_oom is not None:
            trainee.on_oom()
        warn(f"timing B={ref.batch_size} S={ref.seq_len:,} under sustained load ran out of memory; the profile's "
             "times are kept as measured (the closed loop corrects them from training's steps).")
        return by_mode, None
    factor = t / float(ref.time_s)
    applied = factor >= 1 + SUSTAIN_MIN_REL
    record_ = {"batch_size": ref.batch_size, "seq_len": ref.seq_len, "mode": mode, "profiled_s": ref.time_s,
               "sustained_s": t, "factor": factor, "applied": applied, "seconds": seconds, "untimed_steps": untimed}
    what = (f"every profiled step time x{factor:.3f}" if applied
            else f"within {SUSTAIN_MIN_REL:.0%}: the profiled times are kept")
    say(f"sustained load: B={ref.batch_size} S={ref.seq_len:,} took {t * 1e3:.1f} ms a step after {untimed} back-to-back "
        f"steps against {ref.time_s * 1e3:.1f} ms in its profile; {what} ({seconds:.1f} s)")
    if not applied:
        return by_mode, record_
    scaled = [(m_, [dataclasses.replace(m, time_s=m.time_s * factor) if m.status == "ok" else m for m in ms])
              for m_, ms in by_mode]
    return scaled, record_


def _measure_longest_fit(grids: np.ndarray, meas: list[Measurement], run: Callable[..., list[Measurement]],
                         limit: float | None) -> list[Measurement]:
    """Probe, at B = 1, the sequences longer than the longest measured to fit that the profile left out
    (not in its spread) until one does not fit: a mode's range then ends at a measurement."""
    extra: list[Measurement] = []
    tried = {m.seq_len for m in meas if m.batch_size == 1 and m.status != "skipped"}
    for g in _spread(grids, len(grids)):
        s = int(np.prod(g))
        done = meas + extra
        fit_s = max([m.seq_len for m in done if derive.fits_at_one(m, limit)], default=0)
        if s <= fit_s:
            continue
        if s in tried or any(m.seq_len < s and m.batch_size == 1 and m.status in ("oom", "too_large")
                             for m in done):
            break  # measured (or a shorter one did not fit): the range ends here
        extra += run([Shape(1, g)])
        if not derive.fits_at_one(extra[-1], limit):
            break
    return extra


def checkpoint_state(cal: record.Calibration | None, derivation: derive.Derivation | None) -> dict[str, Any]:
    """What a checkpoint keeps so that a resumed run derives the same policy: the calibration and the
    budgets it was derived with (``calibrate(restored=...)`` and :func:`derive_for` read it back)."""
    state: dict[str, Any] = {"version": STATE_VERSION}
    if cal is not None and derivation is not None:
        derived: dict[str, Any] = {"m_mem": derivation.m_mem, "step_budget_s": derivation.step_budget_s}
        if derivation.tiers:
            derived["tier_m_mem"] = [t["m_mem"] for t in derivation.tiers]
        state.update(calibration=cal.to_json(), derived=derived)
    return state


def read_checkpoint_state(state: Any) -> dict[str, Any] | None:
    """A :func:`checkpoint_state`, or ``None`` (absent, of another version, or without a calibration)."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION or not state.get("calibration"):
        return None
    return state


def metrics(cal: record.Calibration, derivation: derive.Derivation) -> dict[str, float]:
    """The constants a run logs: budgets, the fitted parameters and their quality, predicted tokens/s."""
    out = {"m_mem": float(derivation.m_mem), "step_budget_s": derivation.step_budget_s, **cal.cost_model.params,
           "profile_seconds": cal.profile_seconds, "predicted_tokens_per_s": derivation.predicted["tokens_per_s"],
           "baseline_tokens_per_s": derivation.baseline["tokens_per_s"]}
    out.update({f"quality/{k}": v for k, v in cal.cost_model.quality.items()})
    return out


def out_of_memory_advice(cal: record.Calibration, derivation: derive.Derivation | None, batch_size: int,
                         seq_len: int, memory_margin: float) -> str:
    """Why a training batch of ``batch_size`` × ``seq_len`` that ran out of memory was planned, and what to change."""
    mode = derivation.mode_for(seq_len) if derivation is not None else None
    tiers = derive.tiers_from_record(cal.extra) or []
    model = next((t.memory_model for t in tiers if t.mode == mode and t.memory_model is not None), cal.memory_model)
    predicted = ""
    if model is not None and cal.device_memory:
        peak = float(model.predict(batch_size, seq_len)) + cal.optimizer_bytes
        predicted = (f"; the calibration's memory model{f' of {mode!r}' if mode else ''} predicted "
                     f"{peak / 2**30:.1f} GiB of {cal.device_memory / 2**30:.1f} GiB for it")
    return (f"ran out of memory on a B={batch_size} S={seq_len:,} batch{predicted}. Raise the margin "
            f"(ShapeBenchmarkCallback(memory_margin={memory_margin}), e.g. to {min(0.9, memory_margin + 0.1):.1f}) "
            "to get smaller batches, and if the error reports much memory 'reserved but unallocated', use "
            "PYTORCH_ALLOC_CONF=expandable_segments:True (adaptiveload-train sets it unless the environment has a "
            "setting).")


#: A key value longer than this is shortened in :func:`key_diff` (grids and length lists run to kilobytes).
_KEY_VALUE_CHARS = 60


def key_diff(a: dict[str, Any], b: dict[str, Any], *, values: bool = False) -> str:
    """Which fields of two calibration keys differ, in words; with ``values``, each with its value in ``a``
    (the calibration's) and in ``b`` (this run's), shortened to :data:`_KEY_VALUE_CHARS` characters."""
    names = {"model": "model architecture", "grid": "profiled grid"}
    fields = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if not fields:
        return "same key"
    if not values:
        return ", ".join(names.get(k, k) for k in fields) + " differ"

    def short(key: dict[str, Any], k: str) -> str:
        text = repr(key[k]) if k in key else "(absent)"
        return text if len(text) <= _KEY_VALUE_CHARS else text[: _KEY_VALUE_CHARS - 3] + "..."

    return "; ".join(f"{names.get(k, k)} ({k}): {short(a, k)} in the calibration, {short(b, k)} in this run"
                     for k in fields)
