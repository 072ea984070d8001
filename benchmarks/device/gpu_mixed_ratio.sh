#!/bin/bash
# Per-bucket activation checkpointing against one mode for the run (`selective`) on the mixed 480p+720p corpus,
# both trained in one device call (run on the device, from the repository root: `bash benchmarks/device/gpu_mixed_ratio.sh`).
# Each run uses a calibration profiled on one H200 (benchmarks/results/calibration_mixed_*_h200x1.json, 2026-12-02)
# instead of profiling again, so the call's time goes to training; compare the two balance reports' "epoch of
# this plan at these step times" (every bucket weighed by its batches in the epoch), not their plain tokens/s.
# STEPS/WARMUP per run (default 16/6); PROFILE names the runs that profile afresh instead (about 90 s a run more),
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
  NAME=mixed_ratio_$mode STEPS=${STEPS:-16} WARMUP=${WARMUP:-6} RECIPE_TIMEOUT=${RECIPE_TIMEOUT:-270} TAIL=${TAIL:-12} \
    bash benchmarks/device/gpu_recipe.sh "${ov[@]}"
done
grep -h "epoch of this plan" -A1 "$OUT"/recipe_mixed_ratio_*.log
