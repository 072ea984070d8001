#!/bin/bash
# The closed loop on one GPU (run on the device from the repository root: `bash benchmarks/device/gpu_closed_loop.sh`):
# benchmarks/bench_closed_loop.py on a recipe, closed loop off (profiles, fills the cache) then on (reads the
# cache, corrects it from training's steps). RECIPE=480p (default) or mixed; STEPS training steps per run.
# PAIRS off/on pairs (default 1; off, on, on, off, ...); FIRST=on starts with the on run (on, off, off, on, ...).
# Every run profiles (callbacks.shape_benchmark.force=true): a run from the cache compiles each shape's graphs
# the first time training draws it, inside the measured steps (a 10 x 3,600 batch of the mixed corpus ran 5.4x its
# prediction once), while a profiling run has compiled them all before step 1; so off and on start alike.
# RUN_TIMEOUT: seconds one run may take (default 270; the mixed corpus's first run took over 270 s on an H100
# whose loaded SM clock sat at 1,515 MHz, so give it 300 there and keep TIMEOUT above the pair's sum).
# Appends to $OUT/closed_loop.json (copy its record into benchmarks/results/closed_loop.json).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source benchmarks/device/device_env.sh
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/inductor_cache.XXXXXX)}
MIX=()
[ "${RECIPE:-480p}" = mixed ] && MIX=(data.dataset.mixture=wan_mixed_480p_720p)
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -l 1 > "$OUT/gpu_clocks_closed_loop_${RECIPE:-480p}.csv" 2>/dev/null &
SMI=$!
timeout ${TIMEOUT:-560} python3 benchmarks/bench_closed_loop.py --name "wan2_1_1_3b_${RECIPE:-480p}" --out "$OUT/closed_loop.json" --pairs ${PAIRS:-1} --first ${FIRST:-off} \
    --work "$OUT/runs_${RECIPE:-480p}" --timeout ${RUN_TIMEOUT:-270} -- \
    experiment=wan2_1_1_3b_480p trainer.devices=1 trainer.max_steps=${STEPS:-50} \
    callbacks.balance_monitor.warmup_steps=${WARMUP:-10} callbacks.shape_benchmark.closed_loop_every_n_steps=10 \
    trainer.enable_checkpointing=false '~callbacks.model_checkpoint' trainer.enable_progress_bar=false logger=none \
    data.dataset.num_samples=20000 callbacks.shape_benchmark.force=true "${MIX[@]}" 2>&1 | tail -20
kill $SMI 2>/dev/null
python3 benchmarks/summarise.py clocks --csv "$OUT/gpu_clocks_closed_loop_${RECIPE:-480p}.csv" \
    --benchmark device/gpu_closed_loop.sh --command "RECIPE=${RECIPE:-480p} bash benchmarks/device/gpu_closed_loop.sh" \
    --out "$OUT/closed_loop.json"
# The logs of both runs, short: the calibration line, the closed loop's lines, the final metrics.
grep -h "ShapeBenchmarkCallback\`: step\|Final metrics\|means over" -A0 "$OUT"/runs_*/*/*/train.log 2>/dev/null | cut -c1-400 | tail -20
true
