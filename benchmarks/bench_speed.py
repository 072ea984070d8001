"""Whole-step speed per shape through ``adaptiveload-train``: compiled vs eager, checkpointing modes, fused AdaLN.

Each setting is one ``adaptiveload-train`` run (Hydra compose of ``conf/train.yaml`` with overrides, then
``lightning_adaptiveload.train.build`` and ``Trainer.fit``) on a synthetic corpus of three shapes
(by default Wan 2.1 480p: 1×32,760 = one 81-frame clip, 4×7,800 = four 17-frame clips, 16×1,560 =
sixteen images) with the batch sizes pinned (``bucketing=fixed``), batches of the three shapes
interleaved at random. A callback times every optimizer step on the device (CUDA-synchronised, from
``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, clipping and the optimizer;
data loading excluded) and reads the compile clock: steps in which ``torch.compile`` compiled and
the first ``--warmup`` steps are left out; the median of the rest is kept per shape.

MFU = model FLOPs of forward + backward (``FlowMatchingModule.flops_per_sample``: every matmul, attention
included, recompute not counted) / step time / peak (989 TFLOP/s dense bf16 for H100/H200).

    python benchmarks/bench_speed.py          # appends a record to benchmarks/results/speed.json
    python benchmarks/bench_speed.py --model tiny --shapes 2x1x4x4,1x3x4x6 --accelerator cpu \\
        --settings eager_full --steps 2 --warmup 1 --out /tmp/speed_tiny.json            # CPU smoke

``--loss-steps N`` additionally trains ``--loss-shape`` for N steps from one seed with the eager and the
compiled setting and stores both loss curves (``--loss-blocks`` limits the depth; stated in the output).
"""

from __future__ import annotations

import argparse
import datetime
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
from bench_e2e import _compose  # noqa: E402  (the same Hydra composition as the end-to-end benchmark)

# name -> (model.compile, model.activation_checkpointing, fused AdaLN callback)
SETTINGS: dict[str, tuple[bool, str, bool]] = {
    "eager_full": (False, "full", False),
    "eager_full_fused": (False, "full", True),
    "compiled_none": (True, "none", False),
    "compiled_selective": (True, "selective", False),
    "compiled_full": (True, "full", False),
    "compiled_selective_fused": (True, "selective", True),
    "compiled_none_fused": (True, "none", True),
}
DEFAULT_SHAPES = "1x21x30x52,4x5x30x52,16x1x30x52"


def _parse_shapes(text: str) -> list[tuple[int, tuple[int, int, int]]]:
    out = []
    for item in text.split(","):
        parts = [int(v) for v in item.lower().split("x")]
        if len(parts) != 4 or min(parts) < 1:
            raise SystemExit(f"--shapes item {item!r} is not valid; expected BxFxHxW (batch, token grid), e.g. 1x21x30x52")
        out.append((parts[0], (parts[1], parts[2], parts[3])))
    lengths = [f * h * w for _, (f, h, w) in out]
    repeated = sorted({s for s in lengths if lengths.count(s) > 1})
    if repeated:
        # bucketing=fixed pins one batch size per sequence length: a second shape of the same S would
        # silently replace the first.
        raise SystemExit(f"--shapes has more than one shape with S = {', '.join(f'{s:,}' for s in repeated)} tokens; "
                         "bucketing=fixed takes one batch size per sequence length")
    return out


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="wan2_1_1_3b", help="conf/model choice")
    p.add_argument("--blocks", type=int, default=0, help="transformer blocks (0: the preset's full depth)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="B x token grid (f x h x w), comma-separated")
    p.add_argument("--settings", default="eager_full,eager_full_fused,compiled_none,compiled_selective",
                   help=f"subset of {list(SETTINGS)}")
    p.add_argument("--steps", type=int, default=6, help="measured steps per shape (about)")
    p.add_argument("--warmup", type=int, default=3, help="first steps of a run left out")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak for MFU (H100/H200 dense bf16: 989)")
    p.add_argument("--loss-steps", type=int, default=0, help="also record eager vs compiled loss curves")
    p.add_argument("--loss-shape", default="4x1x30x52", help="B x token grid of the loss-curve runs")
    p.add_argument("--loss-blocks", type=int, default=0, help="blocks of the loss-curve runs (0: full depth)")
    p.add_argument("--loss-settings", default="eager_full,compiled_selective",
                   help="the two settings compared by the loss curves")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="profile the last N steps of each setting with torch.profiler (host vs device time)")
    p.add_argument("--out", default=str(RESULTS / "speed.json"), help="JSON result file (record appended)")
    args = p.parse_args(argv)
    bad = [s for s in args.settings.split(",") + args.loss_settings.split(",") if s not in SETTINGS]
    if bad:
        p.error(f"unknown settings {bad}; expected names from {list(SETTINGS)}")
    if args.steps < 1 or min(args.warmup, args.blocks, args.loss_steps, args.trace_steps) < 0:
        p.error("--steps must be >= 1; --warmup, --blocks, --loss-steps and --trace-steps >= 0")
    return args


