#!/usr/bin/env bash
# Data wait of a real training run from shards: is the loader fast enough for the Wan 2.1 1.3B recipe?
#
#   OUT=/some/dir benchmarks/gpu_data_wait.sh            # writes "$OUT/data_wait_h200x1.json"
#   MODE=cpu OUT=/tmp/dw benchmarks/gpu_data_wait.sh     # the same pipeline with the tiny model on CPU
#
# 1. Writes a synthetic sharded corpus with the package's own writer (ShardWriter, write_index):
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
# 3. Writes the monitor's data-wait fraction (run mean after WARMUP steps, per rank: total wait
#    over total wall time) and tokens/s, and the per-step values from the CSV log, to
#    "$OUT/data_wait_h200x1.json" ("$OUT/data_wait_cpu.json" with MODE=cpu).
#
# GPU time on one H200, estimated (not yet run): ~20 s writing the corpus (3.4 GB), ~30 s start-up and
# ~2.8 s a step (the shape benchmark measured 2.79 s at B=1, S=32,760 and 2.82 s at B=42, S=1,560:
# benchmarks/results/shape_benchmark_wan2_1_1_3b_h200x1.json), ~2.5 min in all; STEPS=20 saves 30 s.
set -euo pipefail
OUT=${OUT:?set OUT to the folder for the JSON}
MODE=${MODE:-gpu}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
mkdir -p "$OUT"

if [ "$MODE" = gpu ]; then
  SAMPLES=${SAMPLES:-2000}; STEPS=${STEPS:-30}; WARMUP=${WARMUP:-3}; WORKERS=${WORKERS:-8}
  VIDEO="16,21,60,104"; IMAGE="16,1,60,104"; TEXT="64,4096"; GRID_HW="30,52"
  NAME=data_wait_h200x1.json
  TRAIN_ARGS=(model=wan2_1_1_3b model.activation_checkpointing=true trainer=gpu trainer.devices=1
              strategy=auto data.datamodule.pin_memory=true
              bucketing.policy.m_mem=75600 bucketing.policy.m_comp=1073217600)
elif [ "$MODE" = cpu ]; then
  # tiny model (text_dim 32), latents it can take, fp32 on CPU: checks the pipeline, not speed
  SAMPLES=${SAMPLES:-48}; STEPS=${STEPS:-6}; WARMUP=${WARMUP:-1}; WORKERS=${WORKERS:-2}
  VIDEO="16,5,8,8"; IMAGE="16,1,8,8"; TEXT="8,32"; GRID_HW="4,4"
  NAME=data_wait_cpu.json
  TRAIN_ARGS=(model=tiny trainer=cpu trainer.devices=1 strategy=auto
              bucketing.policy.m_mem=2048 bucketing.policy.m_comp=28800)
else
  echo "gpu_data_wait.sh: MODE=$MODE; expected gpu or cpu" >&2; exit 1
fi
VIDEO_FRAC=${VIDEO_FRAC:-0.25}

T0=$(date +%s.%N)
$PY - "$WORK/corpus" "$SAMPLES" "$VIDEO_FRAC" "$VIDEO" "$IMAGE" "$TEXT" "$GRID_HW" "$REPO/benchmarks" <<'PY'
import json, sys
from pathlib import Path

import numpy as np

sys.path.insert(0, sys.argv[8])
from bench_shards import write_corpus  # noqa: E402

root, n, video_frac = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
video, image, text = (tuple(int(v) for v in a.split(",")) for a in sys.argv[4:7])
gh, gw = (int(v) for v in sys.argv[7].split(","))
rng = np.random.default_rng(0)
# One random array per kind, written for every sample: the bytes read are what matters here.
arrays = {"video": rng.standard_normal(video).astype(np.float16), "image": rng.standard_normal(image).astype(np.float16)}
context = rng.standard_normal(text).astype(np.float16)
is_video = rng.random(n) < video_frac
written = write_corpus(root, [arrays["video" if v else "image"] for v in is_video], context, (gh, gw), evict=True)
shards, size = written["shards"], written["shard_bytes"]
info = {"samples": n, "videos": int(is_video.sum()), "images": int(n - is_video.sum()), "video_latents": video,
        "image_latents": image, "context": text, "stored": "float16", "shards": len(shards), "shard_bytes": size,
        "write_s": written["write_s"]}
(root / "corpus.json").write_text(json.dumps(info))
print(f"corpus: {json.dumps(info)}", flush=True)
PY
T1=$(date +%s.%N)

$PY -m lightning_adaptiveload.train "${TRAIN_ARGS[@]}" data=shards data.dataset.path="$WORK/corpus/index.parquet" \
  data.datamodule.num_workers="$WORKERS" callbacks=balance_monitor callbacks.balance_monitor.log_every_n_steps=1 \
  callbacks.balance_monitor.warmup_steps="$WARMUP" bucketing.fit_from_benchmark=false \
  trainer.max_steps="$STEPS" trainer.log_every_n_steps=1 trainer.enable_checkpointing=false trainer.enable_progress_bar=false \
  seed=0 output_dir="$WORK/run" hydra.run.dir="$WORK/run" 2>&1 | tee "$WORK/train.log"
T2=$(date +%s.%N)

$PY - "$WORK" "$OUT/$NAME" "$MODE" "$WORKERS" "$STEPS" "$WARMUP" "$T0" "$T1" "$T2" <<'PY'
import csv, json, re, sys, time
from pathlib import Path

work, out, mode, workers, steps, warmup = Path(sys.argv[1]), sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
t0, t1, t2 = map(float, sys.argv[7:10])
log = (work / "train.log").read_text()
final = re.search(r"balance, means over (\d+) steps: (.*)", log)
if final is None:
    sys.exit("gpu_data_wait.sh: no 'balance, means over' line in the training log; the run failed (see above)")
means = {}
for part in final.group(2).split(", "):
    key, value = part.rsplit(" ", 1)
    means[key] = float(value.rstrip("%").replace(",", "")) / (100.0 if value.endswith("%") else 1.0)
per_step = []
for path in sorted((work / "run").rglob("metrics.csv")):
    with path.open() as fh:
        for row in csv.DictReader(fh):
            if row.get("train/data_wait_frac"):
                per_step.append({"step": int(row["step"]), "data_wait_frac": float(row["train/data_wait_frac"]),
                                 "tokens_per_s": float(row.get("balance/tokens_per_s") or "nan")})
try:
    import torch
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
except Exception as err:  # noqa: BLE001 - the JSON says why instead
    device = f"unknown ({err})"
result = {
    "what": "data wait of adaptiveload-train from shards (BalanceMonitor: end of one batch to the start of the "
            "next, as a fraction of wait + step time; the run value is per rank total wait over total wall time "
            f"after {warmup} warm-up steps, the largest over ranks)",
    "mode": mode, "device": device, "num_workers": workers, "steps": steps, "warmup_steps": warmup,
    "corpus": json.loads((work / "corpus" / "corpus.json").read_text()),
    "page_cache": "each shard evicted after writing with posix_fadvise(POSIX_FADV_DONTNEED), best effort",
    "data_wait_frac": means.get("data_wait_frac"), "tokens_per_s": means.get("tokens_per_s"),
    "goal_data_wait_frac_at_most": 0.01, "run_means": means, "steps_measured": int(final.group(1)),
    "per_step": per_step, "write_corpus_s": t1 - t0, "train_wall_s": t2 - t1,
    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
}
Path(out).write_text(json.dumps(result, indent=1))
print(json.dumps({k: v for k, v in result.items() if k != "per_step"}, indent=1))
PY
