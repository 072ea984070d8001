"""Shape bucketing: batch-size policies, the rank-aware balanced batch sampler and balance metrics."""

from lightning_adaptiveload.bucketing.metrics import bubble_fraction, compute_imbalance_rate, sync_overhead
from lightning_adaptiveload.bucketing.policy import (
    BatchSizePolicy,
    CostModelPolicy,
    DualConstraintPolicy,
    EqualTokenPolicy,
    FixedBatchPolicy,
    TieredPolicy,
)
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler, EpochPlan
from lightning_adaptiveload.bucketing.sequence_parallel import SequenceParallelConfig, check_sp_degree

__all__ = [
    "AdaptiveBucketBatchSampler",
    "BatchSizePolicy",
    "CostModelPolicy",
    "DualConstraintPolicy",
    "EpochPlan",
    "EqualTokenPolicy",
    "FixedBatchPolicy",
    "SequenceParallelConfig",
    "TieredPolicy",
    "bubble_fraction",
    "check_sp_degree",
    "compute_imbalance_rate",
    "sync_overhead",
]
