"""Measure cross-rank load balance of every training step and report it.

Every step, each rank records its step time, forward time, predicted compute, tokens, peak
memory, model FLOPs, data wait, allocator counts and the GPU's clock and power; these numbers are
all-gathered (one tiny collective per step) and turned into the paper's metrics: compute imbalance
rate (CV of predicted per-rank compute), synchronisation overhead (CV of per-rank step time), bubble fraction (1 - mean/max) and tokens/s (all ranks' tokens over
the slowest rank's time).

Under DDP/FSDP a fast rank waits inside the gradient collectives, so *step* times even out and
their CV understates imbalance; the forward pass has no gradient collective under DDP, so the
forward-time CV and the predicted compute CV are the sharper signals there.

Predicted compute uses the cost model the sampler balanced on (the DataModule's ``cost_model``,
set by the shape benchmark) unless one is given, so the logged compute CV measures what the plan
optimised. With the module's ``flops_per_sample(S)`` (see
:mod:`lightning_adaptiveload.models.protocol`) it also logs model TFLOP/s per GPU and MFU against the
device's dense bf16 peak.

Data wait is the time from the end of one training batch (``on_train_batch_end``) to the start of
the next (``on_train_batch_start``): Lightning fetches the next batch from the DataLoader (and
copies it to the device) in that gap, so a loader that does not keep up shows here. Validation runs
in the gap are left out; checkpoint writes and logger flushes are not. The first batch of each epoch
counts no wait (its fetch and the workers' start-up come before the epoch's hooks).

A sequence-parallel batch (``batch["sp_degree"] = k > 1``) is held by the k ranks of its group,
each processing 1/k of its tokens: each of them counts 1/k of the batch's tokens and model FLOPs
(so tokens/s and MFU count every token once) and the planner's SP step cost
(:func:`~lightning_adaptiveload.bucketing.sequence_parallel.sp_cost_function`) as its compute.

With ``timing="events"`` the monitor times steps on CUDA with CUDA events: it records an event at
each hook on the current stream, never synchronises inside training and reads a step's events (and its
row, all-gathered over a CPU ``gloo`` group on several ranks) at the end of the *next* step, when they
have completed, or where training stops anyway (the end of an epoch, validation, the end of fit). The
host then keeps preparing the next step (the loader's hand-over, the hooks, the launches) while the device
still runs the last one, which a synchronisation at each step would leave the device idle for. Step times
are device times and the data wait of a step is the device's idle time between the end of the previous
step and its start. Metrics are logged a step late. ``timing="synchronize"`` synchronises around each step
and reads the host clock, the rows gathered at once; ``"auto"`` (the default) is events on CUDA and
``"synchronize"`` elsewhere.

This module is the callback: the per-step timing, the one gather and the run totals. What it reads from the
device is in :mod:`~lightning_adaptiveload.callbacks._device_probes`; the per-shape table, the epoch
estimate and the printed report are in :mod:`~lightning_adaptiveload.callbacks._balance_report`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_adaptiveload.bucketing.metrics import bubble_fraction, compute_imbalance_rate, sync_overhead
from lightning_adaptiveload.bucketing.policy import CostPredictor
from lightning_adaptiveload.bucketing.sequence_parallel import sp_cost_function
from lightning_adaptiveload.callbacks import _balance_report
from lightning_adaptiveload.callbacks._balance_report import wait_fraction as _wait_fraction

# The probes under the names this module has always had: the callback calls them through these names, so
# that replacing one here (as tests do with fake NVML reads or allocator counters) replaces what steps read.
from lightning_adaptiveload.callbacks._device_probes import allocator_counts as _allocator_counts
from lightning_adaptiveload.callbacks._device_probes import clock_and_power as _clock_and_power
from lightning_adaptiveload.callbacks._device_probes import device_peak_tflops as _device_peak_tflops
from lightning_adaptiveload.callbacks._device_probes import peak_memory, reset_peak_memory
from lightning_adaptiveload.geometry import tokens_of

_FIELDS = ("step_time", "forward_time", "compute", "tokens", "peak_mem", "flops", "data_wait", "alloc_retries",
           "device_allocs", "sm_clock_mhz", "power_w", "loss_finite", "batch_size", "seq_len",
           "overhead", "epoch_gap")
# Per batch shape, the training step times kept for `observations` (their medians; the most recent ones).
_SHAPE_SAMPLES = 256
#: A rank's batch is taken to bound the step when its predicted compute is at least this fraction of the
#: step's largest: the cost-balanced sampler groups each step's batches to within a few percent, so the
#: ranks of a balanced step all count, and a rank far below the others (a remainder batch) does not.
_BOUNDING = 0.9
#: Under DDP, of the ranks whose predicted compute bounds a step, those whose measured forward time is within
#: this fraction of the longest: a data-parallel forward has no collective, so it is the rank's own compute, and
#: the ranks clearly faster than the slowest waited for it at the gradient all-reduce (their step time is its).
_FORWARD_LEAD = 0.95
TIMINGS = ("auto", "events", "synchronize")


@dataclass
class _Step:
    """One training batch's measurements before its times are read: ``marks`` are host clock readings
    (seconds) or CUDA events at the batch's start (``start``), before backward (``fwd``), before the optimizer
    step (``opt``) and at its end (``end``); ``row`` holds the fields of :data:`_FIELDS` known at its end
    (its times are filled in when it is finished); ``finite``: the loss's finiteness on the device (a device
    tensor, or a pinned host copy that the ``end`` mark follows), ``None`` to keep ``row``'s 1.0."""

    marks: dict[str, Any]
    row: list[float]
    batch_idx: int
    global_step: int
    shape: tuple[int, int]
    flops: float
    device_allocs: float
    host_wait: float
    prev_end: Any = None  # the previous step's end mark (events: the device's gap before this step)
    finite: Any = None


