"""Small constructors that Hydra configs instantiate from paths and numbers."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_adaptiveload.bucketing.policy import CostModelPolicy
from lightning_adaptiveload.costmodel import CostModel


def load_cost_model(path: str | os.PathLike, argument: str = "path") -> CostModel:
    """Read a ``CostModel`` JSON file, or a calibration JSON holding one under ``"cost_model"``.

    ``argument`` names the setting the path came from, for the error message.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"cost model file {str(file)!r} does not exist; point `{argument}` at the calibration "
            "JSON that ShapeBenchmarkCallback wrote (shape_benchmark.json) or a CostModel.to_json() file."
        )
    data = json.loads(file.read_text())
    if isinstance(data, dict) and "cost_model" in data:
        data = data["cost_model"]
    return CostModel.from_dict(data)


def cost_model_policy(
    cost_model_path: str | os.PathLike,
    m_mem: int,
    step_budget: float | None = None,
    max_seq_len: int | None = None,
    oversize: str = "error",
) -> CostModelPolicy:
    """``CostModelPolicy`` from a saved cost model.

    Args:
        cost_model_path: CostModel JSON or calibration JSON.
        m_mem: token budget per micro-batch.
        step_budget: seconds per micro-batch; ``None`` takes the predicted time of one sample of
            ``max_seq_len`` (default ``m_mem``), so the longest samples run at B = 1.
        max_seq_len: the longest S expected (only used when ``step_budget`` is ``None``).
        oversize: ``"error"`` or ``"skip"`` for samples with S > m_mem.
    """
    cost_model = load_cost_model(cost_model_path, argument="cost_model_path")
    if step_budget is None:
        step_budget = float(cost_model.predict(1, max_seq_len or m_mem))
    return CostModelPolicy(cost_model, m_mem=m_mem, step_budget=step_budget, oversize=oversize)
