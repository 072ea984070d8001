"""What a two-rank CPU step costs by what the other rank runs: the README's quickstart (``adaptiveload-train``,
2 CPU processes) ``--runs`` times, each step's slowest-rank time (step + the wait before it) grouped by the
pair of batch shapes the two ranks trained, beside the cost model's predictions of both.

The cost-balanced plan and its simulated gain over equal-token batches price a step at its slowest rank's
batch (``max`` over ranks). Where two ranks share two cores with other work (``--load``: a CPU-bound process
beside them), a rank that waits at the gradient all-reduce frees CPU time for the other, so one shape's step
time depends on its partner; this measures by how much.

    python benchmarks/bench_pairing.py --runs 2            # appends to benchmarks/results/pairing_cpu.json
    python benchmarks/bench_pairing.py --runs 2 --load
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402
from bench_quickstart import add_run_arguments, cpu_load  # noqa: E402

from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor  # noqa: E402

#: Pairs of shapes seen fewer steps than this are left out of the record.
MIN_STEPS = 5


def pair_times(history: np.ndarray) -> list[dict[str, Any]]:
    """Per (shape, partner shape) of a two-rank history ``[steps, 2, fields]``: steps, the median step time (the
    slowest rank's step plus the wait before it) and the median predicted compute of both (``BalanceMonitor``'s
    column: seconds under the cost model, ``B * S**p`` without one, as in the equal-token baseline)."""
    col = {name: i for i, name in enumerate(BalanceMonitor.FIELDS)}
    groups: dict[tuple[tuple[int, int], tuple[int, int]], list[tuple[float, float, float]]] = defaultdict(list)
    for step in history:
        if step.shape[0] != 2:
            raise ValueError(f"a step of {step.shape[0]} ranks: pair_times reads two-rank runs")
        shapes = [(int(step[r, col["batch_size"]]), int(step[r, col["seq_len"]])) for r in range(2)]
        cycle = float((step[:, col["step_time"]] + step[:, col["data_wait"]]).max())
        for r in range(2):
            groups[(shapes[r], shapes[1 - r])].append((cycle, float(step[r, col["compute"]]),
                                                       float(step[1 - r, col["compute"]])))
    out = []
    for (shape, partner), rows in sorted(groups.items()):
        if len(rows) < MIN_STEPS:
            continue
        a = np.array(rows)
        out.append({"B": shape[0], "S": shape[1], "partner_B": partner[0], "partner_S": partner[1],
                    "steps": len(rows), "median_step_s": float(np.median(a[:, 0])),
                    "predicted": float(np.median(a[:, 1])), "partner_predicted": float(np.median(a[:, 2]))})
    return out


def run_once(work: Path, cache: Path, extra: list[str], timeout: int) -> dict[str, Any]:
    out = work / str(time.time_ns())
    out.mkdir(parents=True)
    bench_dir = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [bench_dir, os.environ.get("PYTHONPATH")])))
    args = [sys.executable, "-m", "lightning_adaptiveload.train", f"output_dir={out}", f"hydra.run.dir={out}",
            f"callbacks.shape_benchmark.cache_dir={cache}", "+callbacks.dump_history._target_=_dump_history.DumpHistory",
            f"+callbacks.dump_history.out={out}", *extra]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {"pairs": pair_times(np.load(out / "history.npy"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=2)
    add_run_arguments(p, RESULTS / "pairing_cpu.json")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs {args.runs}: expected a positive integer")
    run = run_info()
    runs = []
    with cpu_load(args.load), tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):  # the first profiles, the later ones read its cache
            runs.append(run_once(Path(tmp), Path(tmp) / "cache", args.extra, args.timeout))
            print(f"run {i + 1}/{args.runs}: {len(runs[-1]['pairs'])} shape pairs of >= {MIN_STEPS} steps", flush=True)
    result = {"runs": runs, "load": bool(args.load), "cpus": os.cpu_count(), "extra": args.extra,
              "how": "adaptiveload-train (the README's quickstart, 2 CPU processes); per step the slowest rank's "
                     "step + wait, grouped by (rank's shape, other rank's shape); medians; predicted: seconds under the "
                     "cost model, B * S**p without one (bucketing=equal_token)"}
    append_record(args.out, "bench_pairing.py", result, run)
    for r in runs:
        for x in r["pairs"]:
            print(f"{x['B']} x {x['S']} beside {x['partner_B']} x {x['partner_S']}: {x['steps']} steps, "
                  f"{x['median_step_s']:.4f} s (predicted {x['predicted']:.4g}, partner {x['partner_predicted']:.4g})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
