#!/bin/bash
# Wan 2.1 1.3B at 480p on the GPUs of this node (default 8).
set -euo pipefail
adaptiveload-train experiment=wan2_1_1_3b_480p trainer.devices="${GPUS:-8}" "$@"
