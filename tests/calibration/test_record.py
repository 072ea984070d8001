import json
import os
import time

import pytest
import torch
from torch import nn

from lightning_adaptiveload.calibration import record
from lightning_adaptiveload.calibration.costmodel import CostModel, MemoryModel
from lightning_adaptiveload.calibration.profile import Measurement
from lightning_adaptiveload.calibration.record import (
    Calibration,
    CalibrationError,
    load_calibration,
    load_cost_model,
    model_fingerprint,
    read_cache,
    write_cache,
)

KEY = {"model": "abc", "device": "cpu:x86_64", "grid": [[1, 1, 2, 2]]}


def _cal(**kw):
    kw.setdefault("key", dict(KEY))
    return Calibration(
        cost_model=CostModel("quadratic", {"a": 0.01, "c1": 1e-6, "c2": 1e-10}),
        measurements=[Measurement(1, (1, 2, 2), 4, 0.01, 1000, "ok", 3, 0.05),
                      Measurement(4, (1, 2, 2), 4, None, None, "oom")],
        memory_model=MemoryModel(1e9, 1e4), device_memory=2**30, optimizer_bytes=8, profile_seconds=1.5,
        world_size=2, **kw)


def test_round_trip_and_file(tmp_path):
    cal = _cal()
    assert Calibration.from_json(cal.to_json()) == cal
    path = tmp_path / "shape_benchmark.json"
    path.write_text(json.dumps({**cal.to_dict(), "derived": {"m_mem": 5}}))
    assert load_calibration(path) == cal
    assert load_cost_model(path) == cal.cost_model
    (tmp_path / "cm.json").write_text(cal.cost_model.to_json())
    assert load_cost_model(tmp_path / "cm.json") == cal.cost_model


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.pop("cost_model"), "invalid model"),
        (lambda d: d.update(measurements=[]), "`measurements` is missing or empty"),
        (lambda d: d["measurements"][0].update(time_s=None), "invalid measurement"),
        (lambda d: d["cost_model"]["params"].update(a=float("nan")), "invalid model"),
        (lambda d: d.update(version=1), "version 1 is not supported"),
        (lambda d: d.update(key=[1]), "`key` is"),
        (lambda d: d.update(device_memory=-1), "`device_memory`"),
    ],
)
def test_schema_errors_name_the_file(tmp_path, mutate, match):
    d = _cal().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CalibrationError, match=match) as info:
        load_calibration(path)
    assert str(path) in str(info.value)


def test_unreadable_files(tmp_path):
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CalibrationError, match="bin.json"):
        load_calibration(path)
    with pytest.raises(FileNotFoundError):
        load_calibration(tmp_path / "missing.json")


def test_cache_treats_invalid_files_as_stale_and_rewrites(tmp_path):
    cal = _cal()
    path = record.cache_path(tmp_path, KEY)
    path.write_text('{"format": "lightning_adaptiveload.Calibration", "version": 2}')
    with pytest.warns(UserWarning, match=f"ignoring the calibration cache file {path}"):
        assert read_cache(tmp_path, KEY) is None
    # A writer killed mid-write left its temp file: the next write removes it once it is stale.
    stale = path.with_name(path.name + ".tmp999")
    stale.write_text("{half")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = path.with_name(path.name + ".tmp1000")
    fresh.write_text("{in flight")
    write_cache(tmp_path, cal)
    assert not stale.exists() and fresh.exists()
    assert read_cache(tmp_path, KEY) == cal
    assert read_cache(tmp_path, {**KEY, "device": "other"}) is None


class Net(nn.Module):
    def __init__(self, layers, width=8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))


def test_model_fingerprint_follows_the_architecture_only():
    assert model_fingerprint(Net(2)) == model_fingerprint(Net(2))
    assert model_fingerprint(Net(2)) != model_fingerprint(Net(6))
    assert model_fingerprint(Net(2)) != model_fingerprint(Net(2, width=16))
    a, b = Net(2), Net(2)
    with torch.no_grad():
        b.blocks[0].weight.mul_(3)  # other weights, same architecture
    assert model_fingerprint(a) == model_fingerprint(b)

    class WithConfig(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.lr = 0.1

    assert model_fingerprint(WithConfig({"layers": 2})) == model_fingerprint(WithConfig({"layers": 2}))
    assert model_fingerprint(WithConfig({"layers": 2})) != model_fingerprint(WithConfig({"layers": 3}))


def test_an_entry_written_before_provenance_and_spreads_reads_as_a_profile(tmp_path):
    d = _cal().to_dict()
    assert "extra" not in d  # what a record of an earlier release holds
    for m in d["measurements"]:
        m.pop("spread")
    record.cache_path(tmp_path, KEY).write_text(json.dumps(d))
    old = read_cache(tmp_path, KEY)
    assert old is not None and all(m.spread is None for m in old.measurements)
    assert record.provenance(old) == {"source": "profiled"} and record.describe_provenance(old) == "profiled"
    assert not record.is_provisional(old)
    # A newer entry replaces it, with its provenance.
    write_cache(tmp_path, old, provenance={"source": "corrected", "training_steps": 1200})
    assert record.describe_provenance(read_cache(tmp_path, KEY)) == "corrected from 1,200 training steps"
