"""CPU smoke test of benchmarks/bench_e2e.py: two gloo ranks, tiny model, tiny mixture, few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_adaptiveload.costmodel import CostModel

ROOT = Path(__file__).resolve().parents[2]
STEPS, WARMUP, LOSS_STEPS, SOLO, MAX_TOKENS = 3, 1, 5, 2, 240


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("e2e") / "e2e_tiny.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "benchmarks" / "bench_e2e.py"), "--cpu", "--model", "tiny", "--mixture", "tiny",
           "--num-samples", "2000", "--steps", str(STEPS), "--warmup", str(WARMUP), "--loss-steps",
           str(LOSS_STEPS), "--solo-steps", str(SOLO), "--max-tokens", str(MAX_TOKENS), "--m-mem-cap", "480",
           "--profile-shapes", "3", "--profile-batches", "2", "--profile-repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), out


def test_runs_and_per_rank_records(result):
    res, _ = result
    runs = res["runs"]
    assert list(runs) == ["equal_token", "dual", "dual_cost", "dual_cost_fused"]
    assert res["hardware"]["world_size"] == 2
    for name, run in runs.items():
        per = run["per_step"]
        n = LOSS_STEPS if name in ("equal_token", "dual_cost_fused") else STEPS
        assert run["measured_steps"] == n
        t, tok, b, s = (np.asarray(per[k]) for k in ("step_time_s", "tokens", "batch_size", "seq_len"))
        assert t.shape == tok.shape == (2, n) and (t > 0).all()
        np.testing.assert_array_equal(tok, b * s)
        assert np.asarray(per["isolated_s"]).shape == (2, SOLO)
        # Throughput is all ranks' tokens over the wall time of the measured steps.
        assert run["tokens_per_s"] == pytest.approx(tok.sum() / run["wall_s"], rel=1e-9)


def test_policies_follow_their_definitions(result):
    res, _ = result
    cm = CostModel.from_dict(res["shape_benchmark"]["cost_model"])
    eq = res["runs"]["equal_token"]["per_step"]
    s, b = np.asarray(eq["seq_len"]), np.asarray(eq["batch_size"])
    np.testing.assert_array_equal(b, np.maximum(1, MAX_TOKENS // s))
    for run in res["runs"].values():
        per = run["per_step"]
        np.testing.assert_allclose(per["predicted_s"], cm.predict(np.asarray(per["batch_size"]),
                                                                  np.asarray(per["seq_len"])), rtol=1e-12)
    dual = res["runs"]["dual_cost"]["per_step"]
    tokens = np.asarray(dual["tokens"])
    assert (tokens <= max(res["policies"]["m_mem"], int(np.max(dual["seq_len"])))).all()


def test_metrics_match_their_formulas(result):
    res, _ = result
    for run in res["runs"].values():
        pred = np.asarray(run["per_step"]["predicted_s"])  # [ranks, steps]
        cv = (pred.std(axis=0) / pred.mean(axis=0)).mean()
        assert run["compute_cv"] == pytest.approx(cv, abs=1e-12)
        iso = np.asarray(run["per_step"]["isolated_s"])
        assert run["bubble"] == pytest.approx((1 - iso.mean(axis=0) / iso.max(axis=0)).mean(), abs=1e-12)


def test_simulation_fidelity_and_plots(result):
    res, out = result
    sim = res["simulation"]
    assert sim["world_sizes"] == [2, 8, 16]
    assert set(sim["results"]) == {"equal_token", "dual", "dual_cost"}
    for name, err in sim["prediction_error_at_measured_world"].items():
        measured = res["runs"][name]["tokens_per_s_step"]
        assert err["tokens_per_s_rel_error"] == pytest.approx(err["predicted_tokens_per_s"] / measured - 1)
    fid = res["fidelity"]
    assert fid["steps_compared"] == LOSS_STEPS and np.isfinite(fid["tail_mean_diff"])
    assert res["shape_benchmark"]["overhead_s"] > 0
    for kind in ("tokens_per_s", "step_times", "loss", "cost_fit"):
        assert (out.parent / f"{out.stem}_{kind}.png").stat().st_size > 0
