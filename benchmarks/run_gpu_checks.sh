#!/usr/bin/env bash
# GPU checks on a device machine: every `cuda`-marked test on one GPU, then a short run of the Wan 2.1
# 1.3B recipe through Lightning's FSDP strategy on all GPUs (shape benchmark -> fitted policy ->
# balanced sampler, fused AdaLN, balance monitor). Logs go to $OUT (default benchmarks/results).
#
#     bash benchmarks/run_gpu_checks.sh            # TESTS=0 runs the recipe alone
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/device_env.sh
source benchmarks/device_env.sh
STEPS=${STEPS:-12}

# The kernel builds once here; the recipe below reuses the build cache.
tests_rc=0
if [ "${TESTS:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"
  tests_rc=${PIPESTATUS[0]}
fi

# 480p mixture (S up to 32,760) and activation checkpointing keep the 30-layer model's steps short.
timeout 330 torchrun --standalone --nproc-per-node="$NPROC" -m lightning_adaptiveload.train \
  experiment=wan2_1_1_3b_480p trainer.devices="$NPROC" trainer.max_steps="$STEPS" \
  trainer.log_every_n_steps=1 data.dataset.mixture=wan_480p data.dataset.num_samples=20000 \
  model.activation_checkpointing=true \
  callbacks.shape_benchmark.max_shapes=4 "callbacks.shape_benchmark.batch_sizes=[1,2,4]" \
  callbacks.shape_benchmark.repeats=2 callbacks.shape_benchmark.warmup=1 \
  callbacks.shape_benchmark.time_budget_s=90 \
  callbacks.shape_benchmark.cache_dir=/tmp/recipe/cache \
  "~callbacks.model_checkpoint" trainer.enable_checkpointing=false \
  output_dir=/tmp/recipe hydra.run.dir=/tmp/recipe 2>&1 | tee "$OUT/recipe_wan2_1_1_3b_480p.log"
recipe_rc=${PIPESTATUS[0]}
# Only a few files come back from the device: keep the calibration, its plot and the metrics.
for f in /tmp/recipe/shape_benchmark.json /tmp/recipe/shape_benchmark.png; do
  [ -f "$f" ] && cp "$f" "$OUT/recipe_$(basename "$f")"
done
find /tmp/recipe -name metrics.csv -exec cp {} "$OUT/recipe_metrics.csv" \;
echo "cuda tests exit $tests_rc; recipe exit $recipe_rc" | tee -a "$OUT/gpu_tests.log"
exit $(( tests_rc || recipe_rc ))
