# Sourced by the device scripts: offline wheels (hydra-core, omegaconf, antlr4, torchdata) from .whl/,
# the checkout on PYTHONPATH, Hopper builds, NVLink multicast off, $OUT and the GPU count.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 || exit
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
