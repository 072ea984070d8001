"""Shape bucketing: batch-size policies, the rank-aware balanced batch sampler and balance metrics."""

from lightning_adaptiveload.bucketing.metrics import bubble_fraction, compute_imbalance_rate, sync_overhead
from lightning_adaptiveload.bucketing.policy import (
    BatchSizePolicy,
    CostModelPolicy,
    DualConstraintPolicy,
    EqualTokenPolicy,
    FixedBatchPolicy,
)
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler, EpochPlan

__all__ = [
    "AdaptiveBucketBatchSampler",
    "BatchSizePolicy",
    "CostModelPolicy",
    "DualConstraintPolicy",
    "EpochPlan",
    "EqualTokenPolicy",
    "FixedBatchPolicy",
    "bubble_fraction",
    "compute_imbalance_rate",
    "sync_overhead",
]
