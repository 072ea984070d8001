import numpy as np
import pytest

from lightning_adaptiveload.bucketing.metrics import (
    bubble_fraction,
    compute_imbalance_rate,
    summarize_step_loads,
    sync_overhead,
)


def test_metrics_match_definitions():
    x = np.array([1.0, 2.0, 3.0, 6.0])
    cv = np.sqrt(((x - 3.0) ** 2).mean()) / 3.0
    assert compute_imbalance_rate(x) == pytest.approx(cv)
    assert sync_overhead(x) == pytest.approx(cv)
    assert bubble_fraction(x) == pytest.approx(1 - 3.0 / 6.0)
    steps = np.array([[1.0, 1.0], [1.0, 3.0]])
    assert compute_imbalance_rate(steps).tolist() == pytest.approx([0.0, 0.5])
    s = summarize_step_loads(steps)
    assert s["compute_cv"] == pytest.approx(0.25)
    assert s["bubble"] == pytest.approx(1 - (1 + 2) / (1 + 3))
    assert summarize_step_loads(np.zeros((0, 2))) == {"compute_cv": 0.0, "max_compute_cv": 0.0, "bubble": 0.0}
