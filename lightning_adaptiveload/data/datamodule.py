"""LightningDataModule that feeds a dataset through the adaptive bucket batch sampler.

Resume: the DataModule's ``state_dict`` (saved by Lightning in every checkpoint) carries the
sampler state with the number of batches of the sampler's epoch actually trained. The DataModule
counts them itself, as they reach the device in training (``on_after_batch_transfer``), less a batch
still in its step; DataLoader workers fetch indices ahead of training, so the sampler's own count
would skip prefetched-but-untrained batches on resume, and Lightning's batch counter restarts with
Lightning's epochs, which are not always the sampler's (below). The state also records the loop's
position (``loop``: Lightning's epochs and batches processed, the sampler's epoch) so that a sampler
state is resumed only with the loop it was saved with.

The sampler's epoch is not always Lightning's: ``last.ckpt`` saved when ``max_steps`` stops a run
part-way through an epoch is written in ``on_train_epoch_end``, after the fit loop counted the epoch
as processed, and a resume from it continues that epoch under the next epoch number. So the epoch
to plan comes from the sampler state (its epoch, or the next one when the state's epoch was
finished), and Lightning's later epochs map onto the sampler's with the offset found at the restore.
The length of every epoch is given to Lightning's loop as the sampler plans it (`_sync_epoch_length`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_adaptiveload.bucketing.policy import BatchSizePolicy, CostPredictor
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler
from lightning_adaptiveload.calibration.sequence_parallel import SequenceParallelCostModel
from lightning_adaptiveload.data.sequence_parallel import (
    SequenceParallelCollate,
    sequence_parallel_from_config,
)
from lightning_adaptiveload.models.protocol import check_batch_against_plan
from lightning_adaptiveload.reporting import print_bucket_plan

# The first real batches of a fit are checked against the planned token grid (cheap, and the first
# batch already shows a patch size or crop that disagrees with the dataset's metadata).
_FIRST_BATCH_CHECKS = 3


def _default_collate() -> Callable[[list[dict]], dict]:
    from lightning_adaptiveload.data.collate import collate_batch

    return collate_batch


class AdaptiveLoadDataModule(pl.LightningDataModule):
    """Dataset + batch-size policy + :class:`AdaptiveBucketBatchSampler`, with exact mid-epoch resume.

    One sampler is built per (world size, rank) — lazily, the first time it is needed, with the
    Trainer's rank and world size — so every rank plans the same epoch once and takes its own
    batches. The policy given here may be a placeholder that a
    :class:`~lightning_adaptiveload.callbacks.shape_benchmark.ShapeBenchmarkCallback` replaces: it is
    checked against the data only when the sampler is built. When the train loader is built, rank 0
    prints the bucket plan that will be trained (once per fit).

    The sampler is rank-aware itself, so Lightning must not wrap it in a ``DistributedSampler``:
    distributed runs need ``Trainer(use_distributed_sampler=False)``; :meth:`setup` raises a clear
    error otherwise (single-device runs work with the Trainer's defaults).

    Args:
        dataset: implements ``__len__``, ``token_grids() -> int64 [N, 3]`` and ``__getitem__``.
        policy: batch-size policy (``DualConstraintPolicy``, ``EqualTokenPolicy``, ``CostModelPolicy``).
        balance: ``"cost"`` (default) or ``"none"``; see the sampler.
        seed: plan seed (the same on every rank).
        shuffle: shuffle within buckets and the order of steps.
        drop_last: drop (counted) instead of padding (counted) to keep ranks even.
        num_workers: DataLoader workers.
        pin_memory: DataLoader ``pin_memory``.
        cost_model: ``predict(B, S)`` model used to balance steps (the shape benchmark sets its fit).
        collate_fn: defaults to ``lightning_adaptiveload.data.collate.collate_batch``.
        persistent_workers: DataLoader ``persistent_workers`` (with ``num_workers > 0``).
        prefetch_factor: DataLoader ``prefetch_factor`` (with ``num_workers > 0``).
        print_plan: print the bucket plan when the train loader is built.
        sequence_parallel: per-bucket Ulysses sequence parallelism (``data.sequence_parallel``: see
            :func:`~lightning_adaptiveload.data.sequence_parallel.sequence_parallel_from_config`), or
            ``None``. When enabled every training batch carries ``batch["sp_degree"]`` (an int; 1: data
            parallel) and the k ranks of an SP group get the same batch at the same step.
        allow_unverified_resume: resume mid-epoch from a sampler state without the ``shapes`` /
            ``fingerprint`` fields (written by an older release). Such a state cannot show that the
            dataset, seed and policy are those it was saved with; resumed on changed ones it silently
            skips and repeats samples, so it is refused unless this is ``True``.

    Raises:
        ValueError: on resume, when the checkpoint's sampler state is unusable: missing while the
            checkpoint is mid-epoch, not a dict, from another dataset, seed or policy, or at another
            step than the Trainer's loop. The message names the checkpoint, the field and both values.

    Attributes:
        policy: the batch-size policy in use.
        cost_model: the cost model the sampler balances on (``None``: ``B·S^p``).

    Example::

        dm = AdaptiveLoadDataModule(SyntheticMixedDataset(10_000, get_mixture("wan_480p")),
                                    DualConstraintPolicy(65_520, 32_760**2, 2.0))
        trainer = Trainer(strategy="ddp", devices=8, use_distributed_sampler=False)
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        dataset: Dataset,
        policy: BatchSizePolicy,
        *,
        balance: str = "cost",
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        cost_model: CostPredictor | None = None,
        collate_fn: Callable[[list[dict]], dict] | None = None,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        print_plan: bool = True,
        sequence_parallel: dict[str, Any] | None = None,
        allow_unverified_resume: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        # Checked here, before any training: a degree the heads or the node do not allow is a config error.
        self.sp_config, self.sp_comm, sp_patch = sequence_parallel_from_config(sequence_parallel)
        self.sp_patch_size = sp_patch or getattr(dataset, "patch_size", None)
        if self.sp_config is not None and self.sp_patch_size is None:
            raise ValueError(
                f"`{name}(sequence_parallel=...)` needs the model's patch size to tell each batch's SP degree: set "
                "`sequence_parallel.patch_size` (or give the dataset a `patch_size`)."
            )
        if not callable(getattr(dataset, "token_grids", None)):
            raise ValueError(
                f"`{name}(dataset={type(dataset).__name__})` is not valid. The dataset must "
                "implement `token_grids() -> int64 [N, 3]` (token grid per sample, from metadata)."
            )
        if not callable(getattr(policy, "batch_sizes", None)):
            raise ValueError(f"`{name}(policy={policy!r})` is not valid. Expected a BatchSizePolicy.")
        if balance not in ("cost", "none"):
            raise ValueError(f"`{name}(balance={balance!r})` is not valid. Expected 'cost' or 'none'.")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"`{name}(num_workers={num_workers!r})` is not valid. Expected a non-negative integer.")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"`{name}(seed={seed!r})` is not valid. Expected a non-negative integer.")
        self.dataset = dataset
        self.policy = policy
        self.balance = balance
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.cost_model = cost_model
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.print_plan = print_plan
        self.allow_unverified_resume = bool(allow_unverified_resume)
        self._shapes: np.ndarray | None = None
        self._sampler: AdaptiveBucketBatchSampler | None = None
        self._pending_state: dict[str, Any] | None = None
        self._restored = False  # load_state_dict ran: the next train loader resumes from it
        # Lightning's epoch minus the sampler's (see the module docstring); `None` right after a restore,
        # until Lightning names the epoch it runs the restored sampler epoch under.
        self._epoch_offset: int | None = 0
        self._resume_epoch = 0
        self._empty_epoch = False  # the next train iteration yields nothing (see `_resume`)
        self._epoch_before = False  # the first epoch Lightning names after a restore is that empty one
        # [sampler epoch, batches of it that reached training]: the steps a checkpoint saves (`_steps_taken`).
        self._trained = [0, 0]
        self._pending_base = 0
        self._pending_loop: Any = None
        self._drawn = False
        self._printed = False
        # (token grid, batch size) the sampler planned for the first batches, checked on arrival.
        self._planned: deque[tuple[tuple[int, int, int], int]] = deque()
        self._checks_left = _FIRST_BATCH_CHECKS

    @property
    def shapes(self) -> np.ndarray:
        """The dataset's token grids ``[N, 3]`` (read once, kept in the dataset's integer dtype)."""
        if self._shapes is None:
            shapes = np.asarray(self.dataset.token_grids())
            self._shapes = shapes if shapes.dtype.kind in "iu" else shapes.astype(np.int64)
        return self._shapes

    # ------------------------------------------------------------------ policy
    def set_policy(self, policy: BatchSizePolicy) -> None:
        """Replace the batch-size policy before the first training epoch (the plan is rebuilt).

        Raises:
            RuntimeError: training batches were already drawn with the old policy.
        """
        self._check_mutable("set_policy")
        self.policy = policy
        if self._sampler is not None:
            self._sampler.set_policy(policy, self._sampler_cost_model())

    def set_cost_model(self, cost_model: CostPredictor | None) -> None:
        """Replace the cost model used to balance steps, before the first training epoch."""
        self._check_mutable("set_cost_model")
        self.cost_model = cost_model
        if self._sampler is not None:
            self._sampler.set_cost_model(self._sampler_cost_model())

    def replan(self, policy: BatchSizePolicy, cost_model: CostPredictor | None) -> int:
        """Train the rest of the current epoch, and every later one, with ``policy`` (e.g. a corrected
        calibration's); every rank calls it at the same training step.

        The new plan starts at the first step no rank has drawn yet (the largest drawn count over ranks:
        batches already prefetched train as planned), covers exactly the samples not planned before it,
        and is part of the sampler state, so a resume (on any world size) continues it. Lightning's count
        of the epoch's batches follows the new length. Returns that epoch step.

        Raises:
            ValueError: with sequence parallelism (not supported).
        """
        sampler = self.sampler
        at = sampler.drawn_steps
        trainer = self.trainer
        if trainer is not None and trainer.world_size > 1:
            drawn = torch.tensor(at, dtype=torch.int64, device=trainer.strategy.root_device)
            at = int(trainer.strategy.reduce(drawn, reduce_op="max"))
        self.policy, self.cost_model = policy, cost_model
        sampler.replan(policy, self._sampler_cost_model(), at)
        self._sync_epoch_length()
        return at

    def _check_mutable(self, what: str) -> None:
        if self._drawn:
            raise RuntimeError(
                f"`AdaptiveLoadDataModule.{what}` was called after training batches were drawn; the epoch "
                "plan cannot change mid-epoch. Call it before the first training epoch (e.g. in `on_fit_start`)."
            )

    # ------------------------------------------------------------------ the sampler
    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return int(trainer.world_size), int(trainer.global_rank)

    @property
    def sampler(self) -> AdaptiveBucketBatchSampler:
        """This rank's sampler (built on first use for the Trainer's world size and rank)."""
        world_size, rank = self._world()
        s = self._sampler
        if s is None or (s.num_replicas, s.rank) != (world_size, rank):
            s = self.make_sampler(world_size, rank)
            self._sampler = s
        return s

    def make_sampler(self, num_replicas: int = 1, rank: int = 0) -> AdaptiveBucketBatchSampler:
        """A new batch sampler with this DataModule's dataset shapes, policy and settings (e.g. to
        inspect the plan for another world size).

        Raises:
            OversizeSampleError: a sample is above the policy's memory budget; the message names the
                file when the dataset can (``dataset.sample_label(index)``).
        """
        return self._new_sampler(num_replicas, rank)

    def _sampler_cost_model(self) -> CostPredictor | None:
        """The cost model, extended with the all-to-all time when SP is on and its size is configured."""
        cm = self.cost_model
        if self.sp_comm is not None and cm is not None and not callable(getattr(cm, "predict_sp", None)):
            return SequenceParallelCostModel(cm, self.sp_comm)
        return cm

    def _new_sampler(self, num_replicas: int, rank: int) -> AdaptiveBucketBatchSampler:
        return AdaptiveBucketBatchSampler(
            self.shapes,
            self.policy,
            num_replicas=num_replicas,
            rank=rank,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            balance=self.balance,
            cost_model=self._sampler_cost_model(),
            sequence_parallel=self.sp_config,
            sample_label=getattr(self.dataset, "sample_label", None),
        )

    def bucket_table(self) -> list[dict[str, Any]]:
        """Distinct token grids with sample counts and the batch size the current policy gives each."""
        return self.sampler.bucket_table()

    # ------------------------------------------------------------------ Lightning hooks
    def _check_trainer(self) -> None:
        trainer = self.trainer
        if trainer is None or trainer.world_size <= 1:
            return
        connector = getattr(trainer, "_accelerator_connector", None)
        if getattr(connector, "use_distributed_sampler", False):
            raise RuntimeError(
                "AdaptiveLoadDataModule plans each rank's batches itself, but the Trainer would replace its "
                f"sampler with a DistributedSampler (world size {trainer.world_size}). Set "
                "`Trainer(use_distributed_sampler=False)`."
            )

    def setup(self, stage: str) -> None:
        self._check_trainer()
        if self.sp_config is not None and self.trainer is not None:
            self.sp_config.usable_degrees(int(self.trainer.world_size))  # ranks that do not tile nodes: error now
        self._printed = False
        if stage == "fit":
            # A new fit starts on Lightning's epochs; a checkpoint restored after this sets its own.
            self._restored, self._epoch_offset, self._empty_epoch = False, 0, False
            self._trained = [0, 0]
            self._planned.clear()
            self._checks_left = _FIRST_BATCH_CHECKS
            self._check_collate()

    def _check_collate(self) -> None:
        """Push one real sample through the collate function now, not after minutes of profiling."""
        if len(self.dataset) == 0:
            raise ValueError("`AdaptiveLoadDataModule`: the dataset is empty.")
        collate = self.collate_fn or _default_collate()
        sample = self.dataset[0]
        try:
            collate([sample])
        except Exception as err:
            keys = sorted(sample) if isinstance(sample, dict) else type(sample).__name__
            name = getattr(collate, "__qualname__", repr(collate))
            raise ValueError(
                f"`AdaptiveLoadDataModule`: the collate function `{name}` fails on dataset[0] (keys {keys}): "
                f"{type(err).__name__}: {err}. The default collate stacks `latents`, `context` and `index`; for "
                "other keys pass `AdaptiveLoadDataModule(..., collate_fn=my_collate)`."
            ) from err

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count the training batch (see `_steps_taken`) and compare the first ones with the token grids the
        sampler planned for them."""
        trainer = self.trainer
        if trainer is not None and trainer.training and self._sampler is not None:
            epoch = self._sampler.epoch
            self._trained = [epoch, self._trained[1] + 1 if self._trained[0] == epoch else 1]
        if self._planned and trainer is not None and trainer.training:
            grid, size = self._planned.popleft()
            module = trainer.lightning_module
            if callable(getattr(module, "batch_shape", None)):
                check_batch_against_plan(module, batch, grid, size)
        return batch

    def train_dataloader(self) -> DataLoader:
        self._check_trainer()
        sampler = self.sampler
        trainer = self.trainer
        if trainer is not None:
            if self._restored or (getattr(trainer, "ckpt_path", None) is not None and _mid_epoch(trainer)):
                self._restored = False
                self._resume(sampler, trainer)
            elif self._epoch_offset is not None:
                sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed - self._epoch_offset)
        if self.print_plan and not self._printed:
            print_bucket_plan(sampler)
            self._printed = True
        collate = self.collate_fn or _default_collate()
        if self.sp_config is not None:
            collate = SequenceParallelCollate(collate, sampler.degree_by_grid(), self.sp_patch_size)
        return _AdaptiveLoadDataLoader(
            self.dataset,
            batch_sampler=_TrackedBatchSampler(sampler, self),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            collate_fn=collate,
            persistent_workers=self.persistent_workers and self.num_workers > 0,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
        )

    # ------------------------------------------------------------------ state
    def _steps_taken(self) -> int | None:
        """Batches of the sampler's epoch trained so far: those counted on arrival in training, less one
        still in its step (Lightning's ``ready`` counts a batch once it is on the device, ``processed`` once
        its step ran; a step checkpoint in ``on_train_batch_end`` sees them equal)."""
        trainer, sampler = self.trainer, self._sampler
        if trainer is None or sampler is None:
            return None
        epoch, count = self._trained
        if epoch != sampler.epoch:
            return 0
        batches = trainer.fit_loop.epoch_loop.batch_progress.current
        return count - max(0, min(1, int(batches.ready) - int(batches.processed)))

    def _loop_position(self) -> dict[str, int]:
        trainer = self.trainer
        return {"epochs": int(trainer.fit_loop.epoch_progress.current.processed),
                "batches": int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)}

    def state_dict(self) -> dict[str, Any]:
        if self._sampler is None:
            return {"sampler": self._pending_state} if self._pending_state is not None else {}
        out: dict[str, Any] = {"sampler": self._sampler.state_dict(steps_taken=self._steps_taken())}
        if self.trainer is not None:
            state = out["sampler"]
            out["loop"] = {**self._loop_position(), "sampler_epoch": self._sampler.epoch,
                           "sampler_steps": state.get("position", sum(seg[1] for seg in state["segments"]))}
        return out

    def _where(self) -> str:
        ckpt = getattr(self.trainer, "ckpt_path", None) if self.trainer is not None else None
        return f"checkpoint {ckpt}" if ckpt else "the restored checkpoint"

    def _field(self) -> str:
        return f'["{type(self).__qualname__}"]["sampler"]'

    def _resume(self, sampler: AdaptiveBucketBatchSampler, trainer: pl.Trainer) -> None:
        """Put the sampler where the restored fit loop continues: mid-epoch at the step it trained to,
        or at the start of the next epoch. Anything else is an error, never a silent restart of the plan."""
        state, self._pending_state = self._pending_state, None
        trained = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        mid_epoch = _mid_epoch(trainer)
        where = self._where()
        if state is None:
            if mid_epoch:
                raise ValueError(
                    f"Cannot resume the data order from {where}: it was saved mid-epoch ({trained} batches into the "
                    f"epoch) but has no sampler state ({self._field()}), so the batches already trained cannot be "
                    "told apart from the rest. Resume from a checkpoint written with this DataModule, or from an "
                    "end-of-epoch checkpoint."
                )
            # No state at an epoch boundary (e.g. written without this DataModule): Lightning's epoch.
            self._epoch_offset = 0
            sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
            return
        epoch = state.get("epoch")
        segments = state.get("segments")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"Cannot resume the data order from {where}: the sampler state has epoch={epoch!r}; "
                             "expected an integer >= 0.")
        try:
            taken = int(state["position"]) if "position" in state else sum(int(seg[1]) for seg in segments)
        except (TypeError, ValueError, IndexError, KeyError):
            raise ValueError(f"Cannot resume the data order from {where}: the sampler state has segments={segments!r}; "
                             "expected a non-empty list of [ranks, steps].") from None
        missed, self._pending_base = self._pending_base, 0
        loop, self._pending_loop = self._pending_loop, None
        if loop is not None:
            self._check_loop(loop, epoch, taken, where)
        elif taken != trained + missed:  # a checkpoint of an earlier release: its steps were Lightning's count
            counted = f"{trained} batches of its epoch" + (f" after {missed} it did not count" if missed else "")
            raise ValueError(
                f"Cannot resume the data order from {where}: the sampler state has {taken} steps taken in epoch {epoch} "
                f"but the checkpoint's loop trained {counted}; the state does not belong to this checkpoint."
            )
        self._empty_epoch = False
        if mid_epoch:
            self._load_sampler_state(sampler, state)
            if len(sampler) > sampler.steps_taken:
                self._resume_epoch = epoch
                self._trained = [epoch, taken]
            else:  # the restored plan is exhausted: the next epoch starts
                sampler.set_epoch(epoch + 1)
                self._resume_epoch = epoch + 1
        else:
            # At an epoch boundary nothing already seen needs reconstructing: the next epoch is planned
            # from the data and settings of this run (which may differ from the checkpoint's).
            self._resume_epoch = epoch + 1 if trained else epoch
            sampler.set_epoch(self._resume_epoch)
            epochs = trainer.fit_loop.epoch_progress.current
            # A checkpoint written in on_train_epoch_end of a finished epoch, resumed with `max_steps`:
            # Lightning restarts that epoch after its last batch and (waiting for a validation that never
            # runs) trains one more batch in it. That batch would be the next epoch's first, trained under
            # the wrong epoch; an empty iteration ends Lightning's epoch where the run without a restart did.
            self._empty_epoch = bool(trained and trainer.fit_loop.restarting and epochs.processed == epochs.started)
        # Found when Lightning names the epoch it runs the resumed one under; the empty epoch (whose
        # iteration may already have run, in the workers' prefetch) runs under the one before.
        self._epoch_offset, self._epoch_before = None, self._empty_epoch

    def _check_loop(self, loop: Any, epoch: int, taken: int, where: str) -> None:
        """The sampler state resumes only with the loop position it was saved with."""
        if not isinstance(loop, dict):
            raise ValueError(f"Cannot resume the data order from {where}: its DataModule state has loop={loop!r}; "
                             "expected a dict. The checkpoint is damaged; resume from another.")
        if loop.get("sampler_epoch") != epoch:
            raise ValueError(
                f"Cannot resume the data order from {where}: the sampler state is for epoch {epoch} but the "
                f"checkpoint's loop is in epoch {loop.get('sampler_epoch')!r} of the sampler; the sampler state does "
                "not belong to this checkpoint. Resume from another checkpoint.")
        if loop.get("sampler_steps") != taken:
            raise ValueError(
                f"Cannot resume the data order from {where}: the sampler state has {taken} steps taken in epoch "
                f"{epoch} but was saved with {loop.get('sampler_steps')!r}; the sampler state does not belong to this "
                "checkpoint. Resume from another checkpoint.")
        now = self._loop_position()
        differ = [f"{k}: saved {loop.get(k)!r}, restored {v}" for k, v in now.items() if loop.get(k) != v]
        if differ:
            raise ValueError(
                f"Cannot resume the data order from {where}: its DataModule state was saved at another point of the "
                f"fit loop than the checkpoint's loop ({'; '.join(differ)}); the sampler state does not belong to "
                "this checkpoint. Resume from another checkpoint.")

    def _set_trainer_epoch(self, epoch: int) -> None:
        """Lightning's ``set_epoch`` (every epoch, on the loader): its epoch mapped onto the sampler's."""
        if self._epoch_offset is None:
            # The first epoch after a restore: the sampler is where `_resume` put it. An empty epoch runs
            # under the Lightning epoch before the one that maps to it.
            self._epoch_offset = int(epoch) + int(self._epoch_before) - self._resume_epoch
            return
        self.sampler.set_epoch(int(epoch) - self._epoch_offset)
        self._sync_epoch_length()

    def _sync_epoch_length(self) -> None:
        """Give Lightning's fit loop the sampler's number of batches for the epoch it runs now.

        Lightning reads a loader's length once, when it builds the loader (again only with
        ``reload_dataloaders_every_n_epochs``), and ends every later epoch after that many batches. The
        sampler's epochs differ in length after a resume on another number of ranks (the resumed epoch
        holds the steps taken before it plus a plan for the new world size) and after a re-plan, so the
        loop's count is set here from the sampler: ``limit_train_batches`` applied as Lightning applies it
        (its ``_parse_num_batches``), the combined loader's limit, the fetcher's end and the validation
        interval. Lightning has no public setter for these; they are the attributes its ``setup_data`` sets.
        """
        trainer, sampler = self.trainer, self._sampler
        loop = getattr(trainer, "fit_loop", None)
        combined = getattr(loop, "_combined_loader", None)
        if sampler is None or combined is None or len(combined.flattened) != 1:
            return
        from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
        from lightning.pytorch.trainer.states import RunningStage

        batches = _parse_num_batches(RunningStage.TRAINING, len(sampler), trainer.limit_train_batches)
        if loop.max_batches == batches:
            return
        combined.limits = [batches]
        loop.max_batches = batches
        fetcher = getattr(loop, "_data_fetcher", None)
        if fetcher is not None and fetcher.length is not None:
            fetcher.length = batches
            fetcher.done = fetcher.fetched >= batches
        interval = trainer.val_check_interval
        if isinstance(interval, float) and getattr(trainer, "_val_check_time_interval", None) is None:
            trainer.val_check_batch = max(1, int(batches * interval))

    def _load_sampler_state(self, sampler: AdaptiveBucketBatchSampler, state: dict[str, Any]) -> None:
        try:
            sampler.load_state_dict(state, allow_unverified=self.allow_unverified_resume)
        except ValueError as err:
            message = str(err).replace("`allow_unverified_resume=True`",
                                       f"`{type(self).__name__}(allow_unverified_resume=True)`")
            raise ValueError(f"Cannot resume the data order from {self._where()}: {message}") from err

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise ValueError(
                f"Cannot resume the data order from {self._where()}: its DataModule state "
                f'["{type(self).__qualname__}"] is a {type(state_dict).__name__}, not a dict. The file is not a '
                "checkpoint of this DataModule; resume from another checkpoint."
            )
        state = state_dict.get("sampler")
        if state is not None and not isinstance(state, dict):
            raise ValueError(
                f"Cannot resume the data order from {self._where()}: its sampler state {self._field()} is a "
                f"{type(state).__name__}, not a dict. The checkpoint is damaged or not from this DataModule; "
                "resume from another checkpoint."
            )
        missed = state_dict.get("uncounted_steps", 0)
        if isinstance(missed, bool) or not isinstance(missed, int) or missed < 0:
            raise ValueError(
                f"Cannot resume the data order from {self._where()}: its DataModule state has "
                f"uncounted_steps={missed!r}; expected an integer >= 0. The checkpoint is damaged; resume from another."
            )
        self._pending_state, self._pending_base = state, missed
        self._pending_loop = state_dict.get("loop")
        self._restored = True
        # The loader may already exist: the Trainer built it before restoring (a strategy that restores
        # after setup, with `estimated_stepping_batches` read in `configure_optimizers`; cf. Lightning
        # #20550) and may have prefetched from the unrestored plan. Make the fit loop build the loader
        # again so the iterator and its length follow the restored plan.
        trainer = self.trainer
        if trainer is not None and getattr(trainer.fit_loop, "_combined_loader", None) is not None:
            trainer.fit_loop._combined_loader = None


def _mid_epoch(trainer: pl.Trainer) -> bool:
    """The fit loop (as restored) continues an epoch part-way: some of its batches trained, not the last."""
    batches = trainer.fit_loop.epoch_loop.batch_progress
    return batches.current.processed > 0 and not batches.is_last_batch


class _AdaptiveLoadDataLoader(DataLoader):
    """A DataLoader that Lightning treats as resumable.

    Its resume state lives in :meth:`AdaptiveLoadDataModule.state_dict` (which knows the steps
    actually trained); the loader's own state is empty. Without these methods Lightning warns on
    every mid-epoch resume that the loader is "not resumable".
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the DataModule restores the sampler."""


class _TrackedBatchSampler:
    """Wraps the sampler for the DataLoader: marks the DataModule as iterated (policy now frozen).

    ``sampler`` is exposed so Lightning's ``_set_sampler_epoch`` (which looks at
    ``loader.batch_sampler.sampler``) sets the epoch every epoch, through the DataModule's epoch map.
    """

    def __init__(self, sampler: AdaptiveBucketBatchSampler, datamodule: AdaptiveLoadDataModule) -> None:
        self.batch_sampler = sampler
        self.sampler = _EpochMap(datamodule)
        self._datamodule = datamodule

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        dm = self._datamodule
        if dm._empty_epoch:
            dm._empty_epoch = False
            return
        shapes = dm.shapes
        for batch in self.batch_sampler:
            dm._drawn = True
            if dm._checks_left > 0:
                dm._checks_left -= 1
                dm._planned.append((tuple(int(v) for v in shapes[batch[0]]), len(batch)))
            yield batch


class _EpochMap:
    """Lightning's ``set_epoch`` target: forwards its epoch to the DataModule, which maps it onto the sampler's."""

    def __init__(self, datamodule: AdaptiveLoadDataModule) -> None:
        self._datamodule = datamodule

    def set_epoch(self, epoch: int) -> None:
        self._datamodule._set_trainer_epoch(epoch)
