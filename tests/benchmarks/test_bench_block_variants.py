"""The compiled-block variant benchmark's parts that run without a GPU: its option parsing, its earlier RoPE
form (the comparison it times) and its refusal on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load_benchmark

from lightning_adaptiveload.models.wan import rope_angles, rope_apply

bench = load_benchmark("bench_block_variants")


def test_option_values_parse_as_inductor_expects():
    assert [bench._value(v) for v in ("true", "False", "3", "0.5", "max-autotune")] == [True, False, 3, 0.5,
                                                                                     "max-autotune"]


def test_the_earlier_rope_form_gives_the_models_values():
    grid, head_dim = (2, 3, 4), 16
    x = torch.randn(3, 24, 4, head_dim)
    cos, sin = rope_angles(grid, head_dim)
    assert torch.equal(bench._rope_pairs(x, cos, sin), rope_apply(x, cos, sin))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_refuses_without_cuda(tmp_path):
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench.main(["--name", "x", "--out", str(tmp_path / "r.json")])


def test_a_malformed_option_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="expected NAME=VALUE"):
        bench.main(["--name", "x", "--option", "coordinate_descent_tuning", "--out", str(tmp_path / "r.json")])
