#!/bin/bash
# Compiled-block variants back to back on one GPU (run on the device from the repository root):
# benchmarks/bench_block_variants.py once per line of VARIANTS ("name|args", default below), each in its own
# process with its own inductor cache, appending to $OUT/block_variants.json as it goes.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/device/device_env.sh
DEFAULT_VARIANTS='base|
coord|--option coordinate_descent_tuning=true
tile|--option triton.tile_reductions=true --option triton.prefer_nd_tiling=true
mixorder|--option triton.mix_order_reduction=true
pairs|--rope pairs'
while IFS='|' read -r name extra; do
  [ -z "$name" ] && continue
  start=$(date +%s)
  # shellcheck disable=SC2086
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d /tmp/inductor_variant.XXXXXX) timeout ${VARIANT_TIMEOUT:-120} \
    python3 benchmarks/bench_block_variants.py --name "$name" $extra ${COMMON:-} --out "$OUT/block_variants.json" 2>&1 \
    | grep -v "^W\|Warning" | tail -4
  echo "[$name] $(( $(date +%s) - start )) s"
done <<< "${VARIANTS:-$DEFAULT_VARIANTS}"
true