class _StepTimer:
    """Times each optimizer step on the device and notes whether anything compiled in it."""

    def __new__(cls, peak_tflops: float, trace_from: int | None = None, trace_out: Path | None = None):
        import torch
        from lightning.pytorch import Callback

        from lightning_adaptiveload.models.compiling import compile_seconds

        class StepTimer(Callback):
            def __init__(self):
                self.rows: list[dict[str, Any]] = []
                self.losses: list[float] = []
                self.prof = None
                self.trace: dict[str, Any] | None = None

            def _sync(self, pl_module):
                if pl_module.device.type == "cuda":
                    torch.cuda.synchronize(pl_module.device)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trace_from is not None and self.prof is None and trainer.global_step >= trace_from:
                    self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                   torch.profiler.ProfilerActivity.CUDA])
                    self.prof.start()
                    self._trace_t0, self._trace_rows = time.perf_counter(), len(self.rows)
                self._sync(pl_module)
                if pl_module.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(pl_module.device)
                self._c0, self._t0 = compile_seconds(), time.perf_counter()
                self._t_update = None

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                # After forward + backward; what follows is clipping and the optimizer update.
                self._sync(pl_module)
                self._t_update = time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self._sync(pl_module)
                dt = time.perf_counter() - self._t0
                b, s = (int(v) for v in pl_module.batch_shape(batch))
                flops = b * float(pl_module.flops_per_sample(s))
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                self.losses.append(float(loss.detach().float().cpu()))
                self.rows.append({
                    "step": trainer.global_step, "batch_size": b, "seq_len": s, "seconds": dt, "loss": self.losses[-1],
                    "update_s": None if self._t_update is None else time.perf_counter() - self._t_update,
                    "compile_s": compile_seconds() - self._c0,
                    "peak_gib": (torch.cuda.max_memory_allocated(pl_module.device) / 2**30
                                 if pl_module.device.type == "cuda" else None),
                    "tokens_per_s": b * s / dt, "tflops": flops / dt / 1e12,
                    "mfu": flops / dt / (peak_tflops * 1e12),
                })

            def on_train_end(self, trainer, pl_module):
                if self.prof is not None:
                    self._sync(pl_module)
                    wall = time.perf_counter() - self._trace_t0
                    self.prof.stop()
                    self.trace = _write_trace(self.prof, wall, self.rows[self._trace_rows:], trace_out)


        return StepTimer()


def _write_trace(prof, wall: float, rows: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """Host vs device time of the traced steps, and the top operators by each: the profiler's tables go to
    ``out`` (a temporary folder), the summary (wall, device busy, top 30 by device time) into the record."""
    import torch

    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    shapes = ", ".join(f"{r['batch_size']}x{r['seq_len']}" for r in rows)
    lines = [f"traced steps: {len(rows)} ({shapes})",
             f"wall {wall * 1e3:.1f} ms; device busy (sum of kernel time) {device_us / 1e3:.1f} ms "
             f"= {device_us / 1e3 / max(wall * 1e3, 1e-9):.1%} of wall", "",
             events.table(sort_by="self_device_time_total", row_limit=30), "",
             events.table(sort_by="self_cpu_time_total", row_limit=30)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines[:2]), f"-> {out}", flush=True)
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:30]
    return {"steps": [f"{r['batch_size']}x{r['seq_len']}" for r in rows], "wall_ms": wall * 1e3,
            "device_busy_ms": device_us / 1e3,
            "top_by_self_device_time": [{"name": e.key[:120], "self_device_ms": e.self_device_time_total / 1e3,
                                         "calls": e.count} for e in top if e.self_device_time_total > 0]}  # fmt: skip


