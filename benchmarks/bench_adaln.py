"""AdaLN forward and forward+backward on one GPU: eager, torch.compile, Liger LayerNorm + eager
modulate, and the fused kernel, as time and as a fraction of the measured copy bandwidth.

Every provider computes ``LN(x)·(1 + e1) + e0`` with Wan's modulation (strided chunk views of an fp32
[B, 6, D] tensor) and a bf16 output. "Bytes" are the fewest any implementation must move: forward
reads x and writes y; forward+backward also reads dy and writes dx (modulation and statistics are
counted too, they are small). Times are medians of CUDA-graph replays (GPU time); the "+host"
columns launch normally and include each provider's Python/dispatch overhead. Activation memory is
what the forward keeps alive for backward beyond its inputs and output.

The ``same_bytes`` rows are a reference, not a peer: a streaming kernel that moves exactly the bytes
counted above and does no normalisation (forward: y = x cast to bf16; backward: dx = x + dy), the
fastest of a few block sizes (Triton autotuning). Its fraction of copy bandwidth is what a single
pass reaches at that shape and L2 state: below the 1 GiB copy at short shapes (launch and the first
DRAM latency are paid on fewer bytes). Its forward+backward has no modulation gradient, so it
leaves out the ``e.chunk`` gradient that the other providers' steps include.

Back-to-back replays on the same tensors leave them in L2 (60 MiB on the H200), so at shapes whose
working set fits it ((4, 1560, 1536) bf16: 38 MB forward) the plain ("warm") replays run partly
from L2 and can beat copy bandwidth. The "cold" columns (``--l2 cold`` or ``both``, the default)
replay calls that take turns over enough copies of the inputs that every call finds its x, dy and
modulation evicted, as in a training step where other layers run between two AdaLN calls. At
shapes far larger than L2 the two agree.

    python benchmarks/bench_adaln.py                   # appends its rows to benchmarks/results/adaln.csv
    python benchmarks/bench_adaln.py --out /tmp/small.csv --providers ours --shapes '4,1560,1536'
    python benchmarks/bench_adaln.py --out /tmp/no_clusters.csv --providers ours --cluster 1   # launch options

Every row carries the run's hardware, commit, date, torch version, measured copy bandwidth, L2 size and mode
and launch options.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math

import torch
import triton
import triton.language as tl
import triton.testing
from _results import RESULTS, run_info, write_csv_run

from lightning_adaptiveload.ops import AdaLNLaunchOptions, adaln, adaln_ref

SHAPES = [(1, 32760, 1536), (2, 16380, 1536), (1, 75600, 5120), (1, 64000, 3072), (4, 1560, 1536)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the roofline)."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def _liger():
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except ImportError:
        return None

    def fn(x, s, h, w, b):
        return (LigerLayerNormFunction.apply(x, w, b, 1e-6) * (1 + s) + h).to(torch.bfloat16)

    return fn


_BLOCKS = [
    triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8))
]


@triton.autotune(configs=_BLOCKS, key=["n"])
@triton.jit
def _cast_bf16(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.bfloat16), mask=mask)


@triton.autotune(configs=_BLOCKS, key=["n"])
@triton.jit
def _add_cast(x_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    dy = tl.load(dy_ptr + offs, mask=mask)
    tl.store(dx_ptr + offs, x + dy.to(x.dtype), mask=mask)


class _SameBytes(torch.autograd.Function):
    """The op's bytes and nothing else: y = bf16(x) forward, dx = x + dy backward."""

    @staticmethod
    def forward(ctx, x):
        y = torch.empty_like(x, dtype=torch.bfloat16)
        n = x.numel()
        _cast_bf16[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        n = x.numel()
        _add_cast[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, dy.contiguous(), dx, n)
        return dx


def _same_bytes(x, s, h, w, b):
    return _SameBytes.apply(x)


_same_bytes.x_grad_only = True  # no modulation gradient: see the module docstring


def providers(options: AdaLNLaunchOptions | None = None):
    out = {
        "eager": lambda x, s, h, w, b: adaln_ref(x, s, h, out_dtype=torch.bfloat16),
        "compile": torch.compile(lambda x, s, h, w, b: adaln_ref(x, s, h, out_dtype=torch.bfloat16), dynamic=False),
        "ours": lambda x, s, h, w, b: adaln(x, s, h, out_dtype=torch.bfloat16, options=options),
    }
    liger = _liger()
    if liger is not None:
        out["liger_ln+eager"] = liger
    out["same_bytes"] = _same_bytes
    return out


def _graph_ms(fn) -> float:
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    except Exception as err:  # not capturable: report it, keep the plain-launch numbers
        print(f"  (CUDA-graph timing failed: {type(err).__name__}: {str(err)[:120]})")
        torch.cuda.synchronize()
        return math.nan


def bench_one(fn, B, N, D, dtype, cold: bool = True, warm: bool = True, l2_bytes: int = 0):
    def inputs():
        x = torch.randn(B, N, D, device="cuda", dtype=dtype, requires_grad=True)
        e = (torch.randn(B, 6, D, device="cuda") * 0.1).requires_grad_()
        gy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)
        return x, e, gy

    # Cold: the calls of one replay take turns over k input sets, so that the k - 1 calls between two
    # uses of a set stream at least 2x L2's size through it (forward bytes; backward adds more).
    forward_bytes = B * N * D * (torch.empty((), dtype=dtype).element_size() + 2)
    k = 1 + math.ceil(2 * l2_bytes / forward_bytes) if cold else 1
    sets = [inputs() for _ in range(k)]
    w = torch.ones(D, device="cuda", dtype=dtype)
    b = torch.zeros(D, device="cuda", dtype=dtype)

    def fwd(i: int = 0):
        x, e, _ = sets[i]
        ch = e.chunk(6, dim=1)
        return fn(x, ch[1], ch[0], w, b)

    x_only = getattr(fn, "x_grad_only", False)

    def fwd_bwd(i: int = 0):
        x, e, gy = sets[i]
        return torch.autograd.grad(fwd(i), (x,) if x_only else (x, e), gy)

    def taking_turns(step):
        turn = itertools.count()
        return lambda: step(next(turn) % k)

    # Replayed CUDA graphs time the GPU work alone; plain launches add each provider's host overhead
    # (Python, autograd, dispatch), which dominates at small shapes.
    nan = math.nan
    with torch.no_grad():
        t_fwd = _graph_ms(fwd) if warm else nan
        t_fwd_cold = _graph_ms(taking_turns(fwd)) if cold else nan
        t_fwd_host = triton.testing.do_bench(fwd, warmup=10, rep=60, return_mode="median")
    t_fb = _graph_ms(fwd_bwd) if warm else nan
    t_fb_cold = _graph_ms(taking_turns(fwd_bwd)) if cold else nan
    t_fb_host = triton.testing.do_bench(fwd_bwd, warmup=10, rep=60, return_mode="median")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fwd()
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return {
        "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb, "fwd_ms_cold": t_fwd_cold, "fwd_bwd_ms_cold": t_fb_cold,
        "activation_mb": kept / 1e6, "fwd_ms_host": t_fwd_host, "fwd_bwd_ms_host": t_fb_host,
    }  # fmt: skip


