"""Every sample exactly once in every epoch after resumes on other numbers of ranks.

The data order does not depend on the model, so each rank of a W-rank run is fitted here as its own
one-process run whose DataModule plans for rank r of W (what a DDP rank computes, without the
process group): the union of the ranks' batches is what W ranks would train. Lightning's counters
(``num_training_batches``, the epoch loop's end) are those of each rank's own fit, so a loader whose
length Lightning keeps from an earlier epoch shows here as lost or repeated samples. One DDP run in
``tests/e2e/test_world_size_resume.py`` covers the same path with a real process group.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_datamodule import GridDataset

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.callbacks.checkpoint import LastStateCheckpoint
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

N = 37
POLICY = DualConstraintPolicy(m_mem=24, m_comp=24 * 4, p=2)
EPOCHS = 3
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",
                                        "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")


class RankDataModule(AdaptiveLoadDataModule):
    """Plans for rank ``rank`` of ``world`` ranks in a one-process fit."""

    def __init__(self, world: int, rank: int, **kw) -> None:
        super().__init__(GridDataset(N), POLICY, seed=3, print_plan=False, **kw)
        self.fake_world = (world, rank)

    def _world(self) -> tuple[int, int]:
        return self.fake_world


class Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch["latents"].mean(dim=(2, 3, 4))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Seen(Callback):
    """Records (sampler epoch, indices) of every trained batch and Lightning's batch count per epoch."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int]]] = []
        self.lightning_lengths: list[tuple[int, int]] = []  # (sampler epoch, trainer.num_training_batches)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        epoch = trainer.datamodule.sampler.epoch
        self.batches.append((epoch, batch["index"].tolist()))
        self.lightning_lengths.append((epoch, trainer.num_training_batches))


def _fit(root: Path, world: int, rank: int, *, ckpt=None, workers: int = 0, persistent: bool = False,
         callbacks=(), **limits) -> tuple[Seen, RankDataModule]:
    seen = Seen()
    dm = RankDataModule(world, rank, num_workers=workers, persistent_workers=persistent)
    Trainer(default_root_dir=root, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[seen, *callbacks],
            enable_checkpointing=bool(callbacks), **limits).fit(Module(), datamodule=dm, ckpt_path=ckpt)
    return seen, dm


def _epoch_length(world: int) -> int:
    return len(RankDataModule(world, 0).sampler)


def _run_all_ranks(root: Path, world: int, tag: str, *, ckpt=None, save=None, **kw) -> list[Seen]:
    """Fit every rank of a ``world``-rank run; rank r saves under ``root/<tag>.rank<r>`` when ``save`` is given."""
    out = []
    for rank in range(world):
        callbacks = [save(root / f"{tag}.rank{rank}")] if save is not None else []
        out.append(_fit(root / f"{tag}{rank}", world, rank, ckpt=ckpt, callbacks=callbacks, **kw)[0])
    return out


def _assert_exactly_once(runs: list[list[Seen]], epochs: int = EPOCHS) -> None:
    """Every sample once per sampler epoch (padding repeats aside: counted, at most a step per segment)."""
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    for ranks in runs:
        for seen in ranks:
            for epoch, batch in seen.batches:
                per_epoch[epoch].update(batch)
    assert sorted(per_epoch) == list(range(epochs)), sorted(per_epoch)
    for epoch, counts in per_epoch.items():
        assert set(counts) == set(range(N)), f"epoch {epoch}: lost {sorted(set(range(N)) - set(counts))}"
        repeats = sum(c - 1 for c in counts.values())
        assert repeats <= 4, f"epoch {epoch}: {repeats} repeats"


def _step_saver(every: int):
    return lambda d: ModelCheckpoint(dirpath=d, filename="{step}", save_top_k=-1, every_n_train_steps=every)


def _last_saver(d: Path) -> LastStateCheckpoint:
    return LastStateCheckpoint(dirpath=d, filename="{step}", save_top_k=-1, save_last=True)


