// SPDX-License-Identifier: Apache-2.0
// `Cuda::window_scores`: SnapKV-style window attention scores on the device.
//
// Three passes, mirroring the scalar reference step by step:
//   1. logits  L[r, j] = scale * <q_r, k_j>       (two implementations, below)
//   2. per-row max and 1/sum(exp(L - max)) (fp64 sum), times 1/window for kMean,
//      over (row, chunk of keys) blocks with a per-row combine (see pass 2)
//   3. out[g, j] = sum_i exp(L[g*w+i, j] - max) * inv   in window order i = 0..w-1
// Keeping the logits in the workspace (rather than an online softmax fused
// with the reduction) makes the softmax the exact two-pass one and the
// window sum order fixed, so results are bitwise reproducible run to run.
//
// Pass 1 has two kernels:
//  - exact (`window_logits_kernel`; fp32 keys always, fp16 / bf16 keys on
//    request or below sm_80): CUDA cores, separately rounded multiply and add
//    in ascending head_dim order, bit-identical to the scalar loop. Results
//    then differ from `backend::Scalar` only by expf rounding and pass 2's
//    chunked denominator (a few ulp).
//  - tensor cores (`window_logits_mma_kernel`; fp16 / bf16 keys, default on
//    sm_80+): keys are used as stored; each fp32 query element is split into
//    low-precision parts whose sum represents it (fp16: hi + lo, 22 bits;
//    bf16: hi + mid + lo, 24 bits), after an exact per-row power-of-two
//    pre-scaling for fp16 (largest |q| of the row in [2^14, 2^15): no fp16
//    overflow, parts stay clear of the subnormal range). Every part x key
//    product is exact in the fp32 mma accumulator. Each 16-wide head_dim step
//    starts from a zero accumulator (smallest part first) and is added to a
//    running fp32 sum with a round-to-nearest add, so the tensor core's
//    truncating accumulation only ever sees a 16-term partial sum.
//
// Accuracy of the tensor-core path. The split represents q to 2^-22
// relative (fp16; bf16: exactly in practice) and every product is exact. The
// mma's fp32 accumulation is not IEEE (measured on V100 / A100: terms aligned
// to the largest with truncation, result rounded toward zero), but it only
// ever sums one 16-wide step of all parts, so per logit, worst case,
//   |L_tc - L_exact| <~ 2^-17 * |scale| * sum_c |q_c k_c|  (+ 2^-24 per step add),
// the order of the sequential scalar loop's own bound d * 2^-24 * (same sum)
// at d = 128. Both errors are random-walk in practice. A host emulation of
// that pessimistic model (no guard bits, truncation, round toward zero, 8- or
// 16-term blocks) against `backend::Scalar` for unit-normal q and k,
// scale = 1/sqrt(d), d <= 256, T <= 4099 put the final scores within 2.6e-6
// relative (a logit error e changes a softmax probability by at most ~2e
// relative); one accumulator chained over all of head_dim gave 8e-6, hence
// the per-step restart. The tests keep their 1e-5 relative tolerance for
// fp16 / bf16 keys. The accumulation order differs from the sequential
// reference, so fp16 / bf16 results are no longer bitwise equal to
// `backend::Scalar`; they are deterministic (fixed mma order, no atomics):
// bitwise equal run to run. Non-finite inputs still give non-finite logits,
// though inf and NaN may differ from the reference's (an inf key times a
// zero lo part is NaN).
//
// Switch: the tensor-core kernel is the default for fp16 / bf16 keys on
// devices of compute capability 8.0 and up (fp32 keys always take the exact
// kernel). It became the default after the H200 device check of 2026-12-04
// passed every score test with it (test_cuda_ops' [mma] cases and all of
// test_cuda_policies, 1e-5 relative against backend::Scalar). The
// environment variable KVP_CUDA_EXACT_SCORES (read once per process; set and
// not "0") selects the exact kernel instead, for bitwise-reproducible logits
// against the scalar reference. Tests and benchmarks override the choice
// through `cuda_detail::set_window_logits_mode`.
#include <cub/block/block_reduce.cuh>

#include <cuda_bf16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {

// Internal hooks, not part of the public API (tests declare them themselves).
/// Pass-1 kernel choice for fp16 / bf16 keys: -1 = default (tensor cores on
/// sm_80+ unless KVP_CUDA_EXACT_SCORES is set and not "0"),
/// 0 = tensor cores where the device has them, 1 = exact kernel.
void set_window_logits_mode(int mode) noexcept;
/// Whether a call with fp16 / bf16 keys on the current device uses the
/// tensor-core logits kernel under the present mode.
bool window_logits_use_tensor_cores() noexcept;

