"""Shape bucketing: token grids, batch-size policies, the balanced batch sampler and the simulator."""

from lightning_adaptiveload.bucketing.balance import (
    SimulationResult,
    bubble_fraction,
    compare_policies,
    compute_imbalance_rate,
    simulate,
    sync_overhead,
)
from lightning_adaptiveload.bucketing.policy import (
    BatchSizePolicy,
    CostModelPolicy,
    DualConstraintPolicy,
    EqualTokenPolicy,
)
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler

__all__ = [
    "AdaptiveBucketBatchSampler",
    "BatchSizePolicy",
    "CostModelPolicy",
    "DualConstraintPolicy",
    "EqualTokenPolicy",
    "SimulationResult",
    "bubble_fraction",
    "compare_policies",
    "compute_imbalance_rate",
    "simulate",
    "sync_overhead",
]
