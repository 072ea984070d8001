"""Resume with another number of ranks while the shape benchmark is on: the calibration and the
policy are kept, the sampler re-plans the rest of the epoch, and every sample trains once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fit_script import NUM_SAMPLES, fit_ranks
from gloo_ranks import spawn


def _fit(tmp_path: Path, record: str, devices: int = 1, **kwargs) -> None:
    """``fit_script.fit`` on ``devices`` ranks forked from this process (no re-import of torch and Lightning)."""
    spawn(fit_ranks, devices, str(tmp_path / "run"), str(tmp_path / record), kwargs, timeout=300)


def _seen(tmp_path: Path, record: str) -> list[int]:
    out = []
    for rank in (0, 1):
        path = tmp_path / f"{record}.rank{rank}"
        if path.exists():
            out += [i for line in path.read_text().splitlines() for i in json.loads(line)]
    return out


@pytest.mark.slow  # ~2 s on a 2-core CPU: two runs, one of them on two forked ranks
def test_resume_on_another_world_size_keeps_calibration_and_sees_every_sample(tmp_path):
    # 1 rank, then 2 from a step checkpoint; 2 ranks then 1 is the last.ckpt test below.
    first, second = 1, 2
    _fit(tmp_path, "a", first, max_steps=2)
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["source"] == "profiled" and a["global_step"] == 2
    _fit(tmp_path, "b", second, ckpt=str(tmp_path / "run" / "ckpt" / "step=2.ckpt"))
    b = json.loads((tmp_path / "b.json").read_text())
    # The checkpoint's calibration and policy, not a new profile on the new world size.
    assert b["source"] == "checkpoint" and not b["profiled"]
    assert b["policy"] == a["policy"] and b["world_size"] == second
    seen = _seen(tmp_path, "a") + _seen(tmp_path, "b")
    assert sorted(set(seen)) == list(range(NUM_SAMPLES))
    # Repeats come only from counted padding: at most one padded step per segment (world - 1 batches).
    assert len(seen) - NUM_SAMPLES <= a["plan"]["padded_samples"] + b["plan"]["padded_samples"]


@pytest.mark.slow  # ~2 s on a 2-core CPU: two runs, one of them on two forked ranks
def test_resume_from_last_ckpt_at_max_steps_on_another_world_size(tmp_path):
    # The quickstart's resume (`last.ckpt`, written when max_steps stops the run mid-epoch), on 1 rank
    # after 2: the rest of the epoch is re-planned for one rank and every sample trains once.
    _fit(tmp_path, "a", 2, max_steps=3)
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["global_step"] == 3
    # Lightning counts the epoch that max_steps stopped as processed, so the rest of the sampler's epoch 0
    # trains as Lightning's epoch 1 (lightning_adaptiveload/data/datamodule.py): max_epochs=2 ends with it.
    _fit(tmp_path, "b", 1, max_epochs=2, ckpt=str(tmp_path / "run" / "ckpt" / "last.ckpt"))
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["source"] == "checkpoint" and b["world_size"] == 1 and b["global_step"] > 3
    # The checkpoint's calibration and policy, not a new profile on the new world size.
    assert a["source"] == "profiled" and not b["profiled"] and b["policy"] == a["policy"]
    seen = _seen(tmp_path, "a") + _seen(tmp_path, "b")
    assert len(_seen(tmp_path, "a")) > 0 and sorted(set(seen)) == list(range(NUM_SAMPLES))
    assert len(seen) - NUM_SAMPLES <= a["plan"]["padded_samples"] + b["plan"]["padded_samples"]


@pytest.mark.slow  # ~1-2 s on a 2-core CPU
def test_diffusers_wan_trains_on_two_ranks_with_every_callback(tmp_path):
    pytest.importorskip("diffusers")
    _fit(tmp_path, "d", 2, model="diffusers", max_steps=3)
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["global_step"] == 3 and d["world_size"] == 2 and d["source"] == "profiled"
    assert d["summary"]["steps"] == 3 and d["summary"]["tflops_per_gpu"] > 0
    assert len(_seen(tmp_path, "d")) > 0
