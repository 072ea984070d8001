// Fused AdaLN forward and backward kernels (see adaln.h for the launcher API).
//
// Two families. The streamed kernels (per-sample modulation on 16-byte-aligned rows, the common
// case) give each CTA rows of one sample (a strip, or row groups dealt out in turn); every thread
// stays on the same 16-24 features for all of them, keeps their modulation (and, backward, their
// column sums) in registers and receives its rows through cp.async into a shared-memory ring
// several row groups deep. Rows the CTA's threads cover exactly take kernels without bounds checks. The
// row-packing kernels (per-token modulation, narrow or unaligned rows) spread each row over one or
// more warps and keep it in registers, with 16-byte loads where the rows are aligned.
//
// Forward: fp32 statistics (warp shuffles, then one shared-memory step across warps). The
// row-packing kernels take exact two-pass sums; the streamed kernels sum each staged row once,
// shifted by the previous row's mean in the same CTA slot, and pass again where that shift would
// cost more than 4 bits of the variance. The modulation is applied as y is written. Only mean and
// rstd (fp32) are kept.
//
// Backward: threads fixed on features walk down their strip, so the column sums accumulate in
// registers and warps read consecutive features (coalesced); dx is finished in the same pass. Each
// CTA then writes one fp32 partial per feature (for short strips on sm_90, each thread-block cluster
// of 8 CTAs, added in distributed shared memory), and a second small kernel adds the partials in a
// fixed order: deterministic, no atomics, and never an [N, D] intermediate for per-sample
// modulation. On sm_90 the streamed kernels and the finishing kernel launch with programmatic
// dependent launch, so that each one's launch overlaps the end of the kernel before it.
//
// Two accumulators per feature cover every case. Per-sample modulation sums A = sum_n dy * x̂ and
// H = sum_n dy for each sample b; then dshift_b = H_b, dscale_b = w * A_b + bias * H_b,
// dweight = sum_b (1 + scale_b) * A_b and dbias = sum_b (1 + scale_b) * H_b (the affine terms need
// no accumulators of their own). Per-token modulation writes dscale = dy * (x̂ w + bias) per element
// and, with an affine, sums dweight/dbias partials directly.

#include "adaln.h"

#include <type_traits>

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kWarp = 32;
// Values each thread holds for one row: the forward keeps x (32 values); the backward keeps x̂, the
// gradient, two accumulators and two prefetched rows per value, so it holds 8 for D <= 4096 and 24
// above. Each backward variant caps its CTA size so that the compiler keeps all of them in
// registers (512 threads -> 128 registers, 256 -> 255) instead of spilling.
constexpr int kFwdValues = 32;
constexpr int kBwdSmallValues = 8;
constexpr int kBwdSmallThreads = 512;
constexpr int kBwdLargeValues = 24;
constexpr int kBwdLargeThreads = 256;
// Unaligned rows (D not a multiple of the vector width) take a scalar path with 4 values a thread.
constexpr int kBwdScalarValues = 4;
constexpr int kBwdScalarThreads = 1024;
constexpr int kBwdMaxThreads = kBwdScalarThreads;

constexpr int bwd_threads(int values) {
  return values == kBwdSmallValues ? kBwdSmallThreads
                                   : (values == kBwdLargeValues ? kBwdLargeThreads : kBwdScalarThreads);
}
// Rows each backward thread loads ahead (see adaln_bwd_kernel). Three spill under the 128-register
// cap of the 512-thread variant for bf16 x with an affine (ptxas -v), so two.
constexpr int kBwdDepth = 2;
// Forward CTAs pack several short rows so that a CTA has at least this many threads.
constexpr int kFwdCtaThreads = 256;
constexpr int kFwdMaxRows = kFwdCtaThreads / kWarp;
// Final reduction of the per-CTA partials: 32 features x up to 32 slices of partials per CTA (the
// launch picks 8, 16 or 32 so that the grid is one wave), each thread summing its slice with
// several loads in flight.
constexpr int kRedCols = 32;
constexpr int kRedSlices = 32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// VEC consecutive elements moved as one access (or as 16-byte chunks when wider than 16 bytes).
template <typename T, int VEC>
struct Pack {
  static constexpr int kBytes = static_cast<int>(sizeof(T)) * VEC;
  static constexpr int kAlign = kBytes < 16 ? kBytes : 16;
  alignas(kAlign) T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* __restrict__ p) {
  Pack<T, VEC> r;
  if constexpr (Pack<T, VEC>::kBytes >= 16) {
#pragma unroll
    for (int c = 0; c < Pack<T, VEC>::kBytes / 16; ++c) {
      reinterpret_cast<uint4*>(r.v)[c] = reinterpret_cast<const uint4*>(p)[c];
    }
  } else {
    r = *reinterpret_cast<const Pack<T, VEC>*>(p);
  }
  return r;
}

// A pack's values as floats. bf16 pairs widen with one integer instruction each (the bits moved into
// the top half of an fp32 word) instead of extracting each half first.
template <typename T, int VEC>
__device__ __forceinline__ void unpack(const Pack<T, VEC>& r, float (&out)[VEC]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && VEC % 2 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      const uint32_t w = reinterpret_cast<const uint32_t*>(r.v)[j / 2];
      out[j] = __uint_as_float(w << 16);
      out[j + 1] = __uint_as_float(w & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = to_float(r.v[j]);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* __restrict__ p, float (&out)[VEC]) {
  unpack<T, VEC>(load_pack<T, VEC>(p), out);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_floats(T* __restrict__ p, const float (&in)[VEC]) {
  Pack<T, VEC> r;
#pragma unroll
  for (int j = 0; j < VEC; ++j) r.v[j] = from_float<T>(in[j]);
  if constexpr (Pack<T, VEC>::kBytes >= 16) {
#pragma unroll
    for (int c = 0; c < Pack<T, VEC>::kBytes / 16; ++c) {
      reinterpret_cast<uint4*>(p)[c] = reinterpret_cast<const uint4*>(r.v)[c];
    }
  } else {
    *reinterpret_cast<Pack<T, VEC>*>(p) = r;
  }
}

// Butterfly sums: every lane ends with the same bits (each step adds the same two operands).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the blockDim.x threads of one row; `slots` holds one value per warp of that row. Every
// thread of the CTA must call it (it may synchronise). Fixed order, so deterministic.
__device__ __forceinline__ float row_sum(float v, float* slots) {
  v = warp_sum(v);
  const int warps = blockDim.x / kWarp;
  if (warps == 1) return v;
  if ((threadIdx.x & (kWarp - 1)) == 0) slots[threadIdx.x / kWarp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += slots[w];
  return total;
}

__device__ __forceinline__ float2 row_sum2(float2 v, float2* slots) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
  }
  const int warps = blockDim.x / kWarp;
  if (warps == 1) return v;
  if ((threadIdx.x & (kWarp - 1)) == 0) slots[threadIdx.x / kWarp] = v;
  __syncthreads();
  float2 total = make_float2(0.f, 0.f);
  for (int w = 0; w < warps; ++w) {
    total.x += slots[w].x;
    total.y += slots[w].y;
  }
  return total;
}

// ------------------------------------------------------------------------------------------------
// Forward. Block (tpr, rows): thread x covers features (i * tpr + x) * VEC + [0, VEC) for i < NV.
template <typename TX, typename TM, typename TO, int VEC>
__global__ void adaln_fwd_kernel(const AdalnFwdParams p) {
  constexpr int NV = kFwdValues / VEC;
  __shared__ float slots[2][kFwdMaxRows][kWarp];
  const int tid = threadIdx.x;
  const int tpr = blockDim.x;
  const int D = static_cast<int>(p.D);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < p.B * p.N;
  const int64_t b = valid ? row / p.N : 0;
  const int64_t n = valid ? row - b * p.N : 0;
  const TX* x = static_cast<const TX*>(p.x) + b * p.x_sb + n * p.x_sn;

  float v[NV][VEC];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * tpr + tid) * VEC;
    if (valid && col < D) {
      load_floats<TX, VEC>(x + col, v[i]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[i][j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum += v[i][j];
  }
  const float inv_d = 1.f / static_cast<float>(D);
  const float mean = row_sum(sum, slots[0][threadIdx.y]) * inv_d;
  // Second pass over registers (not memory): exact centred variance, no E[x^2] - mean^2 cancellation.
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * tpr + tid) * VEC;
    if (col < D) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float c = v[i][j] - mean;
        sq += c * c;
      }
    }
  }
  const float rstd = rsqrtf(row_sum(sq, slots[1][threadIdx.y]) * inv_d + p.eps);
  if (!valid) return;
  if (tid == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }

  const TM* scale = static_cast<const TM*>(p.scale) + b * p.scale_sb + n * p.scale_sn;
  const TM* shift = static_cast<const TM*>(p.shift) + b * p.shift_sb + n * p.shift_sn;
  TO* y = static_cast<TO*>(p.y) + row * p.D;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * tpr + tid) * VEC;
    if (col < D) {
      float s[VEC], h[VEC], out[VEC];
      load_floats<TM, VEC>(scale + col, s);
      load_floats<TM, VEC>(shift + col, h);
      if (p.weight != nullptr) {
        float w[VEC], bi[VEC];
        load_floats<float, VEC>(p.weight + col, w);
        load_floats<float, VEC>(p.bias + col, bi);
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = ((v[i][j] - mean) * rstd * w[j] + bi[j]) * (1.f + s[j]) + h[j];
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = (v[i][j] - mean) * rstd * (1.f + s[j]) + h[j];
      }
      store_floats<TO, VEC>(y + col, out);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward. Grid: B * strips CTAs of tpr threads; CTA c owns rows [s * L, min(N, (s + 1) * L)) of
// sample c / strips. The next row's x and dy are fetched before the current row's reduction so
// the loads overlap the shuffles and stores.
struct BwdGrid {
  int64_t strips;
  int64_t rows_per_strip;
};

template <typename TX, typename TM, typename TD, int VEC, bool AFFINE, int VALUES>
__global__ void __launch_bounds__(bwd_threads(VALUES))
    adaln_bwd_kernel(const AdalnBwdParams p, const BwdGrid g) {
  constexpr int NV = VALUES / VEC;
  __shared__ float2 slots[2][kBwdMaxThreads / kWarp];
  const int tid = threadIdx.x;
  const int D = static_cast<int>(p.D);
  const int64_t cta = blockIdx.x;
  const int64_t b = cta / g.strips;
  const int64_t n0 = (cta - b * g.strips) * g.rows_per_strip;
  const int64_t n1 = n0 + g.rows_per_strip < p.N ? n0 + g.rows_per_strip : p.N;
  const float inv_d = 1.f / static_cast<float>(D);

  const TX* xb = static_cast<const TX*>(p.x) + b * p.x_sb;
  const TD* dyb = static_cast<const TD*>(p.dy) + b * p.dy_sb;
  const TM* sb = static_cast<const TM*>(p.scale) + b * p.scale_sb;

  float acc_a[NV][VEC], acc_h[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_a[i][j] = acc_h[i][j] = 0.f;
  }

  // kBwdDepth rows of x, dy and their statistics in flight: while one row is reduced and written,
  // the next ones are loading, and the row after them is requested as soon as this one is in
  // registers. The statistics travel with the row so that no row waits on a dependent load.
  struct Rows {
    Pack<TX, VEC> x[NV];
    Pack<TD, VEC> dy[NV];
    float mean, rstd;
  };
  Rows rows[kBwdDepth];
  auto fetch = [&](Rows& r, int64_t n) {
    r.mean = p.mean[b * p.N + n];
    r.rstd = p.rstd[b * p.N + n];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int col = (tid * NV + i) * VEC;
      if (col < D) {
        r.x[i] = load_pack<TX, VEC>(xb + n * p.x_sn + col);
        r.dy[i] = load_pack<TD, VEC>(dyb + n * p.dy_sn + col);
      }
    }
  };

  int parity = 0;
  auto step = [&](Rows& r, int64_t n) {
    const int64_t row = b * p.N + n;
    const float mean = r.mean;
    const float rstd = r.rstd;
    float xh[NV][VEC], gr[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        xh[i][j] = (to_float(r.x[i].v[j]) - mean) * rstd;
        gr[i][j] = to_float(r.dy[i].v[j]);
      }
    }
    if (n + kBwdDepth < n1) fetch(r, n + kBwdDepth);

    const TM* scale = sb + n * p.scale_sn;
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int col = (tid * NV + i) * VEC;
      if (col < D) {
        float s[VEC], w[VEC];
        load_floats<TM, VEC>(scale + col, s);
        if constexpr (AFFINE) load_floats<float, VEC>(p.weight + col, w);
        if (p.per_token) {
          float ds[VEC], bi[VEC];
          if constexpr (AFFINE) load_floats<float, VEC>(p.bias + col, bi);
#pragma unroll
          for (int j = 0; j < VEC; ++j) ds[j] = gr[i][j] * (AFFINE ? xh[i][j] * w[j] + bi[j] : xh[i][j]);
          store_floats<TM, VEC>(static_cast<TM*>(p.dscale) + row * p.D + col, ds);
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float dy = gr[i][j];
          float gv = dy * (1.f + s[j]);
          if (!p.per_token) {
            acc_a[i][j] += dy * xh[i][j];
            acc_h[i][j] += dy;
          } else if (AFFINE) {
            acc_a[i][j] += gv * xh[i][j];
            acc_h[i][j] += gv;
          }
          if constexpr (AFFINE) gv *= w[j];
          gr[i][j] = gv;
          s1 += gv * xh[i][j];
          s2 += gv;
        }
      }
    }
    const float2 t = row_sum2(make_float2(s1, s2), slots[parity]);
    parity ^= 1;
    const float c1 = t.x * inv_d;
    const float c2 = t.y * inv_d;
    TX* dx = static_cast<TX*>(p.dx) + row * p.D;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int col = (tid * NV + i) * VEC;
      if (col < D) {
        float out[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = rstd * (gr[i][j] - c2 - xh[i][j] * c1);
        store_floats<TX, VEC>(dx + col, out);
      }
    }
  };

