"""Where the fused AdaLN forward+backward spends its GPU time: every kernel of one step (ours and the
autograd glue around it, e.g. the gradient of Wan's ``e.chunk(6)``), from the PyTorch profiler;
with ``--graph``, CUDA-graph replays of the parts instead (the profiler's kernel spans overlap once
kernels launch with programmatic dependent launch). Prints a table and appends one record to
``results/adaln_profiles.json`` (``--out``).

    python benchmarks/breakdown_adaln.py [--shapes '1,32760,1536;4,1560,1536'] [--dtype bf16] [--steps 20] [--graph]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing
from _results import RESULTS, append_record
from bench_adaln import _parse_shapes
from torch.profiler import ProfilerActivity, profile

from lightning_adaptiveload.ops import AdaLNLaunchOptions, adaln

# The kernels as the torch.library custom ops that torch.compile traces (registered by the import
# above), called directly to time each half on its own.
adaln_fwd = torch.ops.adaptiveload.adaln_fwd
adaln_bwd = torch.ops.adaptiveload.adaln_bwd
_LAUNCH = list(AdaLNLaunchOptions().as_args())


def chunked_step(x: torch.Tensor, e: torch.Tensor, gy: torch.Tensor):
    """Forward+backward as in a Wan block: scale and shift are chunks of ``e`` ([B, 6, D])."""
    ch = e.chunk(6, dim=1)
    return torch.autograd.grad(adaln(x, ch[1], ch[0], out_dtype=torch.bfloat16), (x, e), gy)


def graph_parts(B: int, N: int, D: int, dtype: torch.dtype) -> dict[str, float]:
    """Median CUDA-graph replay time (us) of: the forward op; the backward op (dx, dscale, dshift
    from saved statistics, finishing reduction included); forward+backward through autograd with
    the modulation as leaf views of a [B, 6, D] tensor (no chunk gradient); and with Wan's
    ``e.chunk(6)`` inside the step (its gradient adds zero fills for the unused chunks and a cat)."""
    x = torch.randn(B, N, D, device="cuda", dtype=dtype, requires_grad=True)
    e = (torch.randn(B, 6, D, device="cuda") * 0.1).requires_grad_()
    gy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)
    views = [v.requires_grad_() for v in e.detach().chunk(6, dim=1)[:2]]  # strided leaves
    with torch.no_grad():
        _, mean, rstd = adaln_fwd(x, views[1], views[0], None, None, 1e-6, torch.bfloat16, _LAUNCH)

    def leaves():
        return torch.autograd.grad(adaln(x, views[1], views[0], out_dtype=torch.bfloat16), (x, *views), gy)

    parts = {
        "forward op": lambda: adaln_fwd(x, views[1], views[0], None, None, 1e-6, torch.bfloat16, _LAUNCH),
        "backward op": lambda: adaln_bwd(gy, x, views[1], None, None, mean, rstd, _LAUNCH),
        "fwd+bwd, leaf views": leaves,
        "fwd+bwd, e.chunk(6)": lambda: chunked_step(x, e, gy),
    }
    out = {}
    for name, fn in parts.items():
        grad = torch.enable_grad() if name.startswith("fwd+bwd") else torch.no_grad()
        with grad:
            out[name] = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1,32760,1536;4,1560,1536", help="shapes 'B,N,D;B,N,D'")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--graph", action="store_true", help="time the parts as CUDA-graph replays")
    parser.add_argument("--out", default=str(RESULTS / "adaln_profiles.json"), help="result file to append to")
    args = parser.parse_args()
    sections = []
    shapes = _parse_shapes(args.shapes)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    for B, N, D in shapes:
        if args.graph:
            print(f"\n{(B, N, D)} {args.dtype}: CUDA-graph replay, median us")
            parts = graph_parts(B, N, D, dtype)
            for name, us in parts.items():
                print(f"  {us:8.2f}  {name}")
            sections.append({"shape": [B, N, D], "dtype": args.dtype, "unit": "us, CUDA-graph replay median",
                             "rows": [{"part": k, "us": round(v, 2)} for k, v in parts.items()]})
            continue
        x = torch.randn(B, N, D, device="cuda", dtype=dtype, requires_grad=True)
        e = (torch.randn(B, 6, D, device="cuda") * 0.1).requires_grad_()
        gy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            chunked_step(x, e, gy)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                chunked_step(x, e, gy)
            torch.cuda.synchronize()
        total, rows = 0.0, []
        print(f"\n{(B, N, D)} {args.dtype}: GPU time per step (us), {args.steps} steps")
        for ev in sorted(prof.key_averages(), key=lambda ev: -ev.device_time_total):
            if ev.device_time_total <= 0:
                continue
            per_step = ev.device_time_total / args.steps
            total += per_step
            print(f"  {per_step:8.2f}  x{ev.count // args.steps:<3} {ev.key[:110]}")
            rows.append({"kernel": ev.key[:110], "calls": ev.count // args.steps, "us": round(per_step, 2)})
        print(f"  {total:8.2f}  total")
        sections.append({"shape": [B, N, D], "dtype": args.dtype, "unit": f"us of GPU time per step, {args.steps} steps",
                         "rows": rows, "total_us": round(total, 2)})
    append_record(args.out, "breakdown_adaln.py" + (" --graph" if args.graph else ""), {"sections": sections})


if __name__ == "__main__":
    main()