def _overrides(args: argparse.Namespace, setting: str, shapes, steps: int, blocks: int, out_dir: Path) -> list[str]:
    compile_, ckpt, fused = SETTINGS[setting]
    gpu = args.accelerator != "cpu"
    mixture = ",".join(
        f"{{num_frames:{1 + 4 * (f - 1)},height:{16 * h},width:{16 * w},weight:{b}}}" for b, (f, h, w) in shapes)
    table = ",".join(f"{f * h * w}:{b}" for b, (f, h, w) in shapes)
    ov = [
        f"model={args.model}", "data=synthetic_wan", f"data.dataset.mixture=[{mixture}]",
        f"data.dataset.num_samples={max(64, 4 * steps * sum(b for b, _ in shapes))}",
        "data.datamodule.num_workers=2", f"data.datamodule.pin_memory={str(gpu).lower()}",
        f"trainer={'gpu' if gpu else 'cpu'}", f"trainer.accelerator={args.accelerator}", "trainer.devices=1",
        f"trainer.max_steps={steps}", "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false",
        "logger=none", f"seed={args.seed}", "bucketing=fixed", f"bucketing.policy.batch_sizes={{{table}}}",
        f"callbacks={'gpu' if fused else 'default'}", "~callbacks.model_checkpoint", "~callbacks.shape_benchmark",
        "callbacks.balance_monitor.print_report=false", "print_plan=false",
        f"model.compile={str(compile_ and gpu).lower()}", f"model.activation_checkpointing={ckpt}",
        f"output_dir={out_dir / setting}",
    ]
    if not gpu:
        ov.append("trainer.precision=32-true")
    if blocks:
        ov.append(f"++model.model.num_layers={blocks}")
    return ov + list(args.override)


def _fit(args, setting, shapes, steps, blocks, out_dir) -> tuple[Any, Any, float]:
    from lightning_adaptiveload.train import build

    cfg = _compose(_overrides(args, setting, shapes, steps, blocks, out_dir))
    run = build(cfg)
    trace = getattr(args, "trace_steps", 0)
    timer = _StepTimer(args.peak_tflops, steps - trace if trace else None,
                       Path(out_dir) / f"{Path(args.out).stem}_trace_{setting}.txt")
    run.trainer.callbacks.append(timer)
    t0 = time.perf_counter()
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return run, timer, time.perf_counter() - t0


