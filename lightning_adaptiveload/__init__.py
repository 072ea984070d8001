"""lightning-adaptiveload: fast video diffusion transformer training on mixed image + video data.

Dual-constraint adaptive bucketing with a rank-aware balanced batch sampler, shape benchmarking with
a fitted cost model, a fused AdaLN CUDA kernel, and a faithful Wan 2.1 DiT, for PyTorch Lightning.
"""

from lightning_adaptiveload.bucketing import (
    AdaptiveBucketBatchSampler,
    BatchSizePolicy,
    CostModelPolicy,
    DualConstraintPolicy,
    EqualTokenPolicy,
    bubble_fraction,
    compute_imbalance_rate,
    sync_overhead,
)
from lightning_adaptiveload.calibration import (
    Calibration,
    CostModel,
    MemoryModel,
    SimulationResult,
    compare_policies,
    derive_policy,
    load_calibration,
    simulate,
)
from lightning_adaptiveload.geometry import latent_shape, pixel_token_grid, seq_len, token_grid, tokens_of
from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor
from lightning_adaptiveload.callbacks.fused_adaln import (
    FusedAdaLNCallback,
    apply_fused_adaln,
    register_adaln_module,
)
from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
from lightning_adaptiveload.data import (
    MIXTURES,
    ManifestDataset,
    SyntheticMixedDataset,
    collate_batch,
    get_mixture,
    read_manifest_shapes,
)
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.models import (
    WAN_CONFIGS,
    FlowMatchingModule,
    WanAttentionBlock,
    WanConfig,
    WanModel,
)
from lightning_adaptiveload.modules.adaln import AdaLayerNorm, FusedAdaLayerNorm
from lightning_adaptiveload.ops.adaln import adaln, adaln_ref

__version__ = "0.1.0"

__all__ = [
    "MIXTURES",
    "WAN_CONFIGS",
    "AdaLayerNorm",
    "AdaptiveBucketBatchSampler",
    "AdaptiveLoadDataModule",
    "BalanceMonitor",
    "BatchSizePolicy",
    "Calibration",
    "CostModel",
    "CostModelPolicy",
    "DualConstraintPolicy",
    "EqualTokenPolicy",
    "FlowMatchingModule",
    "FusedAdaLNCallback",
    "FusedAdaLayerNorm",
    "ManifestDataset",
    "MemoryModel",
    "ShapeBenchmarkCallback",
    "SimulationResult",
    "SyntheticMixedDataset",
    "WanAttentionBlock",
    "WanConfig",
    "WanModel",
    "adaln",
    "adaln_ref",
    "apply_fused_adaln",
    "bubble_fraction",
    "collate_batch",
    "compare_policies",
    "compute_imbalance_rate",
    "derive_policy",
    "get_mixture",
    "latent_shape",
    "load_calibration",
    "pixel_token_grid",
    "read_manifest_shapes",
    "register_adaln_module",
    "seq_len",
    "simulate",
    "sync_overhead",
    "token_grid",
    "tokens_of",
]