namespace {

constexpr int kTile = 64;           // query rows and keys per logits block
constexpr int kChunk = 32;          // head_dim elements staged in shared memory per step
constexpr int kLogitThreads = 256;  // 16 x 16 threads, each owning a 4 x 4 block of logits
constexpr int kStatThreads = 256;
constexpr int kReduceThreads = 256;
constexpr std::int64_t kMaxGridY = 65535;
constexpr std::int64_t kMaxKvLen = 2147483647;
static_assert(kLogitThreads == 16 * 16 && kTile == 16 * 4, "thread / tile mapping below assumes 16x16 threads, 4x4 each");

struct WindowParams {
  std::int64_t rows;      // R = group * window query rows
  std::int64_t window;    // w
  std::int64_t head_dim;  // d
  std::int64_t kv_len;    // T
  std::int64_t ld;        // logits row length: max visible keys = min(T, q_pos0 + w)
  std::int64_t q_pos0;    // clamped to [0, T] (same visibility, no overflow)
  std::int64_t num_cols;  // L
  float scale;
  float inv_w;  // 1/w for kMean, 1 for kSum (computed as the scalar reference does)
  bool vec;     // tensor-core kernel<Tk, true>: staging in 16-byte vectors: head_dim % 8 == 0, every key row 16-byte aligned
};

/// Keys visible to window query i: [0, min(T, q_pos0 + i + 1)).
__device__ __forceinline__ std::int64_t visible(const WindowParams& p, std::int64_t i) {
  const std::int64_t v = p.q_pos0 + i + 1;
  return v < p.kv_len ? v : p.kv_len;
}

/// Pass 1. Block (x, y) computes logits for keys [64x, 64x+64) of query rows
/// [64y, 64y+64). Each thread accumulates its dot products over head_dim in
/// ascending order with separately rounded multiply and add (no FMA
/// contraction), exactly the scalar loop; zero padding past head_dim adds +0.
template <class Tk>
__global__ void __launch_bounds__(kLogitThreads)
    window_logits_kernel(WindowParams p, const float* __restrict__ q, Rows<Tk> keys, float* __restrict__ logits) {
  // Transposed tiles [c][row]; the +1 column keeps the transposing store conflict-free.
  __shared__ float qs[kChunk][kTile + 1];
  __shared__ float ks[kChunk][kTile + 1];
  __shared__ const Tk* krow[kTile];  // row pointers of this block's keys (page lookup done once)

  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % 16, ty = tid / 16;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTile;

  if (tid < kTile) krow[tid] = (j0 + tid < p.ld) ? keys.row(j0 + tid) : nullptr;

  float acc[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) acc[a][b] = 0.0f;

  // Staging through registers, the next chunk loaded during this one's
  // products (see window_logits_mma_kernel: interleaved global loads and
  // shared stores serialise). Element e = tid + 256 u of the 64 x 32 chunk is
  // row / key e / 32, column e % 32: consecutive threads read consecutive elements.
  constexpr int kPerThread = kTile * kChunk / kLogitThreads;
  static_assert(kLogitThreads % kChunk == 0, "each thread keeps one column of the chunk");
  const int c_own = tid % kChunk, t0 = tid / kChunk;
  float qv[kPerThread], kv[kPerThread];
  const auto load_chunk = [&](std::int64_t c0) {
    const std::int64_t col = c0 + c_own;
    const bool in_dim = col < p.head_dim;
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int t = t0 + u * (kLogitThreads / kChunk);
      const std::int64_t r = r0 + t;
      qv[u] = (in_dim && r < p.rows) ? __ldg(q + r * p.head_dim + col) : 0.0f;
      const Tk* kr = krow[t];
      kv[u] = (in_dim && kr != nullptr) ? load_f32(kr + col) : 0.0f;
    }
  };
  __syncthreads();  // krow ready
  load_chunk(0);
  for (std::int64_t c0 = 0; c0 < p.head_dim; c0 += kChunk) {
    __syncthreads();  // previous tiles consumed
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int t = t0 + u * (kLogitThreads / kChunk);
      qs[c_own][t] = qv[u];
      ks[c_own][t] = kv[u];
    }
    __syncthreads();
    if (c0 + kChunk < p.head_dim) load_chunk(c0 + kChunk);  // in flight during the products
#pragma unroll 4
    for (int c = 0; c < kChunk; ++c) {
      float qa[4], kb[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) qa[a] = qs[c][ty + 16 * a];
#pragma unroll
      for (int b = 0; b < 4; ++b) kb[b] = ks[c][tx + 16 * b];
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) acc[a][b] = __fadd_rn(acc[a][b], __fmul_rn(qa[a], kb[b]));
    }
  }

#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const std::int64_t r = r0 + ty + 16 * a;
    if (r >= p.rows) continue;
    const std::int64_t vis = visible(p, r % p.window);
    float* lr = logits + r * p.ld;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const std::int64_t j = j0 + tx + 16 * b;
      if (j < vis) lr[j] = __fmul_rn(acc[a][b], p.scale);  // vis <= ld: in bounds
    }
  }
}

// ---- pass 1 on tensor cores (fp16 / bf16 keys, sm_80+) --------------------
//
// Block: 64 query rows x 128 keys, 8 warps in a 2 (rows) x 4 (keys) grid, each
// warp a 32 x 32 tile = 2 x 4 mma tiles of m16n8. head_dim is staged through
// shared memory 32 elements (two k16 steps) at a time, zero-padded past
// head_dim, past the last query row and past the last key, so any head_dim,
// row count and key count work. Keys are fetched row by row through
// `Rows::row(j)` (one page lookup per key row and block), so a page boundary
// may fall anywhere in a tile.
constexpr int kMmaRows = 64;                         // query rows per block
constexpr int kMmaKeys = 128;                        // keys per block
constexpr int kMmaChunk = 32;                        // head_dim elements staged per step
constexpr int kMmaPitch = kMmaChunk + 8;             // 16-bit elements per smem row: 20 words (see below)
constexpr int kMmaThreads = 256;                     // 8 warps
constexpr int kMmaWarpRows = 32, kMmaWarpKeys = 32;  // warp tile
constexpr int kMmaMTiles = kMmaWarpRows / 16;        // m16 tiles per warp
constexpr int kMmaNTiles = kMmaWarpKeys / 8;         // n8 tiles per warp
constexpr std::int64_t kMmaMaxKeyBlocks = 65535;     // grid.y; more key tiles loop in the block
static_assert((kMmaRows / kMmaWarpRows) * (kMmaKeys / kMmaWarpKeys) * 32 == kMmaThreads, "warp grid must cover the block tile");
static_assert(kMmaChunk % 16 == 0 && kMmaKeys <= kMmaThreads, "chunk = whole k16 steps; one thread per key row pointer");
static_assert(kMmaThreads % kMmaChunk == 0 && kMmaRows % (kMmaThreads / kMmaChunk) == 0 && kMmaKeys % (kMmaThreads / kMmaChunk) == 0,
              "staging: each thread owns one column of the chunk");
