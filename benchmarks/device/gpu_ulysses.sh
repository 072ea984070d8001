#!/usr/bin/env bash
# Ulysses sequence parallelism on one CUDA GPU: its cuda test (the SP code path at degree 1 gives
# exactly the plain forward and backward, fp32 and bf16; the all-to-all round trip and its shapes,
# over NCCL), then the cost of that code path against the plain one at Wan 2.1 1.3B's width
# (benchmarks/bench_ulysses.py). Writes $OUT/gpu_ulysses.json and exits with the test's status.
# About 1 minute of GPU time.
#
#     OUT=/tmp/out bash benchmarks/device/gpu_ulysses.sh
set -uo pipefail
OUT="${OUT:?set OUT to a directory for the results}"
cd "$(dirname "$0")/../.."
# shellcheck source=device_env.sh
source benchmarks/device/device_env.sh
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
timeout 120 python3 -m pytest -q tests/parallel/test_ulysses.py -m cuda -p no:cacheprovider 2>&1 | tail -n 25
tests_rc=${PIPESTATUS[0]}
echo "tests done in $(( $(date +%s) - start ))s (rc=$tests_rc)"
timeout 120 python3 benchmarks/bench_ulysses.py --layers 4 --iters 10 --json "$OUT/gpu_ulysses.json"
echo "timing done in $(( $(date +%s) - start ))s"
exit "$tests_rc"