TIMES = ("fwd_ms", "fwd_bwd_ms", "fwd_ms_cold", "fwd_bwd_ms_cold", "activation_mb", "fwd_ms_host", "fwd_bwd_ms_host")

HEADER = (
    f"{'shape':>18} {'x':>4} {'provider':>15} {'fwd ms':>8} {'fwd %bw':>7} {'f+b ms':>8} {'f+b %bw':>7} "
    f"{'fwd %cold':>9} {'f+b %cold':>9} {'act MB':>8} {'fwd ms+host':>11} {'f+b ms+host':>11}"
)


def _fmt(r: dict) -> str:
    return (
        f"{str((r['B'], r['N'], r['D'])):>18} {r['x_dtype']:>4} {r['provider']:>15} {r['fwd_ms']:8.3f} "
        f"{100 * r['fwd_frac_copy_bw']:6.1f}% {r['fwd_bwd_ms']:8.3f} {100 * r['fwd_bwd_frac_copy_bw']:6.1f}% "
        f"{100 * r['fwd_frac_copy_bw_cold']:8.1f}% {100 * r['fwd_bwd_frac_copy_bw_cold']:8.1f}% "
        f"{r['activation_mb']:8.1f} {r['fwd_ms_host']:11.3f} {r['fwd_bwd_ms_host']:11.3f}"
    )


