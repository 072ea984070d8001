"""Summarise a training log and an ``nvidia-smi`` clock log into the figures a result record keeps.

The device scripts (``device/gpu_recipe.sh`` and the scripts that call it) keep the raw log and the clock
samples under ``$OUT`` and append one record per run to ``results/recipes.json``:

    python benchmarks/summarise.py recipe --log $OUT/recipe_x.log --clocks $OUT/gpu_clocks_x.csv \\
        --command "adaptiveload-train experiment=wan2_1_1_3b_480p trainer.devices=1" --name x

A figure is kept only where the log prints it: a run cut short has no ``training`` part, and a log
of several runs (``bench_e2e.py``'s console) gives one summary per ``Shape benchmark`` table.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record  # noqa: E402

_STAMP = re.compile(r"^\d\d:\d\d:\d\d ")
_NUM = r"([\d,]+(?:\.\d+)?)"


def _num(text: str) -> float | int:
    value = float(text.replace(",", ""))
    return int(value) if value.is_integer() and "." not in text else value


def _cell(text: str) -> Any:
    text = text.strip()
    m = re.fullmatch(r"([+-]?[\d,]*\.?\d+)(%?)", text)
    if not m:
        return text
    value = float(m.group(1).replace(",", ""))
    if m.group(2):
        return round(value, 4)
    return int(value) if "." not in m.group(1) else value


def rich_tables(lines: list[str]) -> list[dict[str, Any]]:
    """The tables a ``rich`` console printed: ``{"title", "columns", "rows"}`` each, header cells joined
    over their wrapped lines, numbers as numbers (percentages as printed, without the sign)."""
    tables, i = [], 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("┏"):
            i += 1
            continue
        title = next((lines[j].strip() for j in range(i - 1, max(i - 4, -1), -1) if lines[j].strip()), "")[:120]
        i += 1
        header: list[list[str]] = []
        while i < len(lines) and not lines[i].lstrip().startswith("┡"):
            cells = [c.strip() for c in lines[i].strip().strip("┃").split("┃")]
            header.append(cells)
            i += 1
        columns = [" ".join(h[k] for h in header if k < len(h) and h[k]).strip() for k in range(len(header[0]))]
        rows = []
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith("└"):
            if "│" in lines[i]:
                rows.append([_cell(c) for c in lines[i].strip().strip("│").split("│")])
            i += 1
        tables.append({"title": title, "columns": columns, "rows": rows})
    return tables


def _run_summary(lines: list[str]) -> dict[str, Any]:
    flat = " ".join(line.strip() for line in lines)
    flat = re.sub(r"\s+", " ", flat)
    out: dict[str, Any] = {}
    calib: dict[str, Any] = {}
    if m := re.search(r"Shape benchmark \((profiled|cache|file ([^;]+));", flat):
        calib["source"] = "file" if m.group(2) else m.group(1)
        if m.group(2):
            calib["file"] = m.group(2).strip()
    if m := re.search(r"profiled in " + _NUM + " s", flat):
        calib["profile_s"] = _num(m.group(1))
    if m := re.search(_NUM + r" s of the profile went to torch\.compile", flat):
        calib["compile_s"] = _num(m.group(1))
    if m := re.search(r"held-out median rel\. error " + _NUM + "%", flat):
        calib["heldout_median_rel_error_pct"] = _num(m.group(1))
    if m := re.search(r"predicted on (\d+) rank\(s\): " + _NUM + " tokens/s", flat):
        calib["predicted_tokens_per_s"] = _num(m.group(2))
    if calib:
        out["calibration"] = calib
    if m := re.search(_NUM + r" steps/epoch x (\d+) rank", flat):
        out["plan"] = {"steps_per_epoch": _num(m.group(1)), "ranks": int(m.group(2))}
    train: dict[str, Any] = {}
    if m := re.search(r"`max_steps=(\d+)` reached", flat):
        train["max_steps"] = int(m.group(1))
    if m := re.search(r"Balance report \((\d+) steps(?:, after (\d+) warm-up steps)?\)", flat):
        train["measured_steps"] = int(m.group(1))
        if m.group(2):
            train["warmup_steps"] = int(m.group(2))
    if m := re.search(r"tokens/s " + _NUM + r"(?: \(" + _NUM + r" with the waits between steps\))?(?: \| " + _NUM
                      + r" model TFLOP/s per GPU, MFU " + _NUM + "%)?", flat):  # fmt: skip
        train["tokens_per_s"] = _num(m.group(1))
        if m.group(2):
            train["wall_tokens_per_s"] = _num(m.group(2))
        if m.group(3):
            train["model_tflops_per_gpu"] = _num(m.group(3))
            train["mfu_pct"] = _num(m.group(4))
    if m := re.search(r"GPU: SM clock " + _NUM + r" MHz, " + _NUM + " W", flat):
        train["sm_clock_mhz"], train["power_w"] = _num(m.group(1)), _num(m.group(2))
    if m := re.search(r"epoch of this plan at these step times: tokens/s " + _NUM + ", MFU " + _NUM
                      + r"% \((\d+) of (\d+) buckets measured, (\d+)% of the epoch's time", flat):  # fmt: skip
        train["epoch_tokens_per_s"], train["epoch_mfu_pct"] = _num(m.group(1)), _num(m.group(2))
        train["epoch_buckets_measured"] = f"{m.group(3)} of {m.group(4)}"
        train["epoch_time_measured_pct"] = int(m.group(5))
    if m := re.search(r"peak_mem_gb " + _NUM, flat):
        train["peak_gib"] = _num(m.group(1))
    if m := re.search(r"train/loss at step (\d+) \(the last logged value\): " + _NUM, flat):
        train["final_loss_step"], train["final_loss"] = int(m.group(1)), _num(m.group(2))
    if train:
        out["training"] = train
    errors = [line.strip() for line in lines if re.match(r"\s*\w*(Error|Exception): ", line)]
    if errors:
        out["error"] = errors[-1][:300]
    tables = rich_tables(lines)
    if tables:
        out["tables"] = tables
    return out


def recipe_log(text: str) -> list[dict[str, Any]]:
    """One summary per run in a console log (runs start at each ``Shape benchmark`` line)."""
    lines = [_STAMP.sub("", line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if re.search(r"Shape benchmark \((profiled|cache|file )", line)]
    bounds = [0, *starts[1:], len(lines)] if starts else [0, len(lines)]
    return [_run_summary(lines[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def gpu_clocks(path: str | Path) -> dict[str, Any]:
    """Medians of ``nvidia-smi --query-gpu=... --format=csv -l 1`` samples: all of them and the loaded ones
    (power draw at least half the limit), with the first and last timestamps."""
    rows = list(csv.reader(Path(path).open()))
    head, rows = [h.strip() for h in rows[0]], [[c.strip() for c in r] for r in rows[1:] if len(r) == len(rows[0])]

    def col(name: str) -> list[float]:
        k = next((i for i, h in enumerate(head) if h.startswith(name)), None)
        if k is None:  # a field this call did not sample
            return []
        return [float(r[k].split()[0]) for r in rows if r[k].split() and r[k].split()[0].replace(".", "").isdigit()]

    sm, power, limit = col("clocks.current.sm"), col("power.draw"), col("power.limit")
    cap = max(limit) if limit else None
    # Without a sampled limit, the H200's 700 W: the samples at the cap are the loaded ones either way.
    loaded = [i for i, p in enumerate(power) if p >= (cap or 700.0) / 2]
    out: dict[str, Any] = {
        "samples": len(rows), "first": rows[0][0] if rows else None, "last": rows[-1][0] if rows else None,
        "power_limit_w": cap,
    }
    if sm:
        out["sm_mhz"] = {"median": statistics.median(sm), "min": min(sm), "max": max(sm)}
    if power:
        out["power_w"] = {"median": round(statistics.median(power), 1), "max": max(power)}
    if loaded and sm:
        out["loaded"] = {
            "samples": len(loaded),
            "sm_mhz_median": statistics.median(sm[i] for i in loaded),
            "power_w_median": round(statistics.median(power[i] for i in loaded), 1),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("recipe", help="append a recipe run's record to results/recipes.json")
    r.add_argument("--log", required=True)
    r.add_argument("--clocks", help="nvidia-smi clock samples of the run (csv)")
    r.add_argument("--command", required=True, help="the adaptiveload-train command the run was")
    r.add_argument("--name", required=True)
    r.add_argument("--harness", default="", help="how the device script was called (STEPS=..., ...)")
    r.add_argument("--out", default=str(RESULTS / "recipes.json"))
    c = sub.add_parser("clocks", help="append a record of a run's clock samples to a result file")
    c.add_argument("--csv", required=True)
    c.add_argument("--benchmark", required=True, help="the device script that sampled them")
    c.add_argument("--command", required=True)
    c.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.what == "clocks":
        if Path(args.csv).exists():
            append_record(args.out, args.benchmark, {"gpu_clocks": gpu_clocks(args.csv)}, command=args.command)
        return
    runs = recipe_log(Path(args.log).read_text(errors="replace"))
    result: dict[str, Any] = {"name": args.name, **runs[-1]}
    if args.harness:
        result["harness"] = args.harness
    if args.clocks and Path(args.clocks).exists():
        result["gpu_clocks"] = gpu_clocks(args.clocks)
    record = append_record(args.out, "device/gpu_recipe.sh", result, command=args.command)
    t = record["result"].get("training", {})
    print(f"{args.out}: {args.name}: tokens/s {t.get('tokens_per_s', '-')}, MFU {t.get('mfu_pct', '-')}%")


if __name__ == "__main__":
    main()
