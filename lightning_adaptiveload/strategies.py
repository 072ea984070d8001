"""Strategy factories that Hydra configs can instantiate from plain strings and numbers."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, Strategy


def auto_strategy() -> str:
    """Let Lightning pick (single device, or DDP when several devices are asked for)."""
    return "auto"


def ddp_strategy(find_unused_parameters: bool = False, **kwargs: Any) -> Strategy:
    """DDP with the gradient-bucket view option that avoids a copy of every gradient."""
    return DDPStrategy(find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=True, **kwargs)


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
