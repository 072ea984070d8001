#!/bin/bash
# FA4 against cuDNN SDPA over 200 training steps of the full-depth 1.3B (30 blocks), from one seed (run on the
# device from the repository root, FA4's wheels on PYTHONPATH as ../shared/device/README.md says):
# benchmarks/bench_fidelity.py runs sdpa, sdpa again (the run-to-run spread) and fa4 through adaptiveload-train.
# Eager blocks and a fixed equal-token policy over 480p images (B = 5 x 1,560) and 17-frame clips (1 x 7,800)
# keep the three runs to a few minutes; no shape benchmark (the backend is fixed per run).
# Appends to $OUT/fidelity.json (copy its record into benchmarks/results/fidelity.json).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout ${TIMEOUT:-560} python3 benchmarks/bench_fidelity.py --name "wan2_1_1_3b_30_blocks_${STEPS:-200}_steps" \
    --runs ${RUNS:-sdpa sdpa fa4} --out "$OUT/fidelity.json" --work "$OUT/fidelity_runs" --timeout ${RUN_TIMEOUT:-200} -- \
    experiment=wan2_1_1_3b_480p trainer.devices=1 trainer.max_steps=${STEPS:-200} model.compile=false \
    model.activation_checkpointing=none bucketing=equal_token bucketing.policy.max_tokens=7800 \
    '~callbacks.shape_benchmark' '~callbacks.model_checkpoint' trainer.enable_checkpointing=false \
    trainer.enable_progress_bar=false data.dataset.num_samples=4000 \
    'data.dataset.mixture=[{num_frames:1,height:480,width:832,weight:0.5},{num_frames:17,height:480,width:832,weight:0.5}]' \
    2>&1 | tail -12
true