// Fragment loads read one 32-bit word per lane at word (row * 20 + t + const)
// for rows g = 0..7 and t = 0..3: 20 * g mod 32 = {0,20,8,28,16,4,24,12}
// plus t covers all 32 banks once, so the loads are conflict-free.
static_assert((kMmaPitch / 2) % 32 == 20 && kMmaPitch % 2 == 0, "pitch chosen for conflict-free fragment loads");

/// Element type specifics: how many parts a query is split into, the
/// narrowing / widening of one part, and the mma instruction.
template <class Tk>
struct MmaKeys;

template <>
struct MmaKeys<half> {
  static constexpr int kParts = 2;             // q = hi + lo
  static constexpr bool kScaleQueries = true;  // fp16 range is narrow: pre-scale rows by a power of two
  static __device__ __forceinline__ std::uint16_t narrow(float x) { return __half_as_ushort(__float2half_rn(x)); }
  static __device__ __forceinline__ float widen(std::uint16_t b) { return __half2float(__ushort_as_half(b)); }
  /// c += a * b, m16n8k16, fp16 inputs, fp32 accumulate.
  static __device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <>
struct MmaKeys<bfloat16> {
  static constexpr int kParts = 3;              // q = hi + mid + lo
  static constexpr bool kScaleQueries = false;  // bf16 has the fp32 exponent range: no scaling needed
  static __device__ __forceinline__ std::uint16_t narrow(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
  static __device__ __forceinline__ float widen(std::uint16_t b) { return __uint_as_float(static_cast<unsigned int>(b) << 16); }
  /// c += a * b, m16n8k16, bf16 inputs, fp32 accumulate.
  static __device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

/// 2^k as a float, for k in [-126, 127] (exact).
__device__ __forceinline__ float pow2(int k) { return __uint_as_float(static_cast<unsigned int>(k + 127) << 23); }

/// Exponent shift that puts a row's largest |q| (m) into [2^14, 2^15): the
/// fp16 hi part of every element is then finite (< 65504) and the fp16 lo
/// part of the large elements is normal. 0 for an all-zero or non-finite
/// row; at most 126 (rows with m < 2^-112 keep a few subnormal parts, a
/// negligible absolute error), so 2^shift and 2^-shift are normal floats.
__device__ __forceinline__ int row_shift(float m) {
  if (!(m > 0.0f) || !(m <= 3.402823466e38f)) return 0;
  const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xffu) - 127;  // floor(log2 m); -127 for subnormal m
  const int shift = 14 - e;
  return shift < 126 ? shift : 126;
}

/// Loads a 32-bit word (two consecutive 16-bit elements, the lower index in
/// the low half) from shared memory.
__device__ __forceinline__ std::uint32_t lds32(const std::uint16_t* p) { return *reinterpret_cast<const std::uint32_t*>(p); }

/// Pass 1 on tensor cores. Grid (row tiles, min(key tiles, 65535)); a block
/// loops over key tiles blockIdx.y, +gridDim.y, ... Row tiles are the fast
/// grid dimension, so the blocks sharing one key tile run back to back and
/// the tile is read from DRAM once.
///
/// Fragment layouts of mma.m16n8k16 with .f16 / .bf16 inputs and .f32
/// accumulators (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
/// point type"), with g = lane >> 2 and t = lane % 4; registers hold two
/// 16-bit elements, the lower-numbered in the low half:
///   A (16 x 16, row): a0,a1: (g,   2t..2t+1)   a2,a3: (g+8, 2t..2t+1)
///                     a4,a5: (g,   2t+8..+9)   a6,a7: (g+8, 2t+8..+9)
///   B (16 x 8,  col): b0,b1: (k = 2t..2t+1,   n = g)
///                     b2,b3: (k = 2t+8..+9,   n = g)
///   C (16 x 8, f32):  c0,c1: (g,   2t..2t+1)   c2,c3: (g+8, 2t..2t+1)
/// Here A = query parts (row = query row, k = head_dim), stored [row][k] in
/// shared memory, and B = keys (n = key, k = head_dim), stored [key][k]:
/// "col" B is exactly key rows with head_dim contiguous. So each A / B
/// register is one 32-bit load of two consecutive head_dim elements.
template <class Tk, bool kVec>
__global__ void __launch_bounds__(kMmaThreads)
    window_logits_mma_kernel(WindowParams p, const float* __restrict__ q, Rows<Tk> keys, float* __restrict__ logits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // never launched there: the host dispatch requires compute capability >= 8.0
#else
  using K = MmaKeys<Tk>;
  constexpr int P = K::kParts;
  __shared__ __align__(16) std::uint16_t qs[P][kMmaRows][kMmaPitch];  // query parts, part 0 = hi
  __shared__ __align__(16) std::uint16_t ks[kMmaKeys][kMmaPitch];     // key bits
  __shared__ const Tk* krow[kMmaKeys];                                // key row pointers (nullptr past ld)
  __shared__ float q_up[kMmaRows], q_down[kMmaRows];                  // 2^shift, 2^-shift per query row

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
  const int wm0 = (warp / (kMmaKeys / kMmaWarpKeys)) * kMmaWarpRows;  // warp's first row in the tile
  const int wn0 = (warp % (kMmaKeys / kMmaWarpKeys)) * kMmaWarpKeys;  // warp's first key in the tile
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.x) * kMmaRows;

