#!/bin/bash
# The whole GPU test suite in one process (run on the device from the repository root after
# `source benchmarks/device/device_env.sh`, with FA4's wheels on PYTHONPATH for its tests): `python -m pytest -m cuda`. The verbose report goes to $OUT/pytest_cuda.log as it
# runs (a run cut off by the time limit still returns its first results), the junit report to
# $OUT/pytest_cuda.xml, and one record (counts, failures, the slowest tests) to $OUT/gpu_tests.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout ${TIMEOUT:-540} python3 -m pytest -v -m cuda -p no:cacheprovider --durations=15 -rfE \
    --junitxml="$OUT/pytest_cuda.xml" "$@" > "$OUT/pytest_cuda.log" 2>&1
echo "pytest rc $?"
grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/pytest_cuda.log" | awk '{print $2}' | sort | uniq -c
tail -25 "$OUT/pytest_cuda.log"
python3 - "$OUT" <<'PY'
import importlib.util, json, sys, xml.etree.ElementTree as ET
sys.path.insert(0, "benchmarks")
from pathlib import Path
from _results import append_record, run_info
out = Path(sys.argv[1])
if (out / "pytest_cuda.xml").exists():
    suite = ET.parse(out / "pytest_cuda.xml").getroot().find("testsuite")
    cases = suite.findall("testcase")
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    slow = sorted(cases, key=lambda c: -float(c.get("time", 0)))[:8]
    append_record(out / "gpu_tests.json", "device/gpu_suite.sh", {
        "tests": len(cases), "failed": failed, "skipped": len(skipped),
        "passed": len(cases) - len(failed) - len(skipped), "time_s": float(suite.get("time", 0)),
        "slowest": [[f"{c.get('classname')}::{c.get('name')}", float(c.get("time", 0))] for c in slow],
        "fa4": importlib.util.find_spec("flash_attn") is not None,  # without it, FA4's tests skip
        "skipped_tests": [f"{c.get('classname')}::{c.get('name')}" for c in skipped],
        "how": "python -m pytest -v -m cuda, one process"}, run_info())
PY
true