def _per_shape(rows: list[dict[str, Any]], warmup: int, shapes, peak_tflops: float) -> dict[str, Any]:
    out = {}
    for b, grid in shapes:
        s = math.prod(grid)
        mine = [(i, r) for i, r in enumerate(rows) if r["seq_len"] == s and r["batch_size"] == b]
        # A step whose loss is not finite is left out: a diverged run's step times say nothing about training.
        steady = [r for i, r in mine if i >= warmup and r["compile_s"] < 1e-3 and math.isfinite(r.get("loss", 0.0))]
        nonfinite = sum(not math.isfinite(r.get("loss", 0.0)) for _, r in mine)
        key = f"{b}x{s}"
        if not steady:
            out[key] = {"steps": 0, "nonfinite_loss_steps": nonfinite,
                        "note": f"{len(mine)} steps, none steady (compiling, warm-up or a non-finite loss)"}
            continue
        dt = statistics.median(r["seconds"] for r in steady)
        tflop = steady[0]["tflops"] * steady[0]["seconds"]  # model TFLOP of one step of this shape
        out[key] = {
            "batch_size": b, "grid": list(grid), "seq_len": s, "steps": len(steady), "step_s": dt,
            "tokens_per_s": b * s / dt, "tflops_per_gpu": tflop / dt, "mfu": tflop / dt / peak_tflops,
            "update_s": statistics.median(r.get("update_s") or 0.0 for r in steady),  # clipping + optimizer
            "peak_gib": max((r["peak_gib"] or 0.0) for _, r in mine),
            "compile_s": sum(r["compile_s"] for _, r in mine), "nonfinite_loss_steps": nonfinite,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from lightning_adaptiveload.train import configure_cuda_allocator

    configure_cuda_allocator()  # as adaptiveload-train does
    import torch

    shapes = _parse_shapes(args.shapes)
    out = Path(args.out)
    # Lightning's run folders and the profiler tables are raw output: a temporary folder, not benchmarks/results/.
    out_dir = Path(tempfile.mkdtemp(prefix=f"adaptiveload_{out.stem}_runs_"))
    print(f"run folders (logs, checkpoints): {out_dir}", flush=True)
    steps = args.warmup + args.steps * len(shapes) + 2 * len(shapes)  # room for compile steps
    result: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "how": ("adaptiveload-train (Hydra compose + train.build + Trainer.fit), bucketing=fixed, one run per "
                    "setting with the shapes interleaved; per optimizer step CUDA-synchronised wall time from "
                    "on_train_batch_start to on_train_batch_end (data loading excluded; update_s: from "
                    "on_before_optimizer_step, i.e. clipping + optimizer); steps that compiled and the "
                    f"first {args.warmup} steps left out; median per shape; MFU against {args.peak_tflops} TFLOP/s"),
            "model": args.model, "blocks": args.blocks or "all (preset depth)", "shapes": args.shapes,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__,
        },
        "settings": {},
    }

    run_id = run_info()

    def save():
        append_record(out, "bench_speed.py", result, run_id)

    for setting in args.settings.split(","):
        compile_, ckpt, fused = SETTINGS[setting]
        entry: dict[str, Any] = {"compile": compile_, "checkpointing": ckpt, "fused_adaln": fused}
        try:
            run, timer, wall = _fit(args, setting, shapes, steps, args.blocks, out_dir)
            entry.update(per_shape=_per_shape(timer.rows, args.warmup, shapes, args.peak_tflops), wall_s=wall, rows=timer.rows,
                         compile_s=sum(r["compile_s"] for r in timer.rows))
            if timer.trace is not None:
                entry["trace"] = timer.trace
            del run
        except Exception as err:  # noqa: BLE001 - a failing setting (e.g. out of memory) must not lose the rest
            import traceback

            traceback.print_exc()
            entry["error"] = f"{type(err).__name__}: {err}"[:1500]
        result["settings"][setting] = entry
        save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(_table(result), flush=True)

    if args.loss_steps:
        loss_shape = _parse_shapes(args.loss_shape)
        curves = {}
        for setting in args.loss_settings.split(","):
            try:
                run, timer, wall = _fit(args, setting, loss_shape, args.loss_steps, args.loss_blocks,
                                        out_dir / "loss")
                curves[setting] = timer.losses
                del run
            except Exception as err:  # noqa: BLE001
                curves[setting] = f"{type(err).__name__}: {err}"[:1500]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        result["loss_curves"] = {"shape": args.loss_shape, "steps": args.loss_steps,
                                 "blocks": args.loss_blocks or "all (preset depth)", "curves": curves}
        a, b = (curves.get(s) for s in args.loss_settings.split(","))
        if isinstance(a, list) and isinstance(b, list) and a and b:
            diffs = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=False)]
            result["loss_curves"]["median_rel_diff"] = statistics.median(diffs)
            result["loss_curves"]["max_rel_diff"] = max(diffs)
        save()
    print(_table(result))
    print(f"appended to {out}")
    return 0


def _table(result: dict[str, Any]) -> str:
    rows = ["| setting | shape B×S | tokens/s | TFLOP/s | MFU | peak GiB | update ms | steps |",
            "|---|---|---|---|---|---|---|---|"]
    for name, entry in result["settings"].items():
        if "error" in entry:
            rows.append(f"| {name} | failed: {entry['error'][:100]} | | | | | | |")
            continue
        for key, r in entry["per_shape"].items():
            if not r.get("steps"):
                rows.append(f"| {name} | {key} | - | - | - | - | - | 0 |")
                continue
            rows.append(f"| {name} | {key} | {r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.0f} | {r['mfu']:.1%} | "
                        f"{r['peak_gib']:.1f} | {r.get('update_s', 0.0) * 1e3:.0f} | {r['steps']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
