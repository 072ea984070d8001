#!/usr/bin/env bash
# Data wait of a real training run from shards: is the loader fast enough for the Wan 2.1 1.3B recipe?
#
#   OUT=/some/dir benchmarks/device/gpu_data_wait.sh            # appends a record to "$OUT/data_wait.json"
#   MODE=cpu OUT=/tmp/dw benchmarks/device/gpu_data_wait.sh     # the same pipeline with the tiny model on CPU
#
# 1. Writes a synthetic sharded corpus (data_wait_corpus.py) with the package's own writer (ShardWriter, write_index):
#    SAMPLES (default 2,000) samples, VIDEO_FRAC (0.25) of them 81-frame 480p video latents
#    [16, 21, 60, 104] and the rest 480p image latents [16, 1, 60, 104], float16 on disk as
#    adaptiveload-prepare stores them, 64-token umT5-width contexts [64, 4096], 16 samples a shard.
#    Each shard's pages are dropped from the page cache after writing (posix_fadvise DONTNEED,
#    best effort, no root needed), so training reads the disk rather than memory.
# 2. Runs `adaptiveload-train` (python -m lightning_adaptiveload.train) on it: data=shards, the
#    full-depth Wan 2.1 1.3B (model=wan2_1_1_3b), bf16-mixed, activation checkpointing, WORKERS (8)
#    DataLoader workers with pinned memory, the recipe's dual-constraint policy (m_mem 75,600,
#    m_comp 32,760^2: B=1 for video, B=48 for images), STEPS (30) steps, only the BalanceMonitor
#    callback (no shape benchmark or fused-kernel build, which would take minutes), no checkpoints.
# 3. Writes (data_wait_summary.py) the monitor's data-wait fraction (run mean after WARMUP steps, per rank: total wait
#    over total wall time) and tokens/s, and the per-step values from the CSV log, to
#    "$OUT/data_wait.json" (a result file: the record says the hardware, commit and date).
#
# GPU time on one H200, estimated (not yet run): ~20 s writing the corpus (3.4 GB), ~30 s start-up and
# ~2.8 s a step (the shape benchmark measured 2.79 s at B=1, S=32,760 and 2.82 s at B=42, S=1,560:
# benchmarks/results/shape_benchmark.json), ~2.5 min in all; STEPS=20 saves 30 s.
set -euo pipefail
OUT=${OUT:?set OUT to the folder for the JSON}
MODE=${MODE:-gpu}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
mkdir -p "$OUT"

if [ "$MODE" = gpu ]; then
  SAMPLES=${SAMPLES:-2000}; STEPS=${STEPS:-30}; WARMUP=${WARMUP:-3}; WORKERS=${WORKERS:-8}
  VIDEO="16,21,60,104"; IMAGE="16,1,60,104"; TEXT="64,4096"; GRID_HW="30,52"
    TRAIN_ARGS=(model=wan2_1_1_3b model.activation_checkpointing=true trainer=gpu trainer.devices=1
              strategy=auto data.datamodule.pin_memory=true
              m_mem=75600 bucketing.policy.m_comp=1073217600)
elif [ "$MODE" = cpu ]; then
  # tiny model (text_dim 32), latents it can take, fp32 on CPU: checks the pipeline, not speed
  SAMPLES=${SAMPLES:-48}; STEPS=${STEPS:-6}; WARMUP=${WARMUP:-1}; WORKERS=${WORKERS:-2}
  VIDEO="16,5,8,8"; IMAGE="16,1,8,8"; TEXT="8,32"; GRID_HW="4,4"
    TRAIN_ARGS=(model=tiny trainer=cpu trainer.devices=1 strategy=auto
              m_mem=2048 bucketing.policy.m_comp=28800)
else
  echo "gpu_data_wait.sh: MODE=$MODE; expected gpu or cpu" >&2; exit 1
fi
VIDEO_FRAC=${VIDEO_FRAC:-0.25}

T0=$(date +%s.%N)
$PY "$REPO/benchmarks/device/data_wait_corpus.py" "$WORK/corpus" "$SAMPLES" "$VIDEO_FRAC" "$VIDEO" "$IMAGE" "$TEXT" "$GRID_HW"
T1=$(date +%s.%N)

$PY -m lightning_adaptiveload.train "${TRAIN_ARGS[@]}" data=shards data.dataset.path="$WORK/corpus/index.parquet" \
  data.datamodule.num_workers="$WORKERS" callbacks=balance_monitor callbacks.balance_monitor.log_every_n_steps=1 \
  callbacks.balance_monitor.warmup_steps="$WARMUP" bucketing.fit_from_benchmark=false \
  trainer.max_steps="$STEPS" trainer.log_every_n_steps=1 trainer.enable_checkpointing=false trainer.enable_progress_bar=false \
  seed=0 output_dir="$WORK/run" hydra.run.dir="$WORK/run" 2>&1 | tee "$WORK/train.log"
T2=$(date +%s.%N)

$PY "$REPO/benchmarks/device/data_wait_summary.py" "$WORK" "$OUT/data_wait.json" "$MODE" "$WORKERS" "$STEPS" "$WARMUP" "$T0" "$T1" "$T2"
