"""Where the compiled training step spends its time, per batch shape, against measured ceilings.

One ``adaptiveload-train`` run (the composition of ``bench_speed.py``: ``bucketing=fixed`` with the given
batch shapes interleaved, the recipe's model, compile and checkpointing settings) with a callback that
runs ``torch.profiler`` (CUDA activity) over ``--profile-steps`` steady steps of each shape (no compile in
the step, after ``--warmup`` steps). Every kernel of a traced step goes to one group:

    attention           SDPA kernels (flash, cuDNN, memory-efficient), forward and backward
    gemm                cuBLAS/CUTLASS/nvjet matmuls, convolutions, inductor matmul templates
    fused_elementwise   inductor's fused Triton kernels: norms, modulation, RoPE, gating, casts, GELU
                        (their time also split by kind, roughly, from the fused ops' names: ``fused_kinds``)
    eager_elementwise   other ATen kernels outside the compiled blocks (casts, loss, embeddings)
    optimizer           gradient clipping and AdamW (multi-tensor kernels)
    communication       NCCL
    memory              memcpy / memset
    idle                step wall time in which no kernel ran (host work, launch gaps, syncs)

The group times of a step add up to its wall time (kernels that overlap count once, in the first group
in this order). Model FLOPs are split into attention (self and cross ``S²``/``S·L`` terms) and the rest
(matmuls), counted as forward + backward = 3 × forward, the convention of MFU.

Ceilings measured in the same process, after training, at each shape: the same operations alone, bf16,
CUDA events, median of 10 — SDPA forward + backward (``torch.autograd.grad``) in the model's layout
(``[B, S, heads, head_dim]`` viewed heads-first) for self-attention and against the text length for
cross-attention, and ``F.linear`` with a bias, forward + backward, for the block's linear layers
(q/k/v/o, FFN up/down) at ``M = B·S``. A negative ``in_step_loss`` says the step ran the work faster
than the microbenchmark did (then the microbenchmark is no ceiling for that shape).

The record gives, per shape: the step time (median of untraced steady steps and the traced ones), MFU,
each group's milliseconds and share of the step, achieved TFLOP/s of attention and GEMM in the step against
their ceilings, and "points": the step's time as MFU (model FLOPs at peak) + what attention and GEMM
lose below peak (split into their ceiling's loss and the in-step loss beyond it) + the other groups, which
add up to 100 % of the step. The top kernels of each group are listed.

    python benchmarks/step_breakdown.py                        # 1.3B 480p plan on one GPU -> results/step_breakdown_h200x1.json
    python benchmarks/step_breakdown.py --model tiny --shapes 2x1x4x4,1x3x4x6 --accelerator cpu \\
        --setting eager_full --steps 6 --warmup 1 --out /tmp/breakdown_tiny.json        # CPU smoke (CPU kernels)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402
from bench_e2e import _compose  # noqa: E402
from bench_speed import SETTINGS, _overrides, _parse_shapes  # noqa: E402

# The 1.3B recipe's plan on one H200 for the 480p mix (its record in benchmarks/results/recipes.json).
DEFAULT_SHAPES = "24x1x30x52,4x5x30x52,2x9x30x52,1x13x30x52,1x21x30x52"
GROUPS = ("attention", "gemm", "fused_elementwise", "eager_elementwise", "optimizer", "communication", "memory")


def kernel_group(name: str) -> str:
    """The group of a kernel, from its name (first match in :data:`GROUPS` order, ``eager_elementwise`` last)."""
    n = name.lower()
    if "nccl" in n:
        return "communication"
    if any(k in n for k in ("memcpy", "memset")):
        return "memory"
    if n.startswith("triton_tem"):  # inductor's matmul templates (max-autotune)
        return "gemm"
    if n.startswith("triton_"):  # inductor's fused kernels (their names list the fused ATen ops)
        return "fused_elementwise"
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention")):
        return "attention"
    if any(k in n for k in ("multi_tensor_apply", "adam", "lpnorm", "foreach")):
        return "optimizer"
    if any(k in n for k in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "aten::mm", "addmm", "bmm")):
        return "gemm"
    return "eager_elementwise"


#: Sub-groups of inductor's fused kernels, by the ATen ops their names list (first match): a fused kernel often
#: spans two (the q/k RMSNorm and RoPE in one), so this says where the time goes roughly, by the op named first here.
FUSED_KINDS = (("rope", ("stack", "unbind", "select")), ("norm", ("rsqrt", "native_layer_norm", "mean", "var")),
               ("gelu", ("gelu", "tanh")))


def fused_kind(name: str) -> str:
    """``rope``, ``norm``, ``gelu`` or ``other`` (residual, gating, modulation, casts) for a fused kernel's name."""
    n = name.lower()
    return next((kind for kind, keys in FUSED_KINDS if any(k in n for k in keys)), "other")


