"""lightning-adaptiveload: fast video diffusion transformer training on mixed image + video data.

Dual-constraint adaptive bucketing with a rank-aware balanced batch sampler, shape benchmarking with
a fitted cost model, a fused AdaLN CUDA kernel, and a faithful Wan 2.1 DiT, for PyTorch Lightning.

The names below are imported on first use (PEP 562), so ``import lightning_adaptiveload`` — and the
``adaptiveload-train --help`` path that goes through it — loads neither torch nor Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        ("AdaptiveBucketBatchSampler", "BatchSizePolicy", "CostModelPolicy", "DualConstraintPolicy",
         "EqualTokenPolicy", "bubble_fraction", "compute_imbalance_rate", "sync_overhead"),
        "lightning_adaptiveload.bucketing"),
    **dict.fromkeys(
        ("Calibration", "CostModel", "MemoryModel", "SimulationResult", "compare_policies", "derive_policy",
         "load_calibration", "simulate"),
        "lightning_adaptiveload.calibration"),
    **dict.fromkeys(("latent_shape", "pixel_token_grid", "seq_len", "token_grid", "tokens_of"),
                    "lightning_adaptiveload.geometry"),
    "BalanceMonitor": "lightning_adaptiveload.callbacks.balance_monitor",
    **dict.fromkeys(("FusedAdaLNCallback", "apply_fused_adaln", "register_adaln_module"),
                    "lightning_adaptiveload.callbacks.fused_adaln"),
    "ShapeBenchmarkCallback": "lightning_adaptiveload.callbacks.shape_benchmark",
    **dict.fromkeys(("MIXTURES", "ManifestDataset", "ShardedLatentDataset", "SyntheticMixedDataset",
                     "collate_batch", "get_mixture", "read_manifest_shapes"), "lightning_adaptiveload.data"),
    "AdaptiveLoadDataModule": "lightning_adaptiveload.data.datamodule",
    **dict.fromkeys(("WAN_CONFIGS", "FlowMatchingModule", "WanAttentionBlock", "WanConfig", "WanModel"),
                    "lightning_adaptiveload.models"),
    **dict.fromkeys(("AdaLayerNorm", "FusedAdaLayerNorm"), "lightning_adaptiveload.modules.adaln"),
    **dict.fromkeys(("adaln", "adaln_ref"), "lightning_adaptiveload.ops"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_adaptiveload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from lightning_adaptiveload.bucketing import (  # noqa: F401
        AdaptiveBucketBatchSampler,
        BatchSizePolicy,
        CostModelPolicy,
        DualConstraintPolicy,
        EqualTokenPolicy,
        bubble_fraction,
        compute_imbalance_rate,
        sync_overhead,
    )
    from lightning_adaptiveload.calibration import (  # noqa: F401
        Calibration,
        CostModel,
        MemoryModel,
        SimulationResult,
        compare_policies,
        derive_policy,
        load_calibration,
        simulate,
    )
    from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor  # noqa: F401
    from lightning_adaptiveload.callbacks.fused_adaln import (  # noqa: F401
        FusedAdaLNCallback,
        apply_fused_adaln,
        register_adaln_module,
    )
    from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback  # noqa: F401
    from lightning_adaptiveload.data import (  # noqa: F401
        MIXTURES,
        ManifestDataset,
        ShardedLatentDataset,
        SyntheticMixedDataset,
        collate_batch,
        get_mixture,
        read_manifest_shapes,
    )
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule  # noqa: F401
    from lightning_adaptiveload.geometry import (  # noqa: F401
        latent_shape,
        pixel_token_grid,
        seq_len,
        token_grid,
        tokens_of,
    )
    from lightning_adaptiveload.models import (  # noqa: F401
        WAN_CONFIGS,
        FlowMatchingModule,
        WanAttentionBlock,
        WanConfig,
        WanModel,
    )
    from lightning_adaptiveload.modules.adaln import AdaLayerNorm, FusedAdaLayerNorm  # noqa: F401
    from lightning_adaptiveload.ops import adaln, adaln_ref  # noqa: F401
