"""LightningDataModule that feeds a dataset through the adaptive bucket batch sampler.

Resume: the DataModule's ``state_dict`` (saved by Lightning in every checkpoint) carries the
sampler state with the number of training batches actually processed in the epoch, read from the
Trainer's loop progress at save time. DataLoader workers fetch indices ahead of training, so the
sampler's own count would skip prefetched-but-untrained batches on resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from lightning_adaptiveload.bucketing.policy import BatchSizePolicy, CostPredictor
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler


def _default_collate() -> Callable[[list[dict]], dict]:
    from lightning_adaptiveload.data.collate import collate_batch

    return collate_batch


class AdaptiveLoadDataModule(pl.LightningDataModule):
    """Dataset + batch-size policy + :class:`AdaptiveBucketBatchSampler`, with exact mid-epoch resume.

    The sampler is built in :meth:`train_dataloader` with the rank and world size of the Trainer,
    so every rank plans the same epoch and takes its own batches.

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
        cost_model: ``predict(B, S)`` model used to balance steps.
        collate_fn: defaults to ``lightning_adaptiveload.data.collate.collate_batch``.
        persistent_workers: DataLoader ``persistent_workers`` (with ``num_workers > 0``).
        prefetch_factor: DataLoader ``prefetch_factor`` (with ``num_workers > 0``).

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
    ) -> None:
        super().__init__()
        if not callable(getattr(dataset, "token_grids", None)):
            raise ValueError(
                f"`AdaptiveLoadDataModule(dataset={type(dataset).__name__})` is not valid. The dataset must "
                "implement `token_grids() -> int64 [N, 3]` (token grid per sample, from metadata)."
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"`AdaptiveLoadDataModule(num_workers={num_workers!r})` is not valid. "
                "Expected a non-negative integer."
            )
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
        self._shapes: np.ndarray | None = None
        self.sampler: AdaptiveBucketBatchSampler | None = None
        self._pending_state: dict[str, Any] | None = None
        self._iterated = False
        # A probe sampler validates settings (oversize samples, bad grids) up front and serves
        # `bucket_table()` before the Trainer exists.
        self._probe = AdaptiveBucketBatchSampler(
            self.shapes,
            policy,
            balance=balance,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
            cost_model=cost_model,
        )

    @property
    def shapes(self) -> np.ndarray:
        """The dataset's token grids ``[N, 3]`` (read once)."""
        if self._shapes is None:
            self._shapes = np.asarray(self.dataset.token_grids(), dtype=np.int64)
        return self._shapes

    # ------------------------------------------------------------------ policy
    def set_policy(self, policy: BatchSizePolicy) -> None:
        """Replace the batch-size policy before the first training epoch (the plan is rebuilt).

        Raises:
            RuntimeError: training batches were already drawn with the old policy.
        """
        self._check_mutable("set_policy")
        self._probe.set_policy(policy)
        self.policy = policy
        if self.sampler is not None:
            self.sampler.set_policy(policy)

    def set_cost_model(self, cost_model: CostPredictor | None) -> None:
        """Replace the cost model used to balance steps, before the first training epoch."""
        self._check_mutable("set_cost_model")
        self.cost_model = cost_model
        self._probe.set_cost_model(cost_model)
        if self.sampler is not None:
            self.sampler.set_cost_model(cost_model)

    def _check_mutable(self, what: str) -> None:
        if self._iterated:
            raise RuntimeError(
                f"`AdaptiveLoadDataModule.{what}` was called after training batches were drawn; the epoch "
                "plan cannot change mid-epoch. Call it before the first training epoch (e.g. in `on_fit_start`)."
            )

    def bucket_table(self) -> list[dict[str, Any]]:
        """Distinct token grids with sample counts and the batch size the current policy gives each."""
        return self._probe.bucket_table()

    # ------------------------------------------------------------------ Lightning hooks
    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return int(trainer.world_size), int(trainer.global_rank)

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

    def make_sampler(self, num_replicas: int = 1, rank: int = 0) -> AdaptiveBucketBatchSampler:
        """A batch sampler with this DataModule's dataset shapes, policy and settings."""
        return AdaptiveBucketBatchSampler(
            self.shapes,
            self.policy,
            num_replicas=num_replicas,
            rank=rank,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            balance=self.balance,
            cost_model=self.cost_model,
        )

    def train_dataloader(self) -> DataLoader:
        self._check_trainer()
        world_size, rank = self._world()
        sampler = self.make_sampler(world_size, rank)
        trainer = self.trainer
        if trainer is not None:
            sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
        if self._pending_state is not None and self._pending_state.get("epoch") == sampler.epoch:
            sampler.load_state_dict(self._pending_state)
        self.sampler = sampler
        if sampler.epoch == 0 and not sampler._segments and sampler._offset == 0:
            rank_zero_info(sampler.report())
        return _AdaptiveLoadDataLoader(
            self.dataset,
            batch_sampler=_TrackedBatchSampler(sampler, self),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            collate_fn=self.collate_fn or _default_collate(),
            persistent_workers=self.persistent_workers and self.num_workers > 0,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
        )

    # ------------------------------------------------------------------ state
    def _steps_taken(self) -> int | None:
        trainer = self.trainer
        if trainer is None:
            return None
        # `processed` counts batches whose training step ran; `completed` lags by one while
        # `on_train_batch_end` (where step checkpoints are saved) runs.
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    def state_dict(self) -> dict[str, Any]:
        if self.sampler is None:
            return {"sampler": self._pending_state} if self._pending_state is not None else {}
        return {"sampler": self.sampler.state_dict(steps_taken=self._steps_taken())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("sampler")
        self._pending_state = state
        if state is None or self.sampler is None:
            return
        # The loader already exists: the Trainer built it before restoring (a strategy that restores
        # after setup, with `estimated_stepping_batches` read in `configure_optimizers`; cf. Lightning
        # #20550) and may have prefetched from the unrestored plan. Load the state and make the fit loop
        # build the loader again so the iterator and its length follow the restored plan.
        if state.get("epoch") == self.sampler.epoch:
            self.sampler.load_state_dict(state)
        trainer = self.trainer
        if trainer is not None and getattr(trainer.fit_loop, "_combined_loader", None) is not None:
            trainer.fit_loop._combined_loader = None


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
    ``loader.batch_sampler.sampler``) sets the epoch every epoch.
    """

    def __init__(self, sampler: AdaptiveBucketBatchSampler, datamodule: AdaptiveLoadDataModule) -> None:
        self.batch_sampler = sampler
        self.sampler = sampler.sampler
        self._datamodule = datamodule

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        for batch in self.batch_sampler:
            self._datamodule._iterated = True
            yield batch
