#!/usr/bin/env bash
# Encoding throughput of adaptiveload-prepare (prepare_bench.py) on GPUs with the FULL-SIZE Wan 2.1 VAE (random weights).
#
#   benchmarks/device/gpu_prepare.sh OUT.json [NUM_CLIPS=200] [BATCH=4]
#
# Needs torch with CUDA and diffusers; nothing is downloaded. With PyAV it generates NUM_CLIPS mp4 clips
# of 33 frames at 480x832 and runs the real pipeline (Preparer: probe, decode in DataLoader workers,
# bucket, VAE + text encoder, tar shards, index) on every GPU (torchrun, one rank per GPU, each rank its
# shards); without PyAV only the VAE-alone measurement runs. It also times the VAE alone on
# pre-made pixels (batch 1 and BATCH), which separates decoding from encoding.
# The text encoder is a tiny random UMT5 (2 layers, d_model 4096) with a word-level tokenizer: the
# JSON says so, and its cost is far below umT5-XXL's. Appends clips/s per GPU to OUT.json (a result file,
# e.g. benchmarks/results/prepare.json).
set -euo pipefail
OUT_JSON=${1:?usage: benchmarks/device/gpu_prepare.sh OUT.json [NUM_CLIPS] [BATCH]}
NUM_CLIPS=${2:-200}
BATCH=${3:-4}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
if [ "$NGPU" -lt 1 ]; then echo "gpu_prepare.sh: no CUDA device" >&2; exit 1; fi

if [ "$NGPU" -gt 1 ]; then
  $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" "$REPO/benchmarks/device/prepare_bench.py" "$WORK" "$NUM_CLIPS" "$BATCH" "$OUT_JSON"
else
  $PY "$REPO/benchmarks/device/prepare_bench.py" "$WORK" "$NUM_CLIPS" "$BATCH" "$OUT_JSON"
fi
