"""Where the fused AdaLN forward+backward spends its GPU time: every kernel of one step (ours and the
autograd glue around it, e.g. the gradient of Wan's ``e.chunk(6)``), from the PyTorch profiler.

    python benchmarks/breakdown_adaln.py [--shape 1,32760,1536] [--dtype bf16] [--steps 20]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_adaptiveload.ops import adaln


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="B,N,D (repeatable); default two Wan shapes")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in (args.shape or ["1,32760,1536", "4,1560,1536"])]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    for B, N, D in shapes:
        x = torch.randn(B, N, D, device="cuda", dtype=dtype, requires_grad=True)
        e = (torch.randn(B, 6, D, device="cuda") * 0.1).requires_grad_()
        gy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)

        def step(x=x, e=e, gy=gy):
            ch = e.chunk(6, dim=1)
            y = adaln(x, ch[1], ch[0], out_dtype=torch.bfloat16)
            return torch.autograd.grad(y, (x, e), gy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        total = 0.0
        print(f"\n{(B, N, D)} {args.dtype}: GPU time per step (us), {args.steps} steps")
        for ev in sorted(prof.key_averages(), key=lambda ev: -ev.device_time_total):
            if ev.device_time_total <= 0:
                continue
            per_step = ev.device_time_total / args.steps
            total += per_step
            print(f"  {per_step:8.2f}  x{ev.count // args.steps:<3} {ev.key[:110]}")
        print(f"  {total:8.2f}  total")


if __name__ == "__main__":
    main()
