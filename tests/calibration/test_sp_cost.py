"""The Ulysses SP step cost: exact formulas against float64 references and an explicit head split."""

import numpy as np
import pytest
import torch

from lightning_adaptiveload.calibration.costmodel import CostModel
from lightning_adaptiveload.calibration.sequence_parallel import (
    H200_NVLINK_BANDWIDTH,
    SequenceParallelCostModel,
    UlyssesCommModel,
)

BASE = CostModel("quadratic", {"a": 0.01, "c1": 8.68e-6, "c2": 1.482e-9})


def _bytes_by_head_split(b, s, heads, head_dim, k, dtype=torch.bfloat16):
    """Bytes rank 0 sends in one Ulysses all-to-all, from the tensors it actually exchanges."""
    local = torch.empty(b, s // k, heads, head_dim, dtype=dtype, device="meta")  # sequence-sharded q
    chunks = local.chunk(k, dim=2)  # head group j goes to rank j
    return sum(c.numel() * c.element_size() for j, c in enumerate(chunks) if j != 0)


@pytest.mark.parametrize(("b", "s", "heads", "head_dim", "k"), [(1, 75_600, 12, 128, 4), (3, 32_760, 40, 128, 8),
                                                                (2, 1_560, 12, 128, 2), (1, 12, 6, 4, 3)])
def test_bytes_per_alltoall_equals_the_head_split(b, s, heads, head_dim, k):
    comm = UlyssesCommModel(hidden_dim=heads * head_dim, num_layers=1)
    assert comm.bytes_per_alltoall(b, s, k) == _bytes_by_head_split(b, s, heads, head_dim, k)


def test_predict_sp_formula_float64_reference():
    comm = UlyssesCommModel(hidden_dim=1536, num_layers=30, bandwidth=400e9, latency=30e-6, alltoalls_per_layer=12)
    cm = SequenceParallelCostModel(BASE, comm)
    b, s, k = np.array([1.0, 2.0]), np.array([75_600.0, 32_760.0]), 4
    a, c1, c2 = 0.01, 8.68e-6, 1.482e-9
    compute = a + (b * (c1 * s + c2 * s * s)) / k  # the fixed overhead a is not split
    comm_s = 12 * 30 * (30e-6 + b * s * 1536 * 2 * (k - 1) / k**2 / 400e9)
    np.testing.assert_allclose(cm.predict_sp(b, s, k), compute + comm_s, rtol=1e-12)
    assert cm.predict_sp(2, 1560, 1) == BASE.predict(2, 1560) == cm.predict(2, 1560)
    assert isinstance(cm.predict_sp(1, 75_600, 2), float)
    # SP pays off for a long clip: 4 ranks take well under the one-GPU time.
    assert cm.predict_sp(1, 75_600, 4) < 0.3 * BASE.predict(1, 75_600)
    with pytest.raises(ValueError, match="degree=0"):
        cm.predict_sp(1, 10, 0)


def test_comm_fit_recovers_latency_and_bandwidth():
    sizes = np.array([1e3, 1e5, 1e6, 1e7, 1e8])
    times = 20e-6 + sizes / 300e9
    fit = UlyssesCommModel.fit(sizes, times, hidden_dim=1536, num_layers=30)
    assert fit.latency == pytest.approx(20e-6, rel=1e-6) and fit.bandwidth == pytest.approx(300e9, rel=1e-6)
    with pytest.raises(ValueError, match="two distinct sizes"):
        UlyssesCommModel.fit([1e6, 1e6], [1e-3, 1e-3], hidden_dim=1, num_layers=1)
    with pytest.raises(ValueError, match="do not grow"):
        UlyssesCommModel.fit([1e3, 1e6], [1e-3, 1e-3 * 0.5], hidden_dim=1, num_layers=1)


def test_defaults_bad_values_and_json_round_trip():
    comm = UlyssesCommModel(hidden_dim=5120, num_layers=40)
    assert comm.bandwidth == H200_NVLINK_BANDWIDTH == 450e9 and comm.alltoalls_per_layer == 8
    assert comm.predict(1, 100, 1) == 0.0
    with pytest.raises(ValueError, match=r"UlyssesCommModel\(bandwidth=0"):
        UlyssesCommModel(hidden_dim=1, num_layers=1, bandwidth=0)
    with pytest.raises(ValueError, match=r"hidden_dim=1.5"):
        UlyssesCommModel(hidden_dim=1.5, num_layers=1)
    with pytest.raises(ValueError, match=r"UlyssesCommModel\(latency=-1e-06\)` is not valid. Expected a non-negative"):
        UlyssesCommModel(hidden_dim=1, num_layers=1, latency=-1e-6)
    assert UlyssesCommModel(hidden_dim=1, num_layers=1, latency=0).latency == 0.0  # no latency term
    cm = SequenceParallelCostModel(BASE, comm)
    again = SequenceParallelCostModel.from_dict(cm.to_dict())
    assert again.to_json() == cm.to_json() and again.predict_sp(1, 5000, 4) == cm.predict_sp(1, 5000, 4)
    with pytest.raises(ValueError, match="Not a serialised SequenceParallelCostModel"):
        SequenceParallelCostModel.from_dict({"format": "x"})
    with pytest.raises(ValueError, match="Expected a cost model"):
        SequenceParallelCostModel(object(), comm)
