"""benchmarks/summarise.py: the figures of a recipe log and of nvidia-smi clock samples, and the record a
device run appends; and every record in benchmarks/results/ names its command, hardware, commit and date."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from benchmark_scripts import load_benchmark

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

LOG = """\
20:10:43 `ShapeBenchmarkCallback`: 29.4 s of the profile went to torch.compile (never timed).
20:10:43 Shape benchmark (profiled; profiled in 57 s) — CostModel: t = (138 ms^k +
20:10:43 (held-out median rel. error 2.9%)
20:10:43 predicted on 1 rank(s): 24,005 tokens/s, compute CV 0.0% | equal-token
20:10:43  8,581 steps/epoch x 1 rank(s); padded 0 samples, dropped 0, skipped
20:12:01 `Trainer.fit` stopped: `max_steps=60` reached.
20:12:24                Balance report (45 steps, after 15 warm-up steps)
20:12:24                             Per batch shape (rank 0)
20:12:24 ┏━━━━┳━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━┓
20:12:24 ┃    ┃        ┃  mean step ┃       ┃
20:12:24 ┃  B ┃      S ┃          s ┃   MFU ┃
20:12:24 ┡━━━━╇━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━┩
20:12:24 │  1 │ 32,760 │     1.8392 │ 46.7% │
20:12:24 │ 24 │  1,560 │     0.7410 │ 45.7% │
20:12:24 └────┴────────┴────────────┴───────┘
20:12:24 tokens/s 21,503 | 457 model TFLOP/s per GPU, MFU 46.2% | data wait 0.11% of step
20:12:24 GPU: SM clock 1,755 MHz, 683 W (means over the steps; the lowest clock and the
20:12:24 epoch of this plan at these step times: tokens/s 21,386, MFU 45.3% (4 of 5
20:12:24 buckets measured, 98% of the epoch's time; the rest predicted x 0.99)
20:12:24   train/loss at step 60 (the last logged value): 2.00378
20:12:24   balance, means over 45 steps: step_time_cv 0.00%, tokens_per_s 21,503, peak_mem_gb 124.1, mfu 46.20%
"""


def test_recipe_log_figures():
    (run,) = load_benchmark("summarise").recipe_log(LOG)
    assert run["calibration"] == {"source": "profiled", "profile_s": 57, "compile_s": 29.4,
                                  "heldout_median_rel_error_pct": 2.9, "predicted_tokens_per_s": 24005}  # fmt: skip
    assert run["plan"] == {"steps_per_epoch": 8581, "ranks": 1}
    t = run["training"]
    assert (t["tokens_per_s"], t["model_tflops_per_gpu"], t["mfu_pct"]) == (21503, 457, 46.2)
    assert (t["measured_steps"], t["warmup_steps"], t["max_steps"]) == (45, 15, 60)
    assert (t["sm_clock_mhz"], t["power_w"], t["peak_gib"]) == (1755, 683, 124.1)
    assert (t["epoch_tokens_per_s"], t["epoch_mfu_pct"], t["epoch_time_measured_pct"]) == (21386, 45.3, 98)
    assert (t["final_loss_step"], t["final_loss"]) == (60, 2.00378)
    (table,) = run["tables"]
    assert table["title"] == "Per batch shape (rank 0)"
    assert table["columns"] == ["B", "S", "mean step s", "MFU"]
    assert table["rows"] == [[1, 32760, 1.8392, 46.7], [24, 1560, 0.741, 45.7]]


def test_the_tokens_per_s_with_the_waits_between_steps_is_read_beside_the_mfu():
    log = LOG.replace("tokens/s 21,503 | 457", "tokens/s 21,503 (20,950 with the waits\n20:12:24 between steps) | 457")
    (run,) = load_benchmark("summarise").recipe_log(log)
    t = run["training"]
    assert (t["tokens_per_s"], t["wall_tokens_per_s"], t["mfu_pct"]) == (21503, 20950, 46.2)


def test_a_log_of_several_runs_gives_one_summary_each_and_a_failed_run_its_error():
    second = "Shape benchmark (file /x/calibration.json; profiled in 102 s)\nTraceback (most recent call last):\n" \
             "RuntimeError: CUDA out of memory\n"  # fmt: skip
    runs = load_benchmark("summarise").recipe_log(LOG + second)
    assert [r["training"]["tokens_per_s"] for r in runs[:1]] == [21503]
    assert runs[1]["calibration"] == {"source": "file", "file": "/x/calibration.json", "profile_s": 102}
    assert "training" not in runs[1] and runs[1]["error"] == "RuntimeError: CUDA out of memory"


def _clocks(path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["timestamp", " clocks.current.sm [MHz]", " power.draw [W]", " power.limit [W]"])
        for t, (mhz, watts) in enumerate([(1980, 120.0), (1755, 690.0), (1700, 700.0), (1745, 680.0), (1980, 100.0)]):
            w.writerow([f"2026/12/01 20:09:{t:02d}.000", f" {mhz} MHz", f" {watts} W", " 700.00 W"])


def test_gpu_clocks_medians_all_and_loaded(tmp_path):
    _clocks(tmp_path / "c.csv")
    c = load_benchmark("summarise").gpu_clocks(tmp_path / "c.csv")
    assert c["samples"] == 5 and c["power_limit_w"] == 700.0
    assert c["sm_mhz"] == {"median": 1755.0, "min": 1700.0, "max": 1980.0}
    assert c["loaded"] == {"samples": 3, "sm_mhz_median": 1745.0, "power_w_median": 690.0}


def test_recipe_command_appends_one_record_with_command_and_clocks(tmp_path):
    (tmp_path / "run.log").write_text(LOG)
    _clocks(tmp_path / "c.csv")
    earlier = {"benchmark": "device/gpu_recipe.sh", "command": "c", "hardware": "h", "commit": "a", "date": "d", "result": {}}
    (tmp_path / "r.json").write_text(json.dumps([earlier]))
    load_benchmark("summarise").main(
        ["recipe", "--log", str(tmp_path / "run.log"), "--clocks", str(tmp_path / "c.csv"), "--name", "x",
         "--command", "adaptiveload-train experiment=wan2_1_1_3b_480p", "--out", str(tmp_path / "r.json")])
    records = json.loads((tmp_path / "r.json").read_text())
    assert records[0] == earlier and len(records) == 2  # appended
    r = records[-1]
    assert r["benchmark"] == "device/gpu_recipe.sh" and r["command"] == "adaptiveload-train experiment=wan2_1_1_3b_480p"
    assert {"hardware", "commit", "date"} <= r.keys()
    assert r["result"]["training"]["mfu_pct"] == 46.2 and r["result"]["gpu_clocks"]["loaded"]["samples"] == 3


def test_every_result_record_names_its_run():
    """One file per benchmark; every record (and every CSV row) carries command, hardware, commit and date,
    and a record summarised from a raw file names that file and the commit that held it."""
    files = sorted(p.name for p in RESULTS.iterdir())
    # One file per benchmark: no benchmark's records spread over several files (a file per run would).
    homes: dict[str, set[str]] = {}
    for name in files:
        records = json.loads((RESULTS / name).read_text()) if name.endswith(".json") else []
        for r in records if isinstance(records, list) else []:  # a calibration (a dict) is read by commands
            homes.setdefault(r["benchmark"], set()).add(name)
    assert not {b: f for b, f in homes.items() if len(f) > 1}
    assert not [f for f in files if f.endswith((".log", ".txt", ".png"))], files
    for name in files:
        path = RESULTS / name
        if name.endswith(".csv"):
            rows = list(csv.DictReader(path.open()))
            assert rows and all(r["command"] and r["hardware"] and r["commit"] and r["date"] for r in rows), name
            continue
        data = json.loads(path.read_text())
        if isinstance(data, dict):  # a calibration file in the product's own format (read by bucketing.calibration)
            assert data.get("format") and "cost_model" in data, name
            continue
        for i, r in enumerate(data):
            missing = [k for k in ("benchmark", "command", "hardware", "commit", "date", "result") if not r.get(k)]
            assert not missing, f"{name} record {i}: no {missing}"
            for f in (r.get("source") or {}).get("files", []):
                assert r["source"].get("commit"), f"{name} record {i}: {f} without the commit that held it"
