"""``ModelCheckpoint`` whose ``last.ckpt`` is the state the run stopped in, also when a signal stopped it."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
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

    Interrupt and preemption: while training runs, SIGINT (Ctrl-C) and SIGTERM stop the run at the end of
    the step in progress, after ``last.ckpt`` is written (whatever ``save_last`` says); a second Ctrl-C stops at
    once without saving (Lightning's ``KeyboardInterrupt`` shutdown). Under SLURM with Lightning's auto-requeue
    (``SLURMEnvironment(auto_requeue=True)``, the default when SLURM is detected), its requeue signal (SIGUSR1
    unless ``requeue_signal`` says otherwise) runs Lightning's own requeue handler at the end of the step
    (``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, ``scontrol requeue``; the requeued job resumes from it),
    then stops. ``interrupted_by`` holds the signal's number afterwards, ``interrupt_path`` the checkpoint.

    Why not Lightning's SIGTERM handling as it is: it stops at a step boundary but saves nothing; its SLURM
    handler saves from inside the signal handler, mid-step (after a backward, before the optimizer step), so
    the resume is not exact; and with several ranks its handler broadcasts inside the signal handler, a
    collective that meets whatever collective another rank is in at that moment. Here a handler only records
    the signal, and at the end of every step the ranks agree on it with one scalar all-reduce (none on one
    rank), so every rank saves and stops after the same step; that step's state is the one a periodic
    checkpoint holds, which resumes exactly.
    """

    _last_written_step: int | None = None
    interrupted_by: int | None = None
    interrupt_path: str | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._last_written_step = None
        self.interrupted_by = self.interrupt_path = None
        self._received = 0  # the signal this rank received, 0 for none
        self._requeue_handler: Callable[[int, FrameType | None], Any] | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # Installed after Lightning's _SignalConnector registered its handlers (fit restores the earlier ones
        # when it ends); signal.signal works only in the main thread.
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        # The environment Lightning's _SignalConnector reads to decide on auto-requeue.
        environment = trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
            self._requeue_handler = signal.getsignal(environment.requeue_signal)  # Lightning's requeue handler
            signal.signal(environment.requeue_signal, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if not self._received:
            name = signal.Signals(signum).name
            more = " (Ctrl-C again stops at once, without saving)" if signum == signal.SIGINT else ""
            # os.write: print() inside a signal handler can meet the same stream mid-write (reentrant call)
            os.write(2, f"{name} received: stopping after the step in progress and saving its state{more}\n".encode())
        self._received = self._received or signum

    def _agreed_signal(self, trainer: pl.Trainer) -> tuple[int, bool]:
        """(signal, requeue) as every rank sees them after this step: any rank's signal stops them all."""
        requeue = self._requeue_handler is not None and self._received not in (0, signal.SIGINT, signal.SIGTERM)
        if trainer.world_size == 1:
            return self._received, requeue
        flags = torch.tensor([self._received, int(requeue)], device=trainer.strategy.root_device)
        signum, requeue = trainer.strategy.reduce(flags, reduce_op="max").tolist()
        return int(signum), bool(requeue)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        signum, requeue = self._agreed_signal(trainer)
        if not signum or trainer.sanity_checking or trainer.fast_dev_run:
            return
        self.interrupted_by = signum
        if requeue and self._requeue_handler is not None:  # every rank: the checkpoint is a collective save
            self._requeue_handler(signum, None)
            self.interrupt_path = trainer._checkpoint_connector._hpc_resume_path
        else:
            path = self.format_checkpoint_name(self._monitor_candidates(trainer), self.CHECKPOINT_NAME_LAST)
            if self._last_written_step != trainer.global_step:
                self._write_last(trainer, path)
                self._last_written_step = trainer.global_step
            self.interrupt_path = path
        rank_zero_info(f"{signal.Signals(signum).name}: stopped after step {trainer.global_step}; "
                       f"its state is in {self.interrupt_path}")
        trainer.should_stop = True

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
        if not (last and self.save_last is True):
            super()._save_checkpoint(trainer, filepath)
            return
        self._write_last(trainer, filepath)

    def _write_last(self, trainer: pl.Trainer, filepath: str) -> None:
        if not _is_local_file_protocol(filepath):
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
