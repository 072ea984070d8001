#!/bin/bash
# Per-bucket activation checkpointing against one mode for the run (`selective`) on the mixed 480p+720p corpus,
# both trained in one device call (run on the device, from the repository root: `bash benchmarks/device/gpu_mixed_ratio.sh`).
# Each run uses a calibration profiled on one H200 (benchmarks/results/calibration_mixed_*_h200x1.json) instead of
# profiling again, so the call's time goes to training; compare the two balance reports' "epoch of this plan at
# these step times" (every bucket weighed by its batches in the epoch), not their plain tokens/s.
# STEPS/WARMUP/RECIPE_TIMEOUT per run (default 16/6/270 s; STEPS_SELECTIVE, WARMUP_SELECTIVE and TIMEOUT_SELECTIVE
# set the selective run's apart); PROFILE names the runs that profile afresh instead (about 90 s a run more),
# e.g. PROFILE=per_bucket or PROFILE="per_bucket selective".
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache_mixed_ratio}
for mode in per_bucket selective; do
  ov=(data.dataset.mixture=wan_mixed_480p_720p)
  [ "$mode" = selective ] && ov+=(model.activation_checkpointing=selective)
  # PROFILE lists the modes that profile afresh (e.g. PROFILE=per_bucket: its profile time is measured too).
  case " ${PROFILE:-} " in *" $mode "*) ;; *) ov+=("callbacks.shape_benchmark.calibration=benchmarks/results/calibration_mixed_${mode}_h200x1.json") ;; esac
  echo "=== $mode $(date +%T)"
  steps=${STEPS:-16} warmup=${WARMUP:-6} limit=${RECIPE_TIMEOUT:-270}
  # selective's steps are ~3x longer (B = 155 images, 7.7 s at 75,600 tokens): it may take fewer of them
  [ "$mode" = selective ] && steps=${STEPS_SELECTIVE:-$steps} warmup=${WARMUP_SELECTIVE:-$warmup} limit=${TIMEOUT_SELECTIVE:-$limit}
  NAME=mixed_ratio_$mode STEPS=$steps WARMUP=$warmup RECIPE_TIMEOUT=$limit TAIL=${TAIL:-12} \
    bash benchmarks/device/gpu_recipe.sh "${ov[@]}"
done
grep -h "epoch of this plan" -A1 "$OUT"/recipe_mixed_ratio_*.log  # each run's record: benchmarks/results/recipes.json
