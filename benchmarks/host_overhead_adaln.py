"""Host (Python + dispatch + autograd) cost of the fused AdaLN op with the CUDA kernels stubbed out.

Runs on any machine: the extension is replaced by a stub that only allocates the outputs, so the
time is what ``adaln()`` and autograd cost per call around the kernels. Two paths: ``eager`` is
what ``adaln()`` runs outside ``torch.compile`` (a ``torch.autograd.Function`` over the extension,
plan cached per input signature); ``custom_op`` is the ``torch.library`` path that ``torch.compile``
traces, called eagerly (every check and view per call, the custom ops' dispatch and their
registered autograd), which is what every eager call ran before the eager path existed; ``floor``
is a bare ``torch.autograd.Function`` that calls the stub with no checks, views or options: what
this harness (``e.chunk``, ``torch.autograd.grad``, the stub's allocations) costs by itself. Shapes are
tiny on purpose; the stub allocates on the CPU, so the absolute numbers are this machine's, not a
GPU host's.

With ``--cuda`` it times the real kernels instead, as a training step calls them (no CUDA graph):
forward+backward wall time per call (``torch.cuda.synchronize`` around many calls) of the eager path,
the custom-op path, eager PyTorch (``adaln_ref``) and the floor (no kernels: what the step's
``e.chunk`` and ``torch.autograd.grad`` cost on this host), against the GPU time of one call (CUDA
events around replays of a CUDA graph of it). bf16 x, Wan's fp32 [B, 6, D] modulation as chunk views, bf16
output.

    python benchmarks/host_overhead_adaln.py [--calls 2000] [--repeats 5] [--json PATH] [--profile]
    python benchmarks/host_overhead_adaln.py --cuda [--shapes '1,32760,1536;4,1560,1536'] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import platform
import pstats
import statistics
import time

import torch
from _results import append_record

from lightning_adaptiveload.ops import _adaln, adaln, adaln_ref, adaln_unsupported_reason


class _StubExtension:
    max_d, max_d_any = _adaln.ADALN_MAX_D, _adaln.ADALN_MAX_D_ANY

    @staticmethod
    def adaln(x, scale, shift, weight, bias, eps, out_dtype, launch):
        # The real extension's op has a C++ autograd node; a Python one stands in for it here.
        return _Bare.apply(x, scale, shift)

    @staticmethod
    def fwd(x, scale, shift, weight, bias, eps, out_dtype, launch):
        B, N, D = x.shape
        stats = torch.empty(B * N, device=x.device)
        return torch.empty(B, N, D, dtype=out_dtype, device=x.device), stats, torch.empty_like(stats)

    @staticmethod
    def bwd(dy, x, scale, weight, bias, mean, rstd, launch):
        empty = [torch.empty(0, device=x.device) for _ in range(2)]  # outputs may not alias each other
        return torch.empty_like(x), torch.empty_like(scale), torch.empty_like(scale), *empty


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, shift):
        y, mean, rstd = _StubExtension.fwd(x, scale, shift, None, None, 1e-6, torch.bfloat16, None)
        ctx.save_for_backward(x, scale, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, scale, mean, rstd = ctx.saved_tensors
        dx, dscale, dshift, _, _ = _StubExtension.bwd(dy, x, scale, None, None, mean, rstd, None)
        return dx, dscale, dshift


def _install_stub() -> None:
    # The support check would refuse CPU tensors; the stub stands in for a built extension on a GPU.
    _adaln._extension = _StubExtension()
    _adaln._unsupported_reason = lambda *a: None
    _adaln._plans.clear()


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _cuda_wall_us(step, calls: int, repeats: int) -> list[float]:
    for _ in range(20):
        step()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) / calls * 1e6)
    return out


def _cuda_graph_us(make_step, replays: int, repeats: int) -> list[float]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # Inputs made and the step captured on a side stream: autograd must not tie the capture to the
    # legacy stream (the leaves' streams decide where the backward runs).
    with torch.cuda.stream(side):
        step = make_step()
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(10):
        graph.replay()
    out = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        out.append(begin.elapsed_time(end) / replays * 1e3)
    return out


def _make_step(op, B: int, N: int, D: int):
    """One Wan-style forward+backward of ``op`` on fresh inputs (bf16 x, fp32 [B, 6, D] modulation)."""
    x = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    e = (torch.randn(B, 6, D, device="cuda") * 0.5).requires_grad_()
    gy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)

    def step():
        c = e.chunk(6, dim=1)
        return torch.autograd.grad(op(x, c[1], c[0]), (x, e), gy)

    return step


def cuda_eager_calls(shapes: list[tuple[int, int, int]], calls: int, repeats: int) -> list[dict]:
    """Forward+backward per call of the real op on the current GPU (see the module docstring)."""
    rows = []
    for B, N, D in shapes:
        x = torch.empty(B, N, D, device="cuda", dtype=torch.bfloat16)
        e = torch.empty(B, 6, D, device="cuda").chunk(6, dim=1)
        reason = adaln_unsupported_reason(x, e[1], e[0], out_dtype=torch.bfloat16)
        if reason is not None:
            raise RuntimeError(f"the fused kernel does not run {(B, N, D)}: {reason}")
        ops = {
            "eager": lambda x, s, h: adaln(x, s, h, out_dtype=torch.bfloat16),
            "custom_op": lambda x, s, h: _adaln._adaln_traced(
                x, s, h, None, None, 1e-6, torch.bfloat16, _adaln._DEFAULT_LAUNCH
            ),
            "adaln_ref": lambda x, s, h: adaln_ref(x, s, h, out_dtype=torch.bfloat16),
            "floor": _Bare.apply,  # allocations only: what e.chunk + autograd.grad cost around any op
        }
        row = {"B": B, "N": N, "D": D}
        for name, op in ops.items():
            row[f"{name}_wall_us"] = _cuda_wall_us(_make_step(op, B, N, D), calls, repeats)
            if name in ("eager", "adaln_ref"):  # custom_op runs eager's kernels; floor runs none
                row[f"{name}_gpu_us"] = _cuda_graph_us(functools.partial(_make_step, op, B, N, D), calls, repeats)
            torch.cuda.empty_cache()
        med = {k: statistics.median(v) for k, v in row.items() if isinstance(v, list)}
        row["eager_wall_over_gpu"] = med["eager_wall_us"] / med["eager_gpu_us"]
        row["ref_wall_over_eager_wall"] = med["adaln_ref_wall_us"] / med["eager_wall_us"]
        rows.append(row)
        print(
            f"{(B, N, D)} bf16 fwd+bwd per call, median us: fused GPU {med['eager_gpu_us']:.1f}, "
            f"eager wall {med['eager_wall_us']:.1f} ({row['eager_wall_over_gpu']:.2f}x GPU), "
            f"custom-op wall {med['custom_op_wall_us']:.1f}, adaln_ref wall {med['adaln_ref_wall_us']:.1f} "
            f"(GPU {med['adaln_ref_gpu_us']:.1f}; {row['ref_wall_over_eager_wall']:.2f}x the fused eager wall), "
            f"floor (no kernels) wall {med['floor_wall_us']:.1f}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; the table shows their median")
    parser.add_argument("--json", default=None, help="append the per-round numbers to this result file, e.g. benchmarks/results/host_overhead_adaln.json")
    parser.add_argument("--profile", action="store_true", help="also print the top cProfile entries (eager)")
    parser.add_argument("--cuda", action="store_true", help="time the real kernels on the GPU instead")
    parser.add_argument("--shapes", default="1,32760,1536;4,1560,1536", help="with --cuda: 'B,N,D;B,N,D'")
    args = parser.parse_args()
    if args.cuda:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
        rows = cuda_eager_calls(shapes, min(args.calls, 200), args.repeats)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "x_dtype": "bf16", "modulation": "fp32 [B, 6, D] chunk views", "out_dtype": "bf16",
                "calls": min(args.calls, 200), "repeats": args.repeats}  # fmt: skip
        if args.json:
            append_record(args.json, "host_overhead_adaln.py --cuda", {"meta": meta, "rows": rows})
        return
    _install_stub()
    x = torch.randn(1, 8, 64, requires_grad=True)
    e = torch.randn(1, 6, 64, requires_grad=True)  # Wan's [B, 6, D] modulation, read as chunk views
    gy = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    paths = {
        "eager": lambda x, s, h: adaln(x, s, h, out_dtype=torch.bfloat16),
        "custom_op": lambda x, s, h: _adaln._adaln_traced(
            x, s, h, None, None, 1e-6, torch.bfloat16, _adaln._DEFAULT_LAUNCH
        ),
        "floor": _Bare.apply,
    }
    cases = []
    for path, op in paths.items():

        def fwd(op=op):
            ch = e.chunk(6, dim=1)
            return op(x, ch[1], ch[0])

        def fwd_bwd(fwd=fwd):
            return torch.autograd.grad(fwd(), (x, e), gy)

        def fwd_no_grad(fwd=fwd):
            with torch.no_grad():
                return fwd()

        for what, fn in (("forward", fwd), ("forward+backward", fwd_bwd), ("forward, no grad", fwd_no_grad)):
            for _ in range(50):
                fn()
            cases.append({"path": path, "call": what, "fn": fn, "us_per_call": []})
    # Rounds take turns over the cases, so that load from other processes spreads over all of them.
    for _ in range(args.repeats):
        for case in cases:
            case["us_per_call"].append(_per_call_us(case["fn"], args.calls))
    results = [{k: v for k, v in case.items() if k != "fn"} for case in cases]
    for r in results:
        rounds = r["us_per_call"]
        print(f"{r['path']:>9}  {r['call']:<17} {statistics.median(rounds):7.1f} us per call "
              f"(median of {args.repeats}, min {min(rounds):.1f})")  # fmt: skip
    if args.json:
        meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                "calls": args.calls, "repeats": args.repeats, "shape": [1, 8, 64],
                "note": "CPU, extension stubbed: host cost only; includes torch.autograd.grad and e.chunk(6)"}  # fmt: skip
        append_record(args.json, "host_overhead_adaln.py", {"meta": meta, "rows": results})
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            torch.autograd.grad(paths["eager"](x, *e.chunk(6, dim=1)[1::-1]), (x, e), gy)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
