#!/bin/bash
# The 1.3B recipe as the README gives it, on one GPU, for a short run (run on the device, from the repository
# root: `bash benchmarks/device/gpu_recipe.sh`). Writes under $OUT.
# Extra arguments are Hydra overrides, e.g. data.dataset.mixture=wan_mixed_480p_720p, or experiment=... for
# another recipe; NAME names the run (default: the 1.3B recipe's). The run's figures (profile, tokens/s, MFU, per-shape
# steps, clocks and power) are appended as one record to $RESULT (default benchmarks/results/recipes.json, by
# benchmarks/summarise.py); the raw log and clock samples stay under $OUT.
# Dynamo's recompile reasons go to the log (TORCH_LOGS=recompiles unless set); the last line counts the
# block graphs compiled. Compiles start cold (a fresh inductor cache unless TORCHINDUCTOR_CACHE_DIR is set), so
# the profile time is a first run's. The GPU's SM clock, power and throttle reasons are sampled every second
# to $OUT/gpu_clocks_$NAME.csv (nvidia-smi), to tell a slower clock under sustained load from time the step adds.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/recipe_${NAME:-wan2_1_1_3b_480p_h200x1}.log"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/inductor_cache.XXXXXX)}
SMI_PID=
if command -v nvidia-smi >/dev/null; then
    REASONS=clocks_event_reasons.active  # the older drivers' name: clocks_throttle_reasons.active
    nvidia-smi --query-gpu=$REASONS --format=csv >/dev/null 2>&1 || REASONS=clocks_throttle_reasons.active
    FIELDS=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,$REASONS
    # Memory temperature, utilisation and memory in use where this driver knows them (a field it does not
    # know fails the whole query).
    nvidia-smi --query-gpu=$FIELDS,temperature.memory,utilization.gpu,memory.used --format=csv >/dev/null 2>&1 \
        && FIELDS=$FIELDS,temperature.memory,utilization.gpu,memory.used
    nvidia-smi --query-gpu=$FIELDS --format=csv -l 1 > "$OUT/gpu_clocks_${NAME:-recipe}.csv" 2>/dev/null &
    SMI_PID=$!
    # Every process on the GPU, every 5 s: another process's kernels would slow the steps and draw power.
    (while sleep 5; do echo "$(date +%T) $(nvidia-smi --query-compute-apps=pid,process_name,used_memory \
        --format=csv,noheader 2>/dev/null | tr '\n' ';')"; done) > "$OUT/gpu_apps_${NAME:-recipe}.txt" &
    APPS_PID=$!
fi
TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout ${RECIPE_TIMEOUT:-420} python3 -m lightning_adaptiveload.train \
    experiment=${EXPERIMENT:-wan2_1_1_3b_480p} trainer.devices=1 \
    trainer.max_steps=${STEPS:-40} callbacks.balance_monitor.warmup_steps=${WARMUP:-10} logger=csv \
    trainer.enable_checkpointing=false '~callbacks.model_checkpoint' trainer.enable_progress_bar=false \
    data.dataset.num_samples=20000 callbacks.shape_benchmark.cache_dir="$OUT/cache" output_dir="$OUT/recipe_${NAME:-1_3b}" "$@" 2>&1 \
  | grep --line-buffered -v -i "warnings.warn\|tip:\|litlogger" | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done \
  | tee "$LOG" | grep -v "__recompiles\]" | tail -${TAIL:-70}
echo "block graphs compiled: $(( $(grep -c 'Recompiling function' "$LOG") + 1 )) (Dynamo recompiles + 1, from TORCH_LOGS=recompiles)"
[ -n "$SMI_PID" ] && kill "$SMI_PID" "$APPS_PID" 2>/dev/null
python3 benchmarks/summarise.py recipe --log "$LOG" --clocks "$OUT/gpu_clocks_${NAME:-recipe}.csv" \
    --name "${NAME:-wan2_1_1_3b_480p_h200x1}" --out "${RESULT:-benchmarks/results/recipes.json}" \
    --harness "STEPS=${STEPS:-40} WARMUP=${WARMUP:-10} benchmarks/device/gpu_recipe.sh" \
    --command "adaptiveload-train experiment=${EXPERIMENT:-wan2_1_1_3b_480p} trainer.devices=1 $*"
true
