#!/usr/bin/env bash
# Compiles the torch-free AdaLN kernels for sm_90 and fails on a compile error or a register spill.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if ! command -v nvcc >/dev/null 2>&1; then
  echo "compile_kernels: nvcc not found, skipping the CUDA kernel compile check"
  exit 0
fi
log="$(mktemp)"
trap 'rm -f "$log" "$log.o"' EXIT
nvcc --version | tail -n 1
if ! nvcc -arch=sm_90 -O3 -std=c++17 -Xptxas -v -c "$root/csrc/adaln.cu" -o "$log.o" >"$log" 2>&1; then
  cat "$log"
  echo "compile_kernels: csrc/adaln.cu does not compile for sm_90"
  exit 1
fi
kernels=$(grep -c "Compiling entry function" "$log" || true)
spills=$(grep -E "[1-9][0-9]* bytes spill (stores|loads)" "$log" || true)
if [ -n "$spills" ]; then
  grep -E "Compiling entry function|spill" "$log" | grep -B1 -E "[1-9][0-9]* bytes spill"
  echo "compile_kernels: ptxas reports register spills (see above)"
  exit 1
fi
echo "compile_kernels: csrc/adaln.cu OK for sm_90 ($kernels kernels, no spills)"
