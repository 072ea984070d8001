"""Wan 2.1 DiT and its flow-matching LightningModule."""

from lightning_adaptiveload.models.flow_matching import FlowMatchingModule, shift_timesteps
from lightning_adaptiveload.models.wan import (
    WAN_CONFIGS,
    WanAttentionBlock,
    WanConfig,
    WanModel,
    from_name_or_config,
)

__all__ = [
    "WAN_CONFIGS",
    "FlowMatchingModule",
    "WanAttentionBlock",
    "WanConfig",
    "WanModel",
    "from_name_or_config",
    "shift_timesteps",
]
