"""Calibration, independent of Lightning: profile the real step, fit the cost and memory models,
derive the batch-size policy, record and cache the result, and simulate a cluster with it.

``profile`` → ``derive.fit_models`` → ``derive.memory_budget`` / ``derive.derive_policy`` →
``record.Calibration``; :class:`~lightning_adaptiveload.callbacks.shape_benchmark.ShapeBenchmarkCallback`
adapts Lightning's hooks to this pipeline, and the simulator and the benchmarks call it too.
"""

from lightning_adaptiveload.calibration.costmodel import FORMS, CostModel, MemoryModel
from lightning_adaptiveload.calibration.derive import (
    Derivation,
    derive_policy,
    fit_models,
    memory_budget,
    policy_for_budget,
)
from lightning_adaptiveload.calibration.profile import (
    Collectives,
    LocalCollectives,
    Measurement,
    Shape,
    plan_grid,
    profile,
)
from lightning_adaptiveload.calibration.record import (
    Calibration,
    CalibrationError,
    load_calibration,
    load_cost_model,
)
from lightning_adaptiveload.calibration.sequence_parallel import SequenceParallelCostModel, UlyssesCommModel
from lightning_adaptiveload.calibration.simulate import SimulationResult, compare_policies, simulate

__all__ = [
    "FORMS",
    "Calibration",
    "CalibrationError",
    "Collectives",
    "CostModel",
    "Derivation",
    "LocalCollectives",
    "Measurement",
    "MemoryModel",
    "SequenceParallelCostModel",
    "Shape",
    "SimulationResult",
    "UlyssesCommModel",
    "compare_policies",
    "derive_policy",
    "fit_models",
    "load_calibration",
    "load_cost_model",
    "memory_budget",
    "plan_grid",
    "policy_for_budget",
    "profile",
    "simulate",
]