def split_trace(events: list[dict[str, Any]], wall_us: float) -> dict[str, Any]:
    """Group a traced step's device events (``{"name", "ts", "dur"}``, µs) into :data:`GROUPS` + idle.

    Overlapping kernels (several streams) count once: each microsecond goes to the first group in
    :data:`GROUPS` order that was busy then. ``idle`` = ``wall_us`` − the union of all kernels.
    """
    spans: dict[str, list[tuple[float, float]]] = {g: [] for g in GROUPS}
    kernels: dict[str, dict[str, float]] = {g: {} for g in GROUPS}
    for e in events:
        g = kernel_group(e["name"])
        spans[g].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        kernels[g][e["name"]] = kernels[g].get(e["name"], 0.0) + float(e["dur"])
    taken: list[tuple[float, float]] = []  # union of the groups so far
    out: dict[str, Any] = {}
    for g in GROUPS:
        mine = _union(spans[g])
        out[g] = max(0.0, _length(mine) - _length(_intersect(mine, taken)))
        taken = _union(taken + mine)
    out["idle"] = max(0.0, wall_us - _length(taken))
    # Kernel time (not a share of the union) of the fused element-wise kernels by kind.
    fused: dict[str, float] = {kind: 0.0 for kind, _ in FUSED_KINDS} | {"other": 0.0}
    for name, us in kernels["fused_elementwise"].items():
        fused[fused_kind(name)] += us
    out["fused_kinds"] = fused
    out["top_kernels"] = {
        g: [[name[:120], round(us / 1e3, 3)] for name, us in sorted(k.items(), key=lambda kv: -kv[1])[:6]]
        for g, k in kernels.items() if k
    }
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def device_events(prof, cuda: bool = True) -> list[dict[str, Any]]:
    """The device-side events (kernels, memcpy, memset) of a finished ``torch.profiler`` session; with
    ``cuda=False`` (the CPU smoke run) the CPU operators stand in for kernels (nested ones overlap their
    parents; :func:`split_trace` counts every microsecond once)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    cats = {"kernel", "gpu_memcpy", "gpu_memset"} if cuda else {"cpu_op"}
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in cats]


def flop_split(config, batch_size: int, seq_len: int) -> dict[str, float]:
    """Model FLOPs of one training step (3 × forward), split into attention and the rest (matmuls)."""
    from lightning_adaptiveload.models.wan import wan_forward_flops

    c = config
    attention = c.num_layers * (4 * seq_len * seq_len * c.dim + 4 * seq_len * c.text_len * c.dim)
    total = wan_forward_flops(c, seq_len)
    return {"total": 3.0 * batch_size * total, "attention": 3.0 * batch_size * attention,
            "gemm": 3.0 * batch_size * (total - attention)}


class _Breakdown:
    """Times every step; profiles ``profile_steps`` steady steps of each shape."""

    def __new__(cls, warmup: int, profile_steps: int):
        import torch
        from lightning.pytorch import Callback

        from lightning_adaptiveload.models.compiling import compile_seconds

        class Breakdown(Callback):
            def __init__(self):
                self.rows: list[dict[str, Any]] = []
                self.traces: dict[str, list[dict[str, Any]]] = {}
                self.prof = None
                self.seen = 0

            def _sync(self, pl_module):
                if pl_module.device.type == "cuda":
                    torch.cuda.synchronize(pl_module.device)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                b, s = (int(v) for v in pl_module.batch_shape(batch))
                key = f"{b}x{s}"
                steady = [r for r in self.rows if r["key"] == key and r["compile_s"] < 1e-3]
                self._trace = (self.seen >= warmup and len(steady) >= 1
                               and len(self.traces.get(key, [])) < profile_steps)
                self._sync(pl_module)
                if self._trace:
                    activity = (torch.profiler.ProfilerActivity.CUDA if pl_module.device.type == "cuda"
                                else torch.profiler.ProfilerActivity.CPU)
                    self.prof = torch.profiler.profile(activities=[activity])
                    self.prof.start()
                self._c0, self._t0 = compile_seconds(), time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self._sync(pl_module)
                dt = time.perf_counter() - self._t0
                b, s = (int(v) for v in pl_module.batch_shape(batch))
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                row = {"key": f"{b}x{s}", "batch_size": b, "seq_len": s, "seconds": dt,
                       "compile_s": compile_seconds() - self._c0, "traced": self._trace,
                       "loss": float(loss.detach().float().cpu())}
                self.seen += 1
                if self._trace:
                    self.prof.stop()
                    # A step on non-finite values runs faster and cooler than training: not traced, nor timed.
                    if row["compile_s"] < 1e-3 and math.isfinite(row["loss"]):
                        events = device_events(self.prof, cuda=pl_module.device.type == "cuda")
                        self.traces.setdefault(row["key"], []).append(
                            {"wall_ms": dt * 1e3, **_ms(split_trace(events, dt * 1e6))})
                    self.prof = None
                self.rows.append(row)

        return Breakdown()


def _ms(split: dict[str, Any]) -> dict[str, Any]:
    # Not rounded: the groups of a step add up to its wall time exactly.
    out = {k: (v / 1e3 if isinstance(v, float) else v) for k, v in split.items()}
    out["fused_kinds"] = {k: v / 1e3 for k, v in split["fused_kinds"].items()}
    return out


def ceilings(shapes, config, dtype_name: str = "bfloat16", reps: int = 10, device: str = "cuda") -> dict[str, Any]:
    """SDPA and the block's GEMMs, forward + backward, at each shape, alone on ``device`` (CUDA events;
    on a CPU, for tests, the host clock)."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    dev = torch.device(device)
    heads, hd, d, ffn, text = config.num_heads, config.head_dim, config.dim, config.ffn_dim, config.text_len

    def timed(fn) -> float:
        fn()
        times = []
        if dev.type != "cuda":
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    out = {}
    for b, grid in shapes:
        s = math.prod(grid)
        row: dict[str, Any] = {}
        for name, kv_len in (("self_attention", s), ("cross_attention", text)):
            # The model's layout ([B, S, heads, head_dim] transposed to heads-first) and its backward
            # (autograd.grad, no accumulation into .grad).
            q, k, v = (torch.randn(b, n, heads, hd, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
                       for n in (s, kv_len, kv_len))
            g = torch.randn(b, s, heads, hd, device=dev, dtype=dtype).transpose(1, 2)

            def sdpa(q=q, k=k, v=v, g=g):
                torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), g)

            t = timed(sdpa)
            flops = 3 * 4 * b * s * kv_len * d  # the model-FLOP convention: 3 x forward
            row[name] = {"ms": t * 1e3, "tflops": flops / t / 1e12}
            del q, k, v, g
        m = b * s
        gemm_t, gemm_f = 0.0, 0.0
        for name, (n_in, n_out) in {"qkvo": (d, d), "ffn_up": (d, ffn), "ffn_down": (ffn, d)}.items():
            # The call the model makes: F.linear with a bias, forward and its three backward products.
            x = torch.randn(m, n_in, device=dev, dtype=dtype, requires_grad=True)
            w = torch.randn(n_out, n_in, device=dev, dtype=dtype, requires_grad=True)
            bias = torch.randn(n_out, device=dev, dtype=dtype, requires_grad=True)
            dy = torch.randn(m, n_out, device=dev, dtype=dtype)

            def lin(x=x, w=w, bias=bias, dy=dy):
                torch.autograd.grad(F.linear(x, w, bias), (x, w, bias), dy)

            t = timed(lin)
            flops = 3 * 2 * m * n_in * n_out
            row[name] = {"ms": t * 1e3, "tflops": flops / t / 1e12}
            count = 6 if name == "qkvo" else 1  # self q,k,v,o + cross q,o run at M = B*S
            gemm_t, gemm_f = gemm_t + count * t, gemm_f + count * flops
            del x, w, bias, dy
        row["block_gemms_tflops"] = gemm_f / gemm_t / 1e12
        out[f"{b}x{s}"] = row
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def summarize(rows, traces, ceils, config, warmup: int, peak_tflops: float) -> dict[str, Any]:
    out = {}
    for key, traced in traces.items():
        b, s = (int(v) for v in key.split("x"))
        steady = [r["seconds"] for i, r in enumerate(rows) if r["key"] == key and i >= warmup
                  and r["compile_s"] < 1e-3 and not r["traced"] and math.isfinite(r.get("loss", 0.0))]
        flops = flop_split(config, b, s)
        step_s = statistics.median(steady) if steady else statistics.median(t["wall_ms"] / 1e3 for t in traced)
        groups = {g: statistics.median(t[g] for t in traced) for g in (*GROUPS, "idle")}
        traced_ms = statistics.median(t["wall_ms"] for t in traced)
        peak = peak_tflops * 1e12
        entry: dict[str, Any] = {
            "batch_size": b, "seq_len": s, "step_ms": step_s * 1e3, "untraced_steps": len(steady),
            "nonfinite_loss_steps": sum(r["key"] == key and not math.isfinite(r.get("loss", 0.0)) for r in rows),
            "traced_step_ms": traced_ms, "traced_steps": len(traced),
            "tokens_per_s": b * s / step_s, "mfu": flops["total"] / step_s / peak,
            "group_ms": groups, "group_share": {g: v / traced_ms for g, v in groups.items()},
            "fused_kinds_ms": {k: statistics.median(t["fused_kinds"][k] for t in traced)
                               for k in traced[-1]["fused_kinds"]},
            "top_kernels": traced[-1]["top_kernels"],
        }
        for g in ("attention", "gemm"):
            t = groups[g] / 1e3
            entry[f"{g}_tflops_in_step"] = flops[g] / t / 1e12 if t > 0 else None
        ceil = (ceils or {}).get(key)
        # Points: the traced step's time as shares; attention and GEMM split into FLOPs-at-peak,
        # their ceiling's loss below peak and the in-step loss beyond the ceiling.
        points: dict[str, float] = {}
        for g in ("attention", "gemm"):
            t_ms = groups[g]
            at_peak = flops[g] / peak * 1e3
            points[f"{g}_flops_at_peak"] = at_peak / traced_ms
            if ceil:
                if g == "attention":  # every layer runs one self- and one cross-attention
                    c_t = config.num_layers * (ceil["self_attention"]["ms"] + ceil["cross_attention"]["ms"])
                else:
                    c_t = flops["gemm"] / (ceil["block_gemms_tflops"] * 1e12) * 1e3
                c_t = max(c_t, at_peak)
                points[f"{g}_ceiling_loss"] = (c_t - at_peak) / traced_ms
                points[f"{g}_in_step_loss"] = (t_ms - c_t) / traced_ms
                entry[f"{g}_ceiling_ms"] = c_t
            else:
                points[f"{g}_below_peak"] = (t_ms - at_peak) / traced_ms
        for g in ("fused_elementwise", "eager_elementwise", "optimizer", "communication", "memory", "idle"):
            points[g] = groups[g] / traced_ms
        entry["points"] = points
        if ceil:
            entry["ceilings"] = ceil
        out[key] = entry
    return out


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="wan2_1_1_3b", help="conf/model choice")
    p.add_argument("--blocks", type=int, default=0, help="transformer blocks (0: the preset's full depth)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="B x token grid (f x h x w), comma-separated")
    p.add_argument("--setting", default="compiled_none", help=f"one of {list(SETTINGS)}")
    p.add_argument("--steps", type=int, default=40, help="training steps of the run (all shapes)")
    p.add_argument("--warmup", type=int, default=8, help="first steps of the run never traced nor timed")
    p.add_argument("--profile-steps", type=int, default=2, help="traced steps per shape")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak for MFU (H100/H200 dense bf16: 989)")
    p.add_argument("--no-ceilings", action="store_true", help="skip the SDPA and GEMM microbenchmarks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--out", default=str(RESULTS / "step_breakdown_h200x1.json"), help="JSON result file (appended)")
    args = p.parse_args(argv)
    if args.setting not in SETTINGS:
        p.error(f"--setting {args.setting!r} is not one of {list(SETTINGS)}")
    if min(args.steps, args.profile_steps) < 1 or args.warmup < 0:
        p.error("--steps and --profile-steps must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = _parse_args(argv)
    from lightning_adaptiveload.train import build, configure_cuda_allocator

    configure_cuda_allocator()
    import torch

    shapes = _parse_shapes(args.shapes)
    out = Path(args.out)
    cfg = _compose(_overrides(args, args.setting, shapes, args.steps, args.blocks,
                              out.parent / (out.stem + "_runs")))
    run = build(cfg)
    cb = _Breakdown(args.warmup, args.profile_steps)
    run.trainer.callbacks.append(cb)
    t0 = time.perf_counter()
    run.trainer.fit(run.module, datamodule=run.datamodule)
    wall = time.perf_counter() - t0
    config = run.module.wan_config
    missing = [f"{b}x{math.prod(g)}" for b, g in shapes if f"{b}x{math.prod(g)}" not in cb.traces]
    del run
    ceils = None
    if torch.cuda.is_available() and not args.no_ceilings:
        torch.cuda.empty_cache()
        ceils = ceilings(shapes, config)
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "how": __doc__.split("\n\n")[1].replace("\n", " "),
            "model": args.model, "blocks": args.blocks or "all (preset depth)", "setting": args.setting,
            "shapes": args.shapes, "overrides": args.override, "steps": args.steps, "wall_s": wall,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__, "peak_tflops": args.peak_tflops,
            "not_traced": missing,
        },
        "shapes": summarize(cb.rows, cb.traces, ceils, config, args.warmup, args.peak_tflops),
        "rows": cb.rows,
    }
    append_record(out, "step_breakdown.py", result, run_info())
    print(table(result))
    print(f"appended to {out}")
    return 0


def table(result: dict[str, Any]) -> str:
    """Per shape: step time, MFU, each group's share of the traced step, attention and GEMM TFLOP/s in the step."""
    cols = ["attention", "gemm", "fused_elementwise", "eager_elementwise", "optimizer", "memory", "idle"]
    lines = ["| B × S | step ms | tokens/s | MFU | " + " | ".join(c.replace("_", " ") for c in cols)
             + " | attention TFLOP/s | GEMM TFLOP/s |", "|---" * (len(cols) + 6) + "|"]
    for key, e in sorted(result["shapes"].items(), key=lambda kv: kv[1]["seq_len"]):
        share = " | ".join(f"{e['group_share'][c]:.1%}" for c in cols)
        b, s = key.split("x")
        lines.append(f"| {b} × {int(s):,} | {e['step_ms']:.0f} | {e['tokens_per_s']:,.0f} | {e['mfu']:.1%} | {share} | "
                     f"{e.get('attention_tflops_in_step') or 0:.0f} | {e.get('gemm_tflops_in_step') or 0:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
