"""LastStateCheckpoint: last.ckpt never lags the step checkpoints and is never left half-written."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
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
