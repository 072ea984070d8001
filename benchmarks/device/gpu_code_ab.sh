#!/bin/bash
# The package at another commit (arm a, from OLD: a directory made with
# `git archive REV lightning_adaptiveload | tar -x -C OLD`) against the checkout (arm b) on one recipe, one GPU
# (run on the device from the repository root): benchmarks/bench_ab.py --a-code, ORDER (default "a b"), every
# run timing with CUDA events and profiling its own calibration. Appends to $OUT/ab.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/device/device_env.sh
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/inductor_cache.XXXXXX)}
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -l 1 > "$OUT/gpu_clocks_code_ab.csv" 2>/dev/null &
SMI=$!
# shellcheck disable=SC2086
timeout ${TIMEOUT:-540} python3 benchmarks/bench_ab.py --name "${NAME:-code_ab}" --order ${ORDER:-a b} \
    --a-code "${OLD:?set OLD to a directory holding another copy of lightning_adaptiveload}" \
    --out "$OUT/ab.json" --work "$OUT/runs" --timeout ${RUN_TIMEOUT:-200} -- \
    experiment=${EXPERIMENT:-wan2_1_1_3b_480p} trainer.devices=1 trainer.max_steps=${STEPS:-40} \
    callbacks.balance_monitor.warmup_steps=${WARMUP:-10} callbacks.balance_monitor.timing=events \
    trainer.enable_checkpointing=false '~callbacks.model_checkpoint' trainer.enable_progress_bar=false logger=none \
    data.dataset.num_samples=20000 callbacks.shape_benchmark.force=true ${EXTRA:-} 2>&1 | tail -8
kill $SMI 2>/dev/null
python3 benchmarks/summarise.py clocks --csv "$OUT/gpu_clocks_code_ab.csv" \
    --benchmark device/gpu_code_ab.sh --command "OLD=$OLD ORDER=\"${ORDER:-a b}\" bash benchmarks/device/gpu_code_ab.sh" \
    --out "$OUT/ab.json"
true
