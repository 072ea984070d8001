"""The closed loop on and off: the same ``adaptiveload-train`` run with
``callbacks.shape_benchmark.closed_loop=false`` (first: it profiles and caches the calibration) and with
the closed loop on (it reads that calibration from the cache and corrects it from training's steps).

``--pairs N`` runs N off/on pairs in the order off, on, on, off, off, on, ... (a drift of the device's clocks
over the call weighs on both sides alike); every run after the first starts from the profiled calibration
(the cache is restored from a copy taken after the first run, so an on run's corrected entry does not reach
the runs after it). The record holds every run and the median of the pairs' on/off ratios of tokens/s and of
the epoch estimate (the mixed corpus draws different shapes in a short run, so its tokens/s ratio is noisy;
the epoch estimate weighs each shape's measured step time by the epoch's own counts). ``--first on`` starts
with the on run (on, off, off, on, ...), so two calls of one pair each (``--first off``, then ``--first on``)
make one ABBA series where a call cannot hold two pairs; it needs ``callbacks.shape_benchmark.force=true``
(every run profiles), else the first run's corrected entry would seed the others.

Records per run the tokens/s (``BalanceMonitor``'s run mean), the epoch estimate at the measured per-shape
step times, the closed loop's decisions (measured/predicted before and after correction, the predicted
tokens/s of the plan it keeps) and the per-shape measured/predicted ratios of the balance report.

    python benchmarks/bench_closed_loop.py --name wan480p -- experiment=wan2_1_1_3b_480p trainer.devices=1 \\
        trainer.max_steps=60 callbacks.balance_monitor.warmup_steps=10       # GPU
    python benchmarks/bench_closed_loop.py --name quickstart --out /tmp/cl.json -- trainer.max_steps=60   # CPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402
from bench_quickstart import run_train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", required=True, help="what the runs are (a recipe name), stored with the record")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--work", type=Path, default=None, help="keep the runs' output here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS / "closed_loop.json")
    p.add_argument("--pairs", type=int, default=1, help="off/on pairs (default 1)")
    p.add_argument("--first", choices=("off", "on"), default="off", help="the run each series starts with")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of every run")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs {args.pairs}: expected a positive integer")
    if args.first == "on" and "callbacks.shape_benchmark.force=true" not in args.overrides:
        p.error("--first on: add the override callbacks.shape_benchmark.force=true (every run profiles); "
                "without it the on run's corrected cache entry would seed the off runs")
    run = run_info()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        cache, profiled = work / "cache", work / "cache_profiled"
        for i in range(args.pairs):
            order = ("off", "on") if (i % 2 == 0) == (args.first == "off") else ("on", "off")
            for kind in order:
                if runs:  # every run after the first from the profiled calibration
                    shutil.rmtree(cache, ignore_errors=True)
                    shutil.copytree(profiled, cache)
                extra = ["callbacks.shape_benchmark.closed_loop=false"] if kind == "off" else []
                runs.append(run_train(f"closed_loop_{kind}", [*args.overrides, *extra], work, cache, args.timeout))
                if len(runs) == 1 and cache.exists():
                    shutil.copytree(cache, profiled)
                r = runs[-1]
                # A call cut off by its time limit still leaves the runs it finished.
                args.out.with_suffix(".partial.json").write_text(json.dumps(runs, indent=1))
                print(f"pair {i + 1}/{args.pairs} closed loop {kind}: {r['tokens_per_s']:,.0f} tokens/s "
                      f"(epoch {r['epoch_tokens_per_s'] or 0:,.0f}), MFU {r['mfu'] or 0:.2%}, {r['wall_s']:.0f} s",
                      flush=True)
    offs = [r for r in runs if r["kind"] == "closed_loop_off"]
    ons = [r for r in runs if r["kind"] == "closed_loop_on"]

    def ratios(key: str) -> list[float]:
        return [b[key] / a[key] for a, b in zip(offs, ons, strict=True) if a[key] and b[key]]

    # Per on run: the last check's predicted epoch tokens/s over the one measured at the per-shape step times.
    epoch_errors = [r["decisions"][-1]["predicted_tokens_per_s"] / r["epoch_tokens_per_s"] for r in ons
                    if r["decisions"] and r["epoch_tokens_per_s"]]
    tps, epoch = ratios("tokens_per_s"), ratios("epoch_tokens_per_s")
    result = {"name": args.name, "overrides": args.overrides, "pairs": args.pairs, "first": args.first,
              "off": offs[0], "on": ons[0],
              "runs": runs if args.pairs > 1 else None,
              "on_over_off_tokens_per_s": statistics.median(tps) if tps else None,
              "on_over_off_tokens_per_s_pairs": tps,
              "on_over_off_epoch_tokens_per_s": statistics.median(epoch) if epoch else None,
              "on_over_off_epoch_tokens_per_s_pairs": epoch,
              "predicted_over_measured_epoch": statistics.median(epoch_errors) if epoch_errors else None,
              "how": (f"adaptiveload-train subprocesses, {args.first} first (it fills the cache), then alternating in pairs "
                      "(ABBA); every run after the first from the profiled cache; BalanceMonitor means; ratios: median "
                      "over pairs")}
    append_record(args.out, "bench_closed_loop.py", result, run)
    print({k: v for k, v in result.items() if k not in ("off", "on", "runs")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
