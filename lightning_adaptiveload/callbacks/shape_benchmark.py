"""Profile the real training step at the start of fit and give the DataModule the derived policy.

A hook adapter (as Lightning's ``BatchSizeFinder`` is over ``tuner/``): the conductor
(:func:`lightning_adaptiveload.calibration.calibrate.calibrate`) resolves the source, profiles, fits
and derives; this callback hands it the live strategy's step and collectives, applies the result,
switches the activation-checkpointing mode per batch, and checkpoints, logs and reports.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_adaptiveload.calibration import derive, feedback, record
from lightning_adaptiveload.calibration.calibrate import (
    ProfileSettings,
    calibrate,
    checkpoint_state,
    derive_for,
    key_diff,
    metrics,
    out_of_memory_advice,
    read_checkpoint_state,
    with_trained_plan,
)
from lightning_adaptiveload.calibration.profile import is_out_of_memory
from lightning_adaptiveload.callbacks._trainee import (
    CALLBACK_NAME,
    apply_checkpointing,
    calibration_key,
    check_fit,
    corpus,
    lightning_trainee,
    log_dir,
    sampler_settings,
    samples_of,
)
from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor
from lightning_adaptiveload.models.attention import choose_attention
from lightning_adaptiveload.reporting import print_calibration, save_calibration

_NAME = CALLBACK_NAME


def _monitor(trainer: Trainer) -> BalanceMonitor | None:
    """The Trainer's BalanceMonitor (the closed loop's step times), if it has one."""
    return next((cb for cb in trainer.callbacks if isinstance(cb, BalanceMonitor)), None)

#: How profiling chooses shapes and what its memory model holds; part of the calibration key, so a
#: calibration from an earlier profiler is profiled again rather than reused. 3: activation
#: checkpointing per bucket, memory caps from the first pass on, two batch sizes per S with a
#: convergence stop. 4: on a GPU the longest shape is timed again under sustained load, which can scale every time.
#: 5: all-zero parameters hold noise while profiling (a zero head made every profiled backward multiply zeros);
#: the sustained-load timing is off unless ``sustain_s`` is set.
PROFILE_VERSION = 5


class ShapeBenchmarkCallback(Callback):
    """Profiles step latency over the dataset's shapes and sets the DataModule's batch-size policy.

    In ``on_fit_start`` (after the strategy has wrapped the model, before the train dataloader exists)
    it hands :func:`~lightning_adaptiveload.calibration.calibrate.calibrate` the live strategy's step,
    ``pl_module.compute_loss(pl_module.synthetic_batch(B, grid, device))`` forward + backward, then calls
    ``datamodule.set_cost_model`` / ``set_policy``, prints the fit, logs the constants and writes
    ``shape_benchmark.json`` and ``shape_benchmark.png`` to ``save_dir``. Compile time is never timed;
    profiling leaves no trace (weights, gradients, buffers, modes, RNG states).

    A module whose ``checkpointing`` is ``"auto"`` gets its activation-checkpointing mode per bucket:
    profiled in ``none`` first, the lengths that do not fit in the next mode; before every training
    batch this callback sets the mode of the batch's bucket (compiled blocks compile each mode once).
    The calibration comes from, first match wins: ``calibration=`` (pinned), the checkpoint being
    resumed (its budgets as they were), ``cache_dir`` (keyed by what determines a step's cost, not the
    world size), a fresh profile. The key does not see kernels swapped in by other callbacks: use
    ``force=True`` after such a change. Details: ``docs/components.md`` (Calibration).

    Closed loop (``closed_loop=True``, with a :class:`~lightning_adaptiveload.callbacks.balance_monitor.BalanceMonitor`
    in the Trainer): at training steps ``closed_loop_every_n_steps · 2^k`` the step times training measured
    per batch shape (:meth:`BalanceMonitor.observations`: the step plus the wait before it, every rank)
    correct the calibration (:func:`~lightning_adaptiveload.calibration.feedback.refit`: training's points
    over the profile's, in the calibration's form). When the corrected policy is predicted to train at
    least :data:`~lightning_adaptiveload.calibration.feedback.REPLAN_GAIN` faster than the running one under
    the corrected model at ``closed_loop_confirm`` consecutive checks (2: a single check's gain can be a
    transient; on the 2-core CPU quickstart one check's re-plan on a slow start cost 7% of tokens/s), the
    DataModule re-plans from the next step no rank has drawn (every sample still once per epoch); otherwise
    only the predictions change. The refit and the comparison run on a background thread of rank 0 while
    training goes on (one rank's CPU time, not every rank's: on a CPU job the ranks share the cores the
    thread takes); their decision is broadcast and applied at the next training step on every rank, so the
    training thread pays two broadcasts per check. Either way one line says what changed, the
    corrected calibration replaces the cache entry (marked as corrected from N training steps), and after
    a re-plan the checkpoints carry it, so a resume plans the same batches.

    Args:
        batch_sizes: Batch sizes to try at every sequence length. ``None``: B = 1 and the largest that
            fits (capped by the peaks measured so far).
        max_shapes: Number of distinct sequence lengths to profile, spread over the dataset's range.
        repeats: At most this many timed steps per shape (the median is kept).
        stable_rel: A shape stops early once two or more timed steps span at most this fraction of
            their median (0: always ``repeats``).
        warmup: Untimed steps per shape before timing (a compiled model's steps that compile nothing count).
        shape_time_s: A shape starts no step that its last one predicts would end after this many
            seconds of the shape's time, compile time excluded.
        time_budget_s: No new shape is started after this many seconds, once every sequence length
            has been measured.
        converge_rel: Shapes after the first pass stop once one was predicted within this
            fraction by the fit of the shapes before them (0: profile every shape).
        form: Cost-model form: ``"auto"``, ``"power"``, ``"quadratic"`` or ``"saturating"``.
        memory_margin: Fraction of device memory held back when deriving ``M_mem``.
        step_budget_s: Step budget in seconds; ``None`` picks the one with the highest predicted throughput.
        m_mem: Token budget per batch; ``None`` derives it from measured peak memory (CUDA) or the
            largest profiled batch (CPU). With a fixed ``m_mem``, samples above it are never profiled.
        sustain_s: Seconds of back-to-back steps of the profile's longest shape before it is timed again under
            sustained load, at the end of the profile; a step 2% or more slower than profiled scales every profiled
            time (a power-capped GPU runs the profile's short bursts at a higher clock than training sustains).
            ``None``: 0 (off; on one H100 5 s and 20 s of sustained load did not reach training's step time).
        cache_dir: Directory of the calibration cache; ``None`` disables the cache.
        calibration: A calibration JSON to use instead of profiling (e.g. a previous ``shape_benchmark.json``).
        force: Profile even when the cache or a checkpoint holds a matching calibration.
        save_dir: Where the JSON and the plot go; ``None`` uses ``trainer.log_dir`` (or ``default_root_dir``).
        enabled: ``False`` turns the callback into a no-op.
        closed_loop: Correct the calibration from training's step times and re-plan when that pays (above).
        closed_loop_every_n_steps: First check at this training step, then at twice the step of the last.
        closed_loop_min_steps: Steps of a batch shape before its median counts.
        closed_loop_confirm: Consecutive checks that must call for a re-plan before it is made (1: the first).

    Raises:
        ValueError: If an argument is out of range.
        MisconfigurationException: In ``setup``, if the LightningModule lacks ``compute_loss`` /
            ``synthetic_batch`` or the DataModule lacks ``dataset.token_grids()``, ``set_policy`` or
            ``set_cost_model``.

    Example::

        trainer = Trainer(callbacks=[ShapeBenchmarkCallback(max_shapes=6, cache_dir="~/.cache/adaptiveload")],
                          use_distributed_sampler=False)
        trainer.fit(FlowMatchingModule("wan2_1_1_3b"), datamodule=AdaptiveLoadDataModule(dataset, policy))
    """

    def __init__(
        self,
        batch_sizes: Sequence[int] | None = None,
        max_shapes: int = 8,
        repeats: int = 3,
        stable_rel: float = 0.02,
        warmup: int = 1,
        shape_time_s: float = 5.0,
        time_budget_s: float = 120.0,
        converge_rel: float = 0.03,
        form: str = "auto",
        memory_margin: float = 0.1,
        step_budget_s: float | None = None,
        m_mem: int | None = None,
        sustain_s: float | None = None,
        cache_dir: str | os.PathLike | None = None,
        calibration: str | os.PathLike | None = None,
        force: bool = False,
        save_dir: str | os.PathLike | None = None,
        enabled: bool = True,
        closed_loop: bool = True,
        closed_loop_every_n_steps: int = 25,
        closed_loop_min_steps: int = 3,
        closed_loop_confirm: int = 2,
    ) -> None:
        self.settings = ProfileSettings(
            batch_sizes=batch_sizes, max_shapes=max_shapes, repeats=repeats, stable_rel=stable_rel, warmup=warmup,
            shape_time_s=shape_time_s, time_budget_s=time_budget_s, converge_rel=converge_rel, form=form,
            memory_margin=memory_margin, step_budget_s=step_budget_s, m_mem=m_mem, sustain_s=sustain_s,
            owner=type(self).__name__)
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        self.calibration_path = None if calibration is None else Path(calibration).expanduser()
        self.force = force
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.enabled = enabled
        for name, value in (("closed_loop_every_n_steps", closed_loop_every_n_steps),
                            ("closed_loop_min_steps", closed_loop_min_steps),
                            ("closed_loop_confirm", closed_loop_confirm)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{type(self).__name__}({name}={value!r})` is not valid. Expected a positive integer.")
        self.closed_loop = bool(closed_loop)
        self.closed_loop_every_n_steps = closed_loop_every_n_steps
        self.closed_loop_min_steps = closed_loop_min_steps
        self.closed_loop_confirm = closed_loop_confirm
        self._wanted = 0  # consecutive checks that called for a re-plan (the same on every rank)
        self._next_check: int | None = None
        # The check being computed on the background thread: (global step it was taken at, its result).
        self._pending: tuple[int, Future | None] | None = None  # rank 0's future; None on the other ranks
        self._pool: ThreadPoolExecutor | None = None
        self._corpus: tuple[Any, Any] | None = None  # (distinct grids, counts) counted at fit start
        self._loop_warned = False
        #: The closed loop's decisions of this fit: ``(global step, Decision, re-planned at epoch step or None)``.
        self.decisions: list[tuple[int, feedback.Decision, int | None]] = []
        self._restored: dict[str, Any] | None = None
        self._fit_started = False
        self._auto_checkpointing = False
        self._last_batch: tuple[int, int, int] | None = None  # (step, B, S) of the batch in training
        self.calibration: record.Calibration | None = None
        self.derivation: derive.Derivation | None = None
        self.source: str | None = None
        self.profiled = False
        self._start_gain = float("nan")  # the policy's predicted gain over equal-token batches at fit start
        self._predict_with: Any = None  # the cost model the monitor is to predict with from the first step

    def __getattr__(self, name: str) -> Any:
        # The settings read as attributes (`callback.max_shapes`), as the constructor's arguments.
        settings = self.__dict__.get("settings")
        if settings is not None and name in ProfileSettings.__dataclass_fields__:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # Results of the last application, for users and tests.
    @property
    def cost_model(self) -> Any:
        return None if self.calibration is None else self.calibration.cost_model

    @property
    def memory_model(self) -> Any:
        return None if self.calibration is None else self.calibration.memory_model

    @property
    def policy(self) -> Any:
        return None if self.derivation is None else self.derivation.policy

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or not self.enabled:
            return
        check_fit(trainer, pl_module)
        self._fit_started = False
        self._next_check, self.decisions, self._wanted = None, [], 0

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled:
            return
        self._fit_started = True
        # Read before anything sets a mode, so a calibration applied later (a late-restoring strategy's
        # checkpoint) still gives the per-bucket modes.
        self._auto_checkpointing = getattr(pl_module, "checkpointing", None) == "auto"
        grids, counts = corpus(trainer)
        self._corpus = (grids, counts)  # the closed loop's checks derive for the same corpus
        # attention="auto": the backends are chosen first, so the profile and the key see them.
        choose_attention(trainer, pl_module, say=lambda line: rank_zero_info(f"{_NAME}: {line}"))
        result = calibrate(
            grids, counts, self.settings, lambda: lightning_trainee(trainer, pl_module, self._auto_checkpointing),
            key=calibration_key(trainer, pl_module, self.settings, grids, PROFILE_VERSION), pinned=self.calibration_path,
            restored=None if self.force else self._restored, cache_dir=self.cache_dir, force=self.force,
            is_global_zero=trainer.is_global_zero, broadcast=trainer.strategy.broadcast,
            world_size=trainer.world_size, **sampler_settings(trainer), samples=samples_of(trainer),
            say=lambda line: rank_zero_info(f"{_NAME}: {line}"), warn=lambda line: rank_zero_warn(f"{_NAME}: {line}"))
        self.profiled = result.profiled
        self._apply(trainer, pl_module, result.calibration, result.derivation, result.source)
        # A cached correction prices the plan its run measured: the BalanceMonitor's predictions use it from the
        # first step (set then, as the monitor takes the DataModule's cost model when training starts).
        self._predict_with = result.predict_with
        self._start_gain = result.derivation.baseline_gain

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Strategies that restore after setup (FSDP, DeepSpeed, ModelParallel) get here after
        # on_fit_start; the others restore first and go through load_state_dict → on_fit_start.
        if not (self.enabled and self._fit_started) or self.force or self.calibration_path is not None:
            return
        state = read_checkpoint_state((checkpoint.get("callbacks") or {}).get(self.state_key))
        if state is None or state == checkpoint_state(self.calibration, self.derivation):
            return
        restored = record.Calibration.from_json(state["calibration"], source="the checkpoint")
        if self.calibration is not None and restored.key != self.calibration.key:
            rank_zero_warn(f"{_NAME}: the checkpoint's calibration was made for another setup "
                           f"({key_diff(restored.key, self.calibration.key)}); keeping the current one.")
            return
        rank_zero_info(f"{_NAME}: this strategy restores checkpoints after `on_fit_start`; using the checkpoint's "
                       "calibration so the resumed bucket plan matches. Set `cache_dir` to skip profiling on resume.")
        grids, counts = corpus(trainer)
        derivation = derive_for(restored, grids, counts, self.settings, derived=state.get("derived"),
                                world_size=trainer.world_size, **sampler_settings(trainer),
                                samples=samples_of(trainer))
        self._apply(trainer, pl_module, restored, derivation, "checkpoint")
        self._predict_with = None  # the checkpoint's calibration prices its own plan

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._predict_with is not None:
            monitor = _monitor(trainer)
            if monitor is not None:
                monitor.set_cost_model(self._predict_with)
            self._predict_with = None
        shape = getattr(pl_module, "batch_shape", None)
        if not callable(shape):
            self._last_batch = None
            return
        b, s = (int(v) for v in shape(batch))
        # Remembered so that an out-of-memory error in this batch can be explained (on_exception).
        self._last_batch = (trainer.global_step, b, s)
        if self._auto_checkpointing and self.derivation is not None and len(self.derivation.tiers) > 1:
            mode = self.derivation.mode_for(s) or self.derivation.tiers[-1]["mode"]
            if pl_module.checkpointing != mode:
                pl_module.set_checkpointing(mode)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not (self.enabled and self.closed_loop) or self.calibration is None or self.derivation is None:
            return
        step = trainer.global_step
        if self._pending is not None and step > self._pending[0]:
            self._finish_check(trainer, step)
        if self._next_check is None:  # the schedule continues after a resume
            self._next_check = self.closed_loop_every_n_steps
            while self._next_check <= step:
                self._next_check *= 2
            return
        if step < self._next_check or self._pending is not None:
            return
        self._next_check = max(self._next_check, step) * 2
        self._start_check(trainer, step)

    def _start_check(self, trainer: Trainer, step: int) -> None:
        """Take training's step times (one broadcast) and hand the refit and comparison to the background
        thread; :meth:`_finish_check` applies the decision at the next step."""
        monitor = _monitor(trainer)
        why = None
        if monitor is None:
            why = "it needs a BalanceMonitor in the Trainer's callbacks (it measures the steps)"
        elif getattr(trainer.datamodule, "sp_config", None) is not None:
            why = "re-planning is not supported with sequence parallelism"
        if why is not None:
            if not self._loop_warned:
                self._loop_warned = True
                rank_zero_warn(f"{_NAME}: the closed loop is off: {why}. Set `closed_loop=False` to silence this.")
            return
        # The same on every rank (all-gathered rows); broadcast so that every rank decides on rank 0's floats.
        observed, overhead = trainer.strategy.broadcast((monitor.observations(self.closed_loop_min_steps),
                                                         monitor.overhead_s()))
        if not observed:
            return
        if not trainer.is_global_zero:  # rank 0 computes; _finish_check broadcasts its outcome
            self._pending = (step, None)
            return
        # The corpus's buckets were counted at fit start; its samples are passed for oversize errors' labels.
        args = (self.calibration, self.derivation, [feedback.Observation(*o) for o in observed], overhead,
                trainer.world_size, sampler_settings(trainer), self._corpus, samples_of(trainer))
        if self._pool is None:
            # One worker: checks are computed in order. A thread, not a process: the work is numpy and short,
            # and a thread shares the calibration without pickling it; the training thread mostly waits on
            # kernels (or sleeps in torch ops that release the GIL) while it runs.
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adaptiveload-closed-loop")
        self._pending = (step, self._pool.submit(self._decide, self.settings, *args))

    @staticmethod
    def _decide(settings: ProfileSettings, calibration: record.Calibration, derivation: derive.Derivation,
                observed: list[feedback.Observation], overhead: float | None, world_size: int,
                sampler: dict[str, Any], buckets: tuple[Any, Any], samples: tuple[Any, Any]
                ) -> tuple[record.Calibration, feedback.Decision, float]:
        """The closed loop's computation (rank 0's background thread): refit, then compare the corrected policy
        with the running one. A pure function of its arguments."""
        start = time.perf_counter()
        grids, counts = buckets
        corrected = feedback.refit(calibration, observed, overhead_s=overhead)
        decision = feedback.compare(calibration, derivation, corrected, grids, counts, settings,
                                    world_size=world_size, **sampler, samples=samples)
        return corrected, decision, time.perf_counter() - start

    def _finish_check(self, trainer: Trainer, step: int, *, apply: bool = True) -> None:
        """Apply the pending check's decision at training step ``step`` (waiting for it if it is not done)."""
        (checked, future), self._pending = self._pending, None
        waited = time.perf_counter()
        outcome: Any = None
        if future is not None:
            try:
                outcome = ("ok", future.result())
            except (ValueError, record.CalibrationError) as err:
                outcome = ("keep", str(err))
            except Exception as err:  # noqa: BLE001 - raised below on every rank, not on rank 0 alone
                outcome = ("raise", f"{type(err).__name__}: {err}")
        # Rank 0's outcome on every rank (other ranks computed nothing): all apply the same decision.
        outcome = trainer.strategy.broadcast(outcome)
        waited = time.perf_counter() - waited
        if outcome is None:  # only when a rank started a check rank 0 did not: a bug, never silently skipped
            raise RuntimeError(f"{_NAME}: step {checked}: rank 0 sent no closed-loop decision.")
        if outcome[0] == "raise":
            raise RuntimeError(f"{_NAME}: step {checked}: the closed loop failed on rank 0 ({outcome[1]}). "
                               "Set `callbacks.shape_benchmark.closed_loop=false` to train without it.")
        if outcome[0] == "keep":
            rank_zero_warn(f"{_NAME}: step {checked}: the closed loop could not correct the calibration "
                           f"({outcome[1]}); keeping it.")
            return
        corrected, decision, took = outcome[1]
        dm = trainer.datamodule
        at = None
        model = decision.derivation.cost_model or corrected.cost_model
        self._wanted = self._wanted + 1 if decision.replan else 0
        if apply and decision.replan and self._wanted >= self.closed_loop_confirm:
            self._wanted = 0
            at = dm.replan(decision.derivation.policy, model)
            self.calibration, self.derivation = corrected, decision.derivation
            self.source = f"corrected from {corrected.extra['provenance']['training_steps']} training steps"
        monitor = _monitor(trainer)
        if monitor is not None:
            monitor.set_cost_model(model)
        self.decisions.append((checked, decision, at))
        where = f"; re-planned from step {at} of the epoch" if at is not None else ""
        if decision.replan and at is None:
            more = self.closed_loop_confirm - self._wanted
            where = (f"; re-plans if the next {more} check(s) agree (closed_loop_confirm={self.closed_loop_confirm})"
                     if apply else "; training ended before it could re-plan")
        tps = decision.tokens_per_s(replanned=at is not None)
        rank_zero_info(f"{_NAME}: step {checked}: {decision.summary()}{where}; the plan now trains at {tps:,.0f} "
                       f"predicted tokens/s ({took:.2f} s on a background thread, applied at step {step}; "
                       f"training waited {waited:.2f} s)")
        if self.cache_dir is not None and trainer.is_global_zero:
            # With the plan training ran, so that the next run trains it again unless a new one pays (trained_plan).
            record.write_cache(self.cache_dir, with_trained_plan(corrected, self.calibration, self.derivation))

    def _settle(self) -> None:
        """Wait for a check still being computed (its decision is applied at the next step as usual): a DataLoader
        forks its workers when an epoch or a validation run starts, and a fork while the background thread is
        inside numpy or scipy can leave the child holding their locks."""
        if self._pending is not None and self._pending[1] is not None:
            wait([self._pending[1]])

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._settle()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._settle()

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Say what the plan gains over equal-token batches under the model training corrected, beside what the
        profile predicted (the line printed with the calibration)."""
        if self._pending is not None:  # a check from the last steps: its figures, nothing re-planned
            self._finish_check(trainer, trainer.global_step, apply=False)
        self._stop_pool()
        if not (self.enabled and self.decisions) or self.derivation is None:
            return
        step, decision, at = self.decisions[-1]
        gain = decision.gain_over_baseline(replanned=at is not None)
        start = self._start_gain
        before = f" (the calibration the run started with predicted {start:+.1%})" if math.isfinite(start) else ""
        rank_zero_info(
            f"{_NAME}: against equal-token batches (max_tokens={decision.derivation.m_mem:,}, dealt at random) this "
            f"plan trains at {gain:+.1%} tokens/s under the cost model corrected at step {step} "
            f"from {sum(o.steps for o in decision.observed):,} training steps{before}: two simulated epochs at the "
            "step times training measured, each step priced at its slowest rank's batch (where ranks share CPU cores "
            "with other work a waiting rank frees time for the others, and the measured gain is smaller); "
            "`benchmarks/bench_quickstart.py` measures both runs side by side.")

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Say what the calibration predicted, and what to change, when a training batch runs out of memory."""
        self._pending = None
        self._stop_pool()
        last, cal = self._last_batch, self.calibration
        if not (self.enabled and last and cal is not None and trainer.training and is_out_of_memory(exception)):
            return
        step, b, s = last
        advice = out_of_memory_advice(cal, self.derivation, b, s, self.settings.memory_margin)
        rank_zero_warn(f"{_NAME}: training step {step} {advice}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._pending = None
        self._stop_pool()

    @override
    def state_dict(self) -> dict[str, Any]:
        return checkpoint_state(self.calibration, self.derivation)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = read_checkpoint_state(state_dict)
        if state is not None and not self._fit_started:
            self._restored = state

    # ------------------------------------------------------------------ applying a calibration
    def _apply(self, trainer: Trainer, pl_module: LightningModule, cal: record.Calibration,
               derivation: derive.Derivation, source: str) -> None:
        apply_checkpointing(pl_module, derivation, source, self._auto_checkpointing)
        dm = trainer.datamodule
        dm.set_cost_model(derivation.cost_model or cal.cost_model)
        dm.set_policy(derivation.policy)
        self.calibration, self.derivation, self.source = cal, derivation, source
        for logger in trainer.loggers:
            logger.log_metrics({f"shape_benchmark/{k}": v for k, v in metrics(cal, derivation).items()},
                               step=trainer.global_step)
        if trainer.is_global_zero:
            print_calibration(cal, derivation, source)
            save_calibration(cal, derivation, self.save_dir or log_dir(trainer))
