"""Attention backends, measured: forward + backward of each backend at the recipes' sequence lengths, then
the same ``adaptiveload-train`` run with ``model.attention=sdpa`` and ``model.attention=auto`` (the fastest
backend per bucket, FA4 where it runs).

Kernel TFLOP/s count ``3.5 · 4·B·S²·H·D`` (forward ``4·B·S²·H·D``: q·kᵀ and p·v; backward 2.5x the forward);
``ops.attention.time_backends`` medians of CUDA-event timings, one batch of about ``--tokens`` tokens per S.
Recipe runs: ``BalanceMonitor`` means and the epoch estimate (``metrics.json``), MFU = model FLOPs / the
GPU's peak (989 TFLOP/s dense bf16 on an H100/H200).

    python benchmarks/bench_attention.py --kernels                                  # GPU: the kernel table
    python benchmarks/bench_attention.py --kernels --heads 24 --head-dim 128         # HunyuanVideo's heads
    python benchmarks/bench_attention.py --kernels --heads 48 --head-dim 64 \\
        --lengths 1576 17776                                                         # CogVideoX-5B, 480 x 720: image, 49 frames (+ 226 text)
    python benchmarks/bench_attention.py --name wan480p -- experiment=wan2_1_1_3b_480p trainer.devices=1 \\
        trainer.max_steps=50                                                         # GPU: sdpa vs auto
Appends one record per call to ``benchmarks/results/attention.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402
from bench_quickstart import run_train  # noqa: E402

#: The recipes' sequence lengths: 480p images and 17/33/81-frame clips, 720p images and 81-frame clips.
LENGTHS = (1560, 3600, 7800, 20280, 32760, 75600)


def kernels(tokens: int, heads: int, head_dim: int, lengths: tuple[int, ...] = LENGTHS) -> dict:
    from lightning_adaptiveload.ops.attention import available_backends, time_backends

    backends = available_backends("cuda", torch.bfloat16, head_dim)
    rows = []
    for s in lengths:
        ms = time_backends([s], heads, head_dim, device="cuda", tokens=tokens, repeats=10, warmup=3)[s]
        b = max(1, tokens // s)
        flops = 3.5 * 4 * b * s * s * heads * head_dim
        row = {"B": b, "S": s, **{f"{k}_ms": v for k, v in ms.items()},
               **{f"{k}_tflops": flops / (v * 1e-3) / 1e12 for k, v in ms.items()}}
        if "fa4" in ms:
            row["sdpa_over_fa4_time"] = ms["sdpa"] / ms["fa4"]
            torch.use_deterministic_algorithms(True, warn_only=True)  # FA4's deterministic backward
            try:
                det = time_backends([s], heads, head_dim, device="cuda", tokens=tokens, repeats=10, warmup=3,
                                    backends=("fa4",))[s]["fa4"]
            finally:
                torch.use_deterministic_algorithms(False)
            row["fa4_deterministic_ms"] = det
            row["fa4_deterministic_cost"] = det / ms["fa4"] - 1.0
        rows.append(row)
        print(" ".join(f"{k}={v:,.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return {"what": "kernels", "heads": heads, "head_dim": head_dim, "dtype": "bfloat16", "tokens": tokens,
            "backends": list(backends), "rows": rows, "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", action="store_true", help="time the backends' kernels only")
    p.add_argument("--tokens", type=int, default=39_000, help="tokens per timed kernel batch")
    p.add_argument("--heads", type=int, default=12, help="attention heads of the timed kernels (Wan 1.3B: 12)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim of the timed kernels (Wan: 128)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                   help="sequence lengths of the timed kernels (attention tokens: video + joint text)")
    p.add_argument("--name", help="what the recipe runs are, stored with the record")
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--work", type=Path, default=None, help="keep the runs' output here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS / "attention.json")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of both recipe runs")
    args = p.parse_args(argv)
    for name in ("tokens", "heads", "head_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not valid: expected a positive integer")
    if min(args.lengths) < 1:
        p.error(f"--lengths {args.lengths} is not valid: expected positive integers")
    run = run_info()
    if args.kernels:
        if not torch.cuda.is_available():
            p.error("--kernels times CUDA kernels: run it on a GPU machine")
        result = kernels(args.tokens, args.heads, args.head_dim, tuple(args.lengths))
        append_record(args.out, "bench_attention.py", result, run)
        return 0
    if not args.name:
        p.error("--name is required for recipe runs")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        runs = {}
        for setting in ("sdpa", "auto"):
            runs[setting] = run_train(f"attention_{setting}", [*args.overrides, f"model.attention={setting}"], work,
                                      work / f"cache_{setting}", args.timeout)
            r = runs[setting]
            print(f"attention={setting}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu'] or 0:.1%} (epoch "
                  f"{r['epoch_tokens_per_s'] or 0:,.0f}, {r['epoch_mfu'] or 0:.1%}); {r['wall_s']:.0f} s", flush=True)
    result = {"what": "recipe", "name": args.name, "overrides": args.overrides, **runs,
              "auto_over_sdpa_tokens_per_s": runs["auto"]["tokens_per_s"] / runs["sdpa"]["tokens_per_s"],
              "how": "two adaptiveload-train subprocesses, each profiling its own calibration; BalanceMonitor means"}
    append_record(args.out, "bench_attention.py", result, run)
    print({k: v for k, v in result.items() if k not in runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
