#!/usr/bin/env bash
# End-to-end benchmark on one multi-GPU host (2 H200s here; runs unchanged on 8).
#
# Run from the repository root with the offline wheels (hydra-core, omegaconf, antlr4, torchdata) in .whl/:
#     bash benchmarks/run_e2e_device.sh                 # all GPUs of the host
#     NPROC=1 bash benchmarks/run_e2e_device.sh --steps 20
# Extra arguments go to benchmarks/bench_e2e.py. Everything is written under $OUT
# (default benchmarks/results): e2e_h200x<N>.json, .log, the PNGs and nvidia-smi.txt.
# The whole script is sized for one call of at most 9 minutes (bench_e2e's --max-seconds guard
# plus the installs and the first JIT build of the fused AdaLN kernel).
set -uo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=benchmarks/device_env.sh
source benchmarks/device_env.sh
NAME=${NAME:-e2e_h200x${NPROC}}
MAX_SECONDS=${MAX_SECONDS:-430}

{
  date -u
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} > "$OUT/${NAME}_nvidia_smi.txt" 2>&1

start=$(date +%s)
# A hard stop a little above the script's own guard, so a hang still returns the log.
timeout $((${MAX_SECONDS%.*} + 60)) torchrun --standalone --nproc-per-node="$NPROC" benchmarks/bench_e2e.py \
  --out "$OUT/$NAME.json" --max-seconds "$MAX_SECONDS" "$@" 2>&1 | tee "$OUT/$NAME.log"
rc=${PIPESTATUS[0]}
echo "bench_e2e exit code $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/$NAME.log"
ls -la "$OUT"
exit "$rc"
