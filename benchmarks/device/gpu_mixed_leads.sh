#!/bin/bash
# The slow small-batch steps of the mixed corpus (1.25-1.39x their profile with per-bucket checkpointing,
# docs/benchmarks.md §0): the pinned per-bucket calibration trained with the project's DDP (the model wrapped on
# the current stream) and with Lightning's own DDPStrategy (wrapped on a side stream), in one device call
# (run on the device, from the repository root: `bash benchmarks/device/gpu_mixed_leads.sh`). Compare each
# report's per-shape table and its "device allocations per shape" line. STEPS/WARMUP per run (default 60/10).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache_mixed_leads}
ov=(data.dataset.mixture=wan_mixed_480p_720p
    callbacks.shape_benchmark.calibration=benchmarks/results/calibration_mixed_per_bucket_h200x1.json)
for ddp in same_stream lightning; do
  extra=()
  [ "$ddp" = lightning ] && extra=(strategy._target_=lightning.pytorch.strategies.DDPStrategy
                                   +strategy.gradient_as_bucket_view=true)
  echo "=== $ddp $(date +%T)"
  NAME=mixed_leads_$ddp STEPS=${STEPS:-60} WARMUP=${WARMUP:-10} RECIPE_TIMEOUT=${RECIPE_TIMEOUT:-280} TAIL=${TAIL:-30} \
    bash benchmarks/device/gpu_recipe.sh "${ov[@]}" "${extra[@]}"
done
grep -h "device allocations per shape\|epoch of this plan" -A1 "$OUT"/recipe_mixed_leads_*.log