#pragma unroll
  for (int k = 0; k < kBwdDepth; ++k) {
    if (n0 + k < n1) fetch(rows[k], n0 + k);
  }
  // The row count is the same for every thread of the CTA, so the barriers inside step() match.
  // Unrolled over the buffers so that each one stays in registers (constant indices only).
  for (int64_t n = n0; n < n1; n += kBwdDepth) {
#pragma unroll
    for (int k = 0; k < kBwdDepth; ++k) {
      if (n + k < n1) step(rows[k], n + k);
    }
  }

  // One fp32 partial per CTA and feature (A at [cta, D], H one array later); the finishing kernel
  // adds them in a fixed order.
  if (p.per_token && !AFFINE) return;
  const int64_t ctas = p.B * g.strips;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (tid * NV + i) * VEC;
    if (col < D) {
      float* w = p.workspace + cta * p.D + col;
      store_floats<float, VEC>(w, acc_a[i]);
      store_floats<float, VEC>(w + ctas * p.D, acc_h[i]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Streamed kernels: per-sample modulation on 16-byte-aligned rows (Wan's chunked modulation and
// most DiTs). A CTA owns a strip of rows of one sample and every thread stays on the same features
// for the whole strip, so the modulation is read once into registers. Rows reach shared memory
// through asynchronous copies (cp.async), several row groups ahead, so the bytes in flight do not
// cost registers. Each thread reads back only what it copied itself, so the copies need no barrier;
// the one barrier a row reduction needs is shared by R rows.
//
// Each thread holds 16 or 24 features of every row (two or three 16-byte chunks of a 16-bit row,
// four or six of an fp32 row): enough to amortise a row's reductions and barrier, few enough to
// keep the modulation and the backward's column sums in registers. Wider rows get more threads
// (never more than 384 at ADALN_MAX_D).
constexpr int kStreamFewFeatures = 16;
constexpr int kStreamManyFeatures = 24;
// Register caps (ptxas -v shows no spills at these): the compiler would otherwise take up to 168
// and halve the CTAs a multiprocessor holds. Few features go with wide rows (many threads), so
// their caps are lower; fp32 rows take twice the chunks, so more address registers. The 16-bit
// forward's 128 / 96 keep the CTAs a multiprocessor holds at D = 1536 (8 of 2 warps, 7 of 3).
__host__ __device__ constexpr int stream_regs(bool backward, int nv, int vec) {
  return backward ? (vec == 8 ? (nv == 3 ? 136 : 96) : (nv == 6 ? 168 : 112))
                  : (vec == 8 ? (nv == 3 ? 128 : 96) : (nv == 6 ? 128 : 96));
}

// Rows per barrier (each direction has one cross-warp reduction a row group) and the ring's depth.
constexpr int kStreamFwdRows = 4;
constexpr int kStreamBwdRows = 2;
// fp32 rows are twice as wide, so 4-row groups halve the CTAs whose ring fits a multiprocessor's
// shared memory; 2-row groups measured 76.2-76.7% of copy bandwidth against 72.9-73.0% at
// (4, 1560, 1536), 90.4-90.9% against 88.5-88.9% at (2, 1560, 1536), and within 1 point either
// way at (1, 32760, 1536) and (2, 16380, 1536).
template <typename TX>
__host__ __device__ constexpr int fwd_stream_rows() {
  return sizeof(TX) == 4 ? 2 : kStreamFwdRows;
}
constexpr int kStreamMaxGroups = 8;
// Rows narrower than this many 16-byte chunks take the row-packing kernels above.
constexpr int kStreamMinChunks = 64;
// Shared memory the system keeps per CTA (1 KB on sm_90), left out of the ring's budget.
constexpr int kStreamSmemReserve = 1024;
// Warps a streamed CTA may have (384 threads at ADALN_MAX_D; slots sized for 16).
constexpr int kStreamMaxWarps = kWarp / 2;
// CTAs a backward cluster may have (the portable maximum).
constexpr int kMaxCluster = 8;

struct StreamGrid {
  int64_t strips;          // CTAs per sample
  int64_t rows_per_strip;  // contiguous order: rows a CTA owns
  int groups;              // row groups in the shared-memory ring
  int row_bytes;           // bytes of one staged row
  int cyclic;              // 1: CTA s of a sample takes row groups s, s + strips, ... (else a strip)
  int cluster;             // backward: CTAs of a thread-block cluster (consecutive strips of a sample)
};

// Programmatic dependent launch (sm_90): a kernel launched with the programmatic-serialization
// attribute may start while the previous kernel in the stream drains; it waits here, before its
// first global-memory access, until that kernel has finished and its writes are visible.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel in the stream (launched with the attribute) start its CTAs once every CTA of
// this one has called this or exited; they still wait in wait_for_previous_grid for this one's end.
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

template <int BYTES>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src) {
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src), "n"(BYTES) : "memory");
  }
}

// One pack (VEC elements) from global to shared memory, as 16-byte copies when it is that wide.
template <typename T, int VEC>
__device__ __forceinline__ void cp_async_pack(uint32_t dst, const T* src) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * VEC;
  if constexpr (kBytes > 16) {
#pragma unroll
    for (int c = 0; c < kBytes / 16; ++c) cp_async<16>(dst + 16 * c, reinterpret_cast<const char*>(src) + 16 * c);
  } else {
    cp_async<kBytes>(dst, src);
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most `pending` of this thread's copy groups are still in flight. The wait takes
// the count as an immediate, so a runtime count becomes a jump table (a constant-bank load and an
// indirect branch every row group). A ring of two row groups (pending 1, the plan at every
// benchmarked shape) takes a predicated wait instead, written in PTX so that the compiler cannot
// fold it into the table.
__device__ __forceinline__ void cp_async_wait(int pending) {
  asm volatile(
      "{\n"
      ".reg .pred two;\n"
      "setp.eq.s32 two, %0, 1;\n"
      "@two cp.async.wait_group 1;\n"
      "}\n" ::"r"(pending)
      : "memory");
  if (pending == 1) return;
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;\n" ::: "memory"); break;
  }
}

// Cross-warp slots of the streamed kernels: one float per warp and row, kStreamMaxWarps wide and
// zeroed once (clear_slots), so the sum over warps reads whole float4s without a loop bound.
template <int ROWS>
using Slots = float[ROWS][kStreamMaxWarps];

