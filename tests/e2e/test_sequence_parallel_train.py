"""``adaptiveload-train`` with ``data.sequence_parallel.enabled=true`` on 2 CPU ranks: the build adds the
groups callback, the longest bucket trains sequence-parallel on both ranks, and a mid-epoch resume
continues with the same batches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from gloo_ranks import spawn
from sp_train_script import NUM_SAMPLES, train_ranks

from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset


def _fit(tmp_path: Path, record: str, ckpt: str | None = None) -> None:
    """``sp_train_script.run`` on 2 ranks forked from this process (no re-import of torch and Lightning)."""
    spawn(train_ranks, 2, str(tmp_path / "run"), str(tmp_path / record), ckpt, timeout=300)


def _rows(tmp_path: Path, record: str) -> list[list[dict]]:
    return [[json.loads(line) for line in (tmp_path / f"{record}.rank{r}").read_text().splitlines()] for r in (0, 1)]


@pytest.mark.slow  # ~3 s on a 2-core CPU: two runs on two forked ranks
def test_sequence_parallel_trains_through_adaptiveload_train_and_resumes_mid_epoch(tmp_path):
    _fit(tmp_path, "full")
    full = _rows(tmp_path, "full")
    seq = SyntheticMixedDataset(NUM_SAMPLES, "tiny", text_len=16, text_dim=32, seed=1).token_grids().prod(axis=1)
    assert len(full[0]) == len(full[1]) > 4  # equal step counts on both ranks
    seen = []
    for r0, r1 in zip(*full, strict=True):
        assert r0["step"] == r1["step"] and r0["sp_degree"] == r1["sp_degree"]
        assert math.isfinite(r0["loss"]) and math.isfinite(r1["loss"])
        if r0["sp_degree"] == 2:
            # One batch on both ranks of the group, really exchanged (all-to-alls ran), and only the
            # 120-token clips, which m_mem=100 keeps off a single rank.
            assert r0["index"] == r1["index"] and r0["all_to_all"] == r1["all_to_all"] > 0
            assert r0["loss"] == r1["loss"]
            assert set(seq[r0["index"]].tolist()) == {120}
            seen += r0["index"]
        else:
            assert r0["all_to_all"] == r1["all_to_all"] == 0
            assert max(seq[r0["index"] + r1["index"]]) <= 100
            seen += r0["index"] + r1["index"]
    assert any(r["sp_degree"] == 2 for r in full[0]) and any(r["sp_degree"] == 1 for r in full[0])
    assert sorted(seen) == list(range(NUM_SAMPLES))  # every sample once in the epoch
    assert set(np.flatnonzero(seq == 120).tolist()) <= set(seen)

    _fit(tmp_path, "resumed", str(tmp_path / "run" / "checkpoints" / "step0000004.ckpt"))
    resumed = _rows(tmp_path, "resumed")
    for rank in (0, 1):
        rest = [r for r in full[rank] if r["step"] > 4]
        assert [(r["step"], r["sp_degree"], r["index"]) for r in resumed[rank]] == [
            (r["step"], r["sp_degree"], r["index"]) for r in rest]
        assert np.allclose([r["loss"] for r in resumed[rank]], [r["loss"] for r in rest], rtol=1e-5, atol=0)
