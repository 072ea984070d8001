#!/usr/bin/env bash
# FSDP2 on one GPU through the product: the cuda-marked FSDP2 test (Wan 1.3B-width blocks, world
# size 1: steps run, losses finite, the sharded fp32 parameters take exactly their bytes), then a
# short adaptiveload-train run of the full-depth Wan 2.1 1.3B with strategy=fsdp2 (meta-device build,
# fully_shard per block, bf16 parameters with fp32 reduction, activation checkpointing, shape
# benchmark + cost-balanced buckets) through benchmarks/bench_e2e.py. About 2-3 min of GPU time.
#
#     OUT=/tmp/out bash benchmarks/device/gpu_fsdp2.sh
#
# Writes $OUT/fsdp2_tests.xml (JUnit) and $OUT/e2e_fsdp2_1gpu.json (bench_e2e's result: tokens/s,
# MFU, peak memory, losses); exits with the tests' status, or the benchmark's if the tests passed.
set -uo pipefail
out="${OUT:?set OUT to the output directory}"
cd "$(dirname "$0")/../.."
# shellcheck source=device_env.sh
source benchmarks/device/device_env.sh
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$(date +%s)
timeout 180 python3 -m pytest -q tests/parallel/test_fsdp_cuda.py -m cuda -p no:cacheprovider \
  --junitxml "$out/fsdp2_tests.xml" 2>&1 | tail -n 15
tests_rc=${PIPESTATUS[0]}
echo "tests done in $(( $(date +%s) - start ))s (rc=$tests_rc)"
timeout 300 python3 benchmarks/bench_e2e.py --devices 1 --strategy fsdp2 --configs dual_cost \
  --activation-checkpointing true --m-mem 32760 --steps 6 --warmup 2 --num-samples 2000 \
  --profile-budget 25 --profile-repeats 1 --out "$out/e2e_fsdp2_1gpu.json" 2>&1 | grep -v Warning | tail -n 30
bench_rc=${PIPESTATUS[0]}
echo "benchmark done in $(( $(date +%s) - start ))s (rc=$bench_rc)"
if [ "$tests_rc" -ne 0 ]; then exit "$tests_rc"; fi
exit "$bench_rc"
