"""Compiled Wan blocks under one code or inductor variant: forward + backward time per shape and where the
fused element-wise time goes (GPU).

A variant is a set of inductor options added to the blocks' compile options and/or a RoPE formulation
(``--rope``). Each variant runs in its own process (inductor's options and caches are per process); the
shell loop in ``benchmarks/device/gpu_block_variants.sh`` runs several back to back on one GPU. The model is
the project's Wan at a preset's widths with ``--blocks`` blocks, bf16 autocast, the blocks compiled as
``WanModel.compile_blocks`` compiles them (dynamic B and S), every shape of ``--shapes`` interleaved so one
graph serves them; after ``--warmup`` rounds, ``--iters`` rounds are timed with CUDA events (median per
shape) and one step per shape is traced with ``torch.profiler`` and split as ``step_breakdown.py`` splits it.

    python benchmarks/bench_block_variants.py --name base --out /tmp/block_variants.json
    python benchmarks/bench_block_variants.py --name coord --option coordinate_descent_tuning=true
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import append_record, run_info  # noqa: E402
from step_breakdown import device_events, split_trace  # noqa: E402


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="the variant's name in the record")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an inductor option for the blocks (repeatable)")
    p.add_argument("--rope", default="model", choices=["model", "pairs"],
                   help="RoPE formulation: the model's (`model`) or `unbind` + `stack` of the rotated pairs (its earlier form)")
    p.add_argument("--model", default="wan2_1_1_3b")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--shapes", default="2x9x30x52,1x21x30x52", help="B x f x h x w token grids, comma-separated")
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    import torch
    import torch.nn.functional as F

    from lightning_adaptiveload.models import wan
    from lightning_adaptiveload.models.wan import WanModel, from_name_or_config

    if not torch.cuda.is_available():
        raise SystemExit("bench_block_variants.py times GPU kernels; no CUDA device is visible.")
    options = {}
    for item in args.option:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option {item!r}: expected NAME=VALUE, e.g. coordinate_descent_tuning=true.")
        options[name] = _value(value)
    if args.rope == "pairs":
        wan.rope_apply = _rope_pairs  # the module global the attention looks up at call time
    config = from_name_or_config({"preset": args.model, "num_layers": args.blocks})
    torch.manual_seed(0)
    model = WanModel(config).cuda()
    model.init_weights()
    model.set_attention_backend(args.attention)
    model.compile_blocks(options=options)  # an empty dict: the blocks' default options
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    pt, ph, pw = config.patch_size
    inputs = []
    for b, f, h, w in shapes:
        x = torch.randn(b, config.in_dim, f * pt, h * ph, w * pw, device="cuda")
        inputs.append(((b, f * h * w), x, torch.rand(b, device="cuda") * 1000,
                       torch.randn(b, 64, config.text_dim, device="cuda")))

    def step(x, t, ctx):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t, ctx)
        loss = F.mse_loss(out, x)
        loss.backward()
        return loss

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        for _, x, t, ctx in inputs:
            step(x, t, ctx)
    torch.cuda.synchronize()
    compile_warm_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {f"{b}x{s}": [] for (b, s), *_ in inputs}
    for _ in range(args.iters):
        for (b, s), x, t, ctx in inputs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(x, t, ctx)
            end.record()
            torch.cuda.synchronize()
            times[f"{b}x{s}"].append(start.elapsed_time(end))
    result: dict[str, Any] = {"variant": args.name, "options": options, "rope": args.rope, "blocks": args.blocks,
                              "model": args.model, "attention": args.attention, "warmup_s": round(compile_warm_s, 1),
                              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": {}}
    for (b, s), x, t, ctx in inputs:
        key = f"{b}x{s}"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            w0 = time.perf_counter()
            step(x, t, ctx)
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - w0) * 1e6
        split = split_trace(device_events(prof), wall_us)
        ms = statistics.median(times[key])
        result["shapes"][key] = {
            "step_ms": round(ms, 3), "step_ms_all": [round(v, 3) for v in times[key]],
            "tokens_per_s": round(b * s / ms * 1e3, 1),
            "fused_kinds_ms": {k: round(v / 1e3, 3) for k, v in split["fused_kinds"].items()},
            "group_ms": {k: round(split[k] / 1e3, 3) for k in ("attention", "gemm", "fused_elementwise",
                                                                 "eager_elementwise", "optimizer", "memory", "idle")},
            "top_fused": split["top_kernels"].get("fused_elementwise", []),
        }
        print(f"{args.name}: {key} {ms:.2f} ms, fused {result['shapes'][key]['fused_kinds_ms']}", flush=True)
    append_record(args.out, "bench_block_variants.py", result, run_info())
    return 0


def _rope_pairs(x, cos, sin):
    """RoPE as the model wrote it before ``flip``: ``unbind`` the pairs, ``stack`` the rotated ones (same values)."""
    import torch

    b, s, n, d = x.shape
    x0, x1 = x.float().reshape(b, s, n, d // 2, 2).unbind(-1)
    c, si = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x0 * c - x1 * si, x0 * si + x1 * c], dim=-1).reshape(b, s, n, d)


if __name__ == "__main__":
    raise SystemExit(main())
