"""A callback for benchmark runs of ``adaptiveload-train`` (``+callbacks.dump_history._target_=_dump_history.DumpHistory``
with ``benchmarks/`` on ``PYTHONPATH``): at the end of training, rank 0 saves the ``BalanceMonitor``'s per-step,
per-rank rows (``BalanceMonitor.history``, columns ``BalanceMonitor.FIELDS``) to ``history.npy`` in the run's
output directory."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np

from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor


class DumpHistory(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        monitor = next((c for c in trainer.callbacks if isinstance(c, BalanceMonitor)), None)
        if trainer.global_rank == 0 and monitor is not None and monitor.history:
            np.save(self.out / "history.npy", np.stack(monitor.history))
