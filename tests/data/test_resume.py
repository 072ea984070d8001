"""Exact resume from every checkpoint Lightning writes, and a one-line error for every unusable state.

Each resumed run is compared with one uninterrupted run: the same batches in the same order and
bit-identical losses (plain SGD, so the loss at a step is a function of the data order alone).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_datamodule import GridDataset  # the same tiny dataset (latents hold the sample index)

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.callbacks.checkpoint import LastStateCheckpoint
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

POLICY = DualConstraintPolicy(m_mem=24, m_comp=24 * 4, p=2)
N = 16
KEY = "AdaptiveLoadDataModule"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")


class LossModule(LightningModule):
    """Records every step's dataset indices and loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.steps: list[tuple[list[int], float]] = []

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch["latents"].mean(dim=(2, 3, 4)) / N).pow(2).mean()
        self.steps.append((batch["index"].tolist(), loss.item()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _dm(workers: int = 0, persistent: bool = False, dataset=None, **kw) -> AdaptiveLoadDataModule:
    kw.setdefault("policy", POLICY)
    return AdaptiveLoadDataModule(dataset or GridDataset(N), seed=4, num_workers=workers,
                                  persistent_workers=persistent, print_plan=False, **kw)


def _fit(root: Path, *, ckpt_path=None, callbacks=(), dm=None, **kw) -> LossModule:
    kw.setdefault("max_epochs", 10)
    module = LossModule()
    Trainer(default_root_dir=root, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
            num_sanity_val_steps=0, **kw).fit(module, datamodule=dm or _dm(), ckpt_path=ckpt_path)
    return module


def _steps_per_epoch() -> int:
    return len(_dm().sampler)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> list[tuple[list[int], float]]:
    """The uninterrupted run: three epochs."""
    return _fit(tmp_path_factory.mktemp("full"), max_steps=3 * _steps_per_epoch()).steps


def _saver(dirpath: Path, **kw) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, filename="{step}", save_top_k=-1, **kw)


WORKERS = [pytest.param(0, False, id="workers0"), pytest.param(2, False, id="workers2"),
           pytest.param(2, True, id="workers2-persistent")]


@pytest.mark.parametrize("workers, persistent", WORKERS)
def test_step_checkpoint_mid_epoch(tmp_path, full, workers, persistent):
    e = _steps_per_epoch()
    first = _fit(tmp_path, callbacks=[_saver(tmp_path / "c", every_n_train_steps=e + 3)], max_steps=e + 3,
                 dm=_dm(workers, persistent))
    resumed = _fit(tmp_path, ckpt_path=tmp_path / f"c/step={e + 3}.ckpt", max_steps=3 * e,
                   dm=_dm(workers, persistent))
    assert first.steps + resumed.steps == full


def test_step_checkpoint_at_the_last_batch_of_an_epoch(tmp_path, full):
    e = _steps_per_epoch()
    _fit(tmp_path, callbacks=[_saver(tmp_path / "c", every_n_train_steps=e)], max_steps=e + 2, dm=_dm(2))
    resumed = _fit(tmp_path, ckpt_path=tmp_path / f"c/step={e}.ckpt", max_steps=3 * e, dm=_dm(2))
    assert resumed.steps == full[e:]


@pytest.mark.parametrize("workers, persistent", WORKERS)
def test_last_ckpt_at_max_steps_mid_epoch(tmp_path, full, workers, persistent):
    # The README's resume: `max_steps` stops part-way through an epoch and `last.ckpt` is written in
    # on_train_epoch_end, after Lightning counted the epoch; the resumed run crosses two epoch boundaries.
    e = _steps_per_epoch()
    first = _fit(tmp_path, callbacks=[_saver(tmp_path / "c", save_last=True)], max_steps=e // 2,
                 dm=_dm(workers, persistent))
    resumed = _fit(tmp_path, ckpt_path=tmp_path / "c/last.ckpt", max_steps=3 * e, dm=_dm(workers, persistent))
    assert first.steps + resumed.steps == full


def test_last_ckpt_of_the_product_config_is_where_max_steps_stopped(tmp_path, full):
    # adaptiveload-train's checkpoint callback: periodic saves (every_n_train_steps) and save_last. Stopped
    # between two periodic saves, Lightning's own ModelCheckpoint leaves last.ckpt at the earlier save
    # (resuming repeats the steps in between); LastStateCheckpoint writes it where the run stopped.
    e = _steps_per_epoch()
    stop = e + e // 2 + 1  # mid-epoch, between the saves at steps 2, 4, ...
    assert stop % 2 == 1
    kw = dict(filename="{step}", save_top_k=-1, every_n_train_steps=2, save_last=True)
    _fit(tmp_path / "lightning", callbacks=[ModelCheckpoint(dirpath=tmp_path / "l", **kw)], max_steps=stop)
    assert torch.load(tmp_path / "l/last.ckpt", weights_only=False)["global_step"] == stop - 1
    first = _fit(tmp_path / "ours", callbacks=[LastStateCheckpoint(dirpath=tmp_path / "o", **kw)], max_steps=stop)
    assert torch.load(tmp_path / "o/last.ckpt", weights_only=False)["global_step"] == stop
    resumed = _fit(tmp_path, ckpt_path=tmp_path / "o/last.ckpt", max_steps=3 * e)
    assert first.steps + resumed.steps == full


def test_step_checkpoints_after_resuming_from_last_ckpt_at_max_steps(tmp_path, full):
    # The resumed run continues the sampler's epoch under Lightning's next epoch number (its batch counter
    # starts again at 0); step checkpoints written in that epoch must count the steps before the resume.
    e = _steps_per_epoch()
    first = _fit(tmp_path, callbacks=[LastStateCheckpoint(dirpath=tmp_path / "a", filename="{step}", save_top_k=-1,
                                                          every_n_train_steps=4, save_last=True)], max_steps=e // 2 + 1)
    assert torch.load(tmp_path / "a/last.ckpt", weights_only=False)["global_step"] == e // 2 + 1
    second = _fit(tmp_path, ckpt_path=tmp_path / "a/last.ckpt", max_steps=e // 2 + 3,
                  callbacks=[_saver(tmp_path / "b", every_n_train_steps=1)])
    k = e // 2 + 2
    third = _fit(tmp_path, ckpt_path=tmp_path / f"b/step={k}.ckpt", max_steps=3 * e)
    assert first.steps + second.steps[:1] + third.steps == full


def test_resume_without_max_steps_from_last_ckpt_at_max_steps_then_from_its_step_checkpoints(tmp_path, full):
    # Resumed without max_steps, Lightning runs the rest of the sampler's epoch under its next epoch, whose batch
    # counter starts at 0: the step checkpoints of that epoch must still count the steps before the restore
    # (they said 1, 2, ... instead of 7, 8, ..., and a resume from one replayed the wrong batches).
    e = _steps_per_epoch()
    first = _fit(tmp_path, callbacks=[_saver(tmp_path / "a", save_last=True)], max_steps=e // 2)
    second = _fit(tmp_path, ckpt_path=tmp_path / "a/last.ckpt", max_epochs=2,
                  callbacks=[_saver(tmp_path / "b", every_n_train_steps=1)])
    assert first.steps + second.steps == full[:e]
    for k in (e // 2 + 2, e - 1):
        ckpt = torch.load(tmp_path / f"b/step={k}.ckpt", weights_only=False)
        assert ckpt[KEY]["sampler"]["segments"] == [[1, k]]
        third = _fit(tmp_path, ckpt_path=tmp_path / f"b/step={k}.ckpt", max_steps=3 * e)
        assert first.steps + second.steps[: k - e // 2] + third.steps == full


def test_last_ckpt_at_max_steps_twice_in_a_row(tmp_path, full):
    e = _steps_per_epoch()
    first = _fit(tmp_path, callbacks=[_saver(tmp_path / "a", save_last=True)], max_steps=e // 2)
    second = _fit(tmp_path, callbacks=[_saver(tmp_path / "b", save_last=True)], max_steps=e + e // 2 + 1,
                  ckpt_path=tmp_path / "a/last.ckpt")
    third = _fit(tmp_path, ckpt_path=tmp_path / "b/last.ckpt", max_steps=3 * e)
    assert first.steps + second.steps + third.steps == full


@pytest.mark.parametrize("kind", ["max_epochs", "max_steps_at_epoch_end"])
@pytest.mark.parametrize("resume_limit", ["max_steps", "max_epochs"])
@pytest.mark.parametrize("workers", [0, 2])
def test_end_of_epoch_checkpoint(tmp_path, full, kind, resume_limit, workers):
    # Resumed with max_steps, Lightning restarts the finished epoch after its last batch and would train
    # one more batch in it (it waits for a validation loop that never runs).
    e = _steps_per_epoch()
    limit = {"max_epochs": 1} if kind == "max_epochs" else {"max_steps": e}
    first = _fit(tmp_path, callbacks=[_saver(tmp_path / "c", save_last=True)], dm=_dm(workers), **limit)
    again = {"max_steps": 3 * e} if resume_limit == "max_steps" else {"max_epochs": 3}
    resumed = _fit(tmp_path, ckpt_path=tmp_path / "c/last.ckpt", dm=_dm(workers), **again)
    assert first.steps + resumed.steps == full


# ---------------------------------------------------------------------------------------------- defects
@pytest.fixture(scope="module")
def mid_epoch_ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mid")
    _fit(root, callbacks=[_saver(root / "c", every_n_train_steps=5)], max_steps=5)
    return root / "c/step=5.ckpt"


def _edited(ckpt: Path, tmp_path: Path, edit) -> Path:
    checkpoint = torch.load(ckpt, weights_only=False)
    edit(checkpoint)
    out = tmp_path / "edited.ckpt"
    torch.save(checkpoint, out)
    return out


def _refused(tmp_path: Path, ckpt: Path, match: str, dm=None) -> str:
    with pytest.raises(ValueError, match=match) as info:
        _fit(tmp_path, ckpt_path=ckpt, max_steps=8, dm=dm)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"Cannot resume the data order from checkpoint {ckpt}: ")
    return message


def _sampler_state(checkpoint: dict) -> dict:
    return checkpoint[KEY]["sampler"]


@pytest.mark.parametrize(
    "edit, match",
    [
        pytest.param(lambda c: c.pop(KEY), r"saved mid-epoch \(5 batches into the epoch\) but has no sampler state "
                     r'\(\["AdaptiveLoadDataModule"\]\["sampler"\]\)', id="no-datamodule-state"),
        pytest.param(lambda c: c[KEY].pop("sampler"), "saved mid-epoch .* but has no sampler state", id="no-sampler-state"),
        pytest.param(lambda c: c[KEY].update(sampler=[1, 2]),
                     r'its sampler state \["AdaptiveLoadDataModule"\]\["sampler"\] is a list, not a dict',
                     id="not-a-dict"),
        pytest.param(lambda c: _sampler_state(c).update(epoch=-1), "the sampler state has epoch=-1", id="epoch-minus-1"),
        pytest.param(lambda c: _sampler_state(c).update(segments=[[1, 3]]),
                     "the sampler state has 3 steps taken in epoch 0 but was saved with 5", id="other-step"),
        pytest.param(lambda c: c[KEY]["loop"].update(batches=4),
                     r"saved at another point of the fit loop than the checkpoint's loop \(batches: saved 4, restored 5\)",
                     id="other-loop"),
        pytest.param(lambda c: _sampler_state(c).pop("shapes"),
                     r"has no `shapes` \(written by an older release\).*AdaptiveLoadDataModule\(allow_unverified_resume=True\)",
                     id="no-shapes"),
        pytest.param(lambda c: _sampler_state(c).pop("fingerprint"), "has no `fingerprint`", id="no-fingerprint"),
        pytest.param(lambda c: c[KEY].update(uncounted_steps=-1), "has uncounted_steps=-1; expected an integer >= 0",
                     id="uncounted-minus-1"),
        pytest.param(lambda c: [c[KEY].pop("loop"), c[KEY].update(uncounted_steps=2)],
                     "has 5 steps taken in epoch 0 but the checkpoint's loop trained 5 batches of its epoch after 2 it "
                     "did not count", id="uncounted-disagrees"),
    ],
)
def test_unusable_sampler_state_is_refused_in_one_line(tmp_path, mid_epoch_ckpt, edit, match):
    _refused(tmp_path, _edited(mid_epoch_ckpt, tmp_path, edit), match)


def test_unverified_state_resumes_exactly_when_allowed(tmp_path, full, mid_epoch_ckpt):
    ckpt = _edited(mid_epoch_ckpt, tmp_path, lambda c: [_sampler_state(c).pop(k) for k in ("shapes", "fingerprint")])
    resumed = _fit(tmp_path, ckpt_path=ckpt, max_steps=len(full), dm=_dm(allow_unverified_resume=True))
    assert resumed.steps == full[5:]


class _Changed(GridDataset):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.grids = self.grids.copy()
        self.grids[:3] = (2, 3, 3)


@pytest.mark.parametrize(
    "dm, match",
    [
        pytest.param(lambda: _dm(dataset=_Changed(N)), r"has shapes='[0-9a-f]+' but the dataset has shapes='[0-9a-f]+'",
                     id="changed-grids"),
        pytest.param(lambda: _dm(dataset=GridDataset(N + 1)), f"has num_samples={N} but the dataset has {N + 1}",
                     id="changed-size"),
        pytest.param(lambda: AdaptiveLoadDataModule(GridDataset(N), POLICY, seed=5, print_plan=False),
                     "has seed=4 but this run has seed=5", id="changed-seed"),
        pytest.param(lambda: _dm(policy=DualConstraintPolicy(m_mem=24, m_comp=24 * 8, p=2)),
                     r"different policy \(policy: saved \{.*'m_comp': 96.*\}, now \{.*'m_comp': 192.*\}\)",
                     id="changed-policy"),
    ],
)
def test_changed_data_or_settings_are_refused_mid_epoch(tmp_path, mid_epoch_ckpt, dm, match):
    _refused(tmp_path, mid_epoch_ckpt, match, dm=dm())


def test_changed_dataset_at_an_epoch_boundary_plans_the_new_data(tmp_path):
    _fit(tmp_path, callbacks=[_saver(tmp_path / "c", save_last=True)], max_epochs=1)
    bigger = _dm(dataset=GridDataset(N + 8, seed=1))
    resumed = _fit(tmp_path, ckpt_path=tmp_path / "c/last.ckpt", max_epochs=2, dm=bigger)
    seen = sorted(i for batch, _ in resumed.steps for i in batch)
    assert seen == list(range(N + 8))  # the next epoch, every sample of the new data once


# ------------------------------------------------------------------------- sequences of stops and resumes
@pytest.mark.parametrize("saver", ["lightning", "ours"])
def test_resumed_remainder_shorter_than_the_save_interval_ends_cleanly(tmp_path, full, saver):
    # Resumed without max_steps from a mid-epoch last.ckpt, the run ends before its first periodic save:
    # save_last then writes last.ckpt at the end of training, after Lightning's epoch advanced.
    e = _steps_per_epoch()
    cls = ModelCheckpoint if saver == "lightning" else LastStateCheckpoint
    kw = dict(filename="{step}", save_top_k=-1, every_n_train_steps=1000, save_last=True)
    first = _fit(tmp_path, callbacks=[LastStateCheckpoint(dirpath=tmp_path / "a", **kw)], max_steps=e // 2)
    second = _fit(tmp_path, callbacks=[cls(dirpath=tmp_path / "b", **kw)], ckpt_path=tmp_path / "a/last.ckpt",
                  max_epochs=3)
    assert first.steps + second.steps == full[: 2 * e]
    last = torch.load(tmp_path / "b/last.ckpt", weights_only=False)
    assert last["global_step"] == 2 * e
    third = _fit(tmp_path, ckpt_path=tmp_path / "b/last.ckpt", max_epochs=4)
    assert first.steps + second.steps + third.steps == full


def test_two_max_steps_stops_then_a_resume_without_max_steps(tmp_path, full):
    e = _steps_per_epoch()
    kw = dict(filename="{step}", save_top_k=-1, save_last=True)
    first = _fit(tmp_path, callbacks=[LastStateCheckpoint(dirpath=tmp_path / "a", **kw)], max_steps=e // 2)
    second = _fit(tmp_path, callbacks=[LastStateCheckpoint(dirpath=tmp_path / "b", **kw)],
                  ckpt_path=tmp_path / "a/last.ckpt", max_steps=e // 2 + 2)
    third = _fit(tmp_path, callbacks=[LastStateCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=3, **kw)],
                 ckpt_path=tmp_path / "b/last.ckpt", max_epochs=5)  # each max_steps stop counted an epoch
    assert first.steps + second.steps + third.steps == full
    for path in sorted((tmp_path / "c").glob("step=*.ckpt")):  # every periodic save resumes exactly
        k = torch.load(path, weights_only=False)["global_step"]
        again = _fit(tmp_path / path.stem, ckpt_path=path, max_steps=3 * e)
        assert again.steps == full[k:], path.name


def test_a_sampler_state_of_another_epoch_is_refused(tmp_path, mid_epoch_ckpt):
    for delta in (1, 2):
        ckpt = _edited(mid_epoch_ckpt, tmp_path, lambda c, d=delta: _sampler_state(c).update(epoch=d))
        _refused(tmp_path, ckpt, f"the sampler state is for epoch {delta} but the checkpoint's loop is in epoch 0")