  // Per-row power-of-two scale (fp16): one warp per row, max |q| over head_dim.
  for (int i = warp; i < kMmaRows; i += kMmaThreads / 32) {
    const std::int64_t r = r0 + i;
    float m = 0.0f;
    if (K::kScaleQueries && r < p.rows) {
      for (std::int64_t c = lane; c < p.head_dim; c += 32) m = fmaxf(m, fabsf(q[r * p.head_dim + c]));
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) {
      const int shift = row_shift(m);
      q_up[i] = pow2(shift);
      q_down[i] = pow2(-shift);
    }
  }

  for (std::int64_t kt = blockIdx.y; kt * kMmaKeys < p.ld; kt += gridDim.y) {
    const std::int64_t j0 = kt * kMmaKeys;
    __syncthreads();  // q_up ready (first tile) / previous tile done with krow
    if (tid < kMmaKeys) krow[tid] = (j0 + tid < p.ld) ? keys.row(j0 + tid) : nullptr;

    float acc[kMmaMTiles][kMmaNTiles][4];  // running fp32 sums, one m16n8 C fragment per tile
#pragma unroll
    for (int mi = 0; mi < kMmaMTiles; ++mi)
#pragma unroll
      for (int ni = 0; ni < kMmaNTiles; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;

    // Staging goes through registers: a chunk's global loads are all issued
    // before any shared-memory store (a load through a key row pointer read
    // from shared memory may not be moved past a shared store, so interleaving
    // them serialised every load: ncu on the H200 showed the kernel stalled on
    // L1TEX half the time). Loading the next chunk during the multiplies was
    // tried: 142 registers, one block per SM. Thread tid owns head_dim column c0 + tid % 32 of query rows /
    // keys tid / 32, +8, +16, ... (a warp reads 32 consecutive elements of one row).
    constexpr int kRowsPerThread = kMmaRows / (kMmaThreads / kMmaChunk), kKeysPerThread = kMmaKeys / (kMmaThreads / kMmaChunk);
    const int c = tid % kMmaChunk, i0 = tid / kMmaChunk;
    float qv[kRowsPerThread];
    std::uint16_t kv[kKeysPerThread];
    const auto load_chunk = [&](std::int64_t c0) {
      const std::int64_t col = c0 + c;
      const bool in_dim = col < p.head_dim;
#pragma unroll
      for (int u = 0; u < kRowsPerThread; ++u) {
        const std::int64_t r = r0 + i0 + u * (kMmaThreads / kMmaChunk);
        qv[u] = (in_dim && r < p.rows) ? __ldg(q + r * p.head_dim + col) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kKeysPerThread; ++u) {
        const Tk* kr = krow[i0 + u * (kMmaThreads / kMmaChunk)];
        kv[u] = (in_dim && kr != nullptr) ? kr[col].bits : std::uint16_t{0};
      }
    };
    // The same staging in 16-byte vectors when every key row is 16-byte aligned
    // and head_dim % 8 == 0 (the usual case): thread tid loads keys' 8-element
    // pieces v = tid, tid + 256 (key v / 4, columns (v % 4) * 8 ..) and query
    // float4 pieces (row v / 8, columns (v % 8) * 4 ..): 4 loads instead of 24.
    constexpr int kKeyVecs = kMmaKeys * kMmaChunk / 8 / kMmaThreads, kQueryVecs = kMmaRows * kMmaChunk / 4 / kMmaThreads;
    static_assert(kKeyVecs * 8 * kMmaThreads == kMmaKeys * kMmaChunk && kQueryVecs * 4 * kMmaThreads == kMmaRows * kMmaChunk,
                  "vector staging covers the chunk exactly");
    uint4 kv8[kKeyVecs];
    float4 qv4[kQueryVecs];
    const auto load_chunk_vec = [&](std::int64_t c0) {
#pragma unroll
      for (int u = 0; u < kKeyVecs; ++u) {
        const int v = tid + u * kMmaThreads, n = v / (kMmaChunk / 8), cc = (v % (kMmaChunk / 8)) * 8;
        const Tk* kr = krow[n];
        kv8[u] = (kr != nullptr && c0 + cc < p.head_dim) ? __ldg(reinterpret_cast<const uint4*>(kr + c0 + cc)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kQueryVecs; ++u) {
        const int v = tid + u * kMmaThreads, i = v / (kMmaChunk / 4), cc = (v % (kMmaChunk / 4)) * 4;
        const std::int64_t r = r0 + i;
        qv4[u] = (r < p.rows && c0 + cc < p.head_dim) ? __ldg(reinterpret_cast<const float4*>(q + r * p.head_dim + c0 + cc))
                                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    };
    const auto store_chunk_vec = [&] {
#pragma unroll
      for (int u = 0; u < kKeyVecs; ++u) {
        const int v = tid + u * kMmaThreads, n = v / (kMmaChunk / 8), cc = (v % (kMmaChunk / 8)) * 8;
        *reinterpret_cast<uint4*>(&ks[n][cc]) = kv8[u];  // pitch 80 bytes: 16-byte aligned
      }
#pragma unroll
      for (int u = 0; u < kQueryVecs; ++u) {
        const int v = tid + u * kMmaThreads, i = v / (kMmaChunk / 4), cc = (v % (kMmaChunk / 4)) * 4;
        float x[4] = {__fmul_rn(qv4[u].x, q_up[i]), __fmul_rn(qv4[u].y, q_up[i]), __fmul_rn(qv4[u].z, q_up[i]),
                      __fmul_rn(qv4[u].w, q_up[i])};
#pragma unroll
        for (int part = 0; part < P; ++part) {
          std::uint16_t b[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            b[e] = K::narrow(x[e]);
            x[e] = isfinite(x[e]) ? __fsub_rn(x[e], K::widen(b[e])) : 0.0f;  // as below
          }
          *reinterpret_cast<uint2*>(&qs[part][i][cc]) =
              make_uint2(b[0] | (static_cast<unsigned>(b[1]) << 16), b[2] | (static_cast<unsigned>(b[3]) << 16));
        }
      }
    };
    const auto store_chunk = [&] {
    // Query parts: x = q * 2^shift (exact), part 0 = narrow(x), part n = narrow(x - sum of parts < n).
#pragma unroll
      for (int u = 0; u < kRowsPerThread; ++u) {
        const int i = i0 + u * (kMmaThreads / kMmaChunk);
        float x = __fmul_rn(qv[u], q_up[i]);
#pragma unroll
        for (int part = 0; part < P; ++part) {
          const std::uint16_t b = K::narrow(x);
          qs[part][i][c] = b;
          x = isfinite(x) ? __fsub_rn(x, K::widen(b)) : 0.0f;  // exact remainder; inf / NaN go whole into part 0
        }
      }
      // Keys as stored (bits), zero past head_dim and past ld.
#pragma unroll
      for (int u = 0; u < kKeysPerThread; ++u) ks[i0 + u * (kMmaThreads / kMmaChunk)][c] = kv[u];
    };
    for (std::int64_t c0 = 0; c0 < p.head_dim; c0 += kMmaChunk) {
      __syncthreads();  // krow ready / previous chunk consumed
      if constexpr (kVec) {
        load_chunk_vec(c0);
        store_chunk_vec();
      } else {
        load_chunk(c0);
        store_chunk();
      }
      __syncthreads();

#pragma unroll 1
      for (int kk = 0; kk < kMmaChunk; kk += 16) {
        std::uint32_t b[kMmaNTiles][2];
#pragma unroll
        for (int ni = 0; ni < kMmaNTiles; ++ni) {
          const std::uint16_t* kp = &ks[wn0 + 8 * ni + g][kk + 2 * t];  // key n = g, k = 2t, 2t+1
          b[ni][0] = lds32(kp);
          b[ni][1] = lds32(kp + 8);  // k = 2t+8, 2t+9
        }
#pragma unroll
        for (int mi = 0; mi < kMmaMTiles; ++mi) {
          std::uint32_t a[P][4];
#pragma unroll
          for (int part = 0; part < P; ++part) {
            const std::uint16_t* qp = &qs[part][wm0 + 16 * mi + g][kk + 2 * t];  // row g, k = 2t, 2t+1
            a[part][0] = lds32(qp);
            a[part][1] = lds32(qp + 8 * kMmaPitch);      // row g+8, k = 2t, 2t+1
            a[part][2] = lds32(qp + 8);                  // row g,   k = 2t+8, 2t+9
            a[part][3] = lds32(qp + 8 * kMmaPitch + 8);  // row g+8, k = 2t+8, 2t+9
          }
#pragma unroll
          for (int ni = 0; ni < kMmaNTiles; ++ni) {
            float step[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // this k16 step alone, smallest part first
#pragma unroll
            for (int part = P - 1; part >= 0; --part) K::mma(step, a[part], b[ni]);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = __fadd_rn(acc[mi][ni][e], step[e]);
          }
        }
      }
    }

    // C fragment element e of tile (mi, ni): row g + 8*(e/2), key 2t + (e%2).
#pragma unroll
    for (int mi = 0; mi < kMmaMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = wm0 + 16 * mi + g + 8 * h;
        const std::int64_t r = r0 + i;
        if (r >= p.rows) continue;
        const std::int64_t vis = visible(p, r % p.window);
        if (vis <= j0) continue;  // no visible key in this tile
        float* lr = logits + r * p.ld;
        const float down = q_down[i];
#pragma unroll
        for (int ni = 0; ni < kMmaNTiles; ++ni)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const std::int64_t j = j0 + wn0 + 8 * ni + 2 * t + e;
            if (j < vis) lr[j] = __fmul_rn(__fmul_rn(acc[mi][ni][2 * h + e], p.scale), down);  // vis <= ld
          }
      }
  }
#endif
}

/// std::max(m, x) as the reference uses it: a NaN x never replaces m.
struct MaxIgnoringNaN {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/// Pass 2 runs over (row, chunk of keys) blocks so a layer's few hundred rows
/// still fill the device (a block per row left a 32K-key row latency-bound).
/// 2a: block (r, c) writes its chunk's max m_c and fp64 sum of exp(L - m_c)
/// (a second read of the same 8 KB, from cache); 2b: per row, M = max m_c and
/// sum = sum_c s_c * exp(m_c - M) (fp64, fixed order). The reference sums
/// exp(L - M) directly; the rescaling differs from it by expf's rounding at a
/// shifted argument (~1 ulp per term), inside the tests' 1e-5. Chunks are at
/// least kStatChunk keys and at most kMaxStatChunks per row (`stat_chunk`).
constexpr std::int64_t kStatChunk = 2048;
constexpr int kMaxStatChunks = 64;

/// Keys per pass-2 chunk for logits rows of length ld.
__host__ __device__ inline std::int64_t stat_chunk(std::int64_t ld) {
  std::int64_t c = kStatChunk;
  while ((ld + c - 1) / c > kMaxStatChunks) c *= 2;
  return c;
}

/// Pass 2a. Block (r, c): chunk c of row r's visible logits. An empty chunk
/// (past the row's visible keys) contributes 0.
__global__ void __launch_bounds__(kStatThreads)
    window_chunk_stats_kernel(WindowParams p, std::int64_t chunk, const float* __restrict__ logits, float* __restrict__ part_max,
                              double* __restrict__ part_sum) {
  using MaxReduce = cub::BlockReduce<float, kStatThreads>;
  using SumReduce = cub::BlockReduce<double, kStatThreads>;
  __shared__ typename MaxReduce::TempStorage max_tmp;
  __shared__ typename SumReduce::TempStorage sum_tmp;
  __shared__ float s_max;
  const std::int64_t r = blockIdx.x, c = blockIdx.y;
  const std::int64_t vis = visible(p, r % p.window);
  const std::int64_t j1 = (c + 1) * chunk < vis ? (c + 1) * chunk : vis;
  const float* lr = logits + r * p.ld;
  float m = -INFINITY;
#pragma unroll 8
  for (std::int64_t j = c * chunk + threadIdx.x; j < j1; j += kStatThreads) m = fmaxf(m, lr[j]);
  m = MaxReduce(max_tmp).Reduce(m, MaxIgnoringNaN{});  // valid in thread 0
  if (threadIdx.x == 0) s_max = m;
  __syncthreads();
  m = s_max;
  if (m == -INFINITY) {
    // Empty, or every logit -inf or NaN: for a finite row max M the -inf terms
    // add exactly 0, a NaN term makes the sum NaN (as in the reference).
    bool nan = false;
    for (std::int64_t j = c * chunk + threadIdx.x; j < j1; j += kStatThreads) nan = nan || lr[j] != lr[j];
    nan = __syncthreads_or(nan) != 0;
    if (threadIdx.x == 0) {
      part_max[r * gridDim.y + c] = m;
      part_sum[r * gridDim.y + c] = nan ? __longlong_as_double(0x7ff8000000000000LL) : 0.0;
    }
    return;
  }
  double sum = 0.0;
#pragma unroll 8
  for (std::int64_t j = c * chunk + threadIdx.x; j < j1; j += kStatThreads) sum += static_cast<double>(expf(__fsub_rn(lr[j], m)));
  sum = SumReduce(sum_tmp).Sum(sum);  // valid in thread 0
  if (threadIdx.x == 0) {
    part_max[r * gridDim.y + c] = m;
    part_sum[r * gridDim.y + c] = sum;
  }
}

/// Pass 2b. Warp per row (a thread per row left one block of serial fp64
/// exps: 9 us under ncu): M = max of the chunk maxima (NaN ignored, as the
/// reference's std::max), sum = sum_c s_c * exp(m_c - M) (fp64, lane c, c+32
/// then a fixed shuffle tree), then row_scale = (float)(1 / sum) * inv_w as
/// the reference rounds it. A row whose max is -inf gets NaN, as the
/// reference's exp(-inf - -inf) gives.
constexpr int kScaleRowsPerBlock = 8;
static_assert(kMaxStatChunks <= 64, "two chunks per lane");
__global__ void __launch_bounds__(32 * kScaleRowsPerBlock)
    window_row_scale_kernel(WindowParams p, int nchunks, const float* __restrict__ part_max, const double* __restrict__ part_sum,
                            float* __restrict__ row_max, float* __restrict__ row_scale) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kScaleRowsPerBlock + threadIdx.x / 32;
  if (r >= p.rows) return;  // whole warps leave together
  const float* pm = part_max + r * nchunks;
  const double* ps = part_sum + r * nchunks;
  const float m0 = lane < nchunks ? pm[lane] : -INFINITY, m1 = lane + 32 < nchunks ? pm[lane + 32] : -INFINITY;
  float m = fmaxf(m0, m1);
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  const auto term = [&](int c, float mc) -> double {
    if (c >= nchunks) return 0.0;
    return mc == -INFINITY ? ps[c] : ps[c] * exp(static_cast<double>(mc) - static_cast<double>(m));  // -inf chunk: 0 or NaN
  };
  double sum = term(lane, m0) + term(lane + 32, m1);
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (m == -INFINITY) sum = __longlong_as_double(0x7ff8000000000000LL);  // NaN
  if (lane == 0) {
    row_max[r] = m;
    row_scale[r] = __fmul_rn(static_cast<float>(1.0 / sum), p.inv_w);
  }
}

/// Pass 3. Thread per (head g, key j < num_cols): the window sum in order
/// i = 0..w-1, adding only queries that see key j (the reference's `cols`).
/// Reads of one i are coalesced over j.
__global__ void __launch_bounds__(kReduceThreads)
    window_reduce_kernel(WindowParams p, const float* __restrict__ logits, const float* __restrict__ row_max,
                         const float* __restrict__ row_scale, float* __restrict__ out) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kReduceThreads + threadIdx.x;
  const std::int64_t g = blockIdx.y;
  if (j >= p.num_cols) return;
  float acc = 0.0f;
  for (std::int64_t i = 0; i < p.window; ++i) {
    if (j >= visible(p, i)) continue;
    const std::int64_t r = g * p.window + i;
    const float e = expf(__fsub_rn(logits[r * p.ld + j], row_max[r]));
    acc = __fadd_rn(acc, __fmul_rn(e, row_scale[r]));
  }
  out[g * p.num_cols + j] = acc;
}

/// Logits row length: keys visible to the last window query.
std::int64_t logits_ld(const WindowScoreShape& s) noexcept {
  const std::int64_t q0 = s.q_pos0 < 0 ? 0 : s.q_pos0;
  if (q0 >= s.kv_len) return s.kv_len;
  return q0 + s.window < s.kv_len ? q0 + s.window : s.kv_len;
}

/// Shapes this implementation launches (beyond these: kUnsupported).
bool within_launch_limits(const WindowScoreShape& s) noexcept {
  return s.group <= kMaxGridY && s.window <= kMaxGridY * kTile && s.group * s.window <= kMaxGridY * kTile && s.kv_len <= kMaxKvLen;
}

Status validate_shape(const char* who, const WindowScoreShape& s) noexcept {
  KVP_REQUIRE(s.group >= 1, "%s: group is %lld, must be >= 1", who, static_cast<long long>(s.group));
  KVP_REQUIRE(s.window >= 1, "%s: window is %lld, must be >= 1", who, static_cast<long long>(s.window));
  KVP_REQUIRE(s.head_dim >= 1, "%s: head_dim is %lld, must be >= 1", who, static_cast<long long>(s.head_dim));
  KVP_REQUIRE(s.kv_len >= 0, "%s: kv_len is %lld, must be >= 0", who, static_cast<long long>(s.kv_len));
  KVP_REQUIRE(s.num_cols >= 0 && s.num_cols <= s.kv_len, "%s: num_cols is %lld, must be in [0, kv_len=%lld]", who,
              static_cast<long long>(s.num_cols), static_cast<long long>(s.kv_len));
  KVP_REQUIRE(s.q_pos0 >= 0, "%s: q_pos0 is %lld, must be >= 0", who, static_cast<long long>(s.q_pos0));
  KVP_REQUIRE(s.reduce == WindowReduce::kMean || s.reduce == WindowReduce::kSum, "%s: reduce is %d, not kMean or kSum", who,
              static_cast<int>(s.reduce));
  if (!within_launch_limits(s)) {
    return Status::error(StatusCode::kUnsupported,
                         "%s: group=%lld, window=%lld, kv_len=%lld exceed this backend's launch limits "
                         "(group <= %lld, group*window <= %lld, kv_len <= %lld)",
                         who, static_cast<long long>(s.group), static_cast<long long>(s.window), static_cast<long long>(s.kv_len),
                         static_cast<long long>(kMaxGridY), static_cast<long long>(kMaxGridY * kTile), static_cast<long long>(kMaxKvLen));
  }
  return Status::ok();
}

template <class Tk>
Status validate_keys(const char* who, const WindowScoreShape& s, const Rows<Tk>& keys) noexcept {
  KVP_REQUIRE(keys.base != nullptr, "%s: keys.base is null", who);
  if (keys.pages == nullptr) {
    KVP_REQUIRE(s.kv_len <= 1 || keys.row_stride >= s.head_dim, "%s: keys.row_stride is %lld, less than head_dim %lld (rows would overlap)",
                who, static_cast<long long>(keys.row_stride), static_cast<long long>(s.head_dim));
    return Status::ok();
  }
  KVP_REQUIRE(keys.page_size >= 1, "%s: keys.page_size is %d, must be >= 1 for paged keys", who, static_cast<int>(keys.page_size));
  KVP_REQUIRE(keys.page_size == 1 || s.kv_len <= 1 || keys.row_stride >= s.head_dim,
              "%s: keys.row_stride (slot stride) is %lld, less than head_dim %lld (rows would overlap)", who,
              static_cast<long long>(keys.row_stride), static_cast<long long>(s.head_dim));
  KVP_REQUIRE(s.kv_len <= keys.page_size || keys.page_stride >= s.head_dim,
              "%s: keys.page_stride is %lld, less than head_dim %lld (pages would overlap)", who, static_cast<long long>(keys.page_stride),
              static_cast<long long>(s.head_dim));
  return Status::ok();
}

std::size_t workspace_bytes(const WindowScoreShape& s) noexcept {
  // Shapes the entry point rejects need nothing; the call fails before the check.
  if (s.group < 1 || s.window < 1 || s.kv_len < 1 || s.num_cols < 1 || !within_launch_limits(s)) return 0;
  const auto rows = static_cast<std::size_t>(s.group * s.window);
  const std::int64_t ld = logits_ld(s);
  const auto parts = rows * static_cast<std::size_t>((ld + stat_chunk(ld) - 1) / stat_chunk(ld));
  return WorkspacePlan{}
      .add<float>(rows * static_cast<std::size_t>(ld))
      .add<float>(rows)
      .add<float>(rows)
      .add<float>(parts)
      .add<double>(parts)
      .total();
}

template <class Tk>
Status window_scores_impl(const WindowScoreShape& s, const float* q, Rows<Tk> keys, float* out, Workspace ws, void* stream) noexcept {
  constexpr const char* who = "cuda window_scores";
  KVP_RETURN_IF_ERROR(validate_shape(who, s));
  if (s.num_cols == 0) return Status::ok();  // nothing to write (covers kv_len == 0)
  KVP_REQUIRE(q != nullptr, "%s: q is null", who);
  KVP_REQUIRE(out != nullptr, "%s: out is null", who);
  KVP_RETURN_IF_ERROR(validate_keys(who, s, keys));
  KVP_RETURN_IF_ERROR(check_workspace(who, ws, workspace_bytes(s)));

  WindowParams p{};
  p.rows = s.group * s.window;
  p.window = s.window;
  p.head_dim = s.head_dim;
  p.kv_len = s.kv_len;
  p.ld = logits_ld(s);
  p.q_pos0 = s.q_pos0 < s.kv_len ? s.q_pos0 : s.kv_len;
  p.num_cols = s.num_cols;
  p.scale = s.scale;
  p.inv_w = s.reduce == WindowReduce::kMean ? 1.0f / static_cast<float>(s.window) : 1.0f;
  // 16-byte staging of the tensor-core kernel: the queries are the caller's dense
  // (rows, head_dim) fp32 buffer; every key row address base + page * page_stride +
  // slot * row_stride must be 16-byte aligned.
  if constexpr (sizeof(Tk) == 2) {
    const auto aligned16 = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; };
    p.vec = s.head_dim % 8 == 0 && aligned16(q) && aligned16(keys.base) && (s.kv_len <= 1 || keys.row_stride % 8 == 0) &&
            (keys.pages == nullptr || keys.page_stride % 8 == 0);
  } else {
    p.vec = false;
  }

  WorkspaceCarver carve(ws);
  float* logits = carve.take<float>(static_cast<std::size_t>(p.rows * p.ld));
  float* row_max = carve.take<float>(static_cast<std::size_t>(p.rows));
  float* row_scale = carve.take<float>(static_cast<std::size_t>(p.rows));
  const std::int64_t chunk = stat_chunk(p.ld);
  const int nchunks = static_cast<int>((p.ld + chunk - 1) / chunk);
  float* part_max = carve.take<float>(static_cast<std::size_t>(p.rows * nchunks));
  double* part_sum = carve.take<double>(static_cast<std::size_t>(p.rows * nchunks));
  if (logits == nullptr || row_max == nullptr || row_scale == nullptr || part_max == nullptr || part_sum == nullptr) {
    // Unreachable after check_workspace (same plan); kept so a mismatch can never launch on null.
    return Status::error(StatusCode::kWorkspaceTooSmall, "%s: workspace could not be carved", who);
  }

  const cudaStream_t st = as_stream(stream);
  const auto exact_logits = [&] {
    const dim3 grid(static_cast<unsigned>((p.ld + kTile - 1) / kTile), static_cast<unsigned>((p.rows + kTile - 1) / kTile));
    window_logits_kernel<Tk><<<grid, kLogitThreads, 0, st>>>(p, q, keys, logits);
  };
  if constexpr (std::is_same_v<Tk, float>) {
    exact_logits();
  } else if (window_logits_use_tensor_cores()) {
    const std::int64_t key_tiles = (p.ld + kMmaKeys - 1) / kMmaKeys;
    const dim3 grid(static_cast<unsigned>((p.rows + kMmaRows - 1) / kMmaRows),
                    static_cast<unsigned>(key_tiles < kMmaMaxKeyBlocks ? key_tiles : kMmaMaxKeyBlocks));
    if (p.vec)
      window_logits_mma_kernel<Tk, true><<<grid, kMmaThreads, 0, st>>>(p, q, keys, logits);
    else
      window_logits_mma_kernel<Tk, false><<<grid, kMmaThreads, 0, st>>>(p, q, keys, logits);
  } else {
    exact_logits();
  }
  const dim3 stat_grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(nchunks));
  window_chunk_stats_kernel<<<stat_grid, kStatThreads, 0, st>>>(p, chunk, logits, part_max, part_sum);
  window_row_scale_kernel<<<static_cast<unsigned>((p.rows + kScaleRowsPerBlock - 1) / kScaleRowsPerBlock), 32 * kScaleRowsPerBlock, 0,
                            st>>>(p, nchunks, part_max, part_sum, row_max, row_scale);
  const dim3 reduce_grid(static_cast<unsigned>((p.num_cols + kReduceThreads - 1) / kReduceThreads), static_cast<unsigned>(s.group));
  window_reduce_kernel<<<reduce_grid, kReduceThreads, 0, st>>>(p, logits, row_max, row_scale, out);
  return launch_status(who);
}

/// The mode set by `set_window_logits_mode` (-1: none).
std::atomic<int> g_logits_mode{-1};

/// Exact kernel when KVP_CUDA_EXACT_SCORES is set and not "0" (read once per process).
bool exact_scores_from_env() noexcept {
  static const bool exact = [] {
    const char* v = std::getenv("KVP_CUDA_EXACT_SCORES");
    return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
  }();
  return exact;
}

/// Compute capability >= 8.0 (mma.sync m16n8k16 with fp16 / bf16 inputs) for
/// the current device. Host-only queries, cached per device (no
/// synchronisation, safe during stream capture).
bool device_has_mma() noexcept {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cached_major[kCachedDevices];  // 0: not queried yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;  // the launch that follows reports the error
  if (dev >= 0 && dev < kCachedDevices) {
    if (const int m = cached_major[dev].load(std::memory_order_relaxed); m > 0) return m >= 8;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major <= 0) return false;
  if (dev >= 0 && dev < kCachedDevices) cached_major[dev].store(major, std::memory_order_relaxed);
  return major >= 8;
}

}  // namespace

