#!/usr/bin/env bash
# Device: build, CUDA tests, the launch-plan sweep (benchmarks/sweep_adaln.py), a per-kernel time
# breakdown of one forward+backward and Nsight Compute stall reasons of the streamed kernels.
# Usage (device): bash benchmarks/run_sweep_device.sh "name:KNOB=V,..." ...   -> $OUT
source benchmarks/device_env.sh
t0=$(date +%s)
python3 -c "
import time; t=time.time()
import importlib; m=importlib.import_module('lightning_adaptiveload.ops.adaln')
print('build ok:', m._load_extension() is not None, m._build_error, f'{time.time()-t:.0f}s')
" 2>&1 | tail -n 3
timeout 240 python3 -m pytest tests/ops tests/callbacks/test_fused_adaln.py -q --maxfail=20 -m cuda -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1; tail -n 4 "$OUT/tests.log"
echo "tests done $(( $(date +%s) - t0 ))s"
python3 benchmarks/breakdown_adaln.py 2>&1 | grep -v Warn | tee "$OUT/breakdown.txt"
cat > /tmp/step.py <<'PY'
import torch
from lightning_adaptiveload.ops import adaln
x = torch.randn(1, 32760, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
e = (torch.randn(1, 6, 1536, device="cuda") * 0.1).requires_grad_()
ch = e.chunk(6, dim=1)
y = adaln(x, ch[1], ch[0], out_dtype=torch.bfloat16)
torch.autograd.grad(y, (x, e), torch.randn_like(y))
torch.cuda.synchronize()
PY
timeout 150 ncu --clock-control none --kernel-name regex:adaln --launch-count 3 \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,gpc__cycles_elapsed.max,smsp__inst_executed.sum,lts__t_sectors.sum,dram__bytes_read.sum,dram__bytes_write.sum' \
  python3 /tmp/step.py > "$OUT/ncu_stalls.txt" 2>&1
echo "ncu exit $? ($(( $(date +%s) - t0 ))s)"
args=()
for c in "$@"; do args+=(--config "$c"); done
timeout 300 python3 benchmarks/sweep_adaln.py --out "$OUT/sweep" "${args[@]}" 2>&1 | grep -v Warn
echo "all done $(( $(date +%s) - t0 ))s"
