"""Strategy factories that Hydra configs can instantiate from plain strings and numbers."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from typing_extensions import override

from lightning_adaptiveload.parallel.fsdp import build_fsdp_mesh, check_shard_size


class SameStreamDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy``, with the model wrapped on the current CUDA stream.

    Lightning (2.6.6, the newest release) builds ``DistributedDataParallel`` under a new CUDA stream, which
    only whole-network CUDA-graph capture needs. DDP's reducer then keeps the parameters' ``AccumulateGrad``
    nodes on that stream, so every backward warns "The AccumulateGrad node's stream does not match ..." and
    synchronises the two streams for each parameter (Lightning-AI/pytorch-lightning#21567, fixed upstream by
    #21746, not yet released). Until a release has the fix, this wraps the model as plain PyTorch does. On one
    H200 both trained the mixed 480p+720p corpus at the same speed (docs/benchmarks.md §0); multi-GPU is not
    measured.
    """

    @override
    def _setup_model(self, model: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)


def ddp_strategy(find_unused_parameters: bool = False, **kwargs: Any) -> Strategy:
    """DDP with the gradient-bucket view option that avoids a copy of every gradient, its model wrapped on the
    current CUDA stream (:class:`SameStreamDDPStrategy`)."""
    return SameStreamDDPStrategy(find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=True,
                                 **kwargs)


def fsdp_strategy(
    sharding_strategy: str = "FULL_SHARD",
    state_dict_type: str = "full",
    limit_all_gathers: bool = True,
    **kwargs: Any,
) -> Strategy:
    """FSDP wrapping every Wan transformer block (the unit that is all-gathered and freed).

    Activation checkpointing is the model's own switch (``model.activation_checkpointing=true``),
    which works the same under FSDP, DDP and one device; setting it here as well would recompute
    every block twice.

    Args:
        sharding_strategy: ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``HYBRID_SHARD`` (multi-node) or ``NO_SHARD``.
        state_dict_type: ``full`` (one file, gathered on rank 0) or ``sharded`` (one file per rank).
        limit_all_gathers: rate-limit all-gathers so prefetching cannot exhaust memory.
    """
    from lightning_adaptiveload.models.wan import WanAttentionBlock

    valid = {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"}
    if sharding_strategy not in valid:
        raise ValueError(
            f"`fsdp_strategy(sharding_strategy={sharding_strategy!r})` is not valid. Expected one of {sorted(valid)}."
        )
    return FSDPStrategy(
        auto_wrap_policy={WanAttentionBlock},
        sharding_strategy=sharding_strategy,
        state_dict_type=state_dict_type,
        limit_all_gathers=limit_all_gathers,
        **kwargs,
    )


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with an FSDP (``("shard",)``) or HSDP (``("replicate", "shard")``) mesh.

    ``ModelParallelStrategy`` names its mesh ``("data_parallel", "tensor_parallel")``; HSDP's dims are
    replicate and shard, and every rank reads its own data (the batch sampler is rank-aware), so this
    subclass builds the mesh of :func:`~lightning_adaptiveload.parallel.fsdp.build_fsdp_mesh` instead
    and reports all ranks as data-parallel replicas. The module's ``configure_model`` shards the
    model over ``self.device_mesh``; checkpoints are distributed-checkpoint directories (one file
    per rank) unless ``save_distributed_checkpoint=False``.

    Args:
        shard_size: ranks one model copy is sharded over; ``None`` shards over all ranks (FSDP), the
            GPUs of a node give HSDP (replicate across nodes). Must divide the world size.
        **kwargs: ``ModelParallelStrategy`` arguments (``save_distributed_checkpoint``, ``timeout``, ...).

    Raises:
        ValueError: ``shard_size`` is not a positive integer (at construction) or does not divide
            the world size (when the processes start, before the model is built).
    """

    def __init__(self, shard_size: int | None = None, **kwargs: Any) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size"):
            if name in kwargs:
                raise TypeError(f"`FSDP2Strategy({name}=...)` is not an argument; the mesh is set by `shard_size`.")
        # Its type and sign now; whether it divides the world size once the processes start.
        check_shard_size(1 if shard_size is None else shard_size, shard_size)
        super().__init__(**kwargs)
        self.shard_size = shard_size

    @override
    def setup_environment(self) -> None:
        # ModelParallelStrategy.setup_environment with our mesh in place of its (dp, tp) one.
        self._setup_distributed()
        device_type = self.root_device.type
        self._device_mesh = build_fsdp_mesh(self.world_size, self.shard_size, device_type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


def fsdp2_strategy(shard_size: int | None = None, save_distributed_checkpoint: bool = True, **kwargs: Any) -> Strategy:
    """FSDP2 (``shard_size=None``) or HSDP (``shard_size`` = GPUs per node); see :class:`FSDP2Strategy`."""
    return FSDP2Strategy(shard_size=shard_size, save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
