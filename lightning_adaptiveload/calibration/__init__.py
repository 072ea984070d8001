"""Calibration, independent of Lightning: profile the real step, fit the cost and memory models,
derive the batch-size policy, record and cache the result, and simulate a cluster with it.

:func:`calibrate` conducts it: source (pinned file → checkpoint → cache → ``profile``), key,
``derive.fit_models``, per-mode tiers (``derive.fit_tiers``), memory budgets, ``derive.derive_policy``;
:func:`refit` and :func:`compare` (``feedback``) close the loop with training's own step times;
:class:`~lightning_adaptiveload.callbacks.shape_benchmark.ShapeBenchmarkCallback` adapts Lightning's
hooks to it, and the simulator and the benchmarks call it too.
"""

from lightning_adaptiveload.calibration.calibrate import (
    CalibrationResult,
    ProfileSettings,
    Trainee,
    calibrate,
)
from lightning_adaptiveload.calibration.costmodel import FORMS, CostModel, MemoryModel
from lightning_adaptiveload.calibration.derive import (
    Derivation,
    ModeTier,
    TieredCostModel,
    derive_policy,
    fit_models,
    memory_budget,
    policy_for_budget,
)
from lightning_adaptiveload.calibration.feedback import REPLAN_GAIN, Decision, Observation, compare, refit
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
    "REPLAN_GAIN",
    "Calibration",
    "CalibrationError",
    "CalibrationResult",
    "Collectives",
    "CostModel",
    "Decision",
    "Derivation",
    "LocalCollectives",
    "Measurement",
    "MemoryModel",
    "ModeTier",
    "Observation",
    "ProfileSettings",
    "SequenceParallelCostModel",
    "Shape",
    "SimulationResult",
    "TieredCostModel",
    "Trainee",
    "UlyssesCommModel",
    "calibrate",
    "compare",
    "compare_policies",
    "derive_policy",
    "fit_models",
    "load_calibration",
    "load_cost_model",
    "memory_budget",
    "plan_grid",
    "policy_for_budget",
    "profile",
    "refit",
    "simulate",
]
