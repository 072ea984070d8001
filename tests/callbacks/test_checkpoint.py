"""LastStateCheckpoint: last.ckpt never lags the step checkpoints and is never left half-written."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_adaptiveload.callbacks.checkpoint import LastStateCheckpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",
                                        "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")


class Killed(Exception):
    pass


def _fit(tmp_path, kill_on: str | None, max_steps: int = 6) -> None:
    callback = LastStateCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1,
                                   save_last=True)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=max_steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    save = trainer.save_checkpoint

    def save_or_die(filepath, *args, **kwargs):
        if kill_on is not None and kill_on in str(filepath) and trainer.global_step == 4:
            if kill_on.startswith("last"):
                with open(filepath, "wb") as fh:  # a partial write, then the process dies
                    fh.write(b"PK\x03\x04 half a checkpoint")
            raise Killed(filepath)
        return save(filepath, *args, **kwargs)

    trainer.save_checkpoint = save_or_die
    trainer.fit(BoringModel())


def test_a_kill_between_the_step_checkpoint_and_last_ckpt_leaves_last_current(tmp_path):
    with pytest.raises(Killed):
        _fit(tmp_path, kill_on="step=4")
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 4


def test_a_kill_while_writing_last_ckpt_keeps_the_previous_one_whole(tmp_path):
    with pytest.raises(Killed):
        _fit(tmp_path, kill_on="last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 2


def test_each_step_writes_last_ckpt_once(tmp_path, monkeypatch):
    written = []
    original = LastStateCheckpoint._save_checkpoint
    monkeypatch.setattr(LastStateCheckpoint, "_save_checkpoint",
                        lambda self, trainer, path: (written.append((trainer.global_step, str(path).rsplit("/", 1)[-1])),
                                                     original(self, trainer, path)))
    _fit(tmp_path, kill_on=None, max_steps=5)
    assert written == [(2, "last.ckpt"), (2, "step=2.ckpt"), (4, "last.ckpt"), (4, "step=4.ckpt"), (5, "last.ckpt")]
    assert not list(tmp_path.glob("*.tmp"))


class _SignalAt(Callback):
    """Sends ``signum`` to this process during ``step`` (before the checkpoint callback's end of that step)."""

    def __init__(self, signum: int, step: int, times: int = 1) -> None:
        self.signum, self.step, self.times = signum, step, times

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("save_last", [True, False])
def test_a_signal_saves_last_ckpt_after_the_step_and_stops(tmp_path, signum, save_last):
    before = signal.getsignal(signum)
    callback = LastStateCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=100, save_last=save_last)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=20, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[_SignalAt(signum, 3), callback])
    trainer.fit(BoringModel())
    assert trainer.global_step == 3 and callback.interrupted_by == signum
    assert callback.interrupt_path == str(tmp_path / "last.ckpt") and not list(tmp_path.glob("*.tmp"))
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 3
    assert signal.getsignal(signum) is before  # fit restores the handlers it found


def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    callback = LastStateCheckpoint(dirpath=tmp_path, every_n_train_steps=100, save_last=True)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=20, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[_SignalAt(signal.SIGINT, 3, times=2), callback])
    with pytest.raises(SystemExit):  # Lightning's KeyboardInterrupt shutdown
        trainer.fit(BoringModel())
    assert not (tmp_path / "last.ckpt").exists() and callback.interrupted_by is None
