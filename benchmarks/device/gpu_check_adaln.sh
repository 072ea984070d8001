#!/usr/bin/env bash
# The fused AdaLN op on a CUDA machine: its GPU tests, then what one eager forward+backward call
# costs at Wan 2.1 1.3B's video and image shapes (wall time per call against the kernels' GPU time
# and against eager PyTorch). Appends the timing record to the result file $1 and exits with the tests' status.
#
#     bash benchmarks/device/gpu_check_adaln.sh /tmp/out/host_overhead_adaln.json
#
# The extension builds on first use (1-2 min on an H200) for the GPU's architecture, whatever
# TORCH_CUDA_ARCH_LIST says; the tests and the timing share that build.
set -uo pipefail
out="${1:?usage: bash benchmarks/device/gpu_check_adaln.sh OUT.json}"
cd "$(dirname "$0")/../.."
# shellcheck source=device_env.sh
source benchmarks/device/device_env.sh
mkdir -p "$(dirname "$out")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
timeout 100 python3 benchmarks/device/adaln_build.py
timeout 100 python3 -m pytest -q tests/ops -m cuda -p no:cacheprovider 2>&1 | tail -n 15
tests_rc=${PIPESTATUS[0]}
echo "tests done in $(( $(date +%s) - start ))s (rc=$tests_rc)"
timeout 40 python3 benchmarks/host_overhead_adaln.py --cuda --calls 200 --repeats 5 --json "$out" 2>&1 | grep -v Warning
echo "timing done in $(( $(date +%s) - start ))s"
exit "$tests_rc"
