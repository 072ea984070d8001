#!/bin/bash
# diffusers' HunyuanVideo at a 1.0B config (dim 1536 = 12 heads x 128, 6 dual-stream + 12 single-stream blocks,
# 2 refiner blocks, LLaVA text 256 tokens, joint attention over video + text), compiled blocks, on the 480p mix
# through adaptiveload-train on one GPU; first the diffusers integration's cuda tests (fused AdaLN-Zero family,
# attention processor). Writes $OUT/recipes.json (a benchmarks/summarise.py record) and the log under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m cuda tests/integrations -p no:cacheprovider 2>&1 | tail -12
fi
HUNYUAN_1B=(model=diffusers_hunyuan_video model.transformer.num_attention_heads=12 model.transformer.num_layers=6
            model.transformer.num_single_layers=12 model.compile=true)
NAME=hunyuan_video_1b_480p_h200x1 EXPERIMENT=wan2_1_1_3b_480p RESULT="$OUT/recipes.json" STEPS=${STEPS:-40} \
  WARMUP=${WARMUP:-10} RECIPE_TIMEOUT=${RECIPE_TIMEOUT:-330} TAIL=${TAIL:-30} \
  bash benchmarks/device/gpu_recipe.sh "${HUNYUAN_1B[@]}" "$@"
true
