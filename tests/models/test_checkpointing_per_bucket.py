"""Per-bucket activation checkpointing: compiled blocks switch modes between batches and compile each
mode's graphs once (the shape benchmark switches the mode before every training batch)."""

import pytest
import torch

from lightning_adaptiveload.models.wan import WanModel


def _step(model, b, f, hw, device):
    cfg = model.config
    x = torch.randn(b, cfg.in_dim, f, *hw, device=device)
    out = model(x, torch.rand(b, device=device) * 1000, torch.randn(b, cfg.text_len, cfg.text_dim, device=device))
    out.float().square().mean().backward()


def _graphs_per_mode(device, backend, hw, shapes):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = WanModel({"preset": "wan2_1_1_3b", "num_layers": 2} if device == "cuda" else "tiny").to(device)
    model.compile_blocks(**({"backend": backend} if backend else {}))
    seen, graphs = {}, []
    # Short buckets without recomputation, long ones with it, interleaved as a training epoch deals them.
    for rnd in range(2):
        for mode, b, f in shapes:
            model.set_gradient_checkpointing(mode)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                _step(model, b, f, hw, device)
            graphs.append(counters["stats"]["unique_graphs"])
            if rnd == 0:
                seen[mode] = graphs[-1]
    return seen, graphs


@pytest.mark.slow
def test_modes_switched_per_batch_compile_once_each_cpu():
    shapes = [("none", 4, 1), ("selective", 1, 5), ("none", 2, 3), ("full", 1, 5), ("none", 3, 1), ("selective", 1, 3)]
    seen, graphs = _graphs_per_mode("cpu", "aot_eager", (8, 12), shapes)
    # The second pass over the same modes and shapes compiles nothing new: switching costs no recompiles.
    assert graphs[len(shapes):] == [graphs[len(shapes) - 1]] * len(shapes)
    # At most two graphs (B = 1 and B > 1) per mode.
    assert graphs[-1] <= 2 * 3


@pytest.mark.cuda
def test_modes_switched_per_batch_compile_once_each_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # 1.3B width, 30 x 52 token grids: images and short clips in none, 81-frame clips in selective.
    shapes = [("none", 6, 1), ("selective", 1, 21), ("none", 2, 9), ("selective", 1, 13), ("none", 1, 5)]
    seen, graphs = _graphs_per_mode("cuda", None, (60, 104), shapes)
    assert graphs[len(shapes):] == [graphs[len(shapes) - 1]] * len(shapes)
    print(f"block graphs after each mode's first batch: {seen}; total {graphs[-1]}")
    assert graphs[-1] <= 4  # none: B = 1 and B > 1; selective: B = 1 (and one spare)
