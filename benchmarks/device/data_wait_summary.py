"""Step 3 of ``gpu_data_wait.sh``: the data-wait result JSON from the training log and CSV metrics.

    python benchmarks/device/data_wait_summary.py WORK OUT.json MODE WORKERS STEPS WARMUP T0 T1 T2

Appends a record to OUT.json (a result file). WORK holds ``train.log``, ``run/`` (the CSV logger's ``metrics.csv``) and ``corpus/corpus.json``;
T0, T1, T2 are the epoch seconds at the start, after writing the corpus and after training.
"""

from __future__ import annotations

import csv
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import append_record  # noqa: E402


def main(argv: list[str]) -> None:
    work, out, mode = Path(argv[0]), argv[1], argv[2]
    workers, steps, warmup = map(int, argv[3:6])
    t0, t1, t2 = map(float, argv[6:9])
    log = (work / "train.log").read_text()
    final = re.search(r"balance, means over (\d+) steps: (.*)", log)
    if final is None:
        sys.exit("gpu_data_wait.sh: no 'balance, means over' line in the training log; the run failed (see above)")
    means = {}
    for part in final.group(2).split(", "):
        key, value = part.split(" ", 1)
        value = value.removesuffix(" in total")  # counters: "alloc_retries 0 in total"
        means[key] = float(value.rstrip("%").replace(",", "")) / (100.0 if value.endswith("%") else 1.0)
    per_step = []
    for path in sorted((work / "run").rglob("metrics.csv")):
        with path.open() as fh:
            for row in csv.DictReader(fh):
                if row.get("train/data_wait_frac"):
                    per_step.append({"step": int(row["step"]), "data_wait_frac": float(row["train/data_wait_frac"]),
                                     "tokens_per_s": float(row.get("balance/tokens_per_s") or "nan")})
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception as err:  # noqa: BLE001 - the JSON says why instead
        device = f"unknown ({err})"
    result = {
        "what": "data wait of adaptiveload-train from shards (BalanceMonitor: end of one batch to the start of the "
                "next, as a fraction of wait + step time; the run value is per rank total wait over total wall time "
                f"after {warmup} warm-up steps, the largest over ranks)",
        "mode": mode, "device": device, "num_workers": workers, "steps": steps, "warmup_steps": warmup,
        "corpus": json.loads((work / "corpus" / "corpus.json").read_text()),
        "page_cache": "each shard evicted after writing with posix_fadvise(POSIX_FADV_DONTNEED), best effort",
        "data_wait_frac": means.get("data_wait_frac"), "tokens_per_s": means.get("tokens_per_s"),
        "goal_data_wait_frac_at_most": 0.01, "run_means": means, "steps_measured": int(final.group(1)),
        "per_step": per_step, "write_corpus_s": t1 - t0, "train_wall_s": t2 - t1,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    append_record(out, "device/gpu_data_wait.sh", result)
    print(json.dumps({k: v for k, v in result.items() if k != "per_step"}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
