#!/bin/bash
# The residual stream's dtype end to end on the 480p recipe, one GPU (run on the device from the repository root,
# FA4 installed as ../shared/device/README.md says): benchmarks/bench_ab.py with three arms in ORDER (default
# "a b c"), every run timing with CUDA events and profiling its own calibration,
#   a = ++model.model.residual_fp32=true (the default: fp32 stream between blocks, as Wan)
#   b = ++model.model.residual_fp32=false (bf16 stream, fp32 updates, as diffusers' WanTransformerBlock)
#   c = diffusers' Wan 1.3B compiled (model=diffusers_wan2_1_1_3b model.compile=true) on the same recipe
# The record keeps each run's mean loss, so a and b's losses from one seed can be compared.
# Appends to $OUT/ab.json (copy its records into benchmarks/results/ab.json).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/device/device_env.sh
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/inductor_cache.XXXXXX)}
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -l 1 > "$OUT/gpu_clocks_residual.csv" 2>/dev/null &
SMI=$!
# shellcheck disable=SC2086
timeout ${TIMEOUT:-540} python3 benchmarks/bench_ab.py --name wan2_1_1_3b_480p_residual_dtype --order ${ORDER:-a b c} \
    --a ++model.model.residual_fp32=true --b ++model.model.residual_fp32=false \
    --c model=diffusers_wan2_1_1_3b model.compile=true \
    --out "$OUT/ab.json" --work "$OUT/runs" --timeout ${RUN_TIMEOUT:-200} -- \
    experiment=wan2_1_1_3b_480p trainer.devices=1 trainer.max_steps=${STEPS:-40} \
    callbacks.balance_monitor.warmup_steps=${WARMUP:-10} callbacks.balance_monitor.timing=events \
    trainer.enable_checkpointing=false '~callbacks.model_checkpoint' trainer.enable_progress_bar=false logger=none \
    data.dataset.num_samples=20000 callbacks.shape_benchmark.force=true ${EXTRA:-} 2>&1 | tail -8
kill $SMI 2>/dev/null
python3 benchmarks/summarise.py clocks --csv "$OUT/gpu_clocks_residual.csv" \
    --benchmark device/gpu_residual.sh --command "ORDER=\"${ORDER:-a b c}\" bash benchmarks/device/gpu_residual.sh" \
    --out "$OUT/ab.json"
grep -h "Final metrics\|means over\|train/loss" -A0 "$OUT"/runs/*/*/train.log 2>/dev/null | cut -c1-400 | tail -12
true