template <int N>
__device__ __forceinline__ void clear_slots(float* slots) {
  static_assert(N % 4 == 0, "slots are cleared as float4s");
  for (int i = threadIdx.x; i < N / 4; i += blockDim.x) reinterpret_cast<float4*>(slots)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  __syncthreads();
}

// Lane that holds value r after reduce_scatter<R> (and the value lane l < R holds): the first
// log2(R) butterfly steps split the values by lane bits 0, 1, ..., highest half first, so the index
// is the lane's low bits reversed.
template <int R>
__host__ __device__ constexpr int scatter_lane(int r) {
  int lane = 0;
  for (int h = R / 2, bit = 1; h >= 1; h /= 2, bit *= 2) {
    if (r & h) lane |= bit;
  }
  return lane;
}

// Warp sums of R values (R a power of two) that end scattered: lane l holds the warp's sum of value
// scatter_lane<R>(l & (R - 1)). Each of the first log2(R) butterfly steps sends half of the values a
// lane still holds and keeps the other half (chosen by the lane bit of that step), so the R sums take
// R - 1 + 5 - log2(R) shuffles and adds instead of 5 R (8 values: 9 instead of 40). Fixed order, so
// the lanes holding one value hold the same bits.
template <int R>
__device__ __forceinline__ float reduce_scatter(float (&v)[R]) {
  static_assert(R >= 1 && R <= kWarp && (R & (R - 1)) == 0, "reduce_scatter needs a power of two up to 32");
  const int lane = static_cast<int>(threadIdx.x) & (kWarp - 1);
  int bit = 1;
#pragma unroll
  for (int h = R / 2; h >= 1; h /= 2, bit *= 2) {
    const bool upper = (lane & bit) != 0;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const float send = upper ? v[i] : v[i + h];
      const float keep = upper ? v[i + h] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
    }
  }
  float t = v[0];
#pragma unroll
  for (; bit < kWarp; bit *= 2) t += __shfl_xor_sync(0xffffffffu, t, bit);
  return t;
}

// Sums of R values over the CTA's threads (one row each). Every thread of the CTA must call it.
// Fixed order (warp sums scattered over the first R lanes; then 2 warps: one float2 of slots;
// 3 or 4: one float4 of zero-padded slots, added pairwise; more: in warp order), so every thread
// gets the same bits.
template <int R>
__device__ __forceinline__ void cta_sums(float (&v)[R], Slots<R>& slots) {
  const float t = reduce_scatter<R>(v);
  const int warps = blockDim.x / kWarp;
  const int lane = static_cast<int>(threadIdx.x) & (kWarp - 1);
  if (warps == 1) {
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = __shfl_sync(0xffffffffu, t, scatter_lane<R>(r));
    return;
  }
  if (lane < R) slots[scatter_lane<R>(lane)][threadIdx.x / kWarp] = t;
  __syncthreads();
  if (warps == 2) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float2 q = reinterpret_cast<const float2*>(slots[r])[0];
      v[r] = q.x + q.y;
    }
  } else if (warps <= 4) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float4 q = reinterpret_cast<const float4*>(slots[r])[0];
      v[r] = (q.x + q.y) + (q.z + q.w);
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float t = 0.f;
      for (int w = 0; w < warps; ++w) t += slots[r][w];
      v[r] = t;
    }
  }
}

// The rows CTA blockIdx.x works on, all of sample b: row group j holds rows base + j * stride + r
// (r < R) that are below `limit`. Contiguous order: one strip [n0, n1); cyclic order: the R-row
// groups s, s + strips, s + 2 * strips, ... of the sample.
struct Strip {
  int64_t b, base, stride, limit;
  int iters;
  __device__ __forceinline__ int64_t row(int j, int r) const { return base + static_cast<int64_t>(j) * stride + r; }
};

template <int R>
__device__ __forceinline__ Strip strip_of(int64_t N, const StreamGrid& g) {
  Strip s;
  s.b = blockIdx.x / g.strips;
  const int64_t k = blockIdx.x - s.b * g.strips;
  if (g.cyclic) {
    const int64_t groups = (N + R - 1) / R;
    s.base = k * R;
    s.stride = g.strips * R;
    s.limit = N;
    s.iters = k < groups ? static_cast<int>((groups - k + g.strips - 1) / g.strips) : 0;
  } else {
    s.base = k * g.rows_per_strip;
    s.stride = R;
    s.limit = s.base + g.rows_per_strip < N ? s.base + g.rows_per_strip : N;
    s.iters = static_cast<int>((s.limit - s.base + R - 1) / R);
  }
  return s;
}

// Rows of the group starting at row n0 (< limit) that are below the strip's limit: a group's rows
// are consecutive in both orders.
template <int R>
__device__ __forceinline__ int rows_in_group(const Strip& st, int64_t n0) {
  const int64_t left = st.limit - n0;
  return left < R ? static_cast<int>(left) : R;
}

// Forward. Thread t covers features (i * T + t) * VEC + [0, VEC) for i < NV. Per row group: one
// barrier for the R rows' shifted sums (two or three where a shift was poor), then the output.
template <typename TX, typename TM, typename TO, int VEC, int NV, bool FULL>
__global__ void __maxnreg__(stream_regs(false, NV, VEC)) adaln_fwd_stream_kernel(const AdalnFwdParams p, const StreamGrid g) {
  constexpr int R = fwd_stream_rows<TX>();
  constexpr int PX = static_cast<int>(sizeof(TX)) * VEC;
  extern __shared__ __align__(16) unsigned char ring[];
  // Cross-warp slots for the one-pass sums, used by turns: a cta_sums call never writes the slots
  // that the previous call's slower threads may still be reading.
  __shared__ __align__(16) Slots<2 * R> slots[2];
  const int tid = threadIdx.x;
  const int T = blockDim.x;
  const int D = static_cast<int>(p.D);
  // Everything up to the first global access runs before waiting for the previous kernel.
  const Strip st = strip_of<R>(p.N, g);
  const TX* xb = static_cast<const TX*>(p.x) + st.b * p.x_sb;
  const uint32_t ring_base = smem_addr(ring);
  clear_slots<2 * 2 * R * kStreamMaxWarps>(&slots[0][0][0]);
  wait_for_previous_grid();

  // Row group j goes to ring slot j % groups, passed in as `at` (no integer division in the loop).
  // A group's rows are consecutive, so their addresses advance by one row each (the compiler
  // otherwise multiplied the 64-bit row offsets out for every row).
  auto issue = [&](int j, int at) {
    if (j < st.iters) {
      const int64_t n0 = st.row(j, 0);
      const int valid = rows_in_group<R>(st, n0);
      const TX* src = xb + n0 * p.x_sn;
      uint32_t dst = ring_base + at * R * g.row_bytes;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < valid) {
#pragma unroll
          for (int i = 0; i < NV; ++i) {
            const int col = (i * T + tid) * VEC;
            if (FULL || col < D) cp_async_pack<TX, VEC>(dst + (i * T + tid) * PX, src + col);
          }
        }
        src += p.x_sn;
        dst += g.row_bytes;
      }
    }
    cp_async_commit();  // empty groups too, so that every thread counts the same groups
  };
  // The modulation is loaded before the ring's first filling: behind it, these loads waited for
  // every byte the CTA had asked for, and the first use of scale was the kernel's largest stall
  // (ncu source counters: 32% of the warp samples at (4, 1560, 1536), 11% at (1, 32760, 1536)).
  const TM* scale = static_cast<const TM*>(p.scale) + st.b * p.scale_sb;
  const TM* shift = static_cast<const TM*>(p.shift) + st.b * p.shift_sb;
  Pack<TM, VEC> scale_pack[NV], shift_pack[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * T + tid) * VEC;
    if (FULL || col < D) {
      scale_pack[i] = load_pack<TM, VEC>(scale + col);
      shift_pack[i] = load_pack<TM, VEC>(shift + col);
    }
  }
  for (int j = 0; j < g.groups; ++j) issue(j, j);

  // y = x̂ * a + c with a = (1 + scale) * weight and c = bias * (1 + scale) + shift, per feature.
  float a[NV][VEC], c[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * T + tid) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) a[i][j] = c[i][j] = 0.f;
    if (FULL || col < D) {
      float s[VEC], h[VEC];
      unpack<TM, VEC>(scale_pack[i], s);
      unpack<TM, VEC>(shift_pack[i], h);
      if (p.weight != nullptr) {
        float w[VEC], bi[VEC];
        load_floats<float, VEC>(p.weight + col, w);
        load_floats<float, VEC>(p.bias + col, bi);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          a[i][j] = (1.f + s[j]) * w[j];
          c[i][j] = bi[j] * (1.f + s[j]) + h[j];
        }
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          a[i][j] = 1.f + s[j];
          c[i][j] = h[j];
        }
      }
    }
  }

  const float inv_d = 1.f / static_cast<float>(D);
  TO* yb = static_cast<TO*>(p.y) + st.b * p.N * p.D;
  // The pivot of each row slot's one-pass statistics: the mean of that slot's row in the previous
  // row group (0 for the first), known to every thread without a barrier.
  float pivot[R];
