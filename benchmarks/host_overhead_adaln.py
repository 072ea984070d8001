"""Host (Python + dispatch + autograd) cost of the fused AdaLN path with the CUDA kernels stubbed out.

Runs on any machine: the extension is replaced by a stub that only allocates the outputs, so the
time is what ``adaln()``, the ``torch.library`` custom ops and autograd cost per call. Shapes are
tiny on purpose.

    python benchmarks/host_overhead_adaln.py [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import time

import torch

from lightning_adaptiveload.ops import adaln

ops = importlib.import_module("lightning_adaptiveload.ops.adaln")


class _StubExtension:
    @staticmethod
    def fwd(x, scale, shift, weight, bias, eps, out_dtype):
        B, N, D = x.shape
        return torch.empty(B, N, D, dtype=out_dtype), torch.empty(B * N), torch.empty(B * N)

    @staticmethod
    def bwd(dy, x, scale, weight, bias, mean, rstd):
        return torch.empty_like(x), torch.empty_like(scale), torch.empty_like(scale), torch.empty(0), torch.empty(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="also print the top cProfile entries")
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    ops._extension = _StubExtension()
    ops._unsupported_reason = lambda *a: None
    x = torch.randn(1, 8, 64, requires_grad=True)
    e = torch.randn(1, 6, 64, requires_grad=True)  # Wan's [B, 6, D] modulation, read as chunk views
    gy = torch.randn(1, 8, 64, dtype=torch.bfloat16)

    def fwd():
        ch = e.chunk(6, dim=1)
        return adaln(x, ch[1], ch[0], out_dtype=torch.bfloat16)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (x, e), gy)

    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        for _ in range(50):
            fn()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        print(f"{name}: {(time.perf_counter() - start) / args.calls * 1e6:.0f} us per call")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fwd_bwd()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
