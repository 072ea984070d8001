#!/bin/bash
# The 1.3B 480p recipe beside the peers' setups (benchmarks/bench_peers.py) on one GPU, from the repository root,
# FA4's wheels installed as ../shared/device/README.md says (the recipe runs model.attention=auto).
# Appends one record to $OUT/peers.json (copy it into benchmarks/results/peers.json).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/inductor_cache.XXXXXX)}
timeout ${TIMEOUT:-560} python3 benchmarks/bench_peers.py --name wan2_1_1_3b_480p --out "$OUT/peers.json" \
    --work "$OUT/runs_peers" --timeout ${RUN_TIMEOUT:-240} -- experiment=wan2_1_1_3b_480p trainer.devices=1 \
    trainer.max_steps=${STEPS:-40} callbacks.balance_monitor.warmup_steps=${WARMUP:-10} \
    trainer.enable_checkpointing=false '~callbacks.model_checkpoint' trainer.enable_progress_bar=false logger=none \
    data.dataset.num_samples=20000 2>&1 | tail -8
grep -h "Final metrics\|Error\|error:" "$OUT"/runs_peers/*/*/train.log 2>/dev/null | cut -c1-400 | tail -6
true