#pragma unroll
  for (int r = 0; r < R; ++r) pivot[r] = 0.f;
  int use = 0;  // the slots of the next cta_sums (consecutive calls alternate)
  for (int j = 0, at = 0; j < st.iters; ++j) {
    cp_async_wait(g.groups - 1);
    const int slot = at * R;
    const int64_t n0 = st.row(j, 0);
    const int valid = rows_in_group<R>(st, n0);
    auto staged = [&](int r, int i) {
      return load_pack<TX, VEC>(reinterpret_cast<const TX*>(ring + (slot + r) * g.row_bytes + (i * T + tid) * PX));
    };
    // Statistics in one pass over the staged rows, shifted by K = pivot[r]: S1 = sum (x - K) and
    // S2 = sum (x - K)^2, added over the CTA as plain sums under one barrier; mean = K + S1 / D
    // and var = (S2 - S1^2 / D) / D. That difference cancels log2(1 + (mean - K)^2 / var) bits,
    // and K + S1 / D keeps the mean only to about 2^-24 |mean - K|. Where the difference would
    // cancel more than 4 bits (S1^2 / D > 15/16 S2; the same decision on every thread, which all
    // hold the same sums), the group passes over its rows again shifted by the mean just found,
    // which is then within ~2^-22 |mean - K| of the true one; a third pass is left for rows whose
    // mean sits 10^7 standard deviations or more from the previous row's. One accumulator a sum:
    // the R rows' chains interleave (two a sum spilled under the register caps).
    float sum[R], sq[R];  // mean and variance of each row
    for (int pass = 0;; ++pass) {
      float sums[2 * R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float k0 = pivot[r];
        float a = 0.f, q = 0.f;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          if (FULL || (i * T + tid) * VEC < D) {
            float v[VEC];
            unpack<TX, VEC>(staged(r, i), v);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const float d = v[k] - k0;
              a += d;
              q = fmaf(d, d, q);
            }
          }
        }
        sums[2 * r] = a;
        sums[2 * r + 1] = q;
      }
      cta_sums<2 * R>(sums, slots[use]);
      use ^= 1;
      bool settled = true;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float m = sums[2 * r] * inv_d;
        sum[r] = pivot[r] + m;
        sq[r] = fmaxf(sums[2 * r + 1] * inv_d - m * m, 0.f);
        if (r < valid && sums[2 * r] * m > 0.9375f * sums[2 * r + 1]) settled = false;
      }
      // The rows past the strip's end keep their pivot: their staged bytes are stale.
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < valid) pivot[r] = sum[r];
      }
      if (settled || pass == 2) break;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= valid) break;
      const int64_t n = n0 + r;
      const float mean = sum[r];
      const float rstd = rsqrtf(sq[r] + p.eps);
      const float shifted = -mean * rstd;
      if (tid == 0) {
        p.mean[st.b * p.N + n] = mean;
        p.rstd[st.b * p.N + n] = rstd;
      }
      // The row's outputs (the compiler otherwise rebuilt the 64-bit offset from n, D and col for
      // every chunk).
      TO* yrow = yb + n * p.D;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int col = (i * T + tid) * VEC;
        if (FULL || col < D) {
          float v[VEC];
          unpack<TX, VEC>(staged(r, i), v);
          float out[VEC];
          if constexpr (sizeof(TO) == 2) {
            // x̂ = x * rstd - mean * rstd in one rounding: exact to ~2^-24 |mean| rstd, far under
            // a 16-bit output's rounding, and one instruction an element fewer.
#pragma unroll
            for (int k = 0; k < VEC; ++k) out[k] = fmaf(fmaf(v[k], rstd, shifted), a[i][k], c[i][k]);
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) out[k] = (v[k] - mean) * rstd * a[i][k] + c[i][k];
          }
          store_floats<TO, VEC>(yrow + col, out);
        }
      }
    }
    // Done with this group's slots (every value read above was used): refill them with the group
    // `groups` ahead.
    issue(j + g.groups, at);
    if (++at == g.groups) at = 0;
  }
  cp_async_wait(0);
}

// The column sums of a thread-block cluster's CTAs (consecutive strips of one sample) added through
// distributed shared memory before they reach global memory: each CTA has put its A and H sums
// (2 x D floats) at `own`; CTA r of the cluster adds slice r of the columns over the cluster's CTAs
// in rank order (fixed, so the result is deterministic) and writes it as partial `part` (A at
// [part, D], H at [parts + part, D]). A cluster of C CTAs writes one partial instead of C, so the
// backward writes and the finishing kernel reads C times fewer bytes. D is a multiple of 4 here.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_partials(const float* own, float* workspace, int D, int64_t parts,
                                                 int64_t part) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's sums are in its shared memory
  const int ctas = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int quads = D / 2;  // 2 x D floats as float4s
  const int per = (quads + ctas - 1) / ctas;
  const int q1 = (rank + 1) * per < quads ? (rank + 1) * per : quads;
  for (int q = rank * per + static_cast<int>(threadIdx.x); q < q1; q += static_cast<int>(blockDim.x)) {
    float4 v[kMaxCluster];
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) {
      if (r < ctas) v[r] = reinterpret_cast<const float4*>(cluster.map_shared_rank(own, r))[q];
    }
    float4 s = v[0];
#pragma unroll
    for (int r = 1; r < kMaxCluster; ++r) {
      if (r < ctas) {
        s.x += v[r].x;
        s.y += v[r].y;
        s.z += v[r].z;
        s.w += v[r].w;
      }
    }
    const int col = 4 * q;
    float* dst = col < D ? workspace + part * D + col : workspace + (parts + part) * D + (col - D);
    *reinterpret_cast<float4*>(dst) = s;
  }
  // No CTA leaves while another still reads its shared memory. Relaxed: this thread's reads of the
  // other CTAs are complete (their values were stored above), and nothing written here needs to be
  // seen by them, so the arrival need not wait for the partials' global stores (a release arrival
  // does: ncu showed it at 3.6% of the warp samples at (4, 1560, 1536)).
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}
#endif

// Backward for per-sample modulation. Pass 1 over a row group accumulates the column sums
// A = sum dy * x̂ and H = sum dy and the two row sums dx needs; one barrier for the group; pass 2
// reads the staged rows again and writes dx. The statistics of the next group load a group ahead.
template <typename TX, typename TM, typename TD, int VEC, int NV, bool FULL>
__global__ void __maxnreg__(stream_regs(true, NV, VEC)) adaln_bwd_stream_kernel(const AdalnBwdParams p, const StreamGrid g) {
  constexpr int R = kStreamBwdRows;
  constexpr int PX = static_cast<int>(sizeof(TX)) * VEC;
  constexpr int PD = static_cast<int>(sizeof(TD)) * VEC;
  extern __shared__ __align__(16) unsigned char ring[];
  __shared__ __align__(16) Slots<2 * R> slots[2];
  const int tid = threadIdx.x;
  const int T = blockDim.x;
  const int D = static_cast<int>(p.D);
  // Everything up to the first global access runs before waiting for the previous kernel.
  const Strip st = strip_of<R>(p.N, g);
  const TX* xb = static_cast<const TX*>(p.x) + st.b * p.x_sb;
  const TD* dyb = static_cast<const TD*>(p.dy) + st.b * p.dy_sb;
  const uint32_t ring_base = smem_addr(ring);
  const int dy_off = NV * T * PX;  // the dy half of a staged row
  clear_slots<2 * 2 * R * kStreamMaxWarps>(&slots[0][0][0]);
  wait_for_previous_grid();

  // Row group j goes to ring slot `at` = j % groups (computed once per group by the caller).
  // A group's rows are consecutive: their addresses advance by one row each (the compiler otherwise
  // multiplied the 64-bit row offsets out for every row).
  auto issue = [&](int j, int at) {
    if (j < st.iters) {
      const int64_t n0 = st.row(j, 0);
      const TX* xs = xb + n0 * p.x_sn;
      const TD* dys = dyb + n0 * p.dy_sn;
      uint32_t row = ring_base + at * R * g.row_bytes;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (n0 + r < st.limit) {
#pragma unroll
          for (int i = 0; i < NV; ++i) {
            const int col = (i * T + tid) * VEC;
            if (FULL || col < D) {
              cp_async_pack<TX, VEC>(row + (i * T + tid) * PX, xs + col);
              cp_async_pack<TD, VEC>(row + dy_off + (i * T + tid) * PD, dys + col);
            }
          }
        }
        xs += p.x_sn;
        dys += p.dy_sn;
        row += g.row_bytes;
      }
    }
    cp_async_commit();
  };
  // The modulation and the first rows' statistics are loaded before the ring's first filling, for
  // the forward's reason: behind it they waited for all of its bytes (ncu source counters: the
  // first use of scale held 18% of the warp samples at (4, 1560, 1536), 7% at (1, 32760, 1536)).
  const TM* scale = static_cast<const TM*>(p.scale) + st.b * p.scale_sb;
  Pack<TM, VEC> scale_pack[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * T + tid) * VEC;
    if (FULL || col < D) scale_pack[i] = load_pack<TM, VEC>(scale + col);
  }
  const float* mean_b = p.mean + st.b * p.N;
  const float* rstd_b = p.rstd + st.b * p.N;
  float mean_next[R], rstd_next[R];
  auto load_stats = [&](int j) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t n = st.row(j, r);
      const bool ok = j < st.iters && n < st.limit;
      mean_next[r] = ok ? mean_b[n] : 0.f;
      rstd_next[r] = ok ? rstd_b[n] : 0.f;
    }
  };
  // Under the 96-register cap of 16 features a thread with fp32 dy, holding the statistics across
  // the ring's issue spilled (ptxas -v), so that variant loads them after it.
  constexpr bool kStatsFirst = !(stream_regs(true, NV, VEC) <= 96 && sizeof(TD) == 4);
  if constexpr (kStatsFirst) load_stats(0);
  for (int j = 0; j < g.groups; ++j) issue(j, j);
  if constexpr (!kStatsFirst) load_stats(0);

  // gv = dy * (1 + scale) * weight = dy * a, per feature.
  float a[NV][VEC], acc_a[NV][VEC], acc_h[NV][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * T + tid) * VEC;
