"""The README's quickstart against the README's equal-token baseline, as a user runs them.

Alternates ``--pairs`` pairs of ``adaptiveload-train`` runs (subprocesses, ``python -m lightning_adaptiveload.train`` with the
README's arguments): the quickstart (``adaptiveload-train``, calibrated, closed loop on) and the baseline
``adaptiveload-train bucketing=equal_token bucketing.policy.max_tokens=4096``, and records each run's
tokens/s (``BalanceMonitor``'s run means, with the waits between steps, which the pairs compare, and over the
steps' own time, and its epoch estimate) from ``metrics.json``, the closed loop's
decisions and the per-shape measured/predicted ratios from the log. ``--load`` runs a CPU-bound process
beside them (a second job on the machine). The first quickstart run profiles (the cache starts empty
under ``--cache``), later ones read the cache, as a user's second run does.

    python benchmarks/bench_quickstart.py --pairs 4            # appends to benchmarks/results/quickstart_cpu.json
    python benchmarks/bench_quickstart.py --pairs 4 --load     # with a second CPU-bound job
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402

BASELINE = ["bucketing=equal_token", "bucketing.policy.max_tokens=4096"]
_GAIN = re.compile(r"this plan trains at ([+-][0-9.]+)% tokens/s under the cost model corrected"
                   r"(?:.*?started with predicted ([+-][0-9.]+)%)?")
_SOURCE = re.compile(r"Shape benchmark \(([^;)]+)")
_CHANGE = re.compile(r"S=([0-9,]+) (\d+)->(\d+)")
_OFF = re.compile(r"(\d+) x ([0-9,]+) ([0-9.]+) \((\d+) steps\)")
_DECISION = re.compile(r"`ShapeBenchmarkCallback`: step (\d+): (re-plan|keep the plan): ([+-][0-9.]+)% .*?"
                       r"measured/predicted over \d+ shape\(s\), [0-9,]+ steps: ([0-9.]+) \(([0-9.]+)-([0-9.]+)\) -> "
                       r"([0-9.]+) \(([0-9.]+)-([0-9.]+)\).*?the plan now trains at ([0-9,]+) predicted tokens/s")


def _burn(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1_000_003


@contextlib.contextmanager
def cpu_load(enabled: bool) -> Iterator[None]:
    """A CPU-bound process beside the block's runs (a second job on the machine) when ``enabled``."""
    if not enabled:
        yield
        return
    stop = multiprocessing.Event()
    burner = multiprocessing.Process(target=_burn, args=(stop,), daemon=True)
    burner.start()
    try:
        yield
    finally:
        stop.set()
        burner.join(5)


def parse_decisions(log: str) -> list[dict[str, Any]]:
    """The closed loop's check lines of a run's log: step, verdict, predicted gain, measured/predicted before and
    after (median, min, max), the plan's predicted tokens/s, the batch sizes the corrected policy changes and
    the shapes the line names as still outside the band after correction (``[B, S, ratio, steps]``)."""
    return [{"step": int(m[1]), "replan": m[2] == "re-plan", "gain": float(m[3]) / 100,
             "ratio_before": [float(m[4]), float(m[5]), float(m[6])],
             "ratio_after": [float(m[7]), float(m[8]), float(m[9])],
             "predicted_tokens_per_s": float(m[10].replace(",", "")),
             # S -> [old B, new B] of the buckets the corrected policy changes (applied only on a re-plan).
             "batch_changes": {c[1].replace(",", ""): [int(c[2]), int(c[3])]
                               for c in _CHANGE.finditer(m[0].split("; measured/predicted")[0])},
             "off_after": [[int(o[1]), int(o[2].replace(",", "")), float(o[3]), int(o[4])] for o in _OFF.finditer(
                 m[0].split("after correction: ")[1].split("; the plan now")[0])] if "after correction: " in m[0]
             else []}
            for m in _DECISION.finditer(log)]


