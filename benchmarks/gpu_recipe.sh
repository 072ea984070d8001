#!/bin/bash
# The 1.3B recipe as the README gives it, on one GPU, for a short run (run on the device). Writes under $OUT.
# Extra arguments are Hydra overrides, e.g. 'model.compile_options={triton.mix_order_reduction_non_strict_mode:true}'.
# Dynamo's recompile reasons go to the log (TORCH_LOGS=recompiles unless set); the last line counts the
# block graphs compiled.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/recipe_wan2_1_1_3b_480p_h200x1.log"
TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout ${RECIPE_TIMEOUT:-420} python3 -m lightning_adaptiveload.train \
    experiment=wan2_1_1_3b_480p trainer.devices=1 \
    trainer.max_steps=${STEPS:-40} callbacks.balance_monitor.warmup_steps=${WARMUP:-10} logger=csv \
    trainer.enable_checkpointing=false '~callbacks.model_checkpoint' trainer.enable_progress_bar=false \
    data.dataset.num_samples=20000 callbacks.shape_benchmark.cache_dir="$OUT/cache" output_dir="$OUT/recipe" "$@" 2>&1 \
  | grep -v -i "warnings.warn\|tip:\|litlogger" | tee "$LOG" | grep -v "__recompiles\]" | tail -${TAIL:-70}
echo "block graphs compiled: $(( $(grep -c 'Recompiling function forward' "$LOG") + 1 )) (from TORCH_LOGS=recompiles)"
