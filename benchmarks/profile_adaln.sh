#!/usr/bin/env bash
# Nsight Compute profile of the fused AdaLN kernels (device): one forward + backward at a Wan 1.3B
# shape and a 14B shape, bf16 x, Wan's chunked fp32 modulation, bf16 output. Clocks are left alone.
# Usage (device): bash benchmarks/profile_adaln.sh   -> $OUT/ncu_adaln.txt, $OUT/ncu_adaln_stalls.txt
source benchmarks/device_env.sh
python3 -c "import importlib; m = importlib.import_module('lightning_adaptiveload.ops.adaln'); \
print('build ok:', m._load_extension() is not None, m._build_error)" 2>&1 | tail -n 1
cat > /tmp/adaln_profile_step.py <<'PY'
import torch
from lightning_adaptiveload.ops import adaln
for B, N, D in ((1, 32760, 1536), (1, 75600, 5120)):
    x = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    e = (torch.randn(B, 6, D, device="cuda") * 0.1).requires_grad_()
    ch = e.chunk(6, dim=1)
    y = adaln(x, ch[1], ch[0], out_dtype=torch.bfloat16)
    torch.autograd.grad(y, (x, e), torch.randn_like(y))
    torch.cuda.synchronize()
PY
timeout 240 ncu --clock-control none --kernel-name regex:adaln --launch-count 6 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats \
  python3 /tmp/adaln_profile_step.py > "$OUT/ncu_adaln.txt" 2>&1
echo "ncu exit $?"
# Stall reasons per issued instruction, issue activity, instructions and DRAM bytes of every kernel.
timeout 240 ncu --clock-control none --kernel-name regex:adaln --launch-count 6 \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,gpc__cycles_elapsed.max,smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum' \
  python3 /tmp/adaln_profile_step.py > "$OUT/ncu_adaln_stalls.txt" 2>&1
echo "ncu (stalls) exit $?"
grep -E "adaln_|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps Per" "$OUT/ncu_adaln.txt" | cut -c1-150
