#!/bin/bash
# Does the step's power draw depend on the values it computes (run on the device, from the repository root:
# `bash benchmarks/device/gpu_power_probe.sh`; see benchmarks/power_probe.py)? Runs the GPU tests of the shape
# benchmark first (PARTS="tests probe" by default). Writes under $OUT; nvidia-smi samples clocks and power each second.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PARTS=${PARTS:-tests probe}
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active,utilization.gpu \
    --format=csv -l 1 > "$OUT/gpu_clocks_power_probe.csv" 2>/dev/null &
SMI_PID=$!
for part in $PARTS; do
  echo "=== $part $(date +%T)"
  case $part in
    tests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m cuda tests/models/test_checkpointing_per_bucket.py \
             tests/callbacks/test_shape_benchmark.py tests/callbacks/test_balance_monitor.py 2>&1 | tail -15 \
             | tee "$OUT/gpu_tests_power_probe.log" ;;
    probe) timeout ${PROBE_TIMEOUT:-330} python3 benchmarks/power_probe.py --out "$OUT/power_probe_h200x1.json" \
             ${PROBE_ARGS:-} 2>&1 | grep --line-buffered -v -i "warnings.warn\|tip:\|litlogger" | tail -12 ;;
  esac
done
kill "$SMI_PID" 2>/dev/null
# The clock samples' summary joins the probe's records (the raw samples stay under $OUT).
python3 benchmarks/summarise.py clocks --csv "$OUT/gpu_clocks_power_probe.csv" --benchmark device/gpu_power_probe.sh \
    --command "PARTS='$PARTS' bash benchmarks/device/gpu_power_probe.sh" --out "$OUT/power_probe_h200x1.json"
true
