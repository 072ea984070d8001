"""``ModelCheckpoint`` whose ``last.ckpt`` is the state the run stopped in."""

from __future__ import annotations

import os
import shutil
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

__all__ = ["LastStateCheckpoint"]


class LastStateCheckpoint(ModelCheckpoint):
    """Lightning's :class:`~lightning.pytorch.callbacks.ModelCheckpoint`, with ``last.ckpt`` written at the end
    of every epoch and where ``max_steps`` stops the run, unless it already holds that step.

    With ``save_last=True`` and ``every_n_train_steps``, Lightning 2.6 writes ``last.ckpt`` next to each
    periodic checkpoint, and at the end of training only if the run wrote none before. A run that
    ``max_steps`` stops between two periodic saves therefore keeps the earlier ``last.ckpt``: with saves
    every 1,000 steps and ``max_steps=1500``, ``last.ckpt`` holds step 1,000, and resuming from it trains
    steps 1,001-1,500 again. Here ``last.ckpt`` is also written when the epoch loop ends (its end, or the
    step where ``max_steps`` stopped it) whenever its step is older, so resuming from it continues where
    the run stopped. Everything else is Lightning's. It is a
    subclass rather than a second callback so that there is one ``last.ckpt`` and one set of settings, the
    ones ``ckpt_path="last"`` finds.

    ``last.ckpt`` never lags the step checkpoints: with ``save_last=True`` it is written before the
    periodic checkpoint of the same step (Lightning writes it after, so a kill between the two left it one
    save behind), and on a local file system it is written to ``last.ckpt.tmp`` and renamed over the old
    one, so a kill during the write keeps the previous ``last.ckpt`` whole.
    """

    _last_written_step: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._last_written_step = None

    @override
    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]) -> None:
        if self.save_last is True and self.save_top_k != 0:
            self._save_last_checkpoint(trainer, monitor_candidates)  # first: see the class docstring
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    @override
    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]) -> None:
        if self.save_last is True and self._last_written_step == trainer.global_step:
            return  # written before this step's periodic checkpoint
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_written_step = trainer.global_step

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        last = os.path.basename(filepath).startswith(self.CHECKPOINT_NAME_LAST)
        if not (last and self.save_last is True and _is_local_file_protocol(filepath)):
            super()._save_checkpoint(trainer, filepath)
            return
        partial = f"{filepath}.tmp"
        super()._save_checkpoint(trainer, partial)  # ends with a barrier: every rank has written its part
        if trainer.is_global_zero:
            if os.path.isdir(partial) and os.path.isdir(filepath):  # a sharded checkpoint: a directory
                shutil.rmtree(filepath)
            os.replace(partial, filepath)
        trainer.strategy.barrier("LastStateCheckpoint.rename")
        self._last_checkpoint_saved = filepath

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Where Lightning writes the end-of-epoch checkpoints, also when max_steps stops the run mid-epoch
        # (the resume of such a checkpoint is exact: tests/data/test_resume.py); written at on_train_end
        # instead, the loop state would count the epoch as finished.
        super().on_train_epoch_end(trainer, pl_module)
        # _should_skip_saving_checkpoint is Lightning's own test: not fitting, a sanity check, fast_dev_run,
        # or this step already saved.
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
