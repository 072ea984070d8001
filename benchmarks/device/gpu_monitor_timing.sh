#!/bin/bash
# BalanceMonitor's timing and the closed loop on the 480p recipe, one GPU (run on the device from the repository
# root, FA4 installed as ../shared/device/README.md says): benchmarks/bench_ab.py with three arms, every run profiling,
#   a = callbacks.balance_monitor.timing=synchronize (a synchronisation around every step; closed loop on)
#   b = callbacks.balance_monitor.timing=events (CUDA events read a step late; closed loop on)
#   c = timing=events with the closed loop off
# in ORDER (default "b c a"); a second call with ORDER="a c b" makes one ABBA series of every pair of arms.
# EXTRA: more overrides of every run (e.g. EXTRA=model.attention=sdpa where FA4 is not installed).
# Appends to $OUT/ab.json (copy its records into benchmarks/results/ab.json).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/device/device_env.sh
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/inductor_cache.XXXXXX)}
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -l 1 > "$OUT/gpu_clocks_monitor_timing.csv" 2>/dev/null &
SMI=$!
# shellcheck disable=SC2086
timeout ${TIMEOUT:-560} python3 benchmarks/bench_ab.py --name wan2_1_1_3b_480p_monitor_timing --order ${ORDER:-b c a} \
    --a callbacks.balance_monitor.timing=synchronize --b callbacks.balance_monitor.timing=events \
    --c callbacks.balance_monitor.timing=events callbacks.shape_benchmark.closed_loop=false \
    --out "$OUT/ab.json" --work "$OUT/runs" --timeout ${RUN_TIMEOUT:-270} -- \
    experiment=wan2_1_1_3b_480p trainer.devices=1 trainer.max_steps=${STEPS:-40} \
    callbacks.balance_monitor.warmup_steps=${WARMUP:-10} callbacks.shape_benchmark.closed_loop_every_n_steps=10 \
    trainer.enable_checkpointing=false '~callbacks.model_checkpoint' trainer.enable_progress_bar=false logger=none \
    data.dataset.num_samples=20000 callbacks.shape_benchmark.force=true ${EXTRA:-} 2>&1 | tail -8
kill $SMI 2>/dev/null
python3 benchmarks/summarise.py clocks --csv "$OUT/gpu_clocks_monitor_timing.csv" \
    --benchmark device/gpu_monitor_timing.sh --command "ORDER=\"${ORDER:-b c a}\" bash benchmarks/device/gpu_monitor_timing.sh" \
    --out "$OUT/ab.json"
grep -h "ShapeBenchmarkCallback\`: step\|Final metrics\|means over" -A0 "$OUT"/runs/*/*/train.log 2>/dev/null | cut -c1-300 | tail -12
true