def batch_shape_of(pl_module: Any, batch: Any) -> tuple[int, int]:
    """``(B, S)`` of a batch: the module's ``batch_shape(batch)``, else its ``latents`` and the module's
    ``patch_size``.

    Raises:
        AttributeError: the module has neither ``batch_shape`` nor ``patch_size`` (tokens cannot be
            counted without knowing the patch).
    """
    fn = getattr(pl_module, "batch_shape", None)
    if callable(fn):
        b, s = fn(batch)
        return int(b), int(s)
    patch = getattr(pl_module, "patch_size", None)
    if patch is None:
        raise AttributeError(
            f"{type(pl_module).__name__} has neither `batch_shape(batch)` nor `patch_size`: the number of tokens "
            "of a batch is unknown. Implement `batch_shape` (see lightning_adaptiveload.models.protocol)."
        )
    latents = batch["latents"] if isinstance(batch, dict) else batch[0]
    return tokens_of(latents, tuple(patch))


class BalanceMonitor(Callback):
    """Logs per-step step-time CV, compute CV, bubble fraction and tokens/s across ranks.

    Logged keys (every ``log_every_n_steps`` optimizer steps): ``balance/step_time_cv``,
    ``balance/forward_time_cv``, ``balance/compute_cv``, ``balance/bubble``, ``balance/tokens_per_s``,
    ``balance/peak_mem_gb`` (max over ranks), ``train/data_wait_frac`` (the largest over ranks of
    data wait / (data wait + step time), see the module docstring) and, when the module has
    ``flops_per_sample``, ``balance/tflops_per_gpu`` and ``balance/mfu``; on CUDA also
    ``balance/alloc_retries`` (the most over ranks of the times CUDA's caching allocator had to free its
    cache and retry an allocation in the step; each retry synchronises the device, and the first one
    warns, naming the fix) and ``balance/device_allocs`` (the most over ranks of the device allocations
    and frees, ``cudaMalloc`` / ``cudaFree``, the cache made in the step: 0 in a steady state that reuses
    its cache), ``balance/sm_clock_mhz`` (the lowest over ranks) and ``balance/power_w`` (the highest), the
    GPU's SM clock and power draw read through ``torch.cuda.clock_rate`` / ``power_draw`` (with
    ``nvidia-ml-py`` installed; the report says when they are not). At the end of fit, rank 0 prints a balance report
    (rich table, one row per rank, plus the run's means over the steps after ``warmup_steps``).

    Two throughputs: ``tokens_per_s`` counts the steps' own time (the slowest rank's, from the batch's start
    to its end), ``wall_tokens_per_s`` (in :meth:`summary` and the report) adds the waits between steps: the
    data wait, the other callbacks, logging and the gap to each epoch's first batch (a new loader iterator and
    the sampler's plan; ``epoch_gap`` in :attr:`history`). Validation is left out of both. Compare setups that
    differ in their data or their epochs (batch sizes, the number of batches) by ``wall_tokens_per_s``.

    A step whose loss is not finite on some rank is left out of the run means, the per-shape table and
    :attr:`history`, counted (``nonfinite_loss_steps`` in :meth:`summary`) and warned about once: arithmetic
    on NaNs draws less power, so such steps run faster than training does (measured on an H200 under its
    700 W cap: 1,980 MHz at 558 W instead of 1,590 MHz at 693 W, 1.19× the speed).

    Args:
        log_every_n_steps: log every this many training batches (positive integer).
        cost_model: ``predict(B, S)`` for the predicted compute of a batch; ``None``: the
            DataModule's ``cost_model`` if it has one, else ``B * S**p``.
        p: exponent of S for the compute estimate without a cost model.
        synchronize: with ``timing="synchronize"``, call ``torch.cuda.synchronize()`` before reading the
            clock on CUDA, so times cover the kernels and not only their launch.
        timing: ``"events"``: CUDA events, no synchronisation inside training, each step's row read at the end
            of the next step (see the module docstring); ``"synchronize"``: the host clock around
            synchronisations, each row read at once; ``"auto"`` (default): events on CUDA, else ``"synchronize"``.
        print_report: print the end-of-fit report on rank 0.
        warmup_steps: steps at the start of fit left out of :meth:`summary` and the report (compile,
            allocator and cuDNN warm-up).
        peak_tflops: the device's peak for MFU; ``None``: dense bf16 of known GPUs
            (Lightning's ``get_available_flops``; the H200, which it lacks, at 989), no MFU elsewhere.
        history_steps: how many of the last counted steps :attr:`history` keeps (every rank holds all
            ranks' rows of each, so an unbounded history grows with steps × ranks); 0 keeps none. The
            run means never depend on it.

    Raises:
        ValueError: a non-positive ``log_every_n_steps``, ``p`` or ``peak_tflops``, a negative
            ``warmup_steps`` or ``history_steps``, or an unknown ``timing``.

    Example::

        trainer = Trainer(callbacks=[BalanceMonitor(log_every_n_steps=10)], use_distributed_sampler=False)
    """

    #: Column names of the rows of :attr:`history` (``sm_clock_mhz`` and ``power_w`` are NaN off CUDA or
    #: without ``nvidia-ml-py``).
    FIELDS: tuple[str, ...] = _FIELDS

    def __init__(
        self,
        log_every_n_steps: int = 50,
        cost_model: CostPredictor | None = None,
        p: float = 2.0,
        synchronize: bool = True,
        print_report: bool = True,
        warmup_steps: int = 0,
        peak_tflops: float | None = None,
        history_steps: int = 10_000,
        timing: str = "auto",
    ) -> None:
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(
                f"`BalanceMonitor(log_every_n_steps={log_every_n_steps!r})` is not valid. Expected a positive integer."
            )
        if not p > 0:
            raise ValueError(f"`BalanceMonitor(p={p!r})` is not valid. Expected a positive number.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"`BalanceMonitor(warmup_steps={warmup_steps!r})` is not valid. Expected an integer >= 0.")
        if isinstance(history_steps, bool) or not isinstance(history_steps, int) or history_steps < 0:
            raise ValueError(f"`BalanceMonitor(history_steps={history_steps!r})` is not valid. Expected an integer >= 0.")
        if timing not in TIMINGS:
            raise ValueError(f"`BalanceMonitor(timing={timing!r})` is not valid. Expected one of {', '.join(TIMINGS)}.")
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"`BalanceMonitor(peak_tflops={peak_tflops!r})` is not valid. Expected TFLOP/s > 0.")
        self.log_every_n_steps = log_every_n_steps
        self.cost_model = cost_model
        self.warmup_steps = warmup_steps
        self.peak_tflops = peak_tflops
        self._peak_tflops: float | None = peak_tflops
        self._active_cost_model: CostPredictor | None = cost_model
        self._seen = 0
        self.history_steps = history_steps
        #: Per-step rows ``[ranks, fields]`` of the last ``history_steps`` steps after the warm-up (for
        #: benchmarks; columns: :attr:`FIELDS`).
        self.history: deque[np.ndarray] = deque(maxlen=history_steps)
        self.p = float(p)
        self.synchronize = synchronize
        self.timing = timing
        self._events = False  # resolved from `timing` and the device at the start of fit
        self._cpu_group: Any = None  # events on several ranks: the CPU group the rows are gathered over
        self._pending: _Step | None = None  # events: the last step, read at the end of the next one
        self._prev_end: Any = None  # events: the last step's end mark (None after a pause or at an epoch start)
        self.print_report = print_report
        self.last_metrics: dict[str, float] = {}
        self._t0: float | None = None
        self._t_fwd: float | None = None
        self._forward_is_own = False  # set in setup: under DDP a forward time is the rank's own compute
        self._t_opt: float | None = None  # when the optimizer step of the current batch began
        self._t_end: float | None = None  # when the previous batch's bookkeeping ended
        self._wait = 0.0  # data wait before the current batch
        self._epoch_gap = 0.0  # an epoch's first batch: the host time since the previous epoch's last batch
        self._epoch_end: float | None = None  # the previous epoch's last batch's end (host), until the next batch
        self._paused = 0.0  # validation time inside the current gap (not data wait)
        self._t_val: float | None = None
        self._allocator0 = (0, 0)  # the allocator's counters at the current batch's start
        self._warned_retries = False
        self._warned_nonfinite = False
        self._flops_fn: Any = None
        self._clock_error: str | None = None  # why the GPU clock and power are not recorded (on CUDA)
        #: :meth:`epoch_estimate` of the DataModule's plan, computed at the end of fit (``None``: none).
        self.epoch: dict[str, float] | None = None
        self._reset_totals(0)

    def _reset_totals(self, world_size: int) -> None:
        self.history = deque(maxlen=self.history_steps)
        self._per_rank_sum = np.zeros((world_size, len(_FIELDS)))
        self._peak = np.zeros(world_size)
        self._metric_sums: dict[str, float] = {}
        self._steps = 0
        self._nonfinite_steps = 0
        self._sum_max_time = 0.0
        self._sum_wall = 0.0  # per counted step, the slowest rank's step plus the wait and epoch gap before it
        self._sum_tokens = 0.0
        self._sum_flops = 0.0
        # Per rank: sums of the SM clock and power samples that were read, and how many were.
        self._gpu_sums = np.zeros((world_size, 2))
        self._gpu_samples = np.zeros(world_size)
        # This rank's counted steps per batch shape (B, S): [steps, step time, predicted compute, FLOPs,
        # device allocations, slowest step] (sums, the last a maximum).
        self._shape_sums: dict[tuple[int, int], np.ndarray] = {}
        # Every rank's counted steps per data-parallel batch shape: what a step of it cost training (the
        # step plus the wait before it; the slowest rank of the step that had the shape), the last few.
        self._shape_cycles: dict[tuple[int, int], deque[float]] = {}
        self._shape_counts: dict[tuple[int, int], int] = {}
        self._sp_shapes: set[tuple[int, int]] = set()  # this rank's sequence-parallel batch shapes (not observed)
        # Every rank's counted data-parallel batches per shape: [steps, step time, predicted compute] (sums).
        self._rank_sums: dict[tuple[int, int], np.ndarray] = {}
        # Per counted step, the slowest rank's time outside forward + backward: see `overhead_s`.
        self._overheads: deque[float] = deque(maxlen=_SHAPE_SAMPLES)

    def _now(self, device: torch.device) -> float:
        if self.synchronize and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _mark(self, device: torch.device) -> Any:
        """A point in time of the step: a CUDA event on the current stream (events on CUDA), else the host
        clock (synchronised first in ``"synchronize"`` timing)."""
        if self._events and device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter() if self._events else self._now(device)

    @staticmethod
    def _elapsed(a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (both completed)."""
        if isinstance(a, float):
            return b - a
        return a.elapsed_time(b) / 1000.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        # Only a DDP forward runs without collectives (FSDP's gathers its parameters, so a rank that arrives
        # first waits inside it): there a rank's forward time says whether it bounded the step (`_observe`).
        self._forward_is_own = isinstance(trainer.strategy, DDPStrategy)
        self._events = self.timing == "events" or (self.timing == "auto" and device.type == "cuda")
        self._cpu_group = None
        if not (self._events and trainer.world_size > 1 and dist.is_available() and dist.is_initialized()):
            return
        # The rows of a step are gathered while the device runs the next one: over the device's collectives
        # they would queue behind that step (and reading them would wait for it), so over a CPU group.
        if dist.get_backend() == "gloo":
            self._cpu_group = dist.group.WORLD
            return
        try:
            self._cpu_group = dist.new_group(backend="gloo")
        except Exception as err:  # noqa: BLE001 - every rank fails alike; fall back to the synchronised timing
            self._events = False
            rank_zero_warn(f"`BalanceMonitor`: a CPU (gloo) process group for the per-step rows could not be made "
                           f"({type(err).__name__}: {err}); timing with synchronisations instead "
                           "(`BalanceMonitor(timing='synchronize')`), which leaves the device idle between steps.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_totals(trainer.world_size)
        self._pending = self._prev_end = self._t_end = self._epoch_end = None
        self._t0 = self._t_fwd = None
        self._seen = 0
        self.epoch = None
        self._peak_tflops = self.peak_tflops or _device_peak_tflops(pl_module.device)
        self._clock_error = None
        if pl_module.device.type == "cuda":
            try:
                _clock_and_power(pl_module.device)
            except Exception as err:  # noqa: BLE001 - e.g. no nvidia-ml-py; the report says why
                self._clock_error = f"{type(err).__name__}: {err}"[:200]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After on_fit_start: the shape benchmark has set the DataModule's fitted cost model by now.
        self._active_cost_model = self.cost_model
        if self._active_cost_model is None:
            self._active_cost_model = getattr(trainer.datamodule, "cost_model", None)
        flops_fn = getattr(pl_module, "flops_per_sample", None)
        self._flops_fn = flops_fn if callable(flops_fn) else None

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The gap to an epoch's first batch (a new loader iterator, the sampler's plan, workers starting, the
        # epoch-end callbacks) is not data wait; it is kept apart (`epoch_gap`) and counts in `wall_tokens_per_s`.
        # Validation inside it is left out of it as out of a wait.
        self._epoch_end = None if self._t_end is None else self._t_end + self._paused
        self._t_end, self._paused, self._prev_end = None, 0.0, None

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)
        self._prev_end = None  # the next step's wait is the host's, less the validation
        self._t_val = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._t_val is not None:
            self._paused += time.perf_counter() - self._t_val
            self._t_val = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        reset_peak_memory(pl_module.device)
        self._allocator0 = _allocator_counts(pl_module.device)
        self._t_fwd = self._t_opt = None
        self._t0 = self._mark(pl_module.device)
        host = self._t0 if isinstance(self._t0, float) else time.perf_counter()
        self._wait = 0.0 if self._t_end is None else max(0.0, host - self._t_end - self._paused)
        self._epoch_gap = 0.0 if self._epoch_end is None else max(0.0, host - self._epoch_end - self._paused)
        self._paused, self._epoch_end = 0.0, None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._t0 is not None and self._t_fwd is None:
            self._t_fwd = self._mark(pl_module.device)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._t0 is not None and self._t_opt is None:
            self._t_opt = self._mark(pl_module.device)

    def _predicted_compute(self, b: int, s: int, degree: int = 1) -> float:
        """Predicted time of this rank's share of a ``(B, S)`` batch held by ``degree`` ranks."""
        if degree == 1:
            if self._active_cost_model is not None:
                return float(self._active_cost_model.predict(b, s))
            return float(b) * float(s) ** self.p
        # The planner's rule for an SP batch's step time, so compute CV measures what it balanced.
        _, sp_cost = sp_cost_function(self._active_cost_model, self.p)
        return float(np.asarray(sp_cost(np.array([b]), np.array([s]), degree)).reshape(-1)[0])

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._t0 is None:
            return
        device = pl_module.device
        b, s = batch_shape_of(pl_module, batch)
        # Each of the k ranks of a sequence-parallel batch processes 1/k of it.
        degree = int(batch.get("sp_degree", 1)) if isinstance(batch, dict) else 1
        peak = peak_memory(device)
        flops_fn = getattr(pl_module, "flops_per_sample", None)
        flops = float(b) * float(flops_fn(s)) / degree if callable(flops_fn) else 0.0
        retries, device_allocs = (float(now - then) for now, then in
                                  zip(_allocator_counts(device), self._allocator0, strict=True))
        clock = power = float("nan")
        if not self._clock_error:
            try:
                clock, power = _clock_and_power(device)
            except Exception:  # noqa: BLE001 - a failed NVML read loses one sample, never the step
                pass
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        finite = torch.isfinite(loss.detach()).all() if isinstance(loss, torch.Tensor) else None
        if finite is not None and self._events and device.type == "cuda":
            # A pinned host copy of its own, read once the step's end mark (recorded after it) has completed.
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            finite = host.copy_(finite, non_blocking=True)
        marks = {"start": self._t0, "fwd": self._t_fwd, "opt": self._t_opt, "end": self._mark(device)}
        self._t0 = None
        # Times (step, forward, wait, overhead) are filled in by `_finish`.
        row = [0.0, 0.0, self._predicted_compute(b, s, degree), float(b * s) / degree, float(peak), flops, 0.0,
               retries, device_allocs, clock, power, 1.0, float(b) if degree == 1 else 0.0, float(s), 0.0,
               self._epoch_gap]
        step = _Step(marks=marks, row=row, batch_idx=batch_idx, global_step=trainer.global_step, shape=(b, s),
                     flops=flops, device_allocs=device_allocs, host_wait=self._wait, finite=finite,
                     prev_end=self._prev_end if self._events else None)
        if self._events:
            self._prev_end = marks["end"]
            previous, self._pending = self._pending, step
            if previous is not None:
                self._finish(previous, trainer, pl_module, log=True)
        else:
            self._finish(step, trainer, pl_module, log=True)
        # The gap to the next batch starts here: this callback's own gather is not data wait.
        self._t_end = time.perf_counter()

    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Finish the step still pending (events timing), on every rank at the same point of training."""
        previous, self._pending = self._pending, None
        if previous is not None:
            self._finish(previous, trainer, pl_module, log=False)

    def _gather(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: _Step) -> np.ndarray:
        """Every rank's row of ``step``, ``[ranks, fields]``: one all-gather (none on one rank with events)."""
        if not self._events or (trainer.world_size > 1 and self._cpu_group is None):
            # (Events on several ranks without a CPU group, where no process group existed at setup: the
            # device's gather, which waits for the device.)
            local = torch.tensor(step.row, dtype=torch.float64, device=pl_module.device)
            if step.finite is not None:
                local[11] = step.finite  # on the device: no extra synchronisation
            gathered = trainer.strategy.all_gather(local)
            return gathered.reshape(-1, len(_FIELDS)).cpu().numpy()
        if step.finite is not None:
            step.row[11] = float(bool(step.finite))
        local = torch.tensor(step.row, dtype=torch.float64)
        if trainer.world_size == 1:
            return local.reshape(1, -1).numpy()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self._cpu_group))]
        dist.all_gather(parts, local, group=self._cpu_group)
        return torch.stack(parts).numpy()

    def _finish(self, step: _Step, trainer: pl.Trainer, pl_module: pl.LightningModule, log: bool) -> None:
        """Read ``step``'s times (waiting for its end mark only), gather every rank's row and count it."""
        marks = step.marks
        end = marks["end"]
        if not isinstance(end, float):
            end.synchronize()
        step_time = self._elapsed(marks["start"], end)
        forward_time = self._elapsed(marks["start"], marks["fwd"] if marks["fwd"] is not None else end)
        after_opt = self._elapsed(marks["opt"], end) if marks["opt"] is not None else 0.0
        wait = step.host_wait if step.prev_end is None else max(0.0, self._elapsed(step.prev_end, marks["start"]))
        step.row[0], step.row[1], step.row[6], step.row[14] = step_time, forward_time, wait, after_opt + wait
        rows = self._gather(trainer, pl_module, step)
        b, s = step.shape
        if rows[:, 7].max() > 0 and not self._warned_retries:
            self._warned_retries = True
            rank_zero_warn(
                f"`BalanceMonitor`: at step {step.global_step} CUDA's caching allocator freed its cache and retried "
                f"an allocation {int(rows[:, 7].max())} time(s) on a rank; each retry synchronises the device and slows "
                f"the step. Memory is near capacity for a B={b} S={s:,} batch: raise "
                "`ShapeBenchmarkCallback(memory_margin=...)`, or set PYTORCH_ALLOC_CONF=expandable_segments:True "
                "(adaptiveload-train sets it unless the environment has a setting)."
            )
        self._seen += 1
        finite = bool(rows[:, 11].all())
        if not finite:
            self._nonfinite_steps += 1
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                ranks = ", ".join(str(r) for r in np.flatnonzero(rows[:, 11] == 0))
                rank_zero_warn(
                    f"`BalanceMonitor`: the loss of step {step.global_step} is not finite (rank {ranks}). Steps "
                    "with a non-finite loss are left out of the speed metrics: arithmetic on NaNs draws less power "
                    "and runs faster than training. Lower the learning rate, add warm-up steps or check the data; with "
                    "compiled blocks, keep inductor's mix-order reduction off (their default; pytorch/pytorch#193061)."
                )
        counted = self._seen > self.warmup_steps and finite
        self._accumulate(rows, counted=counted)
        if counted:
            key = (int(b), int(s))
            sums = self._shape_sums.get(key, np.zeros(6))
            sums[:5] += (1.0, step_time, float(step.row[2]), step.flops, step.device_allocs)
            sums[5] = max(sums[5], step_time)
            self._shape_sums[key] = sums
            if step.row[12] == 0:
                self._sp_shapes.add(key)
            self._count_shapes(rows)
            self._observe(rows)
        if log and (step.batch_idx + 1) % self.log_every_n_steps == 0:
            # CPU tensors: Lightning would copy floats to the device, which waits for the device.
            pl_module.log_dict({k: torch.tensor(v) for k, v in self.last_metrics.items()}, on_step=True,
                               on_epoch=False, rank_zero_only=True)

    def _count_shapes(self, rows: np.ndarray) -> None:
        """Adds every rank's data-parallel batch of a counted step to its shape's sums (for
        :meth:`epoch_estimate`): a rank that waited for a heavier batch adds the step's time, which is what its
        batch cost the epoch."""
        for row in rows[rows[:, 12] > 0]:
            shape = (int(row[12]), int(row[13]))
            self._rank_sums[shape] = self._rank_sums.get(shape, np.zeros(3)) + (1.0, row[0], row[2])

    def _observe(self, rows: np.ndarray) -> None:
        """Per data-parallel batch shape of the step, the slowest rank's step plus the wait before it.

        Only the shapes of the ranks whose predicted compute bounds the step (within :data:`_BOUNDING` of the
        step's largest) are observed: a rank with less work waits for the others at the gradient all-reduce,
        so its step time is theirs, not its shape's (with two ranks, a remainder batch beside a full one
        measured 1.6x its own cost). Under DDP, of those, only the ranks whose forward took within
        :data:`_FORWARD_LEAD` of the longest: two batches predicted alike are told apart by what they measured,
        so a shape is not observed at a slower partner's time. Without a cost model every shape is observed."""
        cycle = rows[:, 0] + rows[:, 6]
        self._overheads.append(float(rows[:, 14].max()))
        shapes = rows[:, 12:14].astype(np.int64)
        comp = rows[:, 2]
        bounding = comp >= _BOUNDING * comp.max() if np.isfinite(comp).all() and comp.max() > 0 else np.ones(
            len(rows), dtype=bool)
        forward = rows[:, 1]
        if self._forward_is_own and bounding.sum() > 1 and np.isfinite(forward[bounding]).all():
            bounding &= forward >= _FORWARD_LEAD * forward[bounding].max()
        for b, s in {tuple(v) for v, keep in zip(shapes.tolist(), bounding, strict=True) if v[0] > 0 and keep}:
            mine = (shapes[:, 0] == b) & (shapes[:, 1] == s) & bounding
            key = (int(b), int(s))
            self._shape_cycles.setdefault(key, deque(maxlen=_SHAPE_SAMPLES)).append(float(cycle[mine].max()))
            self._shape_counts[key] = self._shape_counts.get(key, 0) + 1

    def observations(self, min_steps: int = 3) -> list[tuple[int, int, float, int]]:
        """``(B, S, median seconds, steps)`` per batch shape trained at least ``min_steps`` counted steps:
        what a step of that shape cost training, over all ranks (each step's slowest rank with that shape),
        from the start of its step to its end plus the wait before it (the loader's hand-over, the other
        callbacks and logging). The same on every rank. Sequence-parallel batches are left out."""
        return [(b, s, float(np.median(self._shape_cycles[(b, s)])), n)
                for (b, s), n in sorted(self._shape_counts.items()) if n >= min_steps]

    def overhead_s(self) -> float | None:
        """The median over counted steps (the slowest rank of each) of the time a step spends outside its
        forward + backward: from the optimizer step to the step's end (optimizer, zeroing gradients,
        schedulers) plus the wait before the step (the loader's hand-over, the other callbacks, logging).
        The shape benchmark's profiled step is forward + backward only, so this is what the closed loop
        adds to it. ``None`` before the first counted step."""
        return float(np.median(self._overheads)) if self._overheads else None

    def set_cost_model(self, cost_model: CostPredictor | None) -> None:
        """Predict compute with ``cost_model`` from the next step on (a corrected calibration's)."""
        self._active_cost_model = cost_model

    def _accumulate(self, rows: np.ndarray, counted: bool = True) -> None:
        if self._per_rank_sum.shape[0] != rows.shape[0]:
            self._reset_totals(rows.shape[0])
        t, fwd, comp, tokens, peak, flops, wait, retries, device_allocs, clock, power = (
            rows[:, i] for i in range(11))
        max_t = float(t.max())
        metrics = {
            "balance/step_time_cv": float(sync_overhead(t)),
            "balance/forward_time_cv": float(sync_overhead(fwd)),
            "balance/compute_cv": float(compute_imbalance_rate(comp)),
            "balance/bubble": float(bubble_fraction(t)),
            "balance/tokens_per_s": float(tokens.sum() / max_t) if max_t > 0 else 0.0,
            "balance/peak_mem_gb": float(peak.max() / 2**30),
            "train/data_wait_frac": float(_wait_fraction(wait, t).max()),
            "balance/alloc_retries": float(retries.max()),
            "balance/device_allocs": float(device_allocs.max()),
        }
        if np.isfinite(clock).all() and np.isfinite(power).all():
            # The slowest clock and the highest draw over ranks: a rank held back by its power cap shows.
            metrics["balance/sm_clock_mhz"] = float(clock.min())
            metrics["balance/power_w"] = float(power.max())
        if flops.sum() > 0 and max_t > 0:
            # Model FLOPs of all ranks over the slowest rank's time, per GPU.
            tflops = float(flops.sum() / max_t / len(t) / 1e12)
            metrics["balance/tflops_per_gpu"] = tflops
            if self._peak_tflops:
                metrics["balance/mfu"] = tflops / self._peak_tflops
        self.last_metrics = metrics
        if not counted:
            return
        self.history.append(rows.copy())
        for k, v in metrics.items():
            self._metric_sums[k] = self._metric_sums.get(k, 0.0) + v
        self._per_rank_sum += rows
        self._peak = np.maximum(self._peak, peak)
        self._steps += 1
        self._sum_max_time += max_t
        self._sum_wall += float((t + wait + rows[:, _FIELDS.index("epoch_gap")]).max())
        self._sum_tokens += float(tokens.sum())
        self._sum_flops += float(flops.sum())
        read = np.isfinite(clock) & np.isfinite(power)
        self._gpu_sums[read] += np.stack([clock, power], axis=1)[read]
        self._gpu_samples[read] += 1

    def summary(self) -> dict[str, float]:
        """Run means: per-step CVs averaged; bubble and tokens/s from totals (time-weighted): ``tokens_per_s``
        over the steps' time, ``wall_tokens_per_s`` over it plus the waits between steps (see the class)."""
        if self._steps == 0:
            return {"nonfinite_loss_steps": float(self._nonfinite_steps)} if self._nonfinite_steps else {}
        out = {k.split("/", 1)[1]: v / self._steps for k, v in self._metric_sums.items()}
        mean_time = self._per_rank_sum[:, 0].sum() / self._per_rank_sum.shape[0]
        out["bubble"] = 1.0 - mean_time / self._sum_max_time if self._sum_max_time > 0 else 0.0
        out["tokens_per_s"] = self._sum_tokens / self._sum_max_time if self._sum_max_time > 0 else 0.0
        # What the job sees: the waits between steps (data, callbacks, logging, epoch starts) count as time.
        out["wall_tokens_per_s"] = self._sum_tokens / self._sum_wall if self._sum_wall > 0 else 0.0
        if self._sum_flops > 0 and self._sum_max_time > 0:
            world = self._per_rank_sum.shape[0]
            out["tflops_per_gpu"] = self._sum_flops / self._sum_max_time / world / 1e12
            if self._peak_tflops:
                out["mfu"] = out["tflops_per_gpu"] / self._peak_tflops
        out["peak_mem_gb"] = float(self._peak.max() / 2**30) if self._peak.size else 0.0
        # Time-weighted per rank (total wait over total wall time), the largest over ranks.
        out["data_wait_frac"] = float(_wait_fraction(self._per_rank_sum[:, 6], self._per_rank_sum[:, 0]).max())
        out["alloc_retries"] = float(self._per_rank_sum[:, 7].max()) if self._per_rank_sum.size else 0.0  # a total
        out["device_allocs"] = float(self._per_rank_sum[:, 8].max()) if self._per_rank_sum.size else 0.0  # a total
        out["steps"] = float(self._steps)
        out["nonfinite_loss_steps"] = float(self._nonfinite_steps)
        out.pop("sm_clock_mhz", None), out.pop("power_w", None)
        if self._gpu_samples.size and (self._gpu_samples > 0).all():
            # Each rank's mean over the samples read; the lowest clock and the highest draw over ranks.
            means = self._gpu_sums / self._gpu_samples[:, None]
            out["sm_clock_mhz"] = float(means[:, 0].min())
            out["power_w"] = float(means[:, 1].max())
        if self.epoch is not None:
            out["epoch_tokens_per_s"] = self.epoch["tokens_per_s"]
            if "mfu" in self.epoch:
                out["epoch_mfu"] = self.epoch["mfu"]
        return out

    def step_rows(self) -> list[dict[str, float]]:
        """The counted steps :attr:`history` still holds, oldest first, one dict each: the step's slowest rank
        (``step_s``, its ``data_wait_s``, ``overhead_s`` and ``epoch_gap_s``, the slowest of each over ranks) and rank 0's batch
        shape (``B``, ``S``). Written to ``metrics.json`` by ``adaptiveload-train`` for benchmarks that look at
        single steps (a slow step after a callback's work, a clock drop)."""
        col = {name: i for i, name in enumerate(_FIELDS)}
        return [{"step_s": float(rows[:, col["step_time"]].max()), "data_wait_s": float(rows[:, col["data_wait"]].max()),
                 "overhead_s": float(rows[:, col["overhead"]].max()),
                 "epoch_gap_s": float(rows[:, col["epoch_gap"]].max()), "B": int(rows[0, col["batch_size"]]),
                 "S": int(rows[0, col["seq_len"]])} for rows in self.history]

    def per_shape(self) -> list[dict[str, float]]:
        """This rank's counted steps per batch shape, largest S first: ``B``, ``S``, ``steps``,
        ``bound_steps`` (steps of any rank in which a batch of the shape bounded the step, see
        :meth:`observations`), mean ``step_s``, ``cycle_s`` (what a step of the shape cost training: the median
        over those steps of the step plus the wait before it), ``predicted`` (the current cost model's
        seconds for the shape; its mean compute over the steps without a cost model or for a
        sequence-parallel shape), ``measured_over_predicted`` (``cycle_s`` over ``predicted``; NaN with a cost
        model where the shape bounded fewer than 3 steps, as a batch that waited for a heavier one has no time
        of its own; mean step time over mean prediction without a cost model or for a sequence-parallel
        shape), ``tokens_per_s``, ``mfu`` (when the module counts
        FLOPs), ``slowest_step_s`` and ``device_allocs`` (the caching allocator's device allocations and frees
        during those steps: a shape whose steps map new memory is slower than its profile for that reason).

        With a fitted cost model this is how far training steps are from what the cost model predicts for
        the same shape: a ratio above 1 is time the profile did not see (the optimizer step, host gaps, a
        slower clock under sustained load) until the closed loop corrects the model
        (``ShapeBenchmarkCallback(closed_loop=True)``), after which it is the corrected model's error.
        """
        return _balance_report.per_shape(self._shape_sums, self._shape_cycles, self._shape_counts, self._sp_shapes,
                                         self._active_cost_model, self._peak_tflops)

    def epoch_estimate(self, plan: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
        """Tokens/s (and MFU) of one epoch of ``plan`` at the step times the ranks measured per batch shape.

        A short run draws few of an epoch's buckets, so its tokens/s depends on which buckets it drew
        (on a mixed corpus, often by more than the change being measured); this weighs every bucket by
        its batches in the epoch instead. Each bucket's batches are its full ones and, where its samples do
        not fill the last, that smaller batch, each priced at its own (B, S): the mean step time of every
        rank's counted steps of that shape (this rank's for a sequence-parallel shape), which for a batch that
        waited for a heavier one at the gradient all-reduce is the step's time, as in training; a shape not
        measured takes its predicted compute times R, the measured over the predicted time of the measured
        full batches together. On W ranks the epoch's batches are spread evenly (an SP batch holds its k
        ranks) and the measured bubble is kept: ``time = Σ batches · t(B, S) · k / W / (1 - bubble)``,
        ``tokens = Σ samples · S`` (``batches · B · S`` for rows without ``samples``).

        Args:
            plan: rows of the DataModule's ``bucket_table()`` (``seq_len``, ``batch_size``, ``batches``,
                optionally ``samples`` and ``sp_degree``); a row with ``batch_size`` 0 (skipped) is left out.

        Returns:
            ``tokens_per_s``, ``mfu`` (with the module's FLOP count and a peak), ``measured_buckets``,
            ``buckets``, ``measured_time_frac`` (the measured buckets' share of the epoch's time) and
            ``ratio`` (R); ``None`` when no bucket of the plan was measured.
        """
        return _balance_report.epoch_estimate(plan, self._shape_sums, self._rank_sums, self._per_rank_sum.shape[0],
                                              self.summary().get("bubble", 0.0), self._predicted_compute,
                                              self._flops_fn, self._peak_tflops)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        table = getattr(getattr(trainer, "datamodule", None), "bucket_table", None)
        self.epoch = self.epoch_estimate(table()) if callable(table) and self._steps else None
        if self.print_report and self._steps:
            self._print_report()

    @rank_zero_only
    def _print_report(self) -> None:
        _balance_report.print_report(
            steps=self._steps, warmup_steps=self.warmup_steps, per_rank_sum=self._per_rank_sum, peak=self._peak,
            summary=self.summary(), shapes=self.per_shape(), has_cost_model=self._active_cost_model is not None,
            p=self.p, clock_error=self._clock_error, nonfinite_steps=self._nonfinite_steps, epoch=self.epoch)
