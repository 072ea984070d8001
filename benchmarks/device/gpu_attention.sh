#!/bin/bash
# Attention backends on one GPU (from the repository root, after FA4's wheels are installed as
# ../shared/device/README.md says, PYTHONPATH including them): the cuda tests of the attention op, the kernel
# table, then RECIPES (480p | mixed | diffusers480p | 14b, space-separated) with model.attention=sdpa and auto.
# Appends to $OUT/attention.json (copy its records into benchmarks/results/attention.json).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/inductor_cache.XXXXXX)}
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -q tests/ops/test_attention.py tests/models/test_flow_matching.py -m cuda -p no:cacheprovider 2>&1 | tail -15
fi
if [ "${KERNELS:-1}" = 1 ]; then
  timeout 180 python3 benchmarks/bench_attention.py --kernels --out "$OUT/attention.json" 2>&1 | tail -12
fi
COMMON=(trainer.devices=1 trainer.max_steps=${STEPS:-50} callbacks.balance_monitor.warmup_steps=${WARMUP:-10}
        trainer.enable_checkpointing=false '~callbacks.model_checkpoint' trainer.enable_progress_bar=false logger=none
        data.dataset.num_samples=20000)
for recipe in ${RECIPES:-480p}; do
  case $recipe in
    480p) ARGS=(experiment=wan2_1_1_3b_480p) ;;
    mixed) ARGS=(experiment=wan2_1_1_3b_480p data.dataset.mixture=wan_mixed_480p_720p) ;;
    diffusers480p) ARGS=(experiment=wan2_1_1_3b_480p model=diffusers_wan2_1_1_3b model.compile=true) ;;
    14b) ARGS=(experiment=wan2_1_14b_720p ++model.model.num_layers=4 strategy=fsdp2 trainer.num_nodes=1) ;;
  esac
  timeout ${TIMEOUT:-540} python3 benchmarks/bench_attention.py --name "$recipe" --out "$OUT/attention.json" \
      --work "$OUT/runs_$recipe" --timeout ${RUN_TIMEOUT:-260} -- "${ARGS[@]}" "${COMMON[@]}" 2>&1 | tail -6
done
grep -h "attention=auto\|Final metrics" -A0 "$OUT"/runs_*/*/*/train.log 2>/dev/null | cut -c1-600 | tail -8
true
