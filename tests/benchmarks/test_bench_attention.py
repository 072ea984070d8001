"""The attention benchmark's arguments: the kernel shapes it times and its refusals (the timing itself needs a GPU)."""

from __future__ import annotations

import re

import pytest
from benchmark_scripts import load_benchmark

bench = load_benchmark("bench_attention")


def test_kernel_shapes_come_from_the_arguments(monkeypatch, tmp_path):
    seen, written = {}, []
    info = bench.run_info()  # (on this CPU machine, before CUDA is faked available)
    monkeypatch.setattr(bench, "run_info", lambda: info)
    monkeypatch.setattr(bench, "append_record", lambda path, name, result, run: written.append((path, result)))
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "kernels", lambda tokens, heads, head_dim, lengths: seen.update(
        tokens=tokens, heads=heads, head_dim=head_dim, lengths=lengths) or {"what": "kernels"})
    out = tmp_path / "attention.json"
    assert bench.main(["--kernels", "--heads", "48", "--head-dim", "64", "--lengths", "1576", "17776",
                       "--out", str(out)]) == 0
    assert seen == {"tokens": 39_000, "heads": 48, "head_dim": 64, "lengths": (1576, 17776)}
    assert written == [(out, {"what": "kernels"})]
    bench.main(["--kernels", "--out", str(out)])  # the defaults: Wan 1.3B's heads at the recipes' lengths
    assert seen["heads"] == 12 and seen["head_dim"] == 128 and seen["lengths"] == bench.LENGTHS


@pytest.mark.parametrize("args, message", [
    (["--kernels", "--heads", "0"], "--heads 0 is not valid"),
    (["--kernels", "--head-dim", "-8"], "--head-dim -8 is not valid"),
    (["--kernels", "--lengths", "1560", "0"], "--lengths \\[1560, 0\\] is not valid"),
])
def test_bad_kernel_shapes_are_refused_in_one_line(capsys, args, message):
    with pytest.raises(SystemExit):
        bench.main(args)
    assert re.search(message, capsys.readouterr().err)


def test_kernels_without_a_gpu_say_where_to_run(monkeypatch, capsys):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--kernels"])
    assert "run it on a GPU machine" in capsys.readouterr().err
