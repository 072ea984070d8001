"""Small constructors that Hydra configs instantiate from paths and numbers."""

from __future__ import annotations

import os

from lightning_adaptiveload.bucketing.policy import BatchSizePolicy
from lightning_adaptiveload.calibration.derive import policy_for_budget
from lightning_adaptiveload.calibration.record import load_cost_model


def cost_model_policy(
    cost_model_path: str | os.PathLike,
    m_mem: int,
    step_budget: float | None = None,
    max_seq_len: int | None = None,
    oversize: str = "error",
) -> BatchSizePolicy:
    """The policy of a saved cost model, by the rule of :func:`~lightning_adaptiveload.calibration.derive.policy_for_budget`.

    Args:
        cost_model_path: CostModel JSON or calibration JSON.
        m_mem: token budget per micro-batch.
        step_budget: seconds per micro-batch; ``None`` takes the predicted time of one sample of
            ``max_seq_len`` (default ``m_mem``), so the longest samples run at B = 1.
        max_seq_len: the longest S expected (only used when ``step_budget`` is ``None``).
        oversize: ``"error"`` or ``"skip"`` for samples with S > m_mem.
    """
    cost_model = load_cost_model(cost_model_path, argument="cost_model_policy(cost_model_path=...)")
    if step_budget is None:
        step_budget = float(cost_model.predict(1, max_seq_len or m_mem))
    return policy_for_budget(cost_model, int(m_mem), float(step_budget), oversize=oversize)
