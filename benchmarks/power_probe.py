"""Does a step's power draw depend on the values it computes? Train, then poison the weights, and watch.

Sustained training on one H200 runs at the 700 W power cap (~1,700 MHz, 44–46% MFU), but some runs
moved part-way to ~515 W at 1,980 MHz with the same steps at 52–53% MFU (``docs/benchmarks.md`` §3e).
One explanation is the data: a run whose weights have gone non-finite multiplies NaNs (or zeros),
which toggles fewer bits in the tensor cores and draws less power, so the clock rises. This script
tests it through ``adaptiveload-train`` (the composition of ``bench_speed.py``: one shape, compiled,
checkpointing ``none``): per run, ``--steps`` steps, of which those from ``--poison-step`` on run with
every parameter set to the ``--poison`` value (``nan`` or ``zero``; ``none``: never poisoned). Each
step records its CUDA-synchronised time, the SM clock and the power draw after it
(``torch.cuda.clock_rate`` / ``power_draw``) and its loss. The summary compares the medians of the
steps before and after the poisoning, the first ``--settle`` steps of each phase left out.

    python benchmarks/power_probe.py --poison nan,zero --out benchmarks/results/power_probe_h200x1.json
    python benchmarks/power_probe.py --model tiny --shapes 2x1x4x4 --accelerator cpu --steps 6 \\
        --poison-step 3 --settle 1 --poison nan --out /tmp/power_probe.json       # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402
from bench_e2e import _compose  # noqa: E402
from bench_speed import _overrides, _parse_shapes  # noqa: E402

POISONS = ("nan", "zero", "none")


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="wan2_1_1_3b", help="conf/model choice")
    p.add_argument("--shapes", default="24x1x30x52", help="B x token grid (f x h x w) of the one shape trained")
    p.add_argument("--steps", type=int, default=70, help="steps per run")
    p.add_argument("--poison-step", type=int, default=35, help="first step run with poisoned weights")
    p.add_argument("--settle", type=int, default=8, help="first steps of each phase left out of the medians")
    p.add_argument("--poison", default="nan,zero", help=f"comma-separated, one run each, from {list(POISONS)}")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--out", default=str(RESULTS / "power_probe.json"), help="JSON result file (record appended)")
    args = p.parse_args(argv)
    bad = [v for v in args.poison.split(",") if v not in POISONS]
    if bad:
        p.error(f"--poison {bad} is not valid; expected names from {list(POISONS)}")
    if len(_parse_shapes(args.shapes)) != 1:
        p.error("--shapes takes one shape (BxFxHxW), so every step does the same work")
    if not 0 <= args.settle < args.poison_step < args.steps - args.settle:
        p.error("expected 0 <= --settle < --poison-step < --steps - --settle (both phases keep a step)")
    return args


def _probe(poison_step: int, poison: str, peak_tflops: float):
    import torch
    from lightning.pytorch import Callback

    class Probe(Callback):
        """Poisons the parameters at ``poison_step`` and records every step's time, clock, power and loss."""

        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def _sync(self, pl_module) -> None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)

        def on_train_start(self, trainer, pl_module):
            # The probe trains NaN weights on purpose: the module's non-finite loss check would stop it.
            pl_module.on_nonfinite_loss = "off"

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == poison_step and poison != "none":
                with torch.no_grad():
                    for p in pl_module.parameters():
                        p.fill_(math.nan if poison == "nan" else 0.0)
            self._sync(pl_module)
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._sync(pl_module)
            dt = time.perf_counter() - self._t0
            b, s = (int(v) for v in pl_module.batch_shape(batch))
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            row = {"step": trainer.global_step - 1, "seconds": dt, "loss": float(loss.detach().float().cpu()),
                   "mfu": b * float(pl_module.flops_per_sample(s)) / dt / (peak_tflops * 1e12),
                   "tokens_per_s": b * s / dt, "sm_clock_mhz": None, "power_w": None}
            if pl_module.device.type == "cuda":
                try:
                    row["sm_clock_mhz"] = float(torch.cuda.clock_rate(pl_module.device))
                    row["power_w"] = torch.cuda.power_draw(pl_module.device) / 1e3
                except Exception as err:  # noqa: BLE001 - NVML missing: the times still count
                    row["nvml_error"] = f"{type(err).__name__}: {err}"[:200]
            self.rows.append(row)

    return Probe()


def _phase(rows: list[dict[str, Any]], settle: int) -> dict[str, Any]:
    kept = rows[settle:]
    if not kept:
        return {"steps": 0}

    def med(key):
        values = [r[key] for r in kept if r.get(key) is not None and math.isfinite(r[key])]
        return statistics.median(values) if values else None

    return {"steps": len(kept), "step_s": med("seconds"), "mfu": med("mfu"), "tokens_per_s": med("tokens_per_s"),
            "sm_clock_mhz": med("sm_clock_mhz"), "power_w": med("power_w"),
            "finite_loss_steps": sum(math.isfinite(r["loss"]) for r in kept)}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from lightning_adaptiveload.train import build, configure_cuda_allocator

    configure_cuda_allocator()
    import torch

    shapes = _parse_shapes(args.shapes)
    out = Path(args.out)
    result: dict[str, Any] = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "how": __doc__.split("\n\n")[1].replace("\n", " "), "model": args.model, "shapes": args.shapes,
        "steps": args.steps, "poison_step": args.poison_step, "settle": args.settle,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
    }, "runs": {}}
    run_id = run_info()
    for poison in args.poison.split(","):
        ov = _overrides(argparse.Namespace(**vars(args)), "compiled_none", shapes, args.steps, 0,
                        out.parent / (out.stem + "_runs"))
        run = build(_compose(ov))
        probe = _probe(args.poison_step, poison, args.peak_tflops)
        run.trainer.callbacks.append(probe)
        run.trainer.fit(run.module, datamodule=run.datamodule)
        rows = probe.rows
        before = [r for r in rows if r["step"] < args.poison_step]
        after = [r for r in rows if r["step"] >= args.poison_step]
        entry = {"before": _phase(before, args.settle), "after": _phase(after, args.settle), "rows": rows}
        result["runs"][poison] = entry
        append_record(out, "power_probe.py", result, run_id)  # after every run: a cut-short call keeps what it measured
        b, a = entry["before"], entry["after"]
        print(f"poison={poison}: before {_line(b)} | after {_line(a)}", flush=True)
        del run
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"appended to {out}")
    return 0


def _line(phase: dict[str, Any]) -> str:
    if not phase.get("steps"):
        return "no steps"
    clock = "-" if phase["sm_clock_mhz"] is None else f"{phase['sm_clock_mhz']:,.0f} MHz"
    power = "-" if phase["power_w"] is None else f"{phase['power_w']:,.0f} W"
    return (f"{phase['step_s'] * 1e3:.1f} ms, MFU {phase['mfu']:.1%}, {clock}, {power}, "
            f"finite loss {phase['finite_loss_steps']}/{phase['steps']}")


if __name__ == "__main__":
    raise SystemExit(main())
