// Fused AdaLN kernels: y = LayerNorm(x) * (1 + scale) + shift, statistics in fp32.
//
// Torch-free launcher API over raw pointers, so the kernels compile with a bare nvcc (CI) and the
// PyTorch binding stays a thin file of its own. All tensors are [B, N, D] (or [B, 1, D] for
// per-sample modulation) with a contiguous last dimension; the two leading strides are passed in
// elements and may be 0 (broadcast). Offsets are 64-bit throughout.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

enum AdalnDtype : int { ADALN_F32 = 0, ADALN_BF16 = 1, ADALN_F16 = 2 };

// The largest feature sizes the kernels keep in registers. Rows of any layout (the scalar path: 4
// values a thread, up to 1024 threads a row in the backward) up to ADALN_MAX_D_ANY; rows with D a
// multiple of 16 bytes and 16-byte-aligned pointers and strides (the vector paths: up to 24 values
// a thread, 256 threads a row) up to ADALN_MAX_D. Wan 2.1 14B is 5120 wide. The Python op states
// the same two numbers (lightning_adaptiveload/ops/_adaln.py) and checks them against these.
constexpr int64_t ADALN_MAX_D_ANY = 4096;
constexpr int64_t ADALN_MAX_D = 6144;

// Launch choices the host code otherwise makes by rule, passed explicitly by the caller (the
// library passes the defaults; benchmarks may force a choice). 0 means "the rule".
struct AdalnLaunchOptions {
  int pdl = 1;           // programmatic dependent launch on sm_90+ (0 = off)
  int cluster = 0;       // backward thread-block clusters: 0 = rule, 1 = never, 2, 4 or 8 = always that size
  int fwd_features = 0;  // features a thread of the streamed forward: 0 = rule, 16 or 24
  int bwd_features = 0;  // features a thread of the streamed backward: 0 = rule, 16 or 24
};

struct AdalnFwdParams {
  const void* x;  // [B, N, D], dtype x_dtype
  int64_t x_sb, x_sn;
  const void* scale;  // dtype mod_dtype; scale_sn == 0 for per-sample modulation
  int64_t scale_sb, scale_sn;
  const void* shift;  // dtype mod_dtype
  int64_t shift_sb, shift_sn;
  const float* weight;  // [D] or nullptr
  const float* bias;    // [D] or nullptr
  void* y;              // [B, N, D] contiguous, dtype out_dtype
  float* mean;          // [B * N]
  float* rstd;          // [B * N]
  int64_t B, N, D;
  float eps;
  AdalnDtype x_dtype, mod_dtype, out_dtype;
  AdalnLaunchOptions launch;
};

struct AdalnBwdParams {
  const void* dy;  // [B, N, D], dtype out_dtype
  int64_t dy_sb, dy_sn;
  const void* x;  // [B, N, D], dtype x_dtype
  int64_t x_sb, x_sn;
  const void* scale;  // dtype mod_dtype; per_token selects [B, N, D] (else [B, 1, D])
  int64_t scale_sb, scale_sn;
  const float* weight;  // [D] or nullptr
  const float* bias;    // [D] or nullptr (needed to rebuild the affine output for dscale)
  const float* mean;    // [B * N]
  const float* rstd;    // [B * N]
  void* dx;             // [B, N, D] contiguous, dtype x_dtype
  void* dscale;         // per token: [B, N, D]; per sample: [B, D]; contiguous, dtype mod_dtype
  void* dshift;         // per sample: [B, D] dtype mod_dtype; per token: unused (dshift == dy)
  float* dweight;       // [D] or nullptr
  float* dbias;         // [D] or nullptr
  float* workspace;     // adaln_bwd_workspace_bytes() bytes of scratch, 16-byte aligned
  int64_t B, N, D;
  bool per_token;
  AdalnDtype x_dtype, mod_dtype, out_dtype;
  AdalnLaunchOptions launch;
};

// Whether the kernels cover this dtype combination and feature size (callers fall back otherwise):
// D up to ADALN_MAX_D_ANY, or up to ADALN_MAX_D when D is a multiple of 16 bytes of x. Rows wider
// than ADALN_MAX_D_ANY also need 16-byte-aligned pointers and strides (adaln_fwd and adaln_bwd
// return cudaErrorInvalidValue otherwise).
bool adaln_supported(AdalnDtype x_dtype, AdalnDtype mod_dtype, AdalnDtype out_dtype, int64_t D);

cudaError_t adaln_fwd(const AdalnFwdParams& p, cudaStream_t stream);

// Scratch the backward needs for its per-CTA (or per-cluster) fp32 partial sums (0 when it needs
// none). Depends on the current device's multiprocessor count, so query it on the device that runs
// the backward.
size_t adaln_bwd_workspace_bytes(const AdalnBwdParams& p);

cudaError_t adaln_bwd(const AdalnBwdParams& p, cudaStream_t stream);