#pragma unroll
    for (int k = 0; k < VEC; ++k) a[i][k] = acc_a[i][k] = acc_h[i][k] = 0.f;
    if (FULL || col < D) {
      float s[VEC];
      unpack<TM, VEC>(scale_pack[i], s);
      if (p.weight != nullptr) {
        float w[VEC];
        load_floats<float, VEC>(p.weight + col, w);
#pragma unroll
        for (int k = 0; k < VEC; ++k) a[i][k] = (1.f + s[k]) * w[k];
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) a[i][k] = 1.f + s[k];
      }
    }
  }

  const float inv_d = 1.f / static_cast<float>(D);
  TX* dxb = static_cast<TX*>(p.dx) + st.b * p.N * p.D;
  for (int j = 0; j < st.iters; ++j) {
    float mean[R], rstd[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      mean[r] = mean_next[r];
      rstd[r] = rstd_next[r];
    }
    load_stats(j + 1);
    cp_async_wait(g.groups - 1);
    const int slot = (j % g.groups) * R;
    float sums[2 * R];  // per row: sum gv * x̂, sum gv
#pragma unroll
    for (int r = 0; r < R; ++r) {
      sums[2 * r] = sums[2 * r + 1] = 0.f;
      const int64_t n = st.row(j, r);
      if (n >= st.limit) continue;  // same for the whole CTA; stale slots never reach the sums
      const unsigned char* row = ring + (slot + r) * g.row_bytes;
      // Two accumulators per sum (even and odd features) halve the dependent-add chains.
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        if (FULL || (i * T + tid) * VEC < D) {
          float xv[VEC], dy[VEC];
          load_floats<TX, VEC>(reinterpret_cast<const TX*>(row + (i * T + tid) * PX), xv);
          load_floats<TD, VEC>(reinterpret_cast<const TD*>(row + dy_off + (i * T + tid) * PD), dy);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float xh = (xv[k] - mean[r]) * rstd[r];
            const float gv = dy[k] * a[i][k];
            acc_a[i][k] += dy[k] * xh;
            acc_h[i][k] += dy[k];
            c[2 * (k & 1)] = fmaf(gv, xh, c[2 * (k & 1)]);
            c[2 * (k & 1) + 1] += gv;
          }
        }
      }
      sums[2 * r] = c[0] + c[2];
      sums[2 * r + 1] = c[1] + c[3];
    }
    cta_sums<2 * R>(sums, slots[j & 1]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t n = st.row(j, r);
      if (n >= st.limit) break;
      const float c1 = sums[2 * r] * inv_d;
      const float c2 = sums[2 * r + 1] * inv_d;
      const unsigned char* row = ring + (slot + r) * g.row_bytes;
      TX* dxrow = dxb + n * p.D;  // as in the forward
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int col = (i * T + tid) * VEC;
        if (FULL || col < D) {
          float xv[VEC], dy[VEC], out[VEC];
          load_floats<TX, VEC>(reinterpret_cast<const TX*>(row + (i * T + tid) * PX), xv);
          load_floats<TD, VEC>(reinterpret_cast<const TD*>(row + dy_off + (i * T + tid) * PD), dy);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float xh = (xv[k] - mean[r]) * rstd[r];
            out[k] = rstd[r] * fmaf(dy[k], a[i][k], fmaf(-xh, c1, -c2));
          }
          store_floats<TX, VEC>(dxrow + col, out);
        }
      }
    }
    issue(j + g.groups, slot / R);
  }
  cp_async_wait(0);
  allow_next_grid();

  // One fp32 partial per cluster (or CTA) and feature, in the layout the finishing kernel reads.
  const int64_t parts = p.B * g.strips / g.cluster;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (g.cluster > 1) {
    __syncthreads();  // every thread is done with the ring, which now holds this CTA's sums
    float* own = reinterpret_cast<float*>(ring);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int col = (i * T + tid) * VEC;
      if (FULL || col < D) {
        store_floats<float, VEC>(own + col, acc_a[i]);
        store_floats<float, VEC>(own + D + col, acc_h[i]);
      }
    }
    cluster_partials(own, p.workspace, D, parts, blockIdx.x / g.cluster);
    return;
  }
#endif
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int col = (i * T + tid) * VEC;
    if (FULL || col < D) {
      float* w = p.workspace + static_cast<int64_t>(blockIdx.x) * p.D + col;
      store_floats<float, VEC>(w, acc_a[i]);
      store_floats<float, VEC>(w + parts * p.D, acc_h[i]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Finishing: out[g, d] = ca[d] * sum_p f(p, d) * A[g, p, d] + ch[d] * sum_p f(p, d) * H[g, p, d],
// with f = 1 + scale[p / strips, d] for weighted jobs, else 1. p runs in increasing order within
// kRedSlices fixed slices, then the slices are added in order. Up to four jobs share one launch.
struct FinishJob {
  const float* a;   // [G, P, D]
  const float* h;   // [G, P, D] or nullptr
  const float* ca;  // [D] or nullptr (1)
  const float* ch;  // [D] or nullptr (skip H)
  void* out;        // [G, D]
  int64_t parts;    // P
  int64_t first_block;
  int dtype;
  bool weighted;
};

struct FinishJobs {
  FinishJob job[4];
  int count;
  int64_t D;
  int64_t col_blocks;
  int64_t strips;
  const void* scale;  // for weighted jobs
  int64_t scale_sb;
  int scale_dtype;
};

__device__ __forceinline__ float load_any(const void* p, int64_t i, int dtype) {
  switch (dtype) {
    case ADALN_BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case ADALN_F16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// sa += f(q) * a[q] (and sh += f(q) * h[q]) for q = p0, p0 + 1, ..., p1 - 1 in that order; the
// loads of 8 partials are issued before any is added, so a thread has 8 (or 16) in flight.
template <bool WEIGHTED, bool WITH_H>
__device__ __forceinline__ void finish_sum(const FinishJob& job, const FinishJobs& jobs, int64_t base, int64_t d,
                                           int64_t p0, int64_t p1, float& sa, float& sh) {
  constexpr int U = 8;
  const int64_t D = jobs.D;
  auto factor = [&](int64_t q) {
    return WEIGHTED ? 1.f + load_any(jobs.scale, (q / jobs.strips) * jobs.scale_sb + d, jobs.scale_dtype) : 1.f;
  };
  int64_t q = p0;
  for (; q + U <= p1; q += U) {
    float va[U], vh[U], f[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      va[k] = __ldcg(job.a + base + (q + k) * D);
      if constexpr (WITH_H) vh[k] = __ldcg(job.h + base + (q + k) * D);
      f[k] = factor(q + k);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      sa += f[k] * va[k];
      if constexpr (WITH_H) sh += f[k] * vh[k];
    }
  }
  for (; q < p1; ++q) {
    const float f = factor(q);
    sa += f * __ldcg(job.a + base + q * D);
    if constexpr (WITH_H) sh += f * __ldcg(job.h + base + q * D);
  }
}

__global__ void __launch_bounds__(kRedCols * kRedSlices) adaln_finish_kernel(const FinishJobs jobs) {
  __shared__ float part[kRedSlices][kRedCols + 1];
  wait_for_previous_grid();
  const int64_t blk = blockIdx.x;
  // Select the job with constant indices only, so the parameter array stays out of local memory.
  FinishJob job = jobs.job[0];
#pragma unroll
  for (int k = 1; k < 4; ++k) {
    if (k < jobs.count && blk >= jobs.job[k].first_block) job = jobs.job[k];
  }
  const int64_t local = blk - job.first_block;
  const int64_t grp = local / jobs.col_blocks;
  const int64_t d = (local - grp * jobs.col_blocks) * kRedCols + threadIdx.x;
  const int slices = blockDim.y;
  const int64_t per_slice = (job.parts + slices - 1) / slices;
  const int64_t p0 = threadIdx.y * per_slice;
  const int64_t p1 = p0 + per_slice < job.parts ? p0 + per_slice : job.parts;
  float sa = 0.f, sh = 0.f;
  if (d < jobs.D) {
    const int64_t base = grp * job.parts * jobs.D + d;
    if (job.weighted) {
      if (job.ch != nullptr) finish_sum<true, true>(job, jobs, base, d, p0, p1, sa, sh);
      else finish_sum<true, false>(job, jobs, base, d, p0, p1, sa, sh);
    } else {
      if (job.ch != nullptr) finish_sum<false, true>(job, jobs, base, d, p0, p1, sa, sh);
      else finish_sum<false, false>(job, jobs, base, d, p0, p1, sa, sh);
    }
  }
  float v = 0.f;
  if (d < jobs.D) {
    v = (job.ca != nullptr ? job.ca[d] : 1.f) * sa;
    if (job.ch != nullptr) v += job.ch[d] * sh;
  }
  part[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.y != 0 || d >= jobs.D) return;
  float total = 0.f;
  for (int k = 0; k < slices; ++k) total += part[k][threadIdx.x];
  const int64_t o = grp * jobs.D + d;
  switch (job.dtype) {
    case ADALN_BF16: static_cast<__nv_bfloat16*>(job.out)[o] = __float2bfloat16_rn(total); break;
    case ADALN_F16: static_cast<__half*>(job.out)[o] = __float2half_rn(total); break;
    default: static_cast<float*>(job.out)[o] = total; break;
  }
}

// ------------------------------------------------------------------------------------------------
// Host side.
template <typename T>
constexpr int wide_vec() {
  return static_cast<int>(16 / sizeof(T));
}

bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

int pack_align(int elem_bytes, int vec) {
  const int bytes = elem_bytes * vec;
  return bytes < 16 ? bytes : 16;
}

int dtype_bytes(AdalnDtype t) { return t == ADALN_F32 ? 4 : 2; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int round_up_warp(int64_t t) { return static_cast<int>(ceil_div(t, kWarp) * kWarp); }

// Threads per row: enough warps that each thread holds at most `values` values.
int threads_per_row(int64_t D, int vec, int values) { return round_up_warp(ceil_div(D / vec, values / vec)); }

int device_attribute(cudaDeviceAttr attr, int fallback) {
  int dev = 0, value = fallback;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&value, attr, dev) != cudaSuccess) return fallback;
  return value;
}

// An attribute of the current device asked once per device (cache: a slot per device, 0 = not yet);
// launches ask for these every time.
int cached_attribute(int (&cache)[64], cudaDeviceAttr attr, int fallback) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return fallback;
  if (dev < 64 && cache[dev] > 0) return cache[dev];
  const int value = device_attribute(attr, fallback);
  if (dev < 64 && value > 0) cache[dev] = value;
  return value;
}

int multiprocessors() {
  static int cache[64] = {};
  return cached_attribute(cache, cudaDevAttrMultiProcessorCount, 1);
}

// Whether the current device has thread-block clusters and programmatic dependent launch (sm_90+).
bool hopper_or_newer() {
  static int cache[64] = {};
  return cached_attribute(cache, cudaDevAttrComputeCapabilityMajor, 0) >= 9;
}

// A launch of `grid` CTAs of `block` threads, in clusters of `cluster` CTAs when > 1 and with
// programmatic stream serialization when `overlap` (the kernel calls wait_for_previous_grid before
// its first global-memory access); the attributes live in `attrs`.
cudaLaunchConfig_t launch_config(int64_t grid, dim3 block, int smem, cudaStream_t stream, int cluster, bool overlap,
                                 cudaLaunchAttribute (&attrs)[2]) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  unsigned count = 0;
  if (cluster > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = static_cast<unsigned>(cluster);
    attrs[count].val.clusterDim.y = 1;
    attrs[count].val.clusterDim.z = 1;
    ++count;
  }
  if (overlap) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = count;
  return cfg;
}

template <typename Kernel, typename... Args>
cudaError_t launch_ex(Kernel kernel, int64_t grid, dim3 block, int smem, cudaStream_t stream, int cluster,
                      bool overlap, Args... args) {
  if (grid > 0x7fffffff) return cudaErrorInvalidConfiguration;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = launch_config(grid, block, smem, stream, cluster, overlap, attrs);
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// Programmatic dependent launch unless the caller's options turn it off (AdalnLaunchOptions::pdl).
bool overlap_launches(const AdalnLaunchOptions& o) { return o.pdl != 0 && hopper_or_newer(); }

// Answers of the launch-plan queries (occupancy, shared-memory limits, ring sizes), kept per device,
// kernel and up to three integers: each query costs a few microseconds, about as much as a small
// backward. A full memo only stops remembering; callers run under the GIL or their own locking.
template <typename Value>
class PlanMemo {
 public:
  // The kept answer for (current device, fn, a, b, c), else compute(&value) once it succeeds.
  template <typename Compute>
  cudaError_t get(const void* fn, int a, int b, int c, Value* out, Compute compute) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    for (int i = 0; i < used_; ++i) {
      const Entry& e = entries_[i];
      if (e.fn == fn && e.dev == dev && e.a == a && e.b == b && e.c == c) {
        *out = e.value;
        return cudaSuccess;
      }
    }
    err = compute(out);
    if (err == cudaSuccess && used_ < kSize) entries_[used_++] = Entry{fn, dev, a, b, c, *out};
    return err;
  }

 private:
  static constexpr int kSize = 128;
  struct Entry {
    const void* fn;
    int dev, a, b, c;
    Value value;
  };
  Entry entries_[kSize] = {};
  int used_ = 0;
};

// Lets `kernel` take all the shared memory a CTA may opt in to (beyond the default 48 KB, static
// and dynamic together), once per kernel and device.
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel) {
  static PlanMemo<int> memo;
  int done = 0;
  return memo.get(reinterpret_cast<const void*>(kernel), 0, 0, 0, &done, [&](int* out) {
    cudaFuncAttributes attrs{};
    cudaError_t err = cudaFuncGetAttributes(&attrs, kernel);
    if (err != cudaSuccess) return err;
    const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, 48 * 1024);
    *out = 1;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                optin - static_cast<int>(attrs.sharedSizeBytes));
  });
}

