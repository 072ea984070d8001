"""A callback the interrupt tests add to ``adaptiveload-train`` (``+callbacks.record._target_=step_record.StepRecord``):
every rank appends one JSON line per trained step to ``<path>.rank<r>`` (step, sample ids, loss), flushed at once,
so a test can wait for a step and compare an interrupted run with an uninterrupted one."""

from __future__ import annotations

import json
import time

from lightning.pytorch import Callback


class StepRecord(Callback):
    def __init__(self, path: str, slow_s: float = 0.0) -> None:
        self.path = path
        self.slow_s = slow_s  # wall time added to every step, so a signal lands mid-run

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = {"step": trainer.global_step, "ids": batch["index"].tolist(), "loss": float(outputs["loss"])}
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.slow_s:
            time.sleep(self.slow_s)
