"""What ``adaptiveload-train`` says and returns when a signal stopped the run (the saving is
:class:`~lightning_adaptiveload.callbacks.checkpoint.LastStateCheckpoint`'s): how to resume, and the exit
code, 128 + the signal's number as a shell reports a process a signal ended (130 SIGINT, 143 SIGTERM,
138 SIGUSR1), so a script or scheduler sees that the run did not finish."""

from __future__ import annotations

import shlex
import signal
from typing import TYPE_CHECKING

from omegaconf import DictConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl


def interrupt_of(trainer: pl.Trainer) -> tuple[int, str] | None:
    """(signal number, checkpoint path) when a signal stopped ``trainer``'s fit, else None."""
    for callback in trainer.callbacks:
        signum = getattr(callback, "interrupted_by", None)
        if signum:
            return int(signum), str(callback.interrupt_path)
    return None


def resume_hint(cfg: DictConfig, trainer: pl.Trainer, signum: int, path: str) -> str:
    """One line: which signal stopped the run after which step, where its state is, and the command that resumes it."""
    name = signal.Signals(signum).name
    head = f"  stopped by {name} after step {trainer.global_step}; its state is in {path}"
    if signum not in (signal.SIGINT, signal.SIGTERM):  # SLURM's requeue signal: Lightning requeued the job
        return f"{head}; the requeued job resumes from it when its output_dir (hydra.run.dir) is the same"
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("ckpt_path=")]
    except ValueError:  # train(cfg) called without Hydra's app
        overrides = ["..."]
    command = shlex.join(["adaptiveload-train", *overrides, f"ckpt_path={path}"]).replace("'...'", "...")
    return f"{head}; resume with `{command}`"


def exit_if_interrupted(metrics: dict[str, float], rank: int) -> None:
    """Exit 128 + the signal's number on rank 0 when a signal stopped the run; other ranks return (exit 0):
    Lightning's launcher ends every rank as soon as one of its child ranks exits non-zero."""
    signum = int(metrics.get("interrupted_by_signal", 0))
    if signum and rank == 0:
        raise SystemExit(128 + signum)