// CTAs of `threads` threads of `kernel` (with `smem` bytes of dynamic shared memory) resident per
// multiprocessor. Kernels asking for more than the default 48 KB of dynamic shared memory get their
// limit raised first.
template <typename Kernel>
cudaError_t resident_ctas(int* per_sm, Kernel kernel, int threads, int smem = 0) {
  static PlanMemo<int> memo;
  return memo.get(reinterpret_cast<const void*>(kernel), threads, smem, 0, per_sm, [&](int* out) {
    if (smem > 0) {
      const cudaError_t err = allow_dynamic_smem(kernel);
      if (err != cudaSuccess) return err;
    }
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, kernel, threads, smem);
  });
}

// How a streamed kernel runs at one row width: CTAs per multiprocessor and the ring's size.
struct StreamRing {
  int per_sm, groups, smem;
};

// Registers and threads decide how many CTAs share a multiprocessor; the ring then takes that
// CTA's share of the multiprocessor's shared memory (2 to 8 row groups), so the bytes in flight
// per multiprocessor stay about the same at every row width. Kept per (device, kernel, width).
template <typename Kernel>
cudaError_t stream_ring(Kernel kernel, int threads, int row_bytes, int rows, StreamRing* ring) {
  static PlanMemo<StreamRing> memo;
  return memo.get(reinterpret_cast<const void*>(kernel), threads, row_bytes, rows, ring, [&](StreamRing* out) {
    int per_sm = 0;
    cudaError_t err = resident_ctas(&per_sm, kernel, threads, 0);
    if (err != cudaSuccess) return err;
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    cudaFuncAttributes attrs{};
    err = cudaFuncGetAttributes(&attrs, kernel);
    if (err != cudaSuccess) return err;
    const int static_smem = static_cast<int>(attrs.sharedSizeBytes);
    const int optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, 48 * 1024) - static_smem;
    const int per_sm_smem = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, 48 * 1024);
    int budget = per_sm_smem / per_sm - kStreamSmemReserve - static_smem;
    budget = budget < optin ? budget : optin;
    const int group = row_bytes * rows;
    int groups = budget / group;
    groups = groups < 2 ? 2 : (groups > kStreamMaxGroups ? kStreamMaxGroups : groups);
    while (groups > 1 && groups * group > optin) --groups;
    if (groups * group > optin) return cudaErrorInvalidValue;
    out->groups = groups;
    out->smem = groups * group;
    err = resident_ctas(&out->per_sm, kernel, threads, out->smem);
    if (err != cudaSuccess) return err;
    return out->per_sm < 1 ? cudaErrorInvalidConfiguration : cudaSuccess;
  });
}

// The streamed kernels' plan: the ring, and enough CTAs to fill the multiprocessors once. The
// workspace query and the launch both use it. The backward gives each CTA one strip of rows. The
// forward deals R-row groups out in turn (CTA s of a sample takes groups s, s + strips, ...) once
// every CTA gets at least kStreamCyclicGroups of them, so that all CTAs sweep through x together:
// measured 2-4 points of copy bandwidth faster at D = 1536 and 3072 (bf16), and 4 points slower
// for short strips (4 x 1560 rows). Cyclic strips in the backward were slower at D = 5120.
constexpr int kStreamCyclicGroups = 4;

// Clusters of `cluster` CTAs of `kernel` the whole device holds at once (a cluster's CTAs share one
// GPC, so this can be below multiprocessors x CTAs per multiprocessor / cluster).
template <typename Kernel>
cudaError_t resident_clusters(int* count, Kernel kernel, int threads, int smem, int cluster) {
  static PlanMemo<int> memo;
  return memo.get(reinterpret_cast<const void*>(kernel), threads, smem, cluster, count, [&](int* out) {
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t cfg = launch_config(cluster, dim3(threads), smem, nullptr, cluster, false, attrs);
    return cudaOccupancyMaxActiveClusters(out, kernel, &cfg);
  });
}

// The backward's CTAs each write 2 x D fp32 column partials; for short strips these are a large
// part of a CTA's bytes (8-row strips of 16-bit rows: a sixth), so there the CTAs of a cluster add
// them in distributed shared memory first and write one partial a cluster. Measured on the H200
// (forward+backward, D = 1536, clusters of 8 against plain CTAs): 4 x 1560 rows bf16 43.0-45.6 us
// against 44.5-47.7 (fp32 59.7-60.0 against 59.2-59.3), 2 x 1560 rows 30.1-30.3 against 31.4 (fp32
// 36.6-36.8 against 37.9-38.3); 42-row strips (1 x 32760 rows bf16) 157.6 against 156.4, so long
// strips keep plain CTAs.
constexpr int64_t kClusterMaxRows = 16;

// AdalnLaunchOptions::cluster: 0 = clusters of kMaxCluster for strips of at most kClusterMaxRows
// rows; 1 = never; 2, 4 or 8 = always that size. Only on sm_90+ and when the ring can hold a CTA's
// sums.
int cluster_setting(const AdalnLaunchOptions& o) {
  const int want = o.cluster;
  return want <= 0 ? 0 : (want >= kMaxCluster ? kMaxCluster : (want >= 4 ? 4 : (want >= 2 ? 2 : 1)));
}

// Strips of whole row groups covering the N rows of a sample, from `target` CTAs for B samples, in
// whole clusters (a first guess rounded down, so that the grid stays within one wave).
void plan_strips(int64_t B, int64_t N, int rows, int64_t target, StreamGrid* g) {
  int64_t strips = g->cluster > 1 && B * g->cluster <= target ? target / B / g->cluster * g->cluster
                                                              : ceil_div(target, B);
  // Whole row groups a strip: a partial group costs a full group's barriers and latency (the
  // 16-bit forward at 4 x 1560 rows: 6-row strips 85%, 8-row strips 88% of copy bandwidth).
  strips = strips < 1 ? 1 : (strips > N ? N : strips);
  g->rows_per_strip = ceil_div(ceil_div(N, strips), rows) * rows;
  // Strips past the last row (to fill the last cluster) have no rows and add zeros.
  g->strips = ceil_div(ceil_div(N, g->rows_per_strip), g->cluster) * g->cluster;
}

template <typename Kernel>
cudaError_t stream_plan(Kernel kernel, int64_t B, int64_t N, int threads, int row_bytes, int rows, bool backward,
                        int64_t D, const AdalnLaunchOptions& opts, StreamGrid* g, int* smem) {
  StreamRing ring{};
  cudaError_t err = stream_ring(kernel, threads, row_bytes, rows, &ring);
  if (err != cudaSuccess) return err;
  *smem = ring.smem;
  g->groups = ring.groups;
  g->row_bytes = row_bytes;
  g->cluster = 1;
  const int64_t target = static_cast<int64_t>(multiprocessors()) * ring.per_sm;
  const int64_t groups = ceil_div(N, rows);
  g->cyclic = !backward && groups >= kStreamCyclicGroups * ceil_div(target, B);
  if (g->cyclic) {
    g->strips = ceil_div(target, B);
    g->rows_per_strip = 0;
    return cudaSuccess;
  }
  plan_strips(B, N, rows, target, g);
  const int setting = cluster_setting(opts);
  const bool want = setting == 0 ? g->rows_per_strip <= kClusterMaxRows : setting > 1;
  if (!backward || !want || !hopper_or_newer() || ring.smem < 8 * D) return cudaSuccess;
  const int size = setting == 0 ? kMaxCluster : setting;
  int clusters = 0;
  err = resident_clusters(&clusters, kernel, threads, ring.smem, size);
  if (err != cudaSuccess) return err;
  if (clusters < 1) return cudaSuccess;
  g->cluster = size;
  plan_strips(B, N, rows, static_cast<int64_t>(clusters) * size, g);
  return cudaSuccess;
}

