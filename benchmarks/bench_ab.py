"""Two setups of one ``adaptiveload-train`` command side by side: arm A's and arm B's overrides on top of the
common ones, ``--pairs`` pairs in ABBA order (A, B, B, A, ...; ``--first b`` starts with B), one subprocess a run.

Records every run (``BalanceMonitor``'s run mean and epoch estimate, the closed loop's decisions, the per-shape
measured/predicted ratios, the calibration's source) and the median over pairs of B's tokens/s over A's, of the
run means and of the epoch estimates. ``--load`` runs a CPU-bound process beside the runs. Every run shares one
calibration cache (the first profiling run fills it), so pass ``callbacks.shape_benchmark.closed_loop=false``
where the arms must start from the same calibration, or ``callbacks.shape_benchmark.force=true`` for a profile
per run.

    python benchmarks/bench_ab.py --name quickstart_b120 \\
        --a 'bucketing.policy.batch_sizes={16: 256, 64: 64, 72: 56, 120: 34}' \\
        --b 'bucketing.policy.batch_sizes={16: 256, 64: 64, 72: 56, 120: 33}' \\
        -- bucketing=fixed bucketing.balance=cost callbacks.shape_benchmark.closed_loop=false      # 2-core CPU
    python benchmarks/bench_ab.py --name wan480p_residual --pairs 1 --a ++model.model.residual_fp32=true \\
        --b ++model.model.residual_fp32=false -- experiment=wan2_1_1_3b_480p trainer.devices=1 trainer.max_steps=40
``--c`` adds a third arm and ``--order`` gives the arms' sequence itself (``--order b c a``: one run of each, in
that order; two calls with mirrored orders make one ABBA series of every pair of arms where one call cannot hold
more); the record then has the ratios of every pair of arms (``ratios``, e.g. ``"b/c"``), run by run in order.

Appends one record to ``benchmarks/results/ab.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402
from bench_quickstart import cpu_load, run_train  # noqa: E402


def order(pairs: int, first: str) -> list[str]:
    """The arms of ``pairs`` ABBA pairs, starting with ``first``: ``a, b, b, a, a, b, ...``."""
    other = "b" if first == "a" else "a"
    return [arm for i in range(pairs) for arm in ((first, other) if i % 2 == 0 else (other, first))]


def pair_ratios(runs: list[dict[str, Any]], num: str, den: str, key: str = "tokens_per_s") -> list[float]:
    """``key`` of arm ``num``'s runs over arm ``den``'s, the k-th run of one with the k-th of the other."""
    a, b = ([r for r in runs if r["kind"] == arm] for arm in (den, num))
    return [y[key] / x[key] for x, y in zip(a, b, strict=False) if x[key] and y[key]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", required=True, help="what is compared, stored with the record")
    p.add_argument("--a", nargs="*", default=[], help="arm A's overrides")
    p.add_argument("--b", nargs="*", default=[], help="arm B's overrides")
    p.add_argument("--c", nargs="+", default=None, help="a third arm's overrides (optional)")
    p.add_argument("--order", nargs="+", choices=("a", "b", "c"), default=None,
                   help="the arms' runs in this order (default: --pairs ABBA pairs of A and B from --first)")
    p.add_argument("--a-code", type=Path, default=None, metavar="DIR",
                   help="run arm A from the lightning_adaptiveload package in DIR (e.g. another commit's, from "
                        "`git archive REV lightning_adaptiveload | tar -x -C DIR`); the other arms run the checkout's")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--first", choices=("a", "b"), default="a", help="the arm each series starts with")
    p.add_argument("--load", action="store_true", help="run a CPU-bound process beside the runs")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--work", type=Path, default=None, help="keep the runs' output here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS / "ab.json")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of every run")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs {args.pairs}: expected a positive integer")
    if args.order and "c" in args.order and args.c is None:
        p.error("--order names arm c: give its overrides with --c")
    sequence = args.order or order(args.pairs, args.first)
    run = run_info()
    runs: list[dict[str, Any]] = []
    with cpu_load(args.load), tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for i, arm in enumerate(sequence):
            runs.append(run_train(arm, [*args.overrides, *getattr(args, arm)], work, work / "cache", args.timeout,
                                  code=args.a_code if arm == "a" else None))
            r = runs[-1]
            # A run cut off by a time limit still leaves the runs before it.
            args.out.with_suffix(".partial.json").write_text(json.dumps(runs, indent=1))
            print(f"pair {i // 2 + 1}/{args.pairs} {arm}: {r['tokens_per_s']:,.0f} tokens/s "
                  f"(epoch {r['epoch_tokens_per_s'] or float('nan'):,.0f}), {r['wall_s']:.0f} s", flush=True)

    tps, epoch = pair_ratios(runs, "b", "a"), pair_ratios(runs, "b", "a", "epoch_tokens_per_s")
    arms = [arm for arm in ("a", "b", "c") if any(r["kind"] == arm for r in runs)]
    result = {"name": args.name, "a": args.a, "b": args.b, "c": args.c, "order": sequence, "overrides": args.overrides,
              "a_code": str(args.a_code) if args.a_code else None,
              "pairs": args.pairs, "first": args.first, "load": bool(args.load), "runs": runs,
              "ratios": {f"{y}/{x}": pair_ratios(runs, y, x) for y, x in (("b", "a"), ("c", "a"), ("b", "c"))
                         if x in arms and y in arms},
              "b_over_a_tokens_per_s_pairs": tps, "b_over_a_tokens_per_s": statistics.median(tps) if tps else None,
              "b_over_a_epoch_tokens_per_s_pairs": epoch,
              "b_over_a_epoch_tokens_per_s": statistics.median(epoch) if epoch else None,
              "how": (f"adaptiveload-train subprocesses in ABBA order from arm {args.first}, one calibration cache; "
                      "BalanceMonitor run means and epoch estimates; ratios: B over A, median over pairs")}
    append_record(args.out, "bench_ab.py", result, run)
    ratios = "; ".join(f"{k} {', '.join(f'{x:.3f}' for x in v)}" for k, v in result["ratios"].items() if v)
    print(f"{args.name}: tokens/s ratios per pair: {ratios or 'none (no arm ran beside another)'}; "
          f"B / A epoch {', '.join(f'{x:.3f}' for x in epoch) or 'n/a'}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
