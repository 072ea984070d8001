#!/bin/bash
# Where the compiled 1.3B step spends its time on one GPU (run on the device, from the repository root:
# `bash benchmarks/device/gpu_speed_of_light.sh`; see benchmarks/step_breakdown.py). Writes under $OUT; each part
# has its own time limit and saves what it measured. PARTS picks what runs (default: tests breakdown); SHAPES the
# batch shapes (default: the 1.3B recipe's 480p plan); BREAKDOWN_ARGS more step_breakdown.py arguments.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PARTS=${PARTS:-tests breakdown}
SHAPES=${SHAPES:-24x1x30x52,4x5x30x52,2x9x30x52,1x13x30x52,1x21x30x52}
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv | tee "$OUT/gpu.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -l 1 > "$OUT/gpu_clocks_speed_of_light.csv" 2>/dev/null &
SMI_PID=$!
for part in $PARTS; do
  echo "=== $part $(date +%T)"
  case $part in
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m cuda tests/models/test_checkpointing_per_bucket.py \
             tests/callbacks/test_shape_benchmark.py 2>&1 | tail -15 | tee "$OUT/gpu_tests_speed_of_light.log" ;;
    breakdown) timeout ${BREAKDOWN_TIMEOUT:-220} python3 benchmarks/step_breakdown.py --shapes "$SHAPES" \
             --out "$OUT/step_breakdown_h200x1.json" ${BREAKDOWN_ARGS:-} 2>&1 \
             | grep --line-buffered -v -i "warnings.warn\|tip:\|litlogger" | tail -25 ;;
  esac
done
kill "$SMI_PID" 2>/dev/null
python3 benchmarks/summarise.py clocks --csv "$OUT/gpu_clocks_speed_of_light.csv" --benchmark device/gpu_speed_of_light.sh \
    --command "PARTS='$PARTS' bash benchmarks/device/gpu_speed_of_light.sh" --out "$OUT/step_breakdown_h200x1.json"
true