void set_window_logits_mode(int mode) noexcept { g_logits_mode.store(mode < 0 ? -1 : (mode == 0 ? 0 : 1), std::memory_order_relaxed); }

bool window_logits_use_tensor_cores() noexcept {
  const int mode = g_logits_mode.load(std::memory_order_relaxed);
  const bool exact = mode < 0 ? exact_scores_from_env() : mode == 1;
  return !exact && device_has_mma();
}

}  // namespace cuda_detail

namespace backend {

std::size_t Cuda::window_scores_workspace(const WindowScoreShape& s) noexcept { return cuda_detail::workspace_bytes(s); }

Status Cuda::window_scores(const WindowScoreShape& s, const float* q_device, Rows<float> keys_device, float* out_device,
                           Workspace ws_device, void* stream) noexcept {
  return cuda_detail::window_scores_impl(s, q_device, keys_device, out_device, ws_device, stream);
}

Status Cuda::window_scores(const WindowScoreShape& s, const float* q_device, Rows<half> keys_device, float* out_device, Workspace ws_device,
                           void* stream) noexcept {
  return cuda_detail::window_scores_impl(s, q_device, keys_device, out_device, ws_device, stream);
}

Status Cuda::window_scores(const WindowScoreShape& s, const float* q_device, Rows<bfloat16> keys_device, float* out_device,
                           Workspace ws_device, void* stream) noexcept {
  return cuda_detail::window_scores_impl(s, q_device, keys_device, out_device, ws_device, stream);
}

}  // namespace backend
KVP_NAMESPACE_END