def run_train(kind: str, extra: list[str], work: Path, cache: Path, timeout: int,
              code: Path | None = None) -> dict[str, Any]:
    """One ``adaptiveload-train`` run with ``extra`` overrides (plus the baseline's for ``kind="baseline"``):
    its final metrics, wall time and the closed loop's decisions as logged. ``code``: a directory holding
    another copy of the ``lightning_adaptiveload`` package, put first on the run's ``PYTHONPATH``."""
    out = work / kind / str(time.time_ns())
    args = [sys.executable, "-m", "lightning_adaptiveload.train", f"output_dir={out}", f"hydra.run.dir={out}",
            f"callbacks.shape_benchmark.cache_dir={cache}", *extra]
    if kind == "baseline":
        args += BASELINE
    start = time.perf_counter()
    env = None
    if code is not None:
        if not (code / "lightning_adaptiveload" / "__init__.py").is_file():
            raise FileNotFoundError(f"{code}: no lightning_adaptiveload package in it. Make one with "
                                    f"`git archive REV lightning_adaptiveload | tar -x -C {code}`.")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code.resolve()),
                                                                          os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (rc {proc.returncode}):\n{log[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    decisions = parse_decisions(log)
    gain = _GAIN.search(log)
    source = _SOURCE.search(log)
    return {"kind": kind, "wall_s": wall,
            # The run's own line at the end: its plan over equal-token batches under the corrected model, and as
            # the starting calibration predicted (simulated epochs; the pairs measure the two side by side).
            "gain_over_equal_token_corrected": float(gain[1]) / 100 if gain else None,
            "gain_over_equal_token_predicted": float(gain[2]) / 100 if gain and gain[2] else None,
            "tokens_per_s": metrics.get("balance/tokens_per_s"),
            # With the waits between steps (data, callbacks, logging, each epoch's start): what the pairs compare.
            "wall_tokens_per_s": metrics.get("balance/wall_tokens_per_s"),
            "epoch_tokens_per_s": metrics.get("balance/epoch_tokens_per_s"), "steps": metrics.get("balance/steps"),
            "mfu": metrics.get("balance/mfu"), "epoch_mfu": metrics.get("balance/epoch_mfu"),
            "sm_clock_mhz": metrics.get("balance/sm_clock_mhz"), "power_w": metrics.get("balance/power_w"),
            "attention": [line for line in log.splitlines() if "attention=auto" in line][-1:],
            # The calibration table's title names its source ("profiled", "cache", "checkpoint", "file ..."); a
            # profile too noisy to keep is cached as provisional, so the next run profiles again.
            "calibration_source": source[1] if source else None, "profiled": bool(source) and source[1] == "profiled",
            "provisional": "too noisy to keep" in log, "decisions": decisions, "overrides": args[3:],
            "code": str(code) if code is not None else None,
            # measured/predicted is None for a shape that bounded fewer than 3 steps (it waited for heavier batches).
            "per_shape": [{k: None if isinstance(r[k], float) and math.isnan(r[k]) else r[k]
                           for k in ("B", "S", "steps", "bound_steps", "measured_over_predicted") if k in r}
                          for r in metrics.get("per_shape", [])],
            # Every counted step (the slowest rank's time and data wait, ms), to find where two arms differ.
            "step_ms": [round(r["step_s"] * 1e3, 2) for r in metrics.get("steps", [])],
            "data_wait_ms": [round(r["data_wait_s"] * 1e3, 2) for r in metrics.get("steps", [])],
            "epoch_gap_ms": [round(r.get("epoch_gap_s", 0.0) * 1e3, 2) for r in metrics.get("steps", [])]}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def add_run_arguments(p: argparse.ArgumentParser, out: Path) -> None:
    """The options of a benchmark of ``adaptiveload-train`` runs on the CPU: ``--load``, ``--extra``, ``--timeout``
    (seconds a run) and ``--out`` (default ``out``)."""
    p.add_argument("--load", action="store_true", help="run a CPU-bound process beside the runs")
    p.add_argument("--extra", nargs="*", default=[], help="overrides for every run (e.g. trainer.max_steps=20)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", type=Path, default=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=4)
    add_run_arguments(p, RESULTS / "quickstart_cpu.json")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs {args.pairs}: expected a positive integer")
    run = run_info()
    runs: list[dict[str, Any]] = []
    with cpu_load(args.load), tempfile.TemporaryDirectory() as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        for i in range(args.pairs):
            for kind in ("quickstart", "baseline") if i % 2 == 0 else ("baseline", "quickstart"):
                runs.append(run_train(kind, args.extra, work, cache, args.timeout))
                r = runs[-1]
                print(f"pair {i + 1}/{args.pairs} {kind}: {r['wall_tokens_per_s']:,.0f} tokens/s with the waits "
                      f"({r['tokens_per_s']:,.0f} over the steps' own time) "
                      f"(epoch {r['epoch_tokens_per_s'] or float('nan'):,.0f}), {r['wall_s']:.0f} s", flush=True)

    def med(kind: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["kind"] == kind and r.get(key) is not None]
        return statistics.median(values) if values else None

    pairs = list(zip([r for r in runs if r["kind"] == "quickstart"], [r for r in runs if r["kind"] == "baseline"],
                     strict=True))
    ratios = [q["wall_tokens_per_s"] / b["wall_tokens_per_s"] for q, b in pairs]
    ratios_steps = [q["tokens_per_s"] / b["tokens_per_s"] for q, b in pairs]
    result = {"pairs": args.pairs, "load": bool(args.load), "cpus": os.cpu_count(), "extra": args.extra,
              "quickstart_tokens_per_s": med("quickstart", "tokens_per_s"),
              "baseline_tokens_per_s": med("baseline", "tokens_per_s"),
              "quickstart_epoch_tokens_per_s": med("quickstart", "epoch_tokens_per_s"),
              "baseline_epoch_tokens_per_s": med("baseline", "epoch_tokens_per_s"),
              "quickstart_wall_tokens_per_s": med("quickstart", "wall_tokens_per_s"),
              "baseline_wall_tokens_per_s": med("baseline", "wall_tokens_per_s"),
              # "wall": the ratios compare tokens/s with the waits between steps (records before this key compared
              # the steps' own time, as ratio_per_pair_steps does).
              "basis": "wall", "ratio_per_pair": ratios, "ratio_median": statistics.median(ratios),
              "ratio_per_pair_steps": ratios_steps, "ratio_median_steps": statistics.median(ratios_steps),
              "gain_over_equal_token_corrected_median": med("quickstart", "gain_over_equal_token_corrected"),
              "gain_over_equal_token_predicted_median": med("quickstart", "gain_over_equal_token_predicted"),
              "runs": runs,
              "how": "adaptiveload-train subprocesses, alternating order per pair; tokens/s = BalanceMonitor run mean "
                     "with the waits between steps (wall_tokens_per_s)"}
    append_record(args.out, "bench_quickstart.py", result, run)
    print(f"quickstart / baseline tokens/s with the waits, per pair: {', '.join(f'{x:.2f}' for x in ratios)} "
          f"(median {result['ratio_median']:.2f}; over the steps' own time {result['ratio_median_steps']:.2f}); "
          f"the quickstart's own line, median over its runs: "
          f"{_pct(result['gain_over_equal_token_corrected_median'])} under the corrected model "
          f"({_pct(result['gain_over_equal_token_predicted_median'])} as profiled); wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
