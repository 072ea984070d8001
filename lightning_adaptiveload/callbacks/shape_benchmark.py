"""Times the real training step over a grid of (batch size, token grid) shapes at the start of fit,
fits a :class:`~lightning_adaptiveload.costmodel.CostModel`, and hands the implied batch-size policy
to the DataModule before the train dataloader is built."""

from __future__ import annotations

import gc
import hashlib
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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from typing_extensions import override

from lightning_adaptiveload.costmodel import FORMS, CostModel, MemoryModel

_CALIBRATION_FORMAT = "lightning_adaptiveload.ShapeBenchmark"
_CALIBRATION_VERSION = 1
# Bytes per parameter of optimizer state not yet allocated at profiling time: Adam-style optimizers
# create two fp32 moments on their first step, after the benchmark has measured peak memory.
_PENDING_OPTIMIZER_BYTES_PER_PARAM = 8
# Batch sizes tried per sequence length when none are given; the longest sequence gets B = 1, 2.
_DEFAULT_BATCHES_PER_SEQ = 3
_MAX_TABLE_ROWS = 40
# Above this held-out median relative error the fit is reported as poor (reference fits: 4-10%).
_POOR_FIT_REL_ERROR = 0.25


class ShapeBenchmarkCallback(Callback):
    """Profiles step latency over the dataset's shapes and sets the DataModule's batch-size policy.

    In ``on_fit_start`` — after the strategy has wrapped the model (FSDP on GPUs) and before the
    train dataloader exists — it takes the distinct token grids of ``trainer.datamodule.dataset``,
    picks up to ``max_shapes`` sequence lengths spread over their range and a few batch sizes for
    each, and times forward + backward of ``pl_module.compute_loss`` on
    ``pl_module.synthetic_batch(B, grid, device)`` through the live strategy (``warmup`` untimed
    steps, then the median of ``repeats``; the maximum over ranks). Peak memory is recorded on CUDA.
    A shape that runs out of memory on any rank is marked infeasible on every rank, and larger
    batches of that sequence length are skipped. (Recovery assumes every rank fails the same shape,
    as they do under FSDP with identical shapes; a rank failing alone inside a collective would stall
    the others, so the first pass uses the smallest batches.)

    It then fits a :class:`~lightning_adaptiveload.costmodel.CostModel` (and on CUDA a
    :class:`~lightning_adaptiveload.costmodel.MemoryModel`), broadcasts rank 0's fit, derives

    - ``M_mem`` (tokens per batch): ``m_mem`` if given; on CUDA from the memory fit, the device's
      memory less ``memory_margin``, and the optimizer state still to be allocated, kept below the
      smallest shape that ran out of memory; on CPU the largest token count profiled (at least the
      dataset's longest sequence);
    - the step budget: ``step_budget_s`` if given, else the predicted time of one sample at the
      dataset's longest sequence, so the longest videos run at ``B = 1`` and every other bucket is
      sized to take about as long;

    and calls ``datamodule.set_cost_model(cost_model)`` and ``datamodule.set_policy(policy)``. It
    prints the constants and the bucket table, logs the constants, and writes
    ``shape_benchmark.json`` and ``shape_benchmark.png`` to ``save_dir``.

    Profiling leaves no trace: the optimizer never steps, gradients are set to ``None``, buffers and
    train/eval modes are restored, and the torch, CUDA, numpy and Python RNG states are restored.

    The calibration is part of the callback's checkpoint state, so ``fit(ckpt_path=...)`` reuses it
    (the bucket plan of the resumed epoch then matches the saved one). Strategies that restore
    checkpoints after setup (FSDP, DeepSpeed, ModelParallel) call ``on_fit_start`` before the
    checkpoint is read; there the checkpoint's calibration replaces the fresh one before the
    dataloader is built, and ``cache_dir`` avoids profiling again on resume. With ``cache_dir``, a
    calibration is stored under a key of the model hyperparameters, device name, world size,
    precision, strategy, form and shape grid; a later run with the same key skips profiling.
    The key does not see kernels swapped in by other callbacks: use ``force=True`` after such a change.

    Args:
        batch_sizes: Batch sizes to try at every sequence length. ``None`` picks up to three per
            sequence length, geometrically from 1 to ``2·S_max / S``.
        max_shapes: Number of distinct sequence lengths to profile, spread over the dataset's range.
        repeats: Timed steps per shape (the median is kept).
        warmup: Untimed steps per shape before timing.
        time_budget_s: Profiling stops after this many seconds, once the smallest batch of every
            sequence length has been measured.
        form: Cost-model form: ``"auto"``, ``"power"`` or ``"quadratic"``.
        memory_margin: Fraction of device memory held back when deriving ``M_mem``.
        step_budget_s: Target step time in seconds; ``None`` derives it as described above.
        m_mem: Token budget per batch; ``None`` derives it as described above.
        cache_dir: Directory of the calibration cache; ``None`` disables the cache.
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
        repeats: int = 5,
        warmup: int = 2,
        time_budget_s: float = 300.0,
        form: str = "auto",
        memory_margin: float = 0.1,
        step_budget_s: float | None = None,
        m_mem: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        force: bool = False,
        save_dir: str | os.PathLike | None = None,
        enabled: bool = True,
    ) -> None:
        if batch_sizes is not None:
            batch_sizes = list(batch_sizes)
            if not batch_sizes or any(int(b) != b or b < 1 for b in batch_sizes):
                raise ValueError(
                    f"`ShapeBenchmarkCallback(batch_sizes={batch_sizes!r})` is not valid. "
                    "Expected a non-empty list of positive integers, or None."
                )
            batch_sizes = sorted({int(b) for b in batch_sizes})
        for name, value, low in (("max_shapes", max_shapes, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
            if int(value) != value or value < low:
                raise ValueError(
                    f"`ShapeBenchmarkCallback({name}={value!r})` is not valid. Expected an integer >= {low}."
                )
        if not time_budget_s > 0:
            raise ValueError(
                f"`ShapeBenchmarkCallback(time_budget_s={time_budget_s!r})` is not valid. Expected seconds > 0."
            )
        if form not in (*FORMS, "auto"):
            raise ValueError(
                f"`ShapeBenchmarkCallback(form={form!r})` is not valid. Expected one of {(*FORMS, 'auto')}."
            )
        if not 0 <= memory_margin < 1:
            raise ValueError(
                f"`ShapeBenchmarkCallback(memory_margin={memory_margin!r})` is not valid. Expected a fraction in [0, 1)."
            )
        if step_budget_s is not None and not (math.isfinite(step_budget_s) and step_budget_s > 0):
            raise ValueError(
                f"`ShapeBenchmarkCallback(step_budget_s={step_budget_s!r})` is not valid. Expected seconds > 0 or None."
            )
        if m_mem is not None and (int(m_mem) != m_mem or m_mem < 1):
            raise ValueError(
                f"`ShapeBenchmarkCallback(m_mem={m_mem!r})` is not valid. Expected a positive token count or None."
            )
        self.batch_sizes = batch_sizes
        self.max_shapes = int(max_shapes)
        self.repeats = int(repeats)
        self.warmup = int(warmup)
        self.time_budget_s = float(time_budget_s)
        self.form = form
        self.memory_margin = float(memory_margin)
        self.step_budget_s = step_budget_s
        self.m_mem = None if m_mem is None else int(m_mem)
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        self.force = force
        self.save_dir = None if save_dir is None else Path(save_dir)
        self.enabled = enabled
        # JSON text of the calibration in use (the checkpoint state); results of the last application.
        self._calibration: str | None = None
        self._fit_started = False
        self.cost_model: CostModel | None = None
        self.memory_model: MemoryModel | None = None
        self.policy: Any = None
        self.constants: dict[str, float] = {}
        self.profiled = False

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or not self.enabled:
            return
        missing = [n for n in ("compute_loss", "synthetic_batch") if not callable(getattr(pl_module, n, None))]
        if missing:
            raise MisconfigurationException(
                f"`ShapeBenchmarkCallback` needs the LightningModule to implement {missing}; "
                f"{type(pl_module).__name__} does not (see FlowMatchingModule)."
            )
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
        self.profiled = False
        grids = np.asarray(trainer.datamodule.dataset.token_grids(), dtype=np.int64).reshape(-1, 3)
        if len(grids) == 0:
            raise MisconfigurationException("`ShapeBenchmarkCallback`: the dataset has no samples to profile.")
        plan = _plan_shapes(grids, self.batch_sizes, self.max_shapes)
        key = self._cache_key(trainer, pl_module, plan)

        calibration, source = None, "profiled"
        if not self.force and self._calibration is not None:
            if _calibration_key(self._calibration) == key:
                calibration, source = self._calibration, "checkpoint"
            else:
                rank_zero_warn(
                    "`ShapeBenchmarkCallback`: the restored calibration was made for another setup "
                    "(model, device, world size, precision, strategy or shape grid differ); profiling again."
                )
        if calibration is None and not self.force and self.cache_dir is not None:
            calibration = trainer.strategy.broadcast(self._read_cache(key) if trainer.is_global_zero else None)
            source = "cache"
        if calibration is None:
            calibration = self._profile(trainer, pl_module, plan, key)
            source = "profiled"
            if self.cache_dir is not None and trainer.is_global_zero:
                self._write_cache(key, calibration)
        self._apply(trainer, calibration, grids, source)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Only strategies that restore after setup get here after on_fit_start; the others restore
        # before it and go through load_state_dict → on_fit_start.
        if not (self.enabled and self._fit_started):
            return
        state = (checkpoint.get("callbacks") or {}).get(self.state_key) or {}
        restored = state.get("calibration")
        if restored is None or restored == self._calibration or self.force:
            return
        if _calibration_key(restored) != _calibration_key(self._calibration):
            rank_zero_warn(
                "`ShapeBenchmarkCallback`: the checkpoint's calibration was made for another setup; "
                "keeping the current one."
            )
            return
        rank_zero_info(
            "`ShapeBenchmarkCallback`: this strategy restores checkpoints after `on_fit_start`; using the "
            "checkpoint's calibration so the resumed bucket plan matches. Set `cache_dir` to skip profiling on resume."
        )
        grids = np.asarray(trainer.datamodule.dataset.token_grids(), dtype=np.int64).reshape(-1, 3)
        self._apply(trainer, restored, grids, "checkpoint")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"version": _CALIBRATION_VERSION, "calibration": self._calibration}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        calibration = state_dict.get("calibration")
        if calibration is not None and not self._fit_started:
            self._calibration = calibration

    # ------------------------------------------------------------------ profiling
    def _profile(self, trainer: Trainer, pl_module: LightningModule, plan: list[tuple[int, tuple[int, int, int]]],
                 key: dict[str, Any]) -> str:
        strategy = trainer.strategy
        device = strategy.root_device
        n = len(plan)
        rank_zero_info(
            f"`ShapeBenchmarkCallback`: profiling {n} shapes ({self.warmup} warm-up + {self.repeats} timed steps "
            f"each, budget {self.time_budget_s:.0f} s) on {_device_name(device)} × {trainer.world_size}."
        )
        modules = list(pl_module.modules())
        training_modes = [m.training for m in modules]
        buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}
        measurements: list[dict[str, Any]] = []
        oom_at: dict[int, int] = {}  # S -> smallest B that ran out of memory
        first_pass = len({g for _, g in plan})
        start = time.perf_counter()
        self.profiled = True
        try:
            pl_module.train()
            with isolate_rng(), torch.enable_grad():
                for i, (b, grid) in enumerate(plan):
                    s = int(np.prod(grid))
                    if s in oom_at and b >= oom_at[s]:
                        measurements.append(_measurement(b, grid, None, None, "skipped"))
                        continue
                    strategy.barrier("shape_benchmark")
                    t, peak = self._measure(trainer, pl_module, b, grid)
                    if t is None:
                        oom_at[s] = min(b, oom_at.get(s, b))
                    measurements.append(_measurement(b, grid, t, peak, "ok" if t is not None else "oom"))
                    elapsed = time.perf_counter() - start
                    eta = elapsed / (i + 1) * (n - i - 1)
                    rank_zero_info(
                        f"  shape {i + 1}/{n}: B={b} grid={grid} S={s}: "
                        + (f"{t * 1e3:.1f} ms" if t is not None else "out of memory")
                        + f" | elapsed {elapsed:.0f} s, ETA {min(eta, max(self.time_budget_s - elapsed, 0)):.0f} s"
                    )
                    # Every rank must stop at the same shape, so rank 0's clock decides.
                    over = strategy.broadcast(elapsed > self.time_budget_s and i + 1 >= first_pass)
                    if over and i + 1 < n:
                        rank_zero_warn(
                            f"`ShapeBenchmarkCallback`: time budget {self.time_budget_s:.0f} s reached after "
                            f"{i + 1}/{n} shapes; fitting on those."
                        )
                        break
        finally:
            _clear_grads(trainer, pl_module)
            with torch.no_grad():
                for name, b in pl_module.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])
            for m, mode in zip(modules, training_modes, strict=True):
                m.training = mode
        ok = [m for m in measurements if m["status"] == "ok"]
        if not ok:
            raise RuntimeError(
                "`ShapeBenchmarkCallback`: every profiled shape ran out of memory. Shard the model (FSDP), "
                "enable activation checkpointing, or profile smaller shapes via `batch_sizes=[1]`."
            )
        bs = [m["batch_size"] for m in ok]
        ss = [m["seq_len"] for m in ok]
        try:
            cost_model = CostModel.fit(bs, ss, [m["time_s"] for m in ok], form=self.form)
        except ValueError as err:
            raise RuntimeError(
                f"`ShapeBenchmarkCallback` could not fit the cost model on {len(ok)} feasible shapes: {err} "
                "Raise `time_budget_s` or `max_shapes`, or pass more `batch_sizes`."
            ) from err
        held = cost_model.quality.get("heldout_median_rel_error", float("nan"))
        # NaN: too few points to hold any out; CostModel.fit already warned about that.
        if held > _POOR_FIT_REL_ERROR:
            rank_zero_warn(
                f"`ShapeBenchmarkCallback`: the cost model predicts held-out shapes with a median error of "
                f"{held:.0%}; timings are noisy (a busy device?) or the shapes too small. Raise `repeats` "
                "and `warmup`, or profile larger shapes."
            )
        memory_model = None
        peaks = [m["peak_bytes"] for m in ok]
        if device.type == "cuda" and all(p is not None for p in peaks) and len({b * s for b, s in zip(bs, ss, strict=True)}) > 1:
            try:
                memory_model = MemoryModel.fit(bs, ss, peaks)
            except ValueError as err:
                rank_zero_warn(f"`ShapeBenchmarkCallback`: no memory model ({err}); M_mem falls back to the "
                               "largest token count profiled. Pass `m_mem` to set it.")
        calibration = {
            "format": _CALIBRATION_FORMAT,
            "version": _CALIBRATION_VERSION,
            "key": key,
            "cost_model": cost_model.to_dict(),
            "memory_model": None if memory_model is None else memory_model.to_dict(),
            "device_memory": (
                int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
            ),
            "optimizer_bytes": _pending_optimizer_bytes(trainer),
            "measurements": measurements,
            "profile_seconds": time.perf_counter() - start,
        }
        # Timings are already the max over ranks, so every rank fits the same model; broadcasting
        # rank 0's record makes agreement exact regardless of floating-point reduction order.
        return strategy.broadcast(json.dumps(calibration, sort_keys=True))

    def _measure(
        self, trainer: Trainer, pl_module: LightningModule, batch_size: int, grid: tuple[int, int, int]
    ) -> tuple[float | None, int | None]:
        """Median step time over ranks (max) and peak bytes, or ``(None, None)`` if any rank ran out of memory."""
        strategy = trainer.strategy
        device = strategy.root_device
        cuda = device.type == "cuda"
        times: list[float] = []
        oom = False
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        try:
            batch = pl_module.synthetic_batch(batch_size, grid, device)
            for step in range(self.warmup + self.repeats):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                self._step(trainer, pl_module, batch)
                if cuda:
                    torch.cuda.synchronize(device)
                if step >= self.warmup:
                    times.append(time.perf_counter() - t0)
            del batch
        except torch.cuda.OutOfMemoryError:
            oom = True
        # Freed outside the except block: the traceback holds the failed step's tensors until then.
        _clear_grads(trainer, pl_module)
        if oom:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        any_oom = strategy.reduce(torch.tensor(float(oom), device=device), reduce_op="max")
        if float(any_oom) > 0:
            return None, None
        t = strategy.reduce(torch.tensor(float(np.median(times)), device=device, dtype=torch.float64), reduce_op="max")
        peak = None
        if cuda:
            peak_t = torch.tensor(float(torch.cuda.max_memory_allocated(device)), device=device, dtype=torch.float64)
            peak = int(strategy.reduce(peak_t, reduce_op="max"))
        return float(t), peak

    @staticmethod
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

    # ------------------------------------------------------------------ applying a calibration
    def _apply(self, trainer: Trainer, calibration: str, grids: np.ndarray, source: str) -> None:
        record = _parse_calibration(calibration)
        cost_model = CostModel.from_dict(record["cost_model"])
        memory_model = None if record["memory_model"] is None else MemoryModel.from_dict(record["memory_model"])
        seq_lens = grids.prod(axis=1)
        s_max = int(seq_lens.max())
        measured = [m for m in record["measurements"] if m["status"] == "ok"]
        oom_tokens = [m["batch_size"] * m["seq_len"] for m in record["measurements"] if m["status"] == "oom"]
        if self.m_mem is not None:
            m_mem = self.m_mem
        elif memory_model is not None and record["device_memory"]:
            with_optimizer = MemoryModel(memory_model.m0 + record["optimizer_bytes"], memory_model.m1)
            m_mem = with_optimizer.max_tokens(record["device_memory"], self.memory_margin, oom_tokens)
        else:
            m_mem = max([s_max] + [m["batch_size"] * m["seq_len"] for m in measured])
            if oom_tokens:
                m_mem = min(m_mem, min(oom_tokens) - 1)
        if m_mem < s_max:
            rank_zero_warn(
                f"`ShapeBenchmarkCallback`: M_mem={m_mem} tokens is below the dataset's longest sequence "
                f"S={s_max}; those samples may not fit in memory. Shard the model, enable activation "
                "checkpointing, or drop them from the dataset."
            )
        step_budget = self.step_budget_s if self.step_budget_s is not None else float(cost_model.predict(1, s_max))
        policy = cost_model.policy(m_mem, step_budget)

        dm = trainer.datamodule
        dm.set_cost_model(cost_model)
        dm.set_policy(policy)
        self._calibration = calibration
        self.cost_model, self.memory_model, self.policy = cost_model, memory_model, policy
        self.constants = {"m_mem": float(m_mem), "step_budget_s": step_budget, **cost_model.params}
        if cost_model.form == "power":
            self.constants["m_comp"] = (step_budget - cost_model.params["a"]) / cost_model.params["b"]
        self.constants.update({f"quality/{k}": v for k, v in cost_model.quality.items()})

        rank_zero_info(f"`ShapeBenchmarkCallback` ({source}): {cost_model}; policy {policy!r}")
        for logger in trainer.loggers:
            logger.log_metrics({f"shape_benchmark/{k}": v for k, v in self.constants.items()}, step=trainer.global_step)
        save_dir = self._resolve_save_dir(trainer)
        if trainer.is_global_zero:
            _print_table(cost_model, memory_model, policy, seq_lens, self.constants, source)
            save_dir.mkdir(parents=True, exist_ok=True)
            out = json.loads(calibration)
            out["derived"] = {"m_mem": m_mem, "step_budget_s": step_budget, "policy": _policy_dict(policy)}
            (save_dir / "shape_benchmark.json").write_text(json.dumps(out, indent=2, sort_keys=True))
            _plot(record, cost_model, save_dir / "shape_benchmark.png")

    def _resolve_save_dir(self, trainer: Trainer) -> Path:
        if self.save_dir is not None:
            return self.save_dir
        log_dir = trainer.log_dir
        return Path(log_dir if isinstance(log_dir, (str, os.PathLike)) else trainer.default_root_dir)

    # ------------------------------------------------------------------ cache
    def _cache_key(self, trainer: Trainer, pl_module: LightningModule, plan: list) -> dict[str, Any]:
        hparams = json.dumps(dict(pl_module.hparams), sort_keys=True, default=repr)
        return {
            "model": hashlib.sha256(f"{type(pl_module).__qualname__}:{hparams}".encode()).hexdigest(),
            "device": _device_name(trainer.strategy.root_device),
            "world_size": int(trainer.world_size),
            "precision": str(trainer.precision),
            "strategy": type(trainer.strategy).__name__,
            "form": self.form,
            "grid": [[b, *g] for b, g in plan],
            "repeats": [self.warmup, self.repeats],
        }

    def _cache_path(self, key: dict[str, Any]) -> Path:
        assert self.cache_dir is not None
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.cache_dir / f"shape_benchmark_{digest}.json"

    def _read_cache(self, key: dict[str, Any]) -> str | None:
        path = self._cache_path(key)
        if not path.is_file():
            return None
        text = path.read_text()
        try:
            if _calibration_key(text) == key:
                return text
        except ValueError as err:
            rank_zero_warn(f"`ShapeBenchmarkCallback`: ignoring unreadable cache file {path}: {err}")
        return None

    def _write_cache(self, key: dict[str, Any], calibration: str) -> None:
        path = self._cache_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(calibration)
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file


# ---------------------------------------------------------------------- helpers
def _plan_shapes(
    grids: np.ndarray, batch_sizes: list[int] | None, max_shapes: int
) -> list[tuple[int, tuple[int, int, int]]]:
    """(B, grid) pairs to profile, smallest batch of every sequence length first.

    Ordering by round (all sequence lengths at their i-th batch size) means a time budget that
    runs out still leaves the whole range of S covered.
    """
    seq = grids.prod(axis=1)
    uniq_s, first = np.unique(seq, return_index=True)
    reps = [tuple(int(v) for v in grids[i]) for i in first]
    if len(uniq_s) == 1:
        # A single sequence length cannot identify the S-dependence; add a grid with half the
        # tokens along the largest axis so the fit is defined (the policy only queries the real S).
        f, h, w = reps[0]
        axis = int(np.argmax([f, h, w]))
        half = [f, h, w]
        half[axis] = max(1, half[axis] // 2)
        if tuple(half) != reps[0]:
            reps.insert(0, tuple(half))
            uniq_s = np.array([int(np.prod(half)), int(uniq_s[0])])
    if len(reps) > max_shapes:
        idx = np.unique(np.round(np.linspace(0, len(reps) - 1, max_shapes)).astype(int))
        reps = [reps[i] for i in idx]
        uniq_s = uniq_s[idx]
    s_max = int(uniq_s.max())
    per_s: list[list[int]] = []
    for s in uniq_s:
        if batch_sizes is not None:
            per_s.append(list(batch_sizes))
        else:
            b_max = max(1, (2 * s_max) // int(s))
            per_s.append(sorted({int(round(b)) for b in np.geomspace(1, b_max, _DEFAULT_BATCHES_PER_SEQ)}))
    plan = []
    for r in range(max(len(bs) for bs in per_s)):
        for grid, bs in zip(reps, per_s, strict=True):
            if r < len(bs):
                plan.append((bs[r], grid))
    return plan


def _measurement(b: int, grid: tuple[int, int, int], t: float | None, peak: int | None, status: str) -> dict:
    return {"batch_size": int(b), "grid": list(grid), "seq_len": int(np.prod(grid)), "time_s": t,
            "peak_bytes": peak, "status": status}


def _parse_calibration(text: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except (TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"Shape-benchmark calibration is not valid JSON: {err}.") from err
    if not isinstance(record, dict) or record.get("format") != _CALIBRATION_FORMAT:
        raise ValueError(f"Not a shape-benchmark calibration (expected format={_CALIBRATION_FORMAT!r}).")
    if record.get("version") != _CALIBRATION_VERSION:
        raise ValueError(
            f"Shape-benchmark calibration version {record.get('version')!r} is not supported "
            f"(expected {_CALIBRATION_VERSION}); profile again with `force=True`."
        )
    return record


def _calibration_key(text: str | None) -> dict[str, Any] | None:
    return None if text is None else _parse_calibration(text).get("key")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{os.cpu_count()}cpu:{torch.get_num_threads()}threads"


def _clear_grads(trainer: Trainer, pl_module: LightningModule) -> None:
    # The wrapper (e.g. FSDP's root) may own flat parameters the LightningModule does not list.
    modules = [pl_module] + ([trainer.strategy.model] if trainer.strategy.model is not None else [])
    for module in modules:
        for p in module.parameters():
            p.grad = None


def _pending_optimizer_bytes(trainer: Trainer) -> int:
    total = 0
    for opt in trainer.optimizers:
        if len(opt.state) == 0:
            params = {id(p): p for g in opt.param_groups for p in g["params"]}
            total += sum(p.numel() for p in params.values()) * _PENDING_OPTIMIZER_BYTES_PER_PARAM
    return int(total)


def _policy_dict(policy: Any) -> Any:
    to_dict = getattr(policy, "to_dict", None)
    return to_dict() if callable(to_dict) else repr(policy)


@rank_zero_only
def _print_table(cost_model: CostModel, memory_model: MemoryModel | None, policy: Any, seq_lens: np.ndarray,
                 constants: dict[str, float], source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    uniq, counts = np.unique(seq_lens, return_counts=True)
    if len(uniq) > _MAX_TABLE_ROWS:
        keep = np.unique(np.round(np.linspace(0, len(uniq) - 1, _MAX_TABLE_ROWS)).astype(int))
        uniq, counts = uniq[keep], counts[keep]
    # Sequences above M_mem were warned about; the policy would raise for them, the table shows B=0.
    fits = uniq <= getattr(policy, "m_mem", np.inf)
    batch = np.zeros_like(uniq, dtype=np.int64)
    batch[fits] = np.asarray(policy.batch_sizes(uniq[fits].astype(np.int64)), dtype=np.int64)
    shown = ", ".join(f"{k}={v:.4g}" for k, v in constants.items() if not k.startswith("quality/"))
    table = Table(title=f"Shape benchmark ({source}) — {cost_model}\n{shown}")
    for col in ("S (tokens)", "samples", "B", "B·S", "pred. step (ms)", "pred. memory (GiB)"):
        table.add_column(col, justify="right")
    for s, c, b in zip(uniq, counts, batch, strict=True):
        mem = "—" if memory_model is None else f"{memory_model.predict(b, s) / 2**30:.1f}"
        table.add_row(f"{s:,}", f"{c:,}", f"{b}", f"{b * s:,}", f"{cost_model.predict(b, s) * 1e3:.1f}", mem)
    Console().print(table)


def _plot(record: dict[str, Any], cost_model: CostModel, path: Path) -> None:
    # Figure + Agg canvas directly: no pyplot global state, no display needed.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    meas = record["measurements"]
    ok = [m for m in meas if m["status"] == "ok"]
    oom = [m for m in meas if m["status"] == "oom"]
    fig = Figure(figsize=(7, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    s_all = [m["seq_len"] for m in meas]
    s_line = np.geomspace(min(s_all), max(s_all), 100)
    batch_values = sorted({m["batch_size"] for m in meas})
    max_tokens = max(m["batch_size"] * m["seq_len"] for m in ok + oom)
    for i, b in enumerate(batch_values):
        color = colormaps["viridis"](i / max(1, len(batch_values) - 1))
        pts = [m for m in ok if m["batch_size"] == b]
        # Each curve stops where its batch exceeds the largest token count profiled: beyond that
        # is extrapolation no policy uses.
        s_b = s_line[b * s_line <= max_tokens * (1 + 1e-9)]
        ax.plot(s_b, np.asarray(cost_model.predict(b, s_b)) * 1e3, "-", color=color, label=f"B={b}")
        if pts:
            ax.plot([m["seq_len"] for m in pts], [m["time_s"] * 1e3 for m in pts], "o", color=color)
    if oom:
        ax.plot([m["seq_len"] for m in oom], [cost_model.predict(m["batch_size"], m["seq_len"]) * 1e3 for m in oom],
                "x", color="red", markersize=9, label="out of memory")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per sample S")
    ax.set_ylabel("step time (ms): points measured, lines fitted")
    ax.set_title(str(cost_model), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
