"""What one closed-loop check computes on rank 0's background thread, timed against the corpus's size.

A check refits the calibration with training's per-shape step times (``feedback.refit``) and derives the
corrected policy for the corpus to compare it with the running one (``feedback.compare``). Here the
calibration is an exact profile of an H200-like quadratic cost model, training measures every shape 1.15x
slower, and the corpus is the 480p mix at ``--sizes`` samples on 8 ranks. Two variants: ``check_s`` is the
check as given the corpus's buckets counted once (as the callback does from fit start), ``recount_s`` adds
counting them from every sample's token grid (as a check did before). Each is the minimum (and median) of
``--repeats`` timings.

    python benchmarks/bench_check_cost.py            # appends to benchmarks/results/closed_loop.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402

from lightning_adaptiveload.bucketing.buckets import count_buckets  # noqa: E402
from lightning_adaptiveload.calibration import record  # noqa: E402
from lightning_adaptiveload.calibration.calibrate import ProfileSettings, derive_for  # noqa: E402
from lightning_adaptiveload.calibration.costmodel import CostModel  # noqa: E402
from lightning_adaptiveload.calibration.feedback import Observation, compare, refit  # noqa: E402
from lightning_adaptiveload.calibration.profile import Measurement  # noqa: E402
from lightning_adaptiveload.calibration.simulate import mixture_token_grids  # noqa: E402
from lightning_adaptiveload.data.mixtures import get_mixture  # noqa: E402

TRUTH = CostModel("quadratic", {"a": 0.01, "c1": 8.68e-6, "c2": 1.482e-9})
M_MEM, WORLD, SLOWER = 65_520, 8, 1.15


def _setup(grids: np.ndarray, counts: np.ndarray) -> tuple:
    meas = []
    for g in grids:
        s = int(np.prod(g))
        for b in sorted({1, M_MEM // s}):
            meas.append(Measurement(b, tuple(int(v) for v in g), s, float(TRUTH.predict(b, s)), None, "ok", 3, 0.1))
    cm = CostModel.fit([m.batch_size for m in meas], [m.seq_len for m in meas], [m.time_s for m in meas],
                       form="quadratic")
    cal = record.Calibration({"model": "bench"}, cm, meas)
    settings = ProfileSettings(m_mem=M_MEM)
    running = derive_for(cal, grids, counts, settings, world_size=WORLD)
    seq = np.unique(grids.prod(axis=1))
    observed = [Observation(int(b), int(s), SLOWER * float(TRUTH.predict(b, s)), 50)
                for b, s in zip(running.policy.batch_sizes(seq), seq, strict=True)]
    return cal, settings, running, observed


def _check(samples: np.ndarray, buckets: tuple | None, cal, settings, running, observed) -> None:
    """One check: ``buckets`` counted beforehand, or ``None`` to count them from ``samples`` first."""
    grids, counts = buckets or count_buckets(samples)
    corrected = refit(cal, observed, overhead_s=None)
    compare(cal, running, corrected, grids, counts, settings, world_size=WORLD, samples=(samples, None))


def _time(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000, 1_000_000, 10_000_000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "closed_loop.json")
    args = p.parse_args(argv)
    run = run_info()
    rows = []
    for n in args.sizes:
        samples = mixture_token_grids(get_mixture("wan_480p"), n)
        grids, counts = count_buckets(samples)
        setup = _setup(grids, counts)

        check_s = _time(functools.partial(_check, samples, (grids, counts), *setup), args.repeats)
        recount_s = _time(functools.partial(_check, samples, None, *setup), args.repeats)
        rows.append({"samples": n, "check_s": check_s[0], "check_median_s": check_s[1], "recount_s": recount_s[0],
                     "recount_median_s": recount_s[1]})
        print(f"{n:>12,} samples: check {check_s[0]:.3f} s (median {check_s[1]:.3f}), with recounting "
              f"{recount_s[0]:.3f} s (median {recount_s[1]:.3f})", flush=True)
        append_record(args.out, "bench_check_cost.py", {"world_size": WORLD, "repeats": args.repeats, "rows": rows},
                      run=run)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