def _parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(";"):
        parts = item.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--shapes: expected 'all', 'quick' or 'B,N,D;B,N,D' with positive integers, got {text!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "adaln.csv"), help="CSV result file (rows appended)")
    parser.add_argument(
        "--shapes", default="all", help="'all', 'quick' (first shape only) or shapes 'B,N,D;B,N,D' (e.g. '4,1560,1536')"
    )
    parser.add_argument("--providers", default="all", help="'all' or a comma-separated subset, e.g. 'ours'")
    parser.add_argument(
        "--l2", choices=("both", "warm", "cold"), default="both",
        help="warm: back-to-back replays on the same tensors (they may stay in L2); cold: calls take turns "
        "over copies of the inputs, so each finds them evicted; both (default)",
    )  # fmt: skip
    parser.add_argument("--no-pdl", action="store_true", help="ours: launch without programmatic dependent launch")
    parser.add_argument("--cluster", type=int, default=None, help="ours: backward clusters 1 (never), 2, 4 or 8")
    parser.add_argument("--fwd-features", type=int, default=None, help="ours: streamed forward features, 16 or 24")
    parser.add_argument("--bwd-features", type=int, default=None, help="ours: streamed backward features, 16 or 24")
    args = parser.parse_args()
    options = AdaLNLaunchOptions(
        pdl=not args.no_pdl, cluster=args.cluster, fwd_features=args.fwd_features, bwd_features=args.bwd_features
    )
    torch._dynamo.config.cache_size_limit = 64
    bw = copy_bandwidth()
    run = run_info()
    rows = []
    shapes = {"all": SHAPES, "quick": SHAPES[:1]}.get(args.shapes) or _parse_shapes(args.shapes)
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}, L2 {_l2_bytes() / 2**20:.0f} MiB")
    if args.l2 != "warm" and _l2_bytes() == 0:
        print("the device reports no L2 size: the cold columns take no turns and equal the warm ones")
    for B, N, D in shapes:
        for dname, dtype in DTYPES.items():
            elems = B * N * D
            xs = torch.empty((), dtype=dtype).element_size()
            mod = 2 * B * D * 4
            fwd_bytes = elems * (xs + 2) + mod + 8 * B * N
            fb_bytes = fwd_bytes + elems * (2 + xs + xs) + 2 * mod + 8 * B * N  # fwd, then read x, dy; write dx
            for name, fn in providers(options).items():
                if args.providers != "all" and name not in args.providers.split(","):
                    continue
                error = ""
                try:
                    t = bench_one(
                        fn, B, N, D, dtype, cold=args.l2 != "warm", warm=args.l2 != "cold", l2_bytes=_l2_bytes()
                    )
                except Exception as err:  # a peer failing on a shape is a result, not a crash
                    error = f"{type(err).__name__}: {str(err)[:200]}"
                    print(f"{name} failed at {(B, N, D)} {dname}: {error}")
                    t = dict.fromkeys(TIMES, math.nan)
                rows.append(
                    {
                        "B": B, "N": N, "D": D, "x_dtype": dname, "provider": name,
                        "fwd_ms": t["fwd_ms"], "fwd_bwd_ms": t["fwd_bwd_ms"],
                        "fwd_frac_copy_bw": fwd_bytes / (t["fwd_ms"] * 1e-3) / bw,
                        "fwd_bwd_frac_copy_bw": fb_bytes / (t["fwd_bwd_ms"] * 1e-3) / bw,
                        "activation_mb": t["activation_mb"],
                        "fwd_ms_host": t["fwd_ms_host"],
                        "fwd_bwd_ms_host": t["fwd_bwd_ms_host"],
                        "error": error,
                        "fwd_ms_cold": t["fwd_ms_cold"], "fwd_bwd_ms_cold": t["fwd_bwd_ms_cold"],
                        "fwd_frac_copy_bw_cold": fwd_bytes / (t["fwd_ms_cold"] * 1e-3) / bw,
                        "fwd_bwd_frac_copy_bw_cold": fb_bytes / (t["fwd_bwd_ms_cold"] * 1e-3) / bw,
                    }
                )  # fmt: skip
                torch.cuda.empty_cache()
                print(_fmt(rows[-1]), flush=True)
                _write(args.out, run, bw, rows, args.l2, options)  # after every row, so a cut-short run keeps what it measured
    print(HEADER)
    for r in rows:
        print(_fmt(r))


def _l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0))


def _write(out: str, run: dict, bw: float, rows: list[dict], l2: str, options: AdaLNLaunchOptions) -> None:
    meta = {
        **run, "torch": torch.__version__, "copy_bandwidth_gbps": bw / 1e9, "l2_cache_mb": _l2_bytes() / 2**20,
        "l2": l2, "launch_options": json.dumps(dataclasses.asdict(options)),
    }  # fmt: skip
    write_csv_run(out, meta, rows)


if __name__ == "__main__":
    main()
