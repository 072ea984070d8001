#!/bin/bash
# The 1.3B recipe as the README gives it, on one GPU, for a short run (run on the device). Writes under $OUT.
# Extra arguments are Hydra overrides.
set -uo pipefail
OUT=${OUT:-/tmp/out}
timeout ${RECIPE_TIMEOUT:-420} python3 -m lightning_adaptiveload.train experiment=wan2_1_1_3b_480p trainer.devices=1 \
    trainer.max_steps=${STEPS:-40} callbacks.balance_monitor.warmup_steps=${WARMUP:-10} logger=csv \
    trainer.enable_checkpointing=false '~callbacks.model_checkpoint' trainer.enable_progress_bar=false \
    data.dataset.num_samples=20000 callbacks.shape_benchmark.cache_dir="$OUT/cache" output_dir="$OUT/recipe" "$@" 2>&1 \
  | grep -v -i "warnings.warn\|tip:\|litlogger" | tee "$OUT/recipe_wan2_1_1_3b_480p_h200x1.log" | tail -${TAIL:-70}