// 16-byte chunks a streamed thread takes (of `chunks` per row): of the two sizes, the one that
// leaves fewer threads idle in the last warp; on a tie the larger, or the smaller if `prefer_few`.
int stream_nv(int64_t chunks, int few, int many, bool prefer_few = false) {
  const int64_t idle_few = round_up_warp(ceil_div(chunks, few)) * few - chunks;
  const int64_t idle_many = round_up_warp(ceil_div(chunks, many)) * many - chunks;
  if (idle_few == idle_many) return prefer_few ? few : many;
  return idle_many < idle_few ? many : few;
}

// fp32 x at D = 1536 in one short wave of rows (at most this many a multiprocessor) takes 16
// features a thread where 24 would cover the row as exactly. Measured on the H200, alternating runs:
// - backward: 24 features hold 6 CTAs of 2 warps a multiprocessor (registers and shared memory
//   both), 16 features 6 of 3 warps: forward+backward (2, 1560, 1536) 36.4-36.5 -> 34.7-34.8 us,
//   (4, 1560, 1536) 58.9-59.1 -> 58.7-58.9 us; for 16-bit x slower ((4, 1560, 1536) bf16
//   42.9-43.1 -> 43.9-46.2 us), so 16-bit x keeps 24;
// - forward (16 features under a 96-register cap: 7 CTAs of 3 warps instead of 8 of 2):
//   (4, 1560, 1536) forward 75.9-76.8% -> 77.0-77.3% of copy bandwidth, forward+backward
//   61.7-61.8% -> 62.8%; the long shapes within 0.6 points.
constexpr int64_t kShortWaveRowsPerSm = 64;

// 16-byte chunks a streamed thread takes: `setting` (AdalnLaunchOptions::fwd_features or
// bwd_features) 16 or 24 forces that many features; otherwise stream_nv, on a tie the smaller size for fp32 x in a short
// wave (above).
int stream_features(int setting, AdalnDtype x_dtype, int64_t rows, int64_t chunks, int few, int many) {
  if (setting == kStreamFewFeatures || setting == kStreamManyFeatures) return setting == kStreamFewFeatures ? few : many;
  const bool short_wave = rows <= static_cast<int64_t>(multiprocessors()) * kShortWaveRowsPerSm;
  return stream_nv(chunks, few, many, x_dtype == ADALN_F32 && short_wave);
}

// The wide vector path needs every row start and pointer aligned to one vector.
bool fwd_wide_ok(const AdalnFwdParams& p, int vec) {
  const int64_t strides[] = {p.x_sb, p.x_sn, p.scale_sb, p.scale_sn, p.shift_sb, p.shift_sn};
  if (p.D % vec != 0) return false;
  for (int64_t s : strides) {
    if (s % vec != 0) return false;
  }
  const int mb = dtype_bytes(p.mod_dtype);
  return aligned(p.x, pack_align(dtype_bytes(p.x_dtype), vec)) && aligned(p.scale, pack_align(mb, vec)) &&
         aligned(p.shift, pack_align(mb, vec)) && aligned(p.y, pack_align(dtype_bytes(p.out_dtype), vec)) &&
         (p.weight == nullptr || (aligned(p.weight, pack_align(4, vec)) && aligned(p.bias, pack_align(4, vec))));
}

bool bwd_wide_ok(const AdalnBwdParams& p, int vec) {
  const int64_t strides[] = {p.x_sb, p.x_sn, p.dy_sb, p.dy_sn, p.scale_sb, p.scale_sn};
  if (p.D % vec != 0) return false;
  for (int64_t s : strides) {
    if (s % vec != 0) return false;
  }
  const int mb = dtype_bytes(p.mod_dtype);
  const int fb = pack_align(4, vec);
  return aligned(p.x, pack_align(dtype_bytes(p.x_dtype), vec)) &&
         aligned(p.dx, pack_align(dtype_bytes(p.x_dtype), vec)) &&
         aligned(p.dy, pack_align(dtype_bytes(p.out_dtype), vec)) && aligned(p.scale, pack_align(mb, vec)) &&
         (!p.per_token || aligned(p.dscale, pack_align(mb, vec))) &&
         (p.weight == nullptr || (aligned(p.weight, fb) && aligned(p.bias, fb)));
}