WORKERS = [pytest.param(0, False, id="workers0"), pytest.param(2, False, id="workers2"),
           pytest.param(2, True, id="workers2-persistent")]


@pytest.mark.parametrize("workers, persistent", WORKERS)
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_step_checkpoint_resumed_on_another_world_size_keeps_every_later_epoch(tmp_path, before, after, workers,
                                                                               persistent):
    k = _epoch_length(before) // 2
    first = _run_all_ranks(tmp_path, before, "a", save=_step_saver(k), max_steps=k)
    total = k + 2 * _epoch_length(after) + (_epoch_length(after) - 0)  # ample: max_epochs ends the run
    second = _run_all_ranks(tmp_path, after, "b", ckpt=tmp_path / f"a.rank0/step={k}.ckpt", max_steps=total,
                            max_epochs=EPOCHS, workers=workers, persistent=persistent)
    _assert_exactly_once([first, second])
    for seen in second:
        for epoch, length in seen.lightning_lengths:
            if epoch > 0:
                assert length == _epoch_length(after), (epoch, length)


@pytest.mark.parametrize("workers, persistent", WORKERS)
def test_last_ckpt_at_max_steps_resumed_on_fewer_ranks_keeps_every_later_epoch(tmp_path, workers, persistent):
    k = _epoch_length(2) // 2 + 1
    first = _run_all_ranks(tmp_path, 2, "a", save=_last_saver, max_steps=k)
    # Lightning counts the epoch that max_steps stopped as done: the rest of sampler epoch 0 is its epoch 1.
    second = _run_all_ranks(tmp_path, 1, "b", ckpt=tmp_path / "a.rank0/last.ckpt", max_epochs=EPOCHS + 1,
                            workers=workers, persistent=persistent)
    _assert_exactly_once([first, second])
    for seen in second:
        assert all(length == _epoch_length(1) for epoch, length in seen.lightning_lengths if epoch > 0)


def test_two_then_one_then_two_ranks(tmp_path):
    e2, e1 = _epoch_length(2), _epoch_length(1)
    first = _run_all_ranks(tmp_path, 2, "a", save=_step_saver(e2 // 2), max_steps=e2 // 2)
    # On one rank, through the rest of epoch 0 into epoch 1, stopping mid-epoch 1.
    stop = e2 // 2 + (e1 - e2 // 2) // 2 + e1 // 2
    second = _run_all_ranks(tmp_path, 1, "b", ckpt=tmp_path / f"a.rank0/step={e2 // 2}.ckpt", save=_step_saver(stop),
                            max_steps=stop)
    third = _run_all_ranks(tmp_path, 2, "c", ckpt=tmp_path / f"b.rank0/step={stop}.ckpt", max_epochs=EPOCHS)
    _assert_exactly_once([first, second, third])


@pytest.mark.parametrize("saver", [ModelCheckpoint, LastStateCheckpoint])
def test_short_remainder_on_fewer_ranks_ends_with_a_current_last_ckpt(tmp_path, saver):
    # The rest of the run is shorter than the save interval: save_last writes last.ckpt only at the end.
    k = _epoch_length(2) // 2 + 1
    first = _run_all_ranks(tmp_path, 2, "a", save=_last_saver, max_steps=k)
    save = lambda d: saver(dirpath=d, filename="{step}", every_n_train_steps=1000, save_last=True)  # noqa: E731
    second = _run_all_ranks(tmp_path, 1, "b", ckpt=tmp_path / "a.rank0/last.ckpt", save=save, max_epochs=3)
    last = torch.load(tmp_path / "b.rank0/last.ckpt", weights_only=False)
    assert last["global_step"] == k + sum(len(s.batches) for s in second)
    third = _run_all_ranks(tmp_path, 1, "c", ckpt=tmp_path / "b.rank0/last.ckpt", max_epochs=EPOCHS + 1)
    _assert_exactly_once([first, second, third])
