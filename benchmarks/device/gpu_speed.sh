#!/bin/bash
# Whole-step speed on one GPU (run on the device, from the repository root: `bash benchmarks/device/gpu_speed.sh`;
# see benchmarks/bench_speed.py). Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
STAGE=${STAGE:-1}
if [ "$STAGE" = 1 ]; then
  timeout 200 python3 -m pytest -q -m cuda tests/models tests/callbacks/test_shape_benchmark.py 2>&1 | tail -15 | tee "$OUT/gpu_tests_speed.log"
  timeout ${BENCH_TIMEOUT:-360} python3 benchmarks/bench_speed.py --out "$OUT/speed.json" \
      --settings ${SETTINGS:-eager_full,compiled_none,compiled_selective,eager_full_fused} --steps ${STEPS:-4} --warmup 3 \
      2>&1 | grep -v -i "warning\|tip:\|litlogger" | tail -40
fi
