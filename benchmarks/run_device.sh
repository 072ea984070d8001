#!/usr/bin/env bash
# One GPU run: install the offline wheels, build the extension, run the CUDA tests, benchmark.
# Usage (device): bash benchmarks/run_device.sh [all|quick|tests] [PROVIDERS]  (tests: no benchmark;
# PROVIDERS: bench_adaln.py --providers, default all). ADALN_TEST_HUGE=1 adds the >2^31-element test.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
bash .ci/compile_kernels.sh 2>&1 | tail -n 3
start=$(date +%s)
python3 -c "
import time, torch; t=time.time()
from lightning_adaptiveload.ops import adaln as a
import importlib; m=importlib.import_module('lightning_adaptiveload.ops.adaln')
x=torch.randn(1,4,256,device='cuda'); print('build ok:', m._load_extension() is not None, m._build_error, f'{time.time()-t:.0f}s')
" 2>&1 | tail -n 5
timeout 300 python3 -m pytest tests/ops tests/callbacks/test_fused_adaln.py -q --maxfail=20 -m cuda -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -n 25
echo "tests done in $(( $(date +%s) - start ))s"
[ "${1:-all}" = tests ] && exit 0
python3 benchmarks/bench_adaln.py --out "$OUT/adaln_h200" --shapes "${1:-all}" --providers "${2:-all}" 2>&1 | tee "$OUT/bench.log" | grep -v Warning
