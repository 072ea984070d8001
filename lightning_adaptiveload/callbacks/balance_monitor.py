"""Measure cross-rank load balance of every training step and report it.

Every step, each rank records its step time, forward time, predicted compute, tokens and peak
memory; the five numbers are all-gathered (one tiny collective per step) and turned into the
paper's metrics: compute imbalance rate (CV of predicted per-rank compute), synchronisation overhead
(CV of per-rank step time), bubble fraction (1 - mean/max) and tokens/s (all ranks' tokens over
the slowest rank's time).

Under DDP/FSDP a fast rank waits inside the gradient collectives, so *step* times even out and
their CV understates imbalance; the forward pass has no gradient collective under DDP, so the
forward-time CV and the predicted compute CV are the sharper signals there.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_adaptiveload.bucketing.balance import bubble_fraction, compute_imbalance_rate, sync_overhead
from lightning_adaptiveload.bucketing.policy import CostPredictor
from lightning_adaptiveload.bucketing.shapes import PATCH_SIZE

_FIELDS = ("step_time", "forward_time", "compute", "tokens", "peak_mem")


def _batch_shape(batch: Any, patch_size: tuple[int, int, int]) -> tuple[int, int]:
    """(B, S) of a batch with ``latents [B, C, F, H, W]``; S counts tokens after patchify."""
    latents = batch["latents"] if isinstance(batch, dict) else batch[0]
    b, _, f, h, w = latents.shape
    pt, ph, pw = patch_size
    return int(b), int((f // pt) * (h // ph) * (w // pw))


class BalanceMonitor(Callback):
    """Logs per-step step-time CV, compute CV, bubble fraction and tokens/s across ranks.

    Logged keys (every ``log_every_n_steps`` optimizer steps): ``balance/step_time_cv``,
    ``balance/forward_time_cv``, ``balance/compute_cv``, ``balance/bubble``, ``balance/tokens_per_s``,
    ``balance/peak_mem_gb`` (max over ranks). At the end of fit, rank 0 prints a balance report
    (rich table, one row per rank, plus the run's means).

    Args:
        log_every_n_steps: log every this many training batches (positive integer).
        cost_model: ``predict(B, S)`` for the predicted compute of a batch; without one,
            ``B * S**p``.
        p: exponent of S for the compute estimate without a cost model.
        synchronize: call ``torch.cuda.synchronize()`` before reading the clock on CUDA, so times
            cover the kernels and not only their launch.
        print_report: print the end-of-fit report on rank 0.

    Raises:
        ValueError: a non-positive ``log_every_n_steps`` or ``p``.

    Example::

        trainer = Trainer(callbacks=[BalanceMonitor(log_every_n_steps=10)], use_distributed_sampler=False)
    """

    def __init__(
        self,
        log_every_n_steps: int = 50,
        cost_model: CostPredictor | None = None,
        p: float = 2.0,
        synchronize: bool = True,
        print_report: bool = True,
    ) -> None:
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(
                f"`BalanceMonitor(log_every_n_steps={log_every_n_steps!r})` is not valid. Expected a positive integer."
            )
        if not p > 0:
            raise ValueError(f"`BalanceMonitor(p={p!r})` is not valid. Expected a positive number.")
        self.log_every_n_steps = log_every_n_steps
        self.cost_model = cost_model
        self.p = float(p)
        self.synchronize = synchronize
        self.print_report = print_report
        self.last_metrics: dict[str, float] = {}
        self._t0: float | None = None
        self._t_fwd: float | None = None
        self._reset_totals(0)

    def _reset_totals(self, world_size: int) -> None:
        self._per_rank_sum = np.zeros((world_size, len(_FIELDS)))
        self._peak = np.zeros(world_size)
        self._metric_sums: dict[str, float] = {}
        self._steps = 0
        self._sum_max_time = 0.0
        self._sum_tokens = 0.0

    def _now(self, device: torch.device) -> float:
        if self.synchronize and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_totals(trainer.world_size)
        self._t0 = self._t_fwd = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._t_fwd = None
        self._t0 = self._now(pl_module.device)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._t0 is not None and self._t_fwd is None:
            self._t_fwd = self._now(pl_module.device)

    def _predicted_compute(self, b: int, s: int) -> float:
        if self.cost_model is not None:
            return float(self.cost_model.predict(b, s))
        return float(b) * float(s) ** self.p

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._t0 is None:
            return
        end = self._now(pl_module.device)
        step_time = end - self._t0
        forward_time = (self._t_fwd if self._t_fwd is not None else end) - self._t0
        self._t0 = None
        b, s = _batch_shape(batch, tuple(getattr(pl_module, "patch_size", PATCH_SIZE)))
        peak = torch.cuda.max_memory_allocated(pl_module.device) if pl_module.device.type == "cuda" else 0
        local = torch.tensor([step_time, forward_time, self._predicted_compute(b, s), float(b * s), float(peak)],
                             dtype=torch.float64, device=pl_module.device)
        gathered = trainer.strategy.all_gather(local)
        rows = gathered.reshape(-1, len(_FIELDS)).cpu().numpy()
        self._accumulate(rows)
        if (batch_idx + 1) % self.log_every_n_steps == 0:
            pl_module.log_dict(self.last_metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def _accumulate(self, rows: np.ndarray) -> None:
        if self._per_rank_sum.shape[0] != rows.shape[0]:
            self._reset_totals(rows.shape[0])
        t, fwd, comp, tokens, peak = (rows[:, i] for i in range(len(_FIELDS)))
        max_t = float(t.max())
        metrics = {
            "balance/step_time_cv": float(sync_overhead(t)),
            "balance/forward_time_cv": float(sync_overhead(fwd)),
            "balance/compute_cv": float(compute_imbalance_rate(comp)),
            "balance/bubble": float(bubble_fraction(t)),
            "balance/tokens_per_s": float(tokens.sum() / max_t) if max_t > 0 else 0.0,
            "balance/peak_mem_gb": float(peak.max() / 2**30),
        }
        self.last_metrics = metrics
        for k, v in metrics.items():
            self._metric_sums[k] = self._metric_sums.get(k, 0.0) + v
        self._per_rank_sum += rows
        self._peak = np.maximum(self._peak, peak)
        self._steps += 1
        self._sum_max_time += max_t
        self._sum_tokens += float(tokens.sum())

    def summary(self) -> dict[str, float]:
        """Run means: per-step CVs averaged; bubble and tokens/s from totals (time-weighted)."""
        if self._steps == 0:
            return {}
        out = {k.split("/", 1)[1]: v / self._steps for k, v in self._metric_sums.items()}
        mean_time = self._per_rank_sum[:, 0].sum() / self._per_rank_sum.shape[0]
        out["bubble"] = 1.0 - mean_time / self._sum_max_time if self._sum_max_time > 0 else 0.0
        out["tokens_per_s"] = self._sum_tokens / self._sum_max_time if self._sum_max_time > 0 else 0.0
        out["peak_mem_gb"] = float(self._peak.max() / 2**30) if self._peak.size else 0.0
        out["steps"] = float(self._steps)
        return out

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.print_report and self._steps:
            self._print_report()

    @rank_zero_only
    def _print_report(self) -> None:
        from rich.console import Console
        from rich.table import Table

        n = self._steps
        table = Table(title=f"Balance report ({n} steps)")
        for col in ("rank", "mean step s", "mean fwd s", "mean pred. compute", "tokens", "peak GiB"):
            table.add_column(col, justify="right")
        for r, row in enumerate(self._per_rank_sum):
            table.add_row(str(r), f"{row[0] / n:.4f}", f"{row[1] / n:.4f}", f"{row[2] / n:.4g}",
                          f"{int(row[3]):,}", f"{self._peak[r] / 2**30:.2f}")
        s = self.summary()
        console = Console()
        console.print(table)
        console.print(
            f"step-time CV {s['step_time_cv']:.2%} | forward CV {s['forward_time_cv']:.2%} | "
            f"compute CV {s['compute_cv']:.2%} | bubble {s['bubble']:.2%} | tokens/s {s['tokens_per_s']:,.0f}"
        )
