"""The closed loop on and off: the same ``adaptiveload-train`` run twice, once with
``callbacks.shape_benchmark.closed_loop=false`` (first: it profiles and caches the calibration) and once
with the closed loop on (it reads that calibration from the cache and corrects it from training's steps).

Records per run the tokens/s (``BalanceMonitor``'s run mean), the epoch estimate at the measured per-shape
step times, the closed loop's decisions (measured/predicted before and after correction, the predicted
tokens/s of the plan it keeps) and the per-shape measured/predicted ratios of the balance report.

    python benchmarks/bench_closed_loop.py --name wan480p -- experiment=wan2_1_1_3b_480p trainer.devices=1 \\
        trainer.max_steps=60 callbacks.balance_monitor.warmup_steps=10       # GPU
    python benchmarks/bench_closed_loop.py --name quickstart --out /tmp/cl.json -- trainer.max_steps=60   # CPU
"""

from __future__ import annotations

import argparse
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
    p.add_argument("overrides", nargs="*", help="Hydra overrides of both runs")
    args = p.parse_args(argv)
    run = run_info()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        cache = work / "cache"
        off = run_train("closed_loop_off", [*args.overrides, "callbacks.shape_benchmark.closed_loop=false"], work,
                        cache, args.timeout)
        print(f"closed loop off: {off['tokens_per_s']:,.0f} tokens/s (epoch {off['epoch_tokens_per_s'] or 0:,.0f})")
        on = run_train("closed_loop_on", list(args.overrides), work, cache, args.timeout)
        print(f"closed loop on:  {on['tokens_per_s']:,.0f} tokens/s (epoch {on['epoch_tokens_per_s'] or 0:,.0f})")
    last = on["decisions"][-1] if on["decisions"] else None
    result = {"name": args.name, "overrides": args.overrides, "off": off, "on": on,
              "on_over_off_tokens_per_s": on["tokens_per_s"] / off["tokens_per_s"],
              "predicted_over_measured_epoch": (last["predicted_tokens_per_s"] / on["epoch_tokens_per_s"]
                                                if last and on["epoch_tokens_per_s"] else None),
              "how": "two adaptiveload-train subprocesses (off first, it fills the cache); BalanceMonitor means"}
    append_record(args.out, "bench_closed_loop.py", result, run)
    print({k: v for k, v in result.items() if k not in ("off", "on")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
