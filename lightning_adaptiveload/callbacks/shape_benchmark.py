"""Profile the real training step at the start of fit and give the DataModule the derived policy.

A hook adapter (as Lightning's ``BatchSizeFinder`` is over ``tuner/``): the profiling loop, the fits
and the policy rule live in :mod:`lightning_adaptiveload.calibration`; this callback only feeds it
the live strategy's step and collectives, and applies, caches, checkpoints and reports the result.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from typing_extensions import override

from lightning_adaptiveload.bucketing.sampler import count_buckets
from lightning_adaptiveload.calibration import derive, record
from lightning_adaptiveload.calibration.costmodel import FORMS
from lightning_adaptiveload.calibration.profile import (
    MemoryProbe,
    Shape,
    is_out_of_memory,
    plan_grid,
    profile,
)
from lightning_adaptiveload.models.compiling import compile_seconds
from lightning_adaptiveload.models.protocol import check_module
from lightning_adaptiveload.reporting import plot_calibration, print_calibration

_STATE_VERSION = 2


#: How profiling chooses shapes and what its memory model holds; part of the calibration key, so a
#: calibration from an earlier profiler is profiled again rather than reused. 2: batch sizes capped at
#: the memory fitted so far, and a per-sample memory term (a linear-only model under-predicted image
#: batches enough to run out of memory).
PROFILE_VERSION = 2


class _StrategyCollectives:
    """:class:`~lightning_adaptiveload.calibration.profile.Collectives` over a Lightning strategy."""

    def __init__(self, trainer: Trainer) -> None:
        self.strategy = trainer.strategy

    def max(self, value: float) -> float:
        t = torch.tensor(float(value), device=self.strategy.root_device, dtype=torch.float64)
        return float(self.strategy.reduce(t, reduce_op="max"))

    def broadcast(self, obj: Any) -> Any:
        return self.strategy.broadcast(obj)


class ShapeBenchmarkCallback(Callback):
    """Profiles step latency over the dataset's shapes and sets the DataModule's batch-size policy.

    In ``on_fit_start`` — after the strategy has wrapped the model and before the train dataloader
    exists — it plans a grid of (B, token grid) shapes over the dataset's sequence lengths
    (:func:`~lightning_adaptiveload.calibration.profile.plan_grid`), times forward + backward of
    ``pl_module.compute_loss(pl_module.synthetic_batch(B, grid, device))`` through the live strategy
    (:func:`~lightning_adaptiveload.calibration.profile.profile`: warm-up, median, max over ranks,
    out-of-memory recovery, per-shape and total time bounds), fits the cost and memory models, and
    derives ``M_mem``, the step budget and the policy by the one rule of
    :mod:`lightning_adaptiveload.calibration.derive`. It then calls ``datamodule.set_cost_model`` and
    ``datamodule.set_policy``, prints the fit and the predicted gain over equal-token batches, logs
    the constants and writes ``shape_benchmark.json`` (a calibration record with the derivation) and
    ``shape_benchmark.png`` to ``save_dir``.

    A module whose ``checkpointing`` is ``"auto"`` (``FlowMatchingModule(activation_checkpointing="auto")``;
    it also provides ``checkpointing_modes``, least recomputation first, and ``set_checkpointing``) gets
    its activation-checkpointing mode chosen first (:func:`~lightning_adaptiveload.calibration.derive.choose_checkpointing`):
    one step of one sample of the longest sequence per mode, ``none`` → ``selective`` → ``full``, stopping
    at the first whose peak memory fits; the profile then runs in that mode, and the mode is part of
    the calibration record (so a cached, pinned or resumed calibration re-applies it). If no mode fits,
    fit stops before profiling with an error naming the samples (or, with ``oversize=skip``, trains
    them out under ``full``).

    Compile time is never timed: a step in which ``torch.compile`` compiled something is a warm-up
    step, and a warm-up step in which nothing compiled counts as a timed one. The seconds spent
    compiling are reported with the profile.

    Profiling leaves no trace: the optimizer never steps, gradients are set to ``None``, buffers and
    train/eval modes are restored, and the torch, CUDA, numpy and Python RNG states are restored.

    Where the calibration comes from, first match wins: ``calibration=`` (a file, pinned); the
    checkpoint being resumed (its policy is applied as it was, so the resumed epoch's plan matches
    even on another number of ranks); ``cache_dir`` (keyed by what determines a step's cost: the
    model's parameter names and shapes, device, precision, strategy, form and profiled grid — not the
    world size, learning rate or paths); else a fresh profile. A checkpoint or cache entry whose key
    differs is not used, and the warning names the fields that differ. The key does not see kernels
    swapped in by other callbacks: use ``force=True`` after such a change.

    Args:
        batch_sizes: Batch sizes to try at every sequence length. ``None`` picks up to three per
            sequence length, geometrically from 1 to ``2·S_max / S``.
        max_shapes: Number of distinct sequence lengths to profile, spread over the dataset's range.
        repeats: At most this many timed steps per shape (the median is kept).
        stable_rel: A shape stops early once two or more timed steps span at most this fraction of
            their median (0: always ``repeats``).
        warmup: Untimed steps per shape before timing.
        shape_time_s: A shape starts no new step after this many seconds, compile time excluded (one timed step is kept).
        time_budget_s: No new shape is started after this many seconds, once every sequence length
            has been measured; later shapes get only what is left.
        form: Cost-model form: ``"auto"``, ``"power"``, ``"quadratic"`` or ``"saturating"``
            (:mod:`lightning_adaptiveload.calibration.costmodel`).
        memory_margin: Fraction of device memory held back when deriving ``M_mem``.
        step_budget_s: Step budget in seconds; ``None`` picks the one with the highest predicted
            throughput (see :mod:`lightning_adaptiveload.calibration.derive`).
        m_mem: Token budget per batch; ``None`` derives it from measured peak memory (CUDA) or the
            largest profiled batch (CPU). With a fixed ``m_mem``, samples above it are never profiled.
        cache_dir: Directory of the calibration cache; ``None`` disables the cache.
        calibration: A calibration JSON to use instead of profiling (e.g. a previous run's
            ``shape_benchmark.json``).
        force: Profile even when the cache or a checkpoint holds a matching calibration.
        save_dir: Where the JSON and the plot go; ``None`` uses ``trainer.log_dir`` (or
            ``default_root_dir``).
        enabled: ``False`` turns the callback into a no-op.

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
        shape_time_s: float = 30.0,
        time_budget_s: float = 300.0,
        form: str = "auto",
        memory_margin: float = 0.1,
        step_budget_s: float | None = None,
        m_mem: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        calibration: str | os.PathLike | None = None,
        force: bool = False,
        save_dir: str | os.PathLike | None = None,
        enabled: bool = True,
    ) -> None:
        name = type(self).__name__
        if batch_sizes is not None:
            batch_sizes = list(batch_sizes)
            if not batch_sizes or any(isinstance(b, bool) or int(b) != b or b < 1 for b in batch_sizes):
                raise ValueError(
                    f"`{name}(batch_sizes={batch_sizes!r})` is not valid. Expected a non-empty list of positive "
                    "integers, or None."
                )
            batch_sizes = sorted({int(b) for b in batch_sizes})
        for arg, value, low in (("max_shapes", max_shapes, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"`{name}({arg}={value!r})` is not valid. Expected an integer >= {low}.")
        for arg, value in (("time_budget_s", time_budget_s), ("shape_time_s", shape_time_s)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"`{name}({arg}={value!r})` is not valid. Expected seconds > 0.")
        if form not in (*FORMS, "auto"):
            raise ValueError(f"`{name}(form={form!r})` is not valid. Expected one of {(*FORMS, 'auto')}.")
        if not 0 <= memory_margin < 1:
            raise ValueError(f"`{name}(memory_margin={memory_margin!r})` is not valid. Expected a fraction in [0, 1).")
        if step_budget_s is not None and not (math.isfinite(step_budget_s) and step_budget_s > 0):
            raise ValueError(f"`{name}(step_budget_s={step_budget_s!r})` is not valid. Expected seconds > 0 or None.")
        if m_mem is not None and (isinstance(m_mem, bool) or int(m_mem) != m_mem or m_mem < 1):
            raise ValueError(f"`{name}(m_mem={m_mem!r})` is not valid. Expected a positive token count or None.")
        self.batch_sizes = batch_sizes
        self.max_shapes = int(max_shapes)
        self.repeats = int(repeats)
        if not (isinstance(stable_rel, (int, float)) and 0 <= stable_rel < 1):
            raise ValueError(f"`ShapeBenchmarkCallback(stable_rel={stable_rel!r})` is not valid. Expected a fraction "
                             "in [0, 1).")
        self.stable_rel = float(stable_rel)
        self.warmup = int(warmup)
        self.shape_time_s = float(shape_time_s)
        self.time_budget_s = float(time_budget_s)
        self.form = form
        self.memory_margin = float(memory_margin)
        self.step_budget_s = step_budget_s
        self.m_mem = None if m_mem is None else int(m_mem)
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        self.calibration_path = None if calibration is None else Path(calibration).expanduser()
        self.force = force
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.enabled = enabled
        # The calibration in use and the budgets its policy was derived with (the checkpoint state).
        self._state: dict[str, Any] | None = None
        self._restored: dict[str, Any] | None = None
        self._fit_started = False
        self._auto_checkpointing = False
        self.calibration: record.Calibration | None = None
        self._last_batch: tuple[int, int, int] | None = None  # (step, B, S) of the batch in training
        self.derivation: derive.Derivation | None = None
        self.source: str | None = None
        self.profiled = False

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
        # batch_shape is optional here: with it, every synthetic batch is checked against its grid.
        check_module(pl_module, ("compute_loss", "synthetic_batch"), who="`ShapeBenchmarkCallback`")
        dm = trainer.datamodule
        dataset = getattr(dm, "dataset", None)
        if (
            dm is None
            or not callable(getattr(dataset, "token_grids", None))
            or not callable(getattr(dm, "set_policy", None))
            or not callable(getattr(dm, "set_cost_model", None))
        ):
            raise MisconfigurationException(
                "`ShapeBenchmarkCallback` needs `trainer.fit(..., datamodule=dm)` with `dm.dataset.token_grids()`, "
                f"`dm.set_policy` and `dm.set_cost_model` (see AdaptiveLoadDataModule); got {type(dm).__name__}."
            )
        self._fit_started = False

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled:
            return
        self._fit_started = True
        # Whether the module leaves checkpointing to the calibration; read before anything sets a mode,
        # so a calibration applied later (a late-restoring strategy's checkpoint) still gives its mode.
        self._auto_checkpointing = getattr(pl_module, "checkpointing", None) == "auto"
        self.profiled = False
        grids, counts = self._buckets(trainer)
        oversize = getattr(getattr(trainer.datamodule, "policy", None), "oversize", "error")
        max_seq_len = None
        if self.m_mem is not None:
            _check_oversize(grids, counts, self.m_mem, oversize)
            max_seq_len = self.m_mem
        plan = plan_grid(grids, self.batch_sizes, self.max_shapes, max_seq_len=max_seq_len, max_tokens=self.m_mem)
        key = self._key(trainer, pl_module, plan)

        cal, derived, source = None, None, None
        if self.calibration_path is not None:
            cal, source = record.load_calibration(self.calibration_path), f"file {self.calibration_path}"
        elif not self.force and self._restored is not None:
            restored = record.Calibration.from_json(self._restored["calibration"], source="the checkpoint")
            if restored.key == key:
                cal, derived, source = restored, self._restored.get("derived"), "checkpoint"
            else:
                rank_zero_warn(
                    "`ShapeBenchmarkCallback`: the checkpoint's calibration was made for another setup "
                    f"({_key_diff(restored.key, key)}); profiling again."
                )
        if cal is None and not self.force and self.cache_dir is not None:
            text = None
            if trainer.is_global_zero:
                hit = record.read_cache(self.cache_dir, key)
                text = None if hit is None else hit.to_json()
            text = trainer.strategy.broadcast(text)
            if text is not None:
                cal, source = record.Calibration.from_json(text), "cache"
        if cal is None:
            cal, source = self._profile(trainer, pl_module, plan, key, (grids, counts)), "profiled"
            if self.cache_dir is not None and trainer.is_global_zero:
                record.write_cache(self.cache_dir, cal)
        self._apply(trainer, pl_module, cal, (grids, counts), source, derived)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Strategies that restore after setup (FSDP, DeepSpeed, ModelParallel) get here after
        # on_fit_start; the others restore first and go through load_state_dict → on_fit_start.
        if not (self.enabled and self._fit_started) or self.force or self.calibration_path is not None:
            return
        state = _read_state((checkpoint.get("callbacks") or {}).get(self.state_key))
        if state is None or state == self._state:
            return
        restored = record.Calibration.from_json(state["calibration"], source="the checkpoint")
        if self.calibration is not None and restored.key != self.calibration.key:
            rank_zero_warn(
                "`ShapeBenchmarkCallback`: the checkpoint's calibration was made for another setup "
                f"({_key_diff(restored.key, self.calibration.key)}); keeping the current one."
            )
            return
        rank_zero_info(
            "`ShapeBenchmarkCallback`: this strategy restores checkpoints after `on_fit_start`; using the "
            "checkpoint's calibration so the resumed bucket plan matches. Set `cache_dir` to skip profiling on resume."
        )
        self._apply(trainer, pl_module, restored, self._buckets(trainer), "checkpoint", state.get("derived"))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # Remembered so that an out-of-memory error in this batch can be explained (on_exception).
        shape = getattr(pl_module, "batch_shape", None)
        self._last_batch = (trainer.global_step, *(int(v) for v in shape(batch))) if callable(shape) else None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Say what the calibration predicted, and what to change, when a training batch runs out of memory."""
        last, cal = self._last_batch, self.calibration
        if not (self.enabled and last and cal is not None and trainer.training and is_out_of_memory(exception)):
            return
        step, b, s = last
        margin = f"callbacks.shape_benchmark.memory_margin={self.memory_margin}"
        predicted = ""
        if cal.memory_model is not None and cal.device_memory:
            peak = float(cal.memory_model.predict(b, s)) + cal.optimizer_bytes
            predicted = (f"; the calibration's memory model predicted {peak / 2**30:.1f} GiB of "
                         f"{cal.device_memory / 2**30:.1f} GiB for it")
        rank_zero_warn(
            f"`ShapeBenchmarkCallback`: training step {step} ran out of memory on a B={b} S={s:,} batch{predicted}. "
            f"Raise the margin ({margin}, e.g. to {min(0.9, self.memory_margin + 0.1):.1f}) to get smaller "
            "batches, and if the error reports much memory 'reserved but unallocated', use "
            "PYTORCH_ALLOC_CONF=expandable_segments:True (adaptiveload-train sets it unless the environment "
            "has a setting)."
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, **(self._state or {})}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = _read_state(state_dict)
        if state is not None and not self._fit_started:
            self._restored = state

    # ------------------------------------------------------------------ profiling
    def _profile(self, trainer: Trainer, pl_module: LightningModule, plan: list, key: dict,
                 buckets: tuple[np.ndarray, np.ndarray]) -> record.Calibration:
        strategy = trainer.strategy
        device = strategy.root_device
        cuda = device.type == "cuda"
        rank_zero_info(
            f"`ShapeBenchmarkCallback`: profiling {len(plan)} shapes ({self.warmup} warm-up + up to {self.repeats} "
            f"timed steps each, at most {self.shape_time_s:.0f} s a shape, budget {self.time_budget_s:.0f} s) on "
            f"{_device_name(device)} × {trainer.world_size}."
        )
        has_shape = callable(getattr(pl_module, "batch_shape", None))

        def make_step(batch_size: int, grid: tuple[int, int, int]):
            batch = pl_module.synthetic_batch(batch_size, grid, device)
            if has_shape:
                got = tuple(int(v) for v in pl_module.batch_shape(batch))
                want = (batch_size, int(np.prod(grid)))
                if got != want:
                    raise MisconfigurationException(
                        f"`{type(pl_module).__name__}.synthetic_batch({batch_size}, token_grid={grid})` returned a "
                        f"batch whose `batch_shape` is {got}; expected {want}. The token grid is after patchify: "
                        "the latents must be the grid times the patch size."
                    )
            return lambda: _step(trainer, pl_module, batch)

        has_state = all(len(opt.state) > 0 for opt in trainer.optimizers) if trainer.optimizers else True
        params = {id(p): p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
        pending = derive.pending_optimizer_bytes(sum(p.numel() for p in params.values()), has_state)
        device_memory = int(torch.cuda.get_device_properties(device).total_memory) if cuda else None
        common = dict(collectives=_StrategyCollectives(trainer),
                      synchronize=(lambda: torch.cuda.synchronize(device)) if cuda else None,
                      memory=MemoryProbe.for_device(device), on_oom=torch.cuda.empty_cache if cuda else None,
                      progress=rank_zero_info, compile_clock=compile_seconds if _uses_compile(pl_module) else None)
        modules = list(pl_module.modules())
        training_modes = [m.training for m in modules]
        buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}
        start = time.perf_counter()
        compile_start = compile_seconds()
        self.profiled = True
        extra: dict[str, Any] = {}
        try:
            pl_module.train()
            with isolate_rng(), torch.enable_grad():
                if getattr(pl_module, "checkpointing", None) == "auto":
                    choice = self._choose_checkpointing(trainer, pl_module, make_step, buckets, plan, common,
                                                        device_memory, pending)
                    extra["checkpointing"] = choice.to_dict()
                limit = None if device_memory is None else device_memory * (1.0 - self.memory_margin) - pending
                measurements = profile(
                    make_step, plan, warmup=self.warmup, repeats=self.repeats, shape_time_s=self.shape_time_s,
                    time_budget_s=self.time_budget_s, memory_limit=limit, stable_rel=self.stable_rel, **common,
                )
        finally:
            _clear_grads(trainer, pl_module)
            with torch.no_grad():
                for name, b in pl_module.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])
            for m, mode in zip(modules, training_modes, strict=True):
                m.training = mode
        elapsed = time.perf_counter() - start
        skipped = sum(m.status == "skipped" for m in measurements)
        if elapsed >= self.time_budget_s and skipped:
            rank_zero_warn(
                f"`ShapeBenchmarkCallback`: time budget {self.time_budget_s:.0f} s reached; {skipped} of "
                f"{len(measurements)} shapes were not profiled. Fitting on the rest; raise `time_budget_s` to "
                "profile them."
            )
        try:
            cost_model, memory_model, notes = derive.fit_models(measurements, self.form, fit_memory=cuda)
        except ValueError as err:
            raise RuntimeError(f"`ShapeBenchmarkCallback`: {err}") from err
        for note in notes:
            rank_zero_warn(f"`ShapeBenchmarkCallback`: {note}")
        extra["compile_seconds"] = compile_seconds() - compile_start
        if extra["compile_seconds"] > 0:
            rank_zero_info(f"`ShapeBenchmarkCallback`: {extra['compile_seconds']:.1f} s of the profile went to "
                           "torch.compile (never timed).")
        cal = record.Calibration(
            key=key, cost_model=cost_model, measurements=measurements, memory_model=memory_model,
            device_memory=device_memory, optimizer_bytes=pending,
            profile_seconds=time.perf_counter() - start, world_size=int(trainer.world_size), extra=extra,
        )
        # Timings are already maxima over ranks, so every rank fits the same model; broadcasting
        # rank 0's record makes agreement exact regardless of floating-point reduction order.
        return record.Calibration.from_json(trainer.strategy.broadcast(cal.to_json()))

    def _choose_checkpointing(self, trainer: Trainer, pl_module: LightningModule, make_step, buckets, plan: list,
                              common: dict[str, Any], device_memory: int | None, pending: int) -> Any:
        """Probe the module's checkpointing modes at B = 1 on the longest profiled sequence; set the winner."""
        grids, counts = buckets
        longest = max(plan, key=lambda sh: sh.seq_len).grid
        modes = tuple(pl_module.checkpointing_modes)

        def probe(mode: str) -> Any:
            pl_module.set_checkpointing(mode)
            rank_zero_info(f"`ShapeBenchmarkCallback`: activation checkpointing '{mode}': one step at B=1 "
                           f"grid={longest} (S={int(np.prod(longest)):,})")
            return profile(make_step, [Shape(1, longest)], warmup=0, repeats=1,
                           shape_time_s=self.shape_time_s, time_budget_s=self.time_budget_s, **common)[0]

        choice = derive.choose_checkpointing(modes, probe, device_memory, margin=self.memory_margin,
                                             pending_bytes=pending)
        pl_module.set_checkpointing(choice.mode)
        if not choice.fits:
            oversize = getattr(getattr(trainer.datamodule, "policy", None), "oversize", "error")
            seq = grids.prod(axis=1)
            over = int(counts[seq >= int(np.prod(longest))].sum())
            if oversize == "error":
                raise ValueError(
                    f"{over} samples have token grid {tuple(longest)} (S={int(np.prod(longest)):,}), which does not "
                    f"fit one device even with '{choice.mode}' activation checkpointing ({choice.reason}). Shard the "
                    "model (FSDP), crop or remove such samples, or set `bucketing.policy.oversize=skip` to leave "
                    "them out (counted)."
                )
        rank_zero_info(f"`ShapeBenchmarkCallback`: activation checkpointing '{choice.mode}' ({choice.reason}).")
        return choice

    # ------------------------------------------------------------------ applying a calibration
    def _apply(self, trainer: Trainer, pl_module: LightningModule, cal: record.Calibration,
               buckets: tuple[np.ndarray, np.ndarray], source: str, derived: dict[str, Any] | None) -> None:
        grids, counts = buckets
        dm = trainer.datamodule
        oversize = getattr(getattr(dm, "policy", None), "oversize", "error")
        s_max = int(grids.prod(axis=1).max())
        self._apply_checkpointing(pl_module, cal, source)
        if derived is not None:
            # A resumed run applies the budgets its checkpoint was trained with, whatever the world
            # size now: the sampler re-plans the rest of the epoch under the same policy.
            m_mem, budget = int(derived["m_mem"]), float(derived["step_budget_s"])
        else:
            if self.m_mem is not None:
                m_mem = self.m_mem
            else:
                m_mem, how = derive.memory_budget(
                    cal.measurements, cal.memory_model, cal.device_memory, margin=self.memory_margin,
                    pending_bytes=cal.optimizer_bytes, longest_seq_len=s_max,
                    shortest_seq_len=int(grids.prod(axis=1).min()))
                rank_zero_info(f"`ShapeBenchmarkCallback`: M_mem = {m_mem:,} tokens ({how})")
            _check_oversize(grids, counts, m_mem, oversize)
            budget = self.step_budget_s
        derivation = derive.derive_policy(
            cal.cost_model, grids, m_mem, counts=counts, world_size=trainer.world_size, balance=getattr(dm, "balance", "cost"),
            step_budget_s=budget, oversize=oversize, seed=int(getattr(dm, "seed", 0) or 0))
        dm.set_cost_model(cal.cost_model)
        dm.set_policy(derivation.policy)
        self.calibration, self.derivation, self.source = cal, derivation, source
        self._state = {"calibration": cal.to_json(),
                       "derived": {"m_mem": derivation.m_mem, "step_budget_s": derivation.step_budget_s}}
        constants = {"m_mem": float(derivation.m_mem), "step_budget_s": derivation.step_budget_s,
                     **cal.cost_model.params, "profile_seconds": cal.profile_seconds,
                     "predicted_tokens_per_s": derivation.predicted["tokens_per_s"],
                     "baseline_tokens_per_s": derivation.baseline["tokens_per_s"]}
        constants.update({f"quality/{k}": v for k, v in cal.cost_model.quality.items()})
        for logger in trainer.loggers:
            logger.log_metrics({f"shape_benchmark/{k}": v for k, v in constants.items()}, step=trainer.global_step)
        if trainer.is_global_zero:
            print_calibration(cal, derivation, source)
            save_dir = self._resolve_save_dir(trainer)
            save_dir.mkdir(parents=True, exist_ok=True)
            out = cal.to_dict()
            out["derived"] = derivation.to_dict()
            (save_dir / "shape_benchmark.json").write_text(json.dumps(out, indent=2, sort_keys=True))
            plot_calibration(cal, save_dir / "shape_benchmark.png")

    def _apply_checkpointing(self, pl_module: LightningModule, cal: record.Calibration, source: str) -> None:
        """Give an ``"auto"`` module the mode its calibration was profiled with (cache, file, checkpoint)."""
        chosen = (cal.extra.get("checkpointing") or {}).get("mode")
        current = getattr(pl_module, "checkpointing", None)
        if current is None:
            return
        if chosen is None:
            if self._auto_checkpointing:
                rank_zero_warn(f"`ShapeBenchmarkCallback`: the calibration from {source} does not record an "
                               "activation-checkpointing mode; training with 'full'. Profile again (`force=True`) "
                               "to choose one.")
                pl_module.set_checkpointing("full")
            return
        if chosen not in getattr(pl_module, "checkpointing_modes", ()):
            raise ValueError(f"The calibration from {source} was profiled with activation checkpointing {chosen!r}, "
                             f"which {type(pl_module).__name__} does not support. Profile again (`force=True`).")
        if self._auto_checkpointing:
            pl_module.set_checkpointing(chosen)
        elif current != chosen:
            rank_zero_warn(f"`ShapeBenchmarkCallback`: the calibration from {source} was profiled with activation "
                           f"checkpointing {chosen!r}, but the module uses {current!r}; its timings may not match.")

    def _buckets(self, trainer: Trainer) -> tuple[np.ndarray, np.ndarray]:
        """The dataset's distinct token grids and their sample counts (calibration needs no more)."""
        grids = np.asarray(trainer.datamodule.dataset.token_grids())
        if len(grids) == 0:
            raise MisconfigurationException("`ShapeBenchmarkCallback`: the dataset has no samples to profile.")
        return count_buckets(grids)

    def _resolve_save_dir(self, trainer: Trainer) -> Path:
        if self.save_dir is not None:
            return self.save_dir
        log_dir = trainer.log_dir
        return Path(log_dir if isinstance(log_dir, (str, os.PathLike)) else trainer.default_root_dir)

    def _key(self, trainer: Trainer, pl_module: LightningModule, plan: list) -> dict[str, Any]:
        return {
            "model": record.model_fingerprint(pl_module),
            "device": _device_name(trainer.strategy.root_device),
            "precision": str(trainer.precision),
            "strategy": _strategy_kind(trainer.strategy),
            "form": self.form,
            "grid": [[s.batch_size, *s.grid] for s in plan],
            "repeats": [self.warmup, self.repeats],
            # "auto" or the fixed mode: a cached "auto" record carries the mode it chose.
            "checkpointing": getattr(pl_module, "checkpointing", None),
            "profile": PROFILE_VERSION,
        }


# ---------------------------------------------------------------------- helpers
def _read_state(state: Any) -> dict[str, Any] | None:
    """The callback's checkpoint state, or ``None`` (absent, from an older release, or empty)."""
    if not isinstance(state, dict) or state.get("version") != _STATE_VERSION or not state.get("calibration"):
        return None
    return state


def _key_diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    names = {"model": "model architecture", "grid": "profiled grid"}
    diff = [names.get(k, k) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(diff) + " differ" if diff else "same key"


def _check_oversize(grids: np.ndarray, counts: np.ndarray, m_mem: int, oversize: str) -> None:
    seq = grids.prod(axis=1)
    over = np.flatnonzero(seq > m_mem)
    if over.size and oversize == "error":
        i = int(over[0])
        raise ValueError(
            f"{int(counts[i])} samples have token grid {tuple(int(v) for v in grids[i])} (S={int(seq[i]):,} tokens; "
            f"{int(counts[over].sum())} samples in all are above M_mem={m_mem:,}): each would run out of memory alone. Enable activation "
            "checkpointing or shard the model to raise M_mem, crop or remove such samples, or set "
            "`bucketing.policy.oversize=skip` to leave them out (counted; they are not profiled either)."
        )


def _step(trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
    """One forward + backward as the training loop runs it, without optimizer step or hooks."""
    strategy = trainer.strategy
    with trainer.precision_plugin.train_step_context():
        wrapper = strategy.model
        if wrapper is not None and wrapper is not pl_module:
            # Calls through the wrapper's forward (DDP/FSDP gather and reducer hooks), the same
            # redirection Strategy.training_step uses.
            loss = strategy._forward_redirection(wrapper, pl_module, "compute_loss", batch)
        else:
            loss = pl_module.compute_loss(batch)
    # Not `strategy.backward`: that runs every callback's on_before/after_backward hooks, which
    # must not see profiling steps.
    strategy.pre_backward(loss)
    trainer.precision_plugin.backward(loss, pl_module, None)
    strategy.post_backward(loss)
    # Training zeroes gradients (set_to_none) every step, so each timed backward allocates them.
    _clear_grads(trainer, pl_module)


def _uses_compile(module: torch.nn.Module) -> bool:
    """Whether any part of the module runs through ``torch.compile`` (``Module.compile`` or a wrapper)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, OptimizedModule)
               for m in module.modules())


def _strategy_kind(strategy: Any) -> str:
    """The part of the strategy that changes a sample's step cost: replicated weights (one device or
    DDP: a rank runs the whole model on its batch) or the sharding strategy's class. So resuming a
    one-GPU run on eight DDP GPUs keeps the calibration."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        return "replicated"
    return type(strategy).__name__


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # The CPU's architecture, not its thread count: the key must not change with the rank layout.
    return f"{device.type}:{platform.machine()}"


def _clear_grads(trainer: Trainer, pl_module: LightningModule) -> None:
    # The wrapper (e.g. FSDP's root) may own flat parameters the LightningModule does not list.
    modules = [pl_module] + ([trainer.strategy.model] if trainer.strategy.model is not None else [])
    for module in modules:
        for p in module.parameters():
            p.grad = None
