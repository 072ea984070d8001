"""One result file per benchmark under ``benchmarks/results/``; every record carries hardware, commit and date.

JSON result files are a list of records ``{"benchmark", "command", "hardware", "commit", "date", "result"}``
(records summarised from raw logs also name their ``source``: the file and the commit that held it); a run
appends its record. CSV result files (``adaln.csv``) carry the same columns on every row. ``command`` is the
command line of the run (default: this process's), ``commit`` the checkout's ``git rev-parse HEAD``, with
``+dirty`` when tracked files differ from it, so a number can be traced to code.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
_REPO = RESULTS.parents[1]


def hardware() -> str:
    """``"2x NVIDIA H200"`` on GPUs, ``"CPU x86_64, 16 cores"`` otherwise."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"CPU {platform.machine()}, {os.cpu_count()} cores"


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=_REPO, capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head.stdout.strip() + ("+dirty" if dirty else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON result file (``[]`` when it does not exist yet)."""
    path = Path(path)
    if not path.exists():
        return []
    records = json.loads(path.read_text())
    if not isinstance(records, list):
        raise ValueError(f"{path}: not a result file (expected a JSON list of records, got {type(records).__name__})")
    return records


def load_result(path: str | Path, index: int = -1, benchmark: str | None = None) -> dict[str, Any]:
    """The ``result`` of record ``index`` (default: the last) of a JSON result file, counting only the records
    of ``benchmark`` when given (a device script adds its clock samples' record to the same file); a file of
    one bare result (a benchmark's output before result files held records) is returned as it is."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        return data
    if benchmark is not None:
        data = [r for r in data if r.get("benchmark") == benchmark]
    if not data:
        raise ValueError(f"{path}: no records" + (f" of {benchmark}" if benchmark else ""))
    return data[index]["result"]


def command_line() -> str:
    """This process's command line as it can be typed again (``python benchmarks/bench_x.py --flag v``)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        path = Path(argv[0]).resolve()
        argv = ["python", str(path.relative_to(_REPO)) if path.is_relative_to(_REPO) else argv[0], *argv[1:]]
    return shlex.join(argv)


def run_info(command: str | None = None) -> dict[str, str]:
    """The ``command``, ``hardware``, ``commit`` and ``date`` columns of one run: take them once, when the run
    starts (``command`` defaults to this process's command line)."""
    return {"command": command or command_line(), "hardware": hardware(), "commit": commit(), "date": now()}


def append_record(
    path: str | Path, benchmark: str, result: dict[str, Any], run: dict[str, str] | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Append one run's ``result`` to the JSON result file at ``path`` (created if missing); return the record.

    ``run`` (from :func:`run_info`, default: now, with ``command``) names the run: a record of the same
    benchmark and run written earlier is replaced, so a run may save after every part and a cut-short run
    keeps what it measured. Every record carries ``command``, ``hardware``, ``commit`` and ``date``.
    """
    path = Path(path)
    run = {**run_info(command), **(run or {})}
    record = {"benchmark": benchmark, **run, "result": result}
    same = ("benchmark", "commit", "date")
    records = [r for r in read_records(path) if [r.get(k) for k in same] != [record[k] for k in same]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records + [record], indent=1) + "\n")
    return record


def write_csv_run(path: str | Path, run: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write this run's ``rows`` into the CSV result file at ``path``, each prefixed with the ``run`` columns
    (``hardware``, ``commit``, ``date``, ...). Rows an earlier call wrote for the same run (same commit and
    date) are replaced, so a run may write after every row and a cut-short run keeps what it measured."""
    path = Path(path)
    old = list(csv.DictReader(path.open())) if path.exists() else []
    old = [r for r in old if (r.get("commit"), r.get("date")) != (str(run["commit"]), str(run["date"]))]
    new = [{**run, **r} for r in rows]
    fields = list(dict.fromkeys([k for r in old + new for k in r]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(old + new)