template <typename TX, typename TM, typename TO, int VEC>
cudaError_t launch_fwd(const AdalnFwdParams& p, cudaStream_t stream) {
  const int tpr = threads_per_row(p.D, VEC, kFwdValues);
  int rows = kFwdCtaThreads / tpr;
  rows = rows < 1 ? 1 : (rows > kFwdMaxRows ? kFwdMaxRows : rows);
  const int64_t blocks = ceil_div(p.B * p.N, rows);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  adaln_fwd_kernel<TX, TM, TO, VEC><<<static_cast<unsigned>(blocks), dim3(tpr, rows), 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename TX, typename TM, typename TO, int VEC, int NV, bool FULL>
cudaError_t launch_fwd_stream(const AdalnFwdParams& p, int threads, cudaStream_t stream) {
  if (threads > kStreamMaxWarps * kWarp) return cudaErrorInvalidConfiguration;
  const int row_bytes = NV * threads * static_cast<int>(sizeof(TX)) * VEC;
  StreamGrid g{};
  int smem = 0;
  const auto kernel = adaln_fwd_stream_kernel<TX, TM, TO, VEC, NV, FULL>;
  cudaError_t err = stream_plan(kernel, p.B, p.N, threads, row_bytes, fwd_stream_rows<TX>(), false, p.D, p.launch, &g,
                                &smem);
  if (err != cudaSuccess) return err;
  return launch_ex(kernel, p.B * g.strips, dim3(threads), smem, stream, 1, overlap_launches(p.launch), p, g);
}

// Threads of a streamed CTA (NV chunks each) and whether they cover the row exactly (no bounds
// checks in the kernel).
int stream_threads(int64_t chunks, int nv, bool* full) {
  const int threads = round_up_warp(ceil_div(chunks, nv));
  *full = static_cast<int64_t>(threads) * nv == chunks;
  return threads;
}

template <typename TX, typename TM, typename TO, int VEC, int NV>
cudaError_t fwd_stream(const AdalnFwdParams& p, cudaStream_t stream) {
  bool full = false;
  const int threads = stream_threads(p.D / VEC, NV, &full);
  if (full) return launch_fwd_stream<TX, TM, TO, VEC, NV, true>(p, threads, stream);
  if constexpr (sizeof(TX) == 4) {
    return launch_fwd<TX, TM, TO, VEC>(p, stream);  // see kStreamMaxF32D
  } else {
    return launch_fwd_stream<TX, TM, TO, VEC, NV, false>(p, threads, stream);
  }
}

// Per-sample modulation on aligned rows takes the streamed forward, except fp32 rows wider than
// kStreamMaxF32D or not covered exactly by the CTA's threads: those take the row-packing kernel
// (rows in registers), which measured faster there (D = 3072: 100% of copy bandwidth against 93%;
// D = 5120: 99% against 96%) and slower at D = 1536 (82-85% against 90%).
constexpr int64_t kStreamMaxF32D = 2048;

template <typename TX, typename TM, typename TO>
cudaError_t fwd_vec(const AdalnFwdParams& p, cudaStream_t stream) {
  constexpr int V = wide_vec<TX>();
  if (!fwd_wide_ok(p, V)) return launch_fwd<TX, TM, TO, 1>(p, stream);
  if (sizeof(TX) == 2 || p.D <= kStreamMaxF32D) {
    const int64_t chunks = p.D / V;
    if (p.scale_sn == 0 && p.shift_sn == 0 && chunks >= kStreamMinChunks) {
      constexpr int kFew = kStreamFewFeatures / V, kMany = kStreamManyFeatures / V;
      if (stream_features(p.launch.fwd_features, p.x_dtype, p.B * p.N, chunks, kFew, kMany) == kMany) {
        return fwd_stream<TX, TM, TO, V, kMany>(p, stream);
      }
      return fwd_stream<TX, TM, TO, V, kFew>(p, stream);
    }
  }
  return launch_fwd<TX, TM, TO, V>(p, stream);
}

// Adds the per-CTA partials of the backward (workspace: A then H, [B * strips, D] each) into
// dscale/dshift and the affine gradients, in a fixed order.
cudaError_t launch_finish(const AdalnBwdParams& p, int64_t strips, cudaStream_t stream) {
  const bool affine = p.weight != nullptr;
  if (p.per_token && !affine) return cudaSuccess;
  const int64_t ctas = p.B * strips;
  FinishJobs jobs{};
  jobs.D = p.D;
  jobs.col_blocks = ceil_div(p.D, kRedCols);
  jobs.strips = strips;
  jobs.scale = p.scale;
  jobs.scale_sb = p.scale_sb;
  jobs.scale_dtype = p.mod_dtype;
  const float* acc_a = p.workspace;
  const float* acc_h = p.workspace + static_cast<size_t>(ctas) * static_cast<size_t>(p.D);
  int64_t blocks = 0;
  auto add = [&](const float* a, const float* h, const float* ca, const float* ch, void* out, int64_t groups,
                 int64_t parts, AdalnDtype dtype, bool weighted) {
    FinishJob& j = jobs.job[jobs.count++];
    j = FinishJob{a, h, ca, ch, out, parts, blocks, dtype, weighted};
    blocks += groups * jobs.col_blocks;
  };
  if (!p.per_token) {
    add(acc_a, acc_h, p.weight, p.bias, p.dscale, p.B, strips, p.mod_dtype, false);
    add(acc_h, nullptr, nullptr, nullptr, p.dshift, p.B, strips, p.mod_dtype, false);
    if (affine) {
      add(acc_a, nullptr, nullptr, nullptr, p.dweight, 1, ctas, ADALN_F32, true);
      add(acc_h, nullptr, nullptr, nullptr, p.dbias, 1, ctas, ADALN_F32, true);
    }
  } else {
    add(acc_a, nullptr, nullptr, nullptr, p.dweight, 1, ctas, ADALN_F32, false);
    add(acc_h, nullptr, nullptr, nullptr, p.dbias, 1, ctas, ADALN_F32, false);
  }
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  // The most slices (threads on each feature) that still fit the grid in one wave.
  int slices = kRedSlices;
  for (; slices > 8; slices /= 2) {
    int per_sm = 0;
    const cudaError_t err = resident_ctas(&per_sm, adaln_finish_kernel, kRedCols * slices);
    if (err != cudaSuccess) return err;
    if (blocks <= static_cast<int64_t>(multiprocessors()) * per_sm) break;
  }
  return launch_ex(adaln_finish_kernel, blocks, dim3(kRedCols, slices), 0, stream, 1, overlap_launches(p.launch), jobs);
}

// The backward's launch plan; the workspace query and the launch must agree, so both use this.
template <typename TX, typename TM, typename TD, int VEC, bool AFFINE, int VALUES>
cudaError_t bwd_plan(const AdalnBwdParams& p, int* tpr, BwdGrid* grid) {
  *tpr = threads_per_row(p.D, VEC, VALUES);
  if (*tpr > bwd_threads(VALUES)) return cudaErrorInvalidValue;
  int per_sm = 0;
  const cudaError_t err = resident_ctas(&per_sm, adaln_bwd_kernel<TX, TM, TD, VEC, AFFINE, VALUES>, *tpr);
  if (err != cudaSuccess) return err;
  const int64_t target = static_cast<int64_t>(multiprocessors()) * (per_sm > 0 ? per_sm : 1);
  int64_t strips = ceil_div(target, p.B);
  strips = strips < 1 ? 1 : (strips > p.N ? p.N : strips);
  grid->rows_per_strip = ceil_div(p.N, strips);
  grid->strips = ceil_div(p.N, grid->rows_per_strip);
  return cudaSuccess;
}

size_t workspace_floats(const AdalnBwdParams& p, const BwdGrid& g) {
  const int arrays = (p.per_token && p.weight == nullptr) ? 0 : 2;
  return static_cast<size_t>(arrays) * static_cast<size_t>(p.B * g.strips) * static_cast<size_t>(p.D);
}

template <typename TX, typename TM, typename TD, int VEC, bool AFFINE, int VALUES>
cudaError_t launch_bwd(const AdalnBwdParams& p, cudaStream_t stream, size_t* workspace_bytes) {
  int tpr = 0;
  BwdGrid g{};
  cudaError_t err = bwd_plan<TX, TM, TD, VEC, AFFINE, VALUES>(p, &tpr, &g);
  if (err != cudaSuccess) return err;
  if (workspace_bytes != nullptr) {
    *workspace_bytes = workspace_floats(p, g) * sizeof(float);
    return cudaSuccess;
  }
  const int64_t ctas = p.B * g.strips;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  adaln_bwd_kernel<TX, TM, TD, VEC, AFFINE, VALUES><<<static_cast<unsigned>(ctas), tpr, 0, stream>>>(p, g);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  return launch_finish(p, g.strips, stream);
}

template <typename TX, typename TM, typename TD, int VEC, int NV, bool FULL>
cudaError_t launch_bwd_stream(const AdalnBwdParams& p, int threads, cudaStream_t stream, size_t* workspace_bytes) {
  if (threads > kStreamMaxWarps * kWarp) return cudaErrorInvalidConfiguration;
  const int row_bytes = NV * threads * static_cast<int>(sizeof(TX) + sizeof(TD)) * VEC;
  StreamGrid g{};
  int smem = 0;
  const auto kernel = adaln_bwd_stream_kernel<TX, TM, TD, VEC, NV, FULL>;
  cudaError_t err = stream_plan(kernel, p.B, p.N, threads, row_bytes, kStreamBwdRows, true, p.D, p.launch, &g, &smem);
  if (err != cudaSuccess) return err;
  const int64_t parts = p.B * g.strips / g.cluster;
  if (workspace_bytes != nullptr) {
    *workspace_bytes = 2 * static_cast<size_t>(parts) * static_cast<size_t>(p.D) * sizeof(float);
    return cudaSuccess;
  }
  err = launch_ex(kernel, p.B * g.strips, dim3(threads), smem, stream, g.cluster, overlap_launches(p.launch), p, g);
  if (err != cudaSuccess) return err;
  return launch_finish(p, g.strips / g.cluster, stream);
}

template <typename TX, typename TM, typename TD, int VEC, int NV>
cudaError_t bwd_stream(const AdalnBwdParams& p, cudaStream_t stream, size_t* workspace_bytes) {
  bool full = false;
  const int threads = stream_threads(p.D / VEC, NV, &full);
  return full ? launch_bwd_stream<TX, TM, TD, VEC, NV, true>(p, threads, stream, workspace_bytes)
              : launch_bwd_stream<TX, TM, TD, VEC, NV, false>(p, threads, stream, workspace_bytes);
}

template <typename TX, typename TM, typename TD, bool AFFINE>
cudaError_t bwd_values(const AdalnBwdParams& p, cudaStream_t stream, size_t* workspace_bytes) {
  constexpr int V = wide_vec<TX>();
  const bool wide = bwd_wide_ok(p, V);
  if (!wide) return launch_bwd<TX, TM, TD, 1, AFFINE, kBwdScalarValues>(p, stream, workspace_bytes);
  const int64_t chunks = p.D / V;
  if (!p.per_token && chunks >= kStreamMinChunks) {
    constexpr int kFew = kStreamFewFeatures / V, kMany = kStreamManyFeatures / V;
    if (stream_features(p.launch.bwd_features, p.x_dtype, p.B * p.N, chunks, kFew, kMany) == kMany) {
      return bwd_stream<TX, TM, TD, V, kMany>(p, stream, workspace_bytes);
    }
    return bwd_stream<TX, TM, TD, V, kFew>(p, stream, workspace_bytes);
  }
  if (p.D <= kBwdSmallValues * kBwdSmallThreads) {
    return launch_bwd<TX, TM, TD, V, AFFINE, kBwdSmallValues>(p, stream, workspace_bytes);
  }
  return launch_bwd<TX, TM, TD, V, AFFINE, kBwdLargeValues>(p, stream, workspace_bytes);
}

template <typename TX, typename TM, typename TD>
cudaError_t bwd_vec(const AdalnBwdParams& p, cudaStream_t stream, size_t* workspace_bytes) {
  return p.weight != nullptr ? bwd_values<TX, TM, TD, true>(p, stream, workspace_bytes)
                             : bwd_values<TX, TM, TD, false>(p, stream, workspace_bytes);
}

// The dtype combinations compiled: x in {f32, bf16, f16}; modulation in fp32 or x's dtype; output
// in the promoted dtype or bf16.
#define ADALN_DISPATCH(X, M, O, FN, ...)                                                                   \
  do {                                                                                                     \
    if (X == ADALN_F32 && M == ADALN_F32 && O == ADALN_F32) return FN<float, float, float>(__VA_ARGS__); \
    if (X == ADALN_F32 && M == ADALN_F32 && O == ADALN_BF16)                                              \
      return FN<float, float, __nv_bfloat16>(__VA_ARGS__);                                                \
    if (X == ADALN_BF16 && M == ADALN_F32 && O == ADALN_F32)                                              \
      return FN<__nv_bfloat16, float, float>(__VA_ARGS__);                                                \
    if (X == ADALN_BF16 && M == ADALN_F32 && O == ADALN_BF16)                                             \
      return FN<__nv_bfloat16, float, __nv_bfloat16>(__VA_ARGS__);                                        \
    if (X == ADALN_BF16 && M == ADALN_BF16 && O == ADALN_BF16)                                            \
      return FN<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16>(__VA_ARGS__);                                \
    if (X == ADALN_F16 && M == ADALN_F32 && O == ADALN_F32) return FN<__half, float, float>(__VA_ARGS__); \
    if (X == ADALN_F16 && M == ADALN_F32 && O == ADALN_BF16)                                              \
      return FN<__half, float, __nv_bfloat16>(__VA_ARGS__);                                               \
    if (X == ADALN_F16 && M == ADALN_F16 && O == ADALN_F16) return FN<__half, __half, __half>(__VA_ARGS__); \
    if (X == ADALN_F16 && M == ADALN_F16 && O == ADALN_BF16)                                              \
      return FN<__half, __half, __nv_bfloat16>(__VA_ARGS__);                                              \
  } while (0)

}  // namespace

bool adaln_supported(AdalnDtype x, AdalnDtype m, AdalnDtype o, int64_t D) {
  if (D < 1 || D > ADALN_MAX_D) return false;
  if (D > ADALN_MAX_D_ANY && D % (16 / dtype_bytes(x)) != 0) return false;
  if (m != ADALN_F32 && m != x) return false;
  const AdalnDtype promoted = m == ADALN_F32 ? ADALN_F32 : x;
  return o == promoted || o == ADALN_BF16;
}

cudaError_t adaln_fwd(const AdalnFwdParams& p, cudaStream_t stream) {
  if (!adaln_supported(p.x_dtype, p.mod_dtype, p.out_dtype, p.D)) return cudaErrorInvalidValue;
  if (p.B * p.N == 0) return cudaSuccess;
  ADALN_DISPATCH(p.x_dtype, p.mod_dtype, p.out_dtype, fwd_vec, p, stream);
  return cudaErrorInvalidValue;
}

size_t adaln_bwd_workspace_bytes(const AdalnBwdParams& p) {
  if (!adaln_supported(p.x_dtype, p.mod_dtype, p.out_dtype, p.D) || p.B * p.N == 0) return 0;
  size_t bytes = 0;
  const cudaError_t err = [&]() -> cudaError_t {
    ADALN_DISPATCH(p.x_dtype, p.mod_dtype, p.out_dtype, bwd_vec, p, nullptr, &bytes);
    return cudaErrorInvalidValue;
  }();
  return err == cudaSuccess ? bytes : 0;
}

cudaError_t adaln_bwd(const AdalnBwdParams& p, cudaStream_t stream) {
  if (!adaln_supported(p.x_dtype, p.mod_dtype, p.out_dtype, p.D)) return cudaErrorInvalidValue;
  if (p.B * p.N == 0) return cudaSuccess;
  ADALN_DISPATCH(p.x_dtype, p.mod_dtype, p.out_dtype, bwd_vec, p, stream, nullptr);
  return cudaErrorInvalidValue;
}
