"""Create the Ulysses sequence-parallel process groups at setup and hand them to the LightningModule.

A hook adapter over :mod:`lightning_adaptiveload.parallel.ulysses`: the groups, the degree rule and
the exchanges live there; this callback only creates them on every rank at the same point of
``fit`` and sets ``pl_module.sequence_parallel``.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_adaptiveload.parallel.ulysses import UlyssesGroups, allowed_sp_degrees, check_sp_degree


def _num_heads(pl_module: LightningModule) -> int:
    heads = getattr(pl_module, "num_heads", None)
    if heads is None:
        heads = getattr(getattr(pl_module, "config", None), "num_heads", None)
    if heads is None:
        raise MisconfigurationException(
            f"`UlyssesSequenceParallel` needs the number of attention heads of `{type(pl_module).__name__}`: "
            "give it a `num_heads` attribute or a `config.num_heads` (FlowMatchingModule has the latter)."
        )
    return int(heads)


class UlyssesSequenceParallel(Callback):
    """Creates the sequence-parallel groups of the degrees a run may use and sets ``pl_module.sequence_parallel``.

    Batches whose ``batch["sp_degree"]`` is k > 1 then run Ulysses sequence parallelism over the k
    consecutive ranks that received them (see
    :class:`~lightning_adaptiveload.models.FlowMatchingModule`). Creating a process group is
    collective, so all groups are created in ``setup``, on every rank, before the first batch.

    Args:
        degrees: the degrees (> 1) the batch sampler may plan; ``None``: every degree allowed for the
            model's heads and the ranks per node (:func:`~lightning_adaptiveload.parallel.ulysses.
            allowed_sp_degrees`). Each up to ``trainer.world_size`` is checked in ``setup`` against the
            heads, ``trainer.num_devices`` (ranks per node) and the world size; larger ones are skipped,
            as the planner skips them. ``adaptiveload-train`` adds this callback itself, with
            ``data.sequence_parallel.degrees``, when ``data.sequence_parallel.enabled=true``.

    Raises:
        ValueError: in ``__init__``, ``degrees`` holds a non-integer or a value < 1; in ``setup``, a
            degree does not divide the heads or the ranks per node.
        MisconfigurationException: the module has no ``sequence_parallel`` attribute to receive the
            groups, or no number of heads.

    Example::

        trainer = Trainer(devices=8, strategy="ddp", callbacks=[UlyssesSequenceParallel(degrees=[2, 4])])
    """

    def __init__(self, degrees: Iterable[int] | None = None) -> None:
        if degrees is not None:
            degrees = tuple(degrees)
            if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in degrees):
                raise ValueError(
                    f"`UlyssesSequenceParallel(degrees={degrees!r})` is not valid. Expected positive integers."
                )
        self.degrees = degrees
        self.groups: UlyssesGroups | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "sequence_parallel"):
            raise MisconfigurationException(
                f"`UlyssesSequenceParallel` sets `{type(pl_module).__name__}.sequence_parallel`, which the module "
                "does not have: its step must read the groups from there (as FlowMatchingModule does)."
            )
        heads, per_node, world = _num_heads(pl_module), trainer.num_devices, trainer.world_size
        if self.degrees is None:
            degrees = allowed_sp_degrees(heads, per_node)
        else:
            # Degrees above the world size are never planned (SequenceParallelConfig.usable_degrees).
            degrees = [check_sp_degree(k, heads, per_node, world) for k in self.degrees if k <= world]
        if self.groups is None and any(k > 1 for k in degrees):
            self.groups = UlyssesGroups(degrees, heads, per_node)
            rank_zero_info(f"Sequence parallelism: {self.groups}, {heads} heads, {per_node} ranks per node.")
        pl_module.sequence_parallel = self.groups
