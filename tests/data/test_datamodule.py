from collections import Counter
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import Dataset

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy, EqualTokenPolicy
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

GRIDS = np.array([(1, 2, 2), (1, 2, 3), (3, 2, 2), (2, 3, 3)])


class GridDataset(Dataset):
    """Tiny dataset with the dataset interface: token grids from 'metadata', latents on demand."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.grids = GRIDS[np.random.default_rng(seed).integers(0, len(GRIDS), n)]

    def __len__(self) -> int:
        return len(self.grids)

    def token_grids(self) -> np.ndarray:
        return self.grids

    def __getitem__(self, i: int) -> dict:
        f, h, w = (int(v) for v in self.grids[i])
        return {
            "latents": torch.full((4, f, 2 * h, 2 * w), float(i)),
            "context": torch.zeros(3, 8),
            "index": i,
        }


class RecordingModule(LightningModule):
    """Records the dataset indices of every trained batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["index"].tolist())
        x = batch["latents"].mean(dim=(2, 3, 4))
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SteppingBatchesModule(RecordingModule):
    def configure_optimizers(self):
        assert self.trainer.estimated_stepping_batches > 0  # builds the train loader early (Lightning #20550)
        return super().configure_optimizers()


class LateRestoreStrategy(SingleDeviceStrategy):
    """Restores the checkpoint after setup, as FSDP does."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


POLICY = DualConstraintPolicy(m_mem=24, m_comp=24 * 4, p=2)


def _trainer(tmp_path, callbacks=(), **kw):
    kw.setdefault("max_epochs", 1)
    return Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **kw,
    )


def _dm(num_workers=0, n=60):
    return AdaptiveLoadDataModule(GridDataset(n), POLICY, seed=4, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fit_checkpoint_mid_epoch_resume_sees_each_sample_once(tmp_path, num_workers):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    full = RecordingModule()
    _trainer(tmp_path, [ckpt], enable_checkpointing=True).fit(full, datamodule=_dm(num_workers))
    assert sorted(i for b in full.seen for i in b) == list(range(60))

    resumed = RecordingModule()
    _trainer(tmp_path / "b").fit(
        resumed, datamodule=_dm(num_workers), ckpt_path=str(tmp_path / "step=4.ckpt")
    )
    # the first 4 batches of the uninterrupted run + the resumed run = the whole epoch, each sample once
    assert Counter(i for b in full.seen[:4] + resumed.seen for i in b) == Counter(range(60))
    assert resumed.seen == full.seen[4:]


def test_two_resumes_in_a_row(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    first = RecordingModule()
    _trainer(tmp_path, [ckpt], max_steps=3).fit(first, datamodule=_dm())
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=7, save_top_k=-1, filename="{step}")
    second = RecordingModule()
    _trainer(tmp_path, [ckpt2], max_steps=7).fit(
        second, datamodule=_dm(), ckpt_path=str(tmp_path / "a/step=3.ckpt")
    )
    third = RecordingModule()
    _trainer(tmp_path).fit(third, datamodule=_dm(), ckpt_path=str(tmp_path / "b/step=7.ckpt"))
    assert len(first.seen) == 3 and len(second.seen) == 4
    assert Counter(i for b in first.seen + second.seen + third.seen for i in b) == Counter(range(60))


def test_resume_when_loader_is_built_before_restore(tmp_path):
    # Workers pull indices from the sampler as soon as the loader is iterated, i.e. before the restore.
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}")
    full = SteppingBatchesModule()
    _trainer(tmp_path, [ckpt], strategy=LateRestoreStrategy(torch.device("cpu"))).fit(full, datamodule=_dm(2))
    resumed = SteppingBatchesModule()
    _trainer(tmp_path / "b", strategy=LateRestoreStrategy(torch.device("cpu"))).fit(
        resumed, datamodule=_dm(2), ckpt_path=str(tmp_path / "step=5.ckpt")
    )
    assert resumed.seen == full.seen[5:]


def test_epochs_differ_and_cover_all(tmp_path):
    model = RecordingModule()
    dm = _dm()
    _trainer(tmp_path, max_epochs=2).fit(model, datamodule=dm)
    n = len(dm.sampler)
    e0, e1 = model.seen[:n], model.seen[n:]
    assert sorted(i for b in e0 for i in b) == sorted(i for b in e1 for i in b) == list(range(60))
    assert e0 != e1


def test_set_policy_before_fit_and_frozen_after(tmp_path):
    dm = _dm()
    dm.set_policy(EqualTokenPolicy(12))
    table = {row["grid"]: row["batch_size"] for row in dm.bucket_table()}
    assert table == {(1, 2, 2): 3, (1, 2, 3): 2, (2, 3, 3): 1, (3, 2, 2): 1}
    model = RecordingModule()
    _trainer(tmp_path, max_steps=2).fit(model, datamodule=dm)
    assert all(len(b) <= 3 for b in model.seen)
    with pytest.raises(RuntimeError, match="before the first training epoch"):
        dm.set_policy(POLICY)


def test_distributed_sampler_injection_is_refused():
    dm = _dm()
    dm.trainer = Mock(world_size=2, global_rank=0)
    dm.trainer._accelerator_connector.use_distributed_sampler = True
    with pytest.raises(RuntimeError, match=r"use_distributed_sampler=False"):
        dm.setup("fit")
    dm.trainer._accelerator_connector.use_distributed_sampler = False
    dm.setup("fit")


def test_rejects_dataset_without_token_grids():
    with pytest.raises(ValueError, match="token_grids"):
        AdaptiveLoadDataModule(list(range(3)), POLICY)


def test_one_sampler_an_epoch_planned_once_and_the_plan_printed_once(tmp_path, capsys):
    dm = _dm()
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    trainer.fit(RecordingModule(), datamodule=dm)
    sampler = dm.sampler
    assert sampler is dm.sampler  # cached, not rebuilt
    assert sampler.plans_built == 1
    out = capsys.readouterr().out
    assert out.count("Bucket plan:") == 1
    assert f"{len(sampler)} steps/epoch x 1 rank(s)" in out.replace(",", "")


def test_placeholder_policy_is_not_checked_before_the_sampler_is_built(tmp_path):
    # A policy whose memory budget rejects every sample, as a recipe's placeholder would before the
    # shape benchmark replaces it: building the DataModule must not fail.
    dm = AdaptiveLoadDataModule(GridDataset(20), DualConstraintPolicy(m_mem=2, m_comp=4, p=2), seed=4)
    dm.set_policy(POLICY)
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    trainer.fit(RecordingModule(), datamodule=dm)
    assert trainer.global_step == len(dm.sampler)
    bad = AdaptiveLoadDataModule(GridDataset(20), DualConstraintPolicy(m_mem=2, m_comp=4, p=2), seed=4)
    with pytest.raises(ValueError, match="above the memory budget of 2 tokens"):
        _trainer(tmp_path, enable_checkpointing=False).fit(RecordingModule(), datamodule=bad)


def test_resume_error_names_the_checkpoint_and_the_field(tmp_path):
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = _trainer(tmp_path, [ckpt_cb], max_steps=3)
    trainer.fit(RecordingModule(), datamodule=_dm())
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    other_seed = AdaptiveLoadDataModule(GridDataset(60), POLICY, seed=5)
    with pytest.raises(ValueError, match=rf"checkpoint {path}.*seed=4 but this run has seed=5"):
        _trainer(tmp_path, max_steps=6).fit(RecordingModule(), datamodule=other_seed, ckpt_path=path)


def test_collate_is_tried_on_one_sample_before_training(tmp_path):
    class OtherKeys(GridDataset):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            return {"x": item.pop("latents"), **item}

    dm = AdaptiveLoadDataModule(OtherKeys(20), POLICY)
    with pytest.raises(ValueError, match=r"collate function `collate_batch` fails on dataset\[0\].*collate_fn="):
        _trainer(tmp_path, enable_checkpointing=False).fit(RecordingModule(), datamodule=dm)


def test_first_batches_are_checked_against_the_plan(tmp_path):
    class WrongPatch(RecordingModule):
        patch_size = (1, 1, 1)  # the data was patchified with (1, 2, 2)

        def batch_shape(self, batch):
            from lightning_adaptiveload.geometry import tokens_of

            return tokens_of(batch["latents"], self.patch_size)

    with pytest.raises(Exception, match=r"the sampler planned \(\d+, \d+\)"):
        _trainer(tmp_path, enable_checkpointing=False).fit(WrongPatch(), datamodule=_dm())

    class RightPatch(WrongPatch):
        patch_size = (1, 2, 2)

    trainer = _trainer(tmp_path, enable_checkpointing=False)
    dm = _dm()
    trainer.fit(RightPatch(), datamodule=dm)
    assert trainer.global_step == len(dm.sampler) and not dm._planned


def test_oversize_error_names_the_file(tmp_path):
    from lightning_adaptiveload.bucketing.sampler import OversizeSampleError

    class Labelled(GridDataset):
        def sample_label(self, i):
            return f"manifest row {i + 1} (clip_{i:04d}.mp4)"

    dm = AdaptiveLoadDataModule(Labelled(20), DualConstraintPolicy(m_mem=4, m_comp=16, p=2))
    with pytest.raises(OversizeSampleError) as info:
        dm.make_sampler()
    i = info.value.index
    assert dm.shapes[i].prod() > 4 and (dm.shapes[:i].prod(axis=1) <= 4).all()
    assert str(info.value).startswith(f"manifest row {i + 1} (clip_{i:04d}.mp4): S={dm.shapes[i].prod()} tokens")
