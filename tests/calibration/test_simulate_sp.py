"""The simulator with sequence parallelism: SP off changes nothing; 720p clips above M_mem train with SP."""

import json

import numpy as np
import pytest

from lightning_adaptiveload.bucketing.policy import CostModelPolicy
from lightning_adaptiveload.bucketing.sampler import OversizeSampleError
from lightning_adaptiveload.bucketing.sequence_parallel import SequenceParallelConfig
from lightning_adaptiveload.calibration.derive import derive_policy
from lightning_adaptiveload.calibration.sequence_parallel import SequenceParallelCostModel, UlyssesCommModel
from lightning_adaptiveload.calibration.simulate import (
    compare_policies,
    default_cost_model,
    mixture_token_grids,
    simulate,
)
from lightning_adaptiveload.cli.simulate import main
from lightning_adaptiveload.data.mixtures import get_mixture

M_MEM = 65_520
SP = SequenceParallelConfig((2, 4), num_heads=12, ranks_per_node=8)
COMM = UlyssesCommModel(hidden_dim=1536, num_layers=30)


@pytest.fixture(scope="module")
def mixed():
    shapes = mixture_token_grids(get_mixture("wan_mixed_480p_720p"), 6_000)
    assert (shapes.prod(axis=1) == 75_600).sum() > 0  # 81-frame 720p clips, above M_MEM
    dual = derive_policy(default_cost_model(), shapes, M_MEM, world_size=64, oversize="skip").policy
    return shapes, dual


def test_sp_off_rows_equal_todays_rows(mixed):
    shapes, dual = mixed
    today = compare_policies(shapes, [8, 64], dual=dual, m_mem=M_MEM)
    with_sp = compare_policies(shapes, [8, 64], dual=dual, m_mem=M_MEM, sequence_parallel=SP, sp_comm=COMM)
    dp_rows = [r for r in with_sp if not r.name.endswith("+ SP")]
    assert [r.to_dict() for r in dp_rows] == [r.to_dict() for r in today]
    for a, b in zip(dp_rows, today, strict=True):
        assert np.array_equal(a.step_times, b.step_times)
    assert [r.name for r in with_sp if r.name.endswith("+ SP")] == ["dual-constraint + balance + SP"] * 2


def test_sp_trains_720p_clips_that_one_gpu_refuses(mixed):
    shapes, dual = mixed
    n_720 = int((shapes.prod(axis=1) == 75_600).sum())
    assert isinstance(dual, CostModelPolicy)
    strict = CostModelPolicy(dual.cost_model, dual.m_mem, dual.step_budget)  # oversize="error": refused today
    with pytest.raises(OversizeSampleError, match="S=75,600"):
        simulate(shapes, strict, 64, cost_model=default_cost_model())
    assert simulate(shapes, strict, 64, cost_model=default_cost_model(), sequence_parallel=SP).samples == len(shapes)
    cm = SequenceParallelCostModel(default_cost_model(), COMM)
    for world in (8, 64, 1024):
        dp = simulate(shapes, dual, world, cost_model=default_cost_model())
        sp = simulate(shapes, dual, world, cost_model=cm, sequence_parallel=SP)
        assert dp.skipped_samples == n_720 and dp.samples == len(shapes) - n_720
        assert sp.skipped_samples == 0 and sp.samples == len(shapes)
        assert sp.tokens == int(shapes.prod(axis=1).sum())  # an SP batch's tokens count once
        ((s, b, k),) = [x for x in sp.sp_buckets if x[0] == 75_600]
        assert k in (2, 4) and b * s <= k * M_MEM
        if world <= 64:  # at 1024 ranks 6,000 samples are a few padded steps
            assert sp.compute_cv < 0.05


def test_sp_row_needs_a_comm_model(mixed):
    shapes, dual = mixed
    with pytest.raises(ValueError, match="needs `sp_comm`"):
        compare_policies(shapes, [8], dual=dual, m_mem=M_MEM, sequence_parallel=SP)


def test_cli_sp_degrees_adds_the_sp_row(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["--mixture", "wan_mixed_480p_720p", "--num-samples", "4000", "--world-sizes", "8", "1024",
                 "--m-mem", "65520", "--sp-degrees", "2,4", "--ranks-per-node", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dual-constraint + balance + SP" in text and "SP buckets: S=75,600: k=" in text
    rows = json.loads(out.read_text())
    sp_rows = [r for r in rows if r["name"].endswith("+ SP")]
    assert [r["world_size"] for r in sp_rows] == [8, 1024]
    assert all(r["skipped_samples"] == 0 and r["samples"] == 4000 for r in sp_rows)
    with pytest.raises(SystemExit):  # 5 does not divide Wan 1.3B's 12 heads
        main(["--mixture", "wan_480p", "--num-samples", "100", "--sp-degrees", "5"])
    assert "Expected one of [2, 4]" in capsys.readouterr().err
