#!/bin/bash
# Compiled B = 1 gradients with the blocks' default options (inductor's mix-order reduction off), then the speed
# they cost (run on the device, from the repository root: `bash benchmarks/device/gpu_b1_gradients.sh`).
# PARTS picks what runs (default: tests probe recipe): tests, the GPU tests of compiled blocks (the B = 1
# gradient regression test with the default options, the fusion on and the fusion off, and the graph-count test);
# probe, nonfinite_probe.py on the 480p plan (gradient norms per shape, expected 0.1-1.5 at
# every B); recipe, the 1.3B recipe through gpu_recipe.sh (profile time, block graphs, MFU).
# Writes under $OUT, each part with its own time limit.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PARTS=${PARTS:-tests probe recipe}
for part in $PARTS; do
  echo "=== $part $(date +%T)"
  case $part in
    tests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m cuda tests/models/test_compile.py 2>&1 | tail -8 \
             | tee "$OUT/gpu_tests_b1_gradients.log" ;;
    probe) timeout ${PROBE_TIMEOUT:-200} python3 benchmarks/nonfinite_probe.py --steps ${PROBE_STEPS:-40} \
             --out "$OUT/nonfinite_probe_h200x1.json" 2>&1 | grep -E "^step|first non-finite" | cut -c1-200 | tail -42 ;;
    recipe) NAME=${NAME:-b1_gradients_480p} STEPS=${STEPS:-40} WARMUP=${WARMUP:-10} RECIPE_TIMEOUT=${RECIPE_TIMEOUT:-300} \
             TAIL=${TAIL:-30} bash benchmarks/device/gpu_recipe.sh ;;
  esac
done
true
