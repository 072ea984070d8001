"""Training fidelity of an attention backend: the per-step loss of ``adaptiveload-train`` with
``model.attention=<candidate>`` against the reference backend, from one seed, beside the run-to-run spread of
the reference against itself.

Runs ``--runs`` (default: ``sdpa sdpa fa4``) ``adaptiveload-train`` subprocesses with the same overrides and seed and
``trainer.log_every_n_steps=1``, reads each run's per-step ``train/loss`` from its CSV log and compares every run
with the first: per step the relative difference ``|l_run - l_ref| / l_ref``, summarised by its mean and 95th
percentile over the steps, and the relative difference of the mean loss over the last half of the steps. The
candidate passes when both statistics are within the largest of the reference repeats' (a repeat that matches the
reference bit for bit has a spread of 0, and then the check is recorded as failed with that reason).

    python benchmarks/bench_fidelity.py --name wan1_3b_30blocks -- experiment=wan2_1_1_3b_480p trainer.devices=1 \\
        trainer.max_steps=200                                    # GPU (benchmarks/device/gpu_fidelity.sh)
    python benchmarks/bench_fidelity.py --name tiny --runs sdpa sdpa --out /tmp/f.json -- trainer.max_steps=20  # CPU
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402


def losses(out: Path) -> dict[int, float]:
    """``{step: train/loss}`` from the run's CSVLogger file (``<output_dir>/logs/version_*/metrics.csv``)."""
    files = sorted(out.glob("logs/version_*/metrics.csv"))
    if not files:
        raise FileNotFoundError(f"{out}: no logs/version_*/metrics.csv (run with logger=csv)")
    found: dict[int, float] = {}
    with files[-1].open() as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                found[int(row["step"])] = float(row["train/loss"])
    if not found:
        raise ValueError(f"{files[-1]}: no train/loss rows (set trainer.log_every_n_steps=1)")
    return found


def compare(ref: dict[int, float], run: dict[int, float]) -> dict[str, Any]:
    """Per-step relative loss difference (mean, p95, max, and the mean over the first quarter of the steps)
    over the common steps, and the relative difference of the mean loss over their last half."""
    steps = sorted(set(ref) & set(run))
    if not steps:
        raise ValueError("the runs share no logged step")
    per_step = [abs(run[s] - ref[s]) / abs(ref[s]) for s in steps]
    rel = sorted(per_step)
    early = per_step[:max(1, len(steps) // 4)]  # before the runs drift apart: the kernels' own difference
    tail = steps[len(steps) // 2:]
    ref_tail, run_tail = statistics.fmean(ref[s] for s in tail), statistics.fmean(run[s] for s in tail)
    return {"steps": len(steps), "mean_rel_diff": statistics.fmean(rel), "p95_rel_diff": rel[int(0.95 * (len(rel) - 1))],
            "max_rel_diff": rel[-1], "first_quarter_mean_rel_diff": statistics.fmean(early), "identical_steps": sum(r == 0.0 for r in rel),
            "tail_mean_loss_ref": ref_tail, "tail_mean_loss": run_tail,
            "tail_mean_rel_diff": abs(run_tail - ref_tail) / abs(ref_tail)}


def verdict(comparisons: list[dict[str, Any]], backends: list[str]) -> dict[str, Any]:
    """Whether every candidate (a backend other than the reference) is within the reference repeats' spread."""
    ref = backends[0]
    repeats = [c for c, b in zip(comparisons, backends[1:], strict=True) if b == ref]
    candidates = [(c, b) for c, b in zip(comparisons, backends[1:], strict=True) if b != ref]
    if not repeats or not candidates:
        return {"within_spread": None, "why": f"needs a repeat of {ref} and a candidate"}
    spread = {k: max(c[k] for c in repeats) for k in ("mean_rel_diff", "tail_mean_rel_diff")}
    if spread["mean_rel_diff"] == 0.0:
        return {"within_spread": False, "spread": spread,
                "why": f"the {ref} repeats match bit for bit: no run-to-run spread to compare with"}
    ok = all(c[k] <= spread[k] for c, _ in candidates for k in spread)
    return {"within_spread": ok, "spread": spread,
            "why": "candidate's mean per-step and last-half-mean relative differences <= the largest repeat's"}


def pairwise(series: list[dict[int, float]], backends: list[str]) -> list[dict[str, Any]]:
    """Every pair of runs (``i < j``): the two statistics of :func:`compare` (with one repeat of the reference,
    the spread is a single pair, so the candidate's distance to each reference run is worth seeing)."""
    return [{"runs": [i, j], "backends": [backends[i], backends[j]],
             **{k: v for k, v in compare(series[i], series[j]).items() if k in ("mean_rel_diff", "tail_mean_rel_diff", "first_quarter_mean_rel_diff",
                                                             "tail_mean_loss_ref", "tail_mean_loss")}}
            for i in range(len(series)) for j in range(i + 1, len(series))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", required=True, help="what the runs are, stored with the record")
    p.add_argument("--runs", nargs="+", default=["sdpa", "sdpa", "fa4"],
                   help="model.attention of each run; the first is the reference")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--work", type=Path, default=None, help="keep the runs' output here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS / "fidelity.json")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of every run")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        p.error(f"--runs {' '.join(args.runs)}: expected the reference and at least one more run")
    run = run_info()
    series: list[dict[int, float]] = []
    walls: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for i, backend in enumerate(args.runs):
            out = work / f"{i}_{backend}"
            cmd = [sys.executable, "-m", "lightning_adaptiveload.train", f"output_dir={out}", f"hydra.run.dir={out}",
                   *args.overrides, f"model.attention={backend}", "logger=csv", "trainer.log_every_n_steps=1"]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            walls.append(time.perf_counter() - start)
            out.mkdir(parents=True, exist_ok=True)
            (out / "train.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
            series.append(losses(out))
            print(f"run {i + 1}/{len(args.runs)} model.attention={backend}: {len(series[-1])} steps, "
                  f"last loss {series[-1][max(series[-1])]:.5f}, {walls[-1]:.0f} s", flush=True)
    comparisons = [compare(series[0], s) for s in series[1:]]
    for b, c in zip(args.runs[1:], comparisons, strict=True):
        print(f"{b} vs {args.runs[0]}: mean |dl|/l {c['mean_rel_diff']:.2e} (p95 {c['p95_rel_diff']:.2e}), "
              f"last-half mean {c['tail_mean_rel_diff']:.2e}, {c['identical_steps']}/{c['steps']} steps identical")
    result = {"name": args.name, "overrides": args.overrides, "runs": args.runs, "wall_s": walls,
              "comparisons": [{"run": b, "against": args.runs[0], **c} for b, c in zip(args.runs[1:], comparisons, strict=True)],
              "pairwise": pairwise(series, args.runs),
              "verdict": verdict(comparisons, args.runs),
              "losses": [[series[i][s] for s in sorted(series[i])] for i in range(len(series))],
              "how": "adaptiveload-train subprocesses, one seed, per-step train/loss from the CSV log"}
    append_record(args.out, "bench_fidelity.py", result, run)
    print(result["verdict"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
