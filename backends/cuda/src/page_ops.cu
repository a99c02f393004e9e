// SPDX-License-Identifier: Apache-2.0
// The PageOps family of `backend::Cuda` (Quest): page metadata fold, the
// per-page upper bound of q.k, and decode attention of one query group over a
// list of pages. Semantics are those of `ScalarPageOps`
// (include/kvpolicy/ops/paged_scalar.hpp); every pointer is a device pointer.
//
// Contract-form ops: work is enqueued on the calling thread's current stream
// (`Cuda::current_stream`), nothing is allocated, synchronised or copied, and a
// rejected argument or launch error is recorded (`cuda_detail::record_error`).
//
// Accuracy (tests/cuda/test_cuda_page_ops.cpp checks each statement):
// - page_meta_fold: bit-identical to the reference (same comparisons; rows are
//   split into contiguous slices whose partial max / min are combined in
//   slice order, which keeps the reference's first-wins choice between +0 and
//   -0; a stored NaN keeps its payload as the reference's conversions do).
// - page_bounds: bit-identical (each output sums its channels in ascending
//   order, products and sums rounded separately with __fmul_rn / __fadd_rn).
// - paged_decode_attention: fp32 online softmax over the same blocks as the
//   reference (attention_block), split over tokens; differs from it by expf
//   and summation-order rounding only: the test allows
//   |out - ref| <= 2e-5 * |ref| + 2e-5 * max|v| and |lse - ref| <= 2e-5 * |ref| + 2e-5.
//   NaN / -inf / empty behaviour is identical (which outputs are NaN, inf,
//   0 / -inf), including the reference's rule that a block is accumulated
//   (its -inf-logit tokens adding 0 * v, NaN for a non-finite value) exactly
//   when a finite logit occurs in it or an earlier block.
#include <cstddef>
#include <cstdint>

// PageMetaView<const T> declares its (constrained-away) conversion to PageMetaView<const T>; nvcc's
// front end warns about that member whenever the const view is instantiated (#554). Harmless.
#pragma nv_diag_suppress 554

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

__device__ __forceinline__ float f32_nan() { return __uint_as_float(0x7fc00000u); }

// ---- exact conversions of the reference (core/dtype.hpp) on the device --------

/// `to_float(half)`: exact; a NaN keeps its payload with the quiet bit set.
__device__ __forceinline__ float exact_f32(const float* p) { return *p; }
__device__ __forceinline__ float exact_f32(const half* p) {
  const unsigned b = p->bits;
  if ((b & 0x7c00u) == 0x7c00u && (b & 0x3ffu) != 0u) return __uint_as_float(((b & 0x8000u) << 16) | 0x7fc00000u | ((b & 0x3ffu) << 13));
  return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));  // exact for every non-NaN half
}
__device__ __forceinline__ float exact_f32(const bfloat16* p) { return __uint_as_float(static_cast<unsigned>(p->bits) << 16); }

// ---- page_meta_fold -------------------------------------------------------------

constexpr int kFoldChannels = 32;  // blockDim.x: one warp reads 32 consecutive channels of a row
constexpr int kFoldSlices = 8;     // blockDim.y: contiguous slices of the rows, folded in parallel

/// Channel c = blockIdx.x*32 + threadIdx.x. Slice y folds rows [y*chunk, (y+1)*chunk) from the empty
/// state with the reference's comparisons; thread y == 0 then folds the stored state (or the empty one)
/// with the slice results in slice order. That is the reference's sequential fold: both keep the first
/// value, in row order, that attains the max (min) -- which matters only for +0 / -0 -- and a NaN start
/// stays NaN.
template <class Tk, class Tm>
__global__ void __launch_bounds__(kFoldChannels* kFoldSlices)
    page_meta_fold_kernel(const Tk* __restrict__ rows, std::int64_t row_stride, std::int64_t num_rows, std::int64_t head_dim, Tm* max,
                          Tm* min, bool fresh) {
  __shared__ float s_hi[kFoldSlices][kFoldChannels];
  __shared__ float s_lo[kFoldSlices][kFoldChannels];
  const int x = static_cast<int>(threadIdx.x), y = static_cast<int>(threadIdx.y);
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kFoldChannels + x;
  const std::int64_t chunk = (num_rows + kFoldSlices - 1) / kFoldSlices;
  const std::int64_t r0 = y * chunk;
  const std::int64_t r1 = r0 + chunk < num_rows ? r0 + chunk : num_rows;
  float hi = neg_inf(), lo = pos_inf();
  if (c < head_dim) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const float v = load_f32(rows + r * row_stride + c);
      hi = v > hi ? v : hi;
      lo = v < lo ? v : lo;
    }
  }
  s_hi[y][x] = hi;
  s_lo[y][x] = lo;
  __syncthreads();
  if (y == 0 && c < head_dim) {
    float h = fresh ? neg_inf() : exact_f32(max + c);
    float l = fresh ? pos_inf() : exact_f32(min + c);
    for (int k = 0; k < kFoldSlices; ++k) {
      const float a = s_hi[k][x], b = s_lo[k][x];
      h = a > h ? a : h;
      l = b < l ? b : l;
    }
    store_exact(max + c, h);
    store_exact(min + c, l);
  }
}

// ---- page_meta_append ------------------------------------------------------------

constexpr int kAppendThreads = 128;

/// Block (x, y): logical page t0 / P + x of the sequence, kv head y. Each thread folds its channels over the
/// page's rows in row order, as the reference's `page_meta_fold` does.
template <class Tk, class Tm>
__global__ void __launch_bounds__(kAppendThreads)
    page_meta_append_kernel(const Tk* __restrict__ k_data, std::int64_t s_page, std::int64_t s_head, std::int64_t s_slot, std::int32_t P,
                            std::int64_t head_dim, const std::int32_t* __restrict__ pages, std::int64_t t0, std::int64_t t1, Tm* max_data,
                            Tm* min_data, std::int64_t m_page, std::int64_t m_head) {
  const std::int64_t lp = t0 / P + blockIdx.x, h = blockIdx.y;
  const std::int64_t a = t0 > lp * P ? t0 : lp * P, b = t1 < (lp + 1) * P ? t1 : (lp + 1) * P;
  const std::int64_t slot0 = a - lp * P, rows = b - a;
  const std::int64_t page = pages[lp];
  const Tk* base = k_data + page * s_page + h * s_head + slot0 * s_slot;
  Tm* mx = max_data + page * m_page + h * m_head;
  Tm* mn = min_data + page * m_page + h * m_head;
  const bool fresh = slot0 == 0;
  for (std::int64_t c = threadIdx.x; c < head_dim; c += blockDim.x) {
    float hi = fresh ? neg_inf() : exact_f32(mx + c);
    float lo = fresh ? pos_inf() : exact_f32(mn + c);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float v = load_f32(base + r * s_slot + c);
      hi = v > hi ? v : hi;
      lo = v < lo ? v : lo;
    }
    store_exact(mx + c, hi);
    store_exact(mn + c, lo);
  }
}

// ---- page_bounds ----------------------------------------------------------------

constexpr int kBoundPages = 32;  // blockDim.x: pages of a tile (one per lane)
constexpr int kBoundRows = 8;    // blockDim.y (at most): query rows of a tile
constexpr int kBoundChunk = 64;  // channels staged in shared memory per step

/// Tile = 32 pages (i0 = blockIdx.x*32 ..) x up to 8 query rows of kv head g; blockIdx.y = g*row_tiles +
/// row tile. Thread (x, y) owns output (row j0 + y, page i0 + x) and sums its channels in ascending order
/// across the chunks (its accumulator persists), reading the metadata (staged per chunk, coalesced along
/// head_dim, converted to fp32) and the query chunk from shared memory. Metadata rows are read once per
/// row tile, i.e. once per kv head group when group <= 8.
template <class Tm>
__global__ void __launch_bounds__(kBoundPages* kBoundRows)
    page_bounds_kernel(const float* __restrict__ q, std::int64_t group, std::int64_t head_dim, const Tm* __restrict__ max_data,
                       const Tm* __restrict__ min_data, std::int64_t page_stride, std::int64_t head_stride,
                       const std::int32_t* __restrict__ pages, std::int64_t n, float* __restrict__ out, std::int64_t ld_out,
                       std::int64_t row_tiles) {
  __shared__ float s_hi[kBoundPages][kBoundChunk + 1];  // +1: lanes read column cc of 32 different pages, no bank conflicts
  __shared__ float s_lo[kBoundPages][kBoundChunk + 1];
  __shared__ float s_q[kBoundRows][kBoundChunk];
  __shared__ std::int64_t s_off[kBoundPages];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int tid = ty * kBoundPages + tx, nthreads = kBoundPages * static_cast<int>(blockDim.y);
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.x) * kBoundPages;
  const std::int64_t g = static_cast<std::int64_t>(blockIdx.y) / row_tiles;
  const std::int64_t j0 = (static_cast<std::int64_t>(blockIdx.y) % row_tiles) * kBoundRows;
  if (ty == 0) {
    const std::int64_t i = i0 + tx;
    const std::int64_t p = i < n ? (pages != nullptr ? static_cast<std::int64_t>(pages[i]) : i) : 0;
    s_off[tx] = p * page_stride + g * head_stride;
  }
  const std::int64_t i = i0 + tx, j = j0 + ty;
  const bool active = i < n && j < group;
  const float* qg = q + g * group * head_dim;  // the group's rows g*group .. g*group + group - 1
  float acc = 0.0f;
  for (std::int64_t c0 = 0; c0 < head_dim; c0 += kBoundChunk) {
    const int cn = head_dim - c0 < kBoundChunk ? static_cast<int>(head_dim - c0) : kBoundChunk;
    __syncthreads();  // s_off written (first chunk) / the previous chunk fully consumed
    for (int e = tid; e < kBoundPages * kBoundChunk; e += nthreads) {
      const int p = e / kBoundChunk, cc = e % kBoundChunk;
      float hi = 0.0f, lo = 0.0f;
      if (i0 + p < n && cc < cn) {
        hi = exact_f32(max_data + s_off[p] + c0 + cc);
        lo = exact_f32(min_data + s_off[p] + c0 + cc);
      }
      s_hi[p][cc] = hi;
      s_lo[p][cc] = lo;
    }
    for (int e = tid; e < kBoundRows * kBoundChunk; e += nthreads) {
      const int r = e / kBoundChunk, cc = e % kBoundChunk;
      s_q[r][cc] = (j0 + r < group && cc < cn) ? qg[(j0 + r) * head_dim + c0 + cc] : 0.0f;
    }
    __syncthreads();
    if (active) {
      for (int cc = 0; cc < cn; ++cc) {
        const float qv = s_q[ty][cc];
        const float a = __fmul_rn(qv, s_hi[tx][cc]);
        const float b = __fmul_rn(qv, s_lo[tx][cc]);
        acc = __fadd_rn(acc, a > b ? a : b);
      }
    }
  }
  if (active) out[(g * group + j) * ld_out + i] = acc;
}

// ---- paged_decode_attention -----------------------------------------------------
//
// Split over tokens: split s (blockIdx.x) takes whole blocks [s*bps, (s+1)*bps) of `block` rows (the
// reference's blocks: a page, or 64 contiguous rows), heads g0 = blockIdx.y*8 .. +8 of the group, and
// channels blockIdx.z*256 .. +256 (thread t owns channels t and t + 128). It runs the reference's online
// softmax on its blocks from the empty state and writes (max, sum, o) per head to the workspace; a second
// kernel merges the splits. Per block and head:
// - logits: one warp per row, lanes over channels (coalesced), warp-shuffle reduction;
// - a NaN logit (or a NaN already in the sum) makes the head "dead" (NaN result);
// - while every logit so far in the split is -inf, the block is not accumulated, but 0 * v of its rows
//   is kept per channel in `pend` (NaN iff a value is non-finite): the reference does accumulate such a
//   block when an earlier *split* had a finite logit, and the merge adds `pend` exactly then;
// - otherwise rescale by exp(old max - new max) and add exp(s - max) * v.

constexpr int kAttnThreads = 128;  // 4 warps
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnHeads = 8;                             // query heads per CTA (grid.y chunks the group)
constexpr int kAttnPerThread = 2;                         // channels per thread
constexpr int kAttnTile = kAttnThreads * kAttnPerThread;  // channels per CTA (grid.z tiles head_dim)
constexpr std::int64_t kAttnMaxSplits = 64;               // partial results the workspace holds per head
constexpr std::int64_t kAttnMinSplitTokens = 64;          // no split shorter than this (beyond one block)
constexpr std::int64_t kAttnSmemBlock = 512;              // logits in shared memory up to this block length
constexpr std::int64_t kAttnSmemDim = 512;                // queries in shared memory up to this head_dim
constexpr int kModeDead = 0, kModeAccumulate = 1, kModePending = 2;

/// The workspace of paged_decode_attention, one definition for the size and the carve.
struct AttnLayout {
  float* o = nullptr;       // (kAttnMaxSplits, group, head_dim) partial outputs (unnormalised)
  float* pend = nullptr;    // (kAttnMaxSplits, group, head_dim) 0 * v of the split's leading all -inf blocks
  float* m = nullptr;       // (kAttnMaxSplits, group) running max
  float* l = nullptr;       // (kAttnMaxSplits, group) running sum (NaN: the head is NaN)
  float* logits = nullptr;  // (kAttnMaxSplits, group, block) when block > kAttnSmemBlock, else in shared memory
};

template <class Alloc>
AttnLayout attn_layout(Alloc& a, std::int64_t group, std::int64_t block, std::int64_t head_dim) noexcept {
  const std::size_t rows = saturating_mul(static_cast<std::size_t>(kAttnMaxSplits), static_cast<std::size_t>(group));
  AttnLayout L;
  L.o = a.template take<float>(saturating_mul(rows, static_cast<std::size_t>(head_dim)));
  L.pend = a.template take<float>(saturating_mul(rows, static_cast<std::size_t>(head_dim)));
  L.m = a.template take<float>(rows);
  L.l = a.template take<float>(rows);
  if (block > kAttnSmemBlock) L.logits = a.template take<float>(saturating_mul(rows, static_cast<std::size_t>(block)));
  return L;
}

/// Row j0 of `r` and the stride to the next rows when rows j0 .. j0+bn-1 are evenly spaced (contiguous
/// rows, or all in one page); nullptr otherwise (then use r.row(j) per row).
template <class T>
__device__ __forceinline__ const T* block_base(const Rows<T>& r, std::int64_t j0, std::int64_t bn) {
  if (r.pages == nullptr) return r.base + j0 * r.row_stride;
  const std::int64_t p0 = j0 / r.page_size;
  if (p0 != (j0 + bn - 1) / r.page_size) return nullptr;
  return r.base + static_cast<std::int64_t>(r.pages[p0]) * r.page_stride + (j0 - p0 * r.page_size) * r.row_stride;
}

template <class Tk, class Tv>
__global__ void __launch_bounds__(kAttnThreads)
    attn_split_kernel(const float* __restrict__ q, std::int64_t group, std::int64_t head_dim, Rows<Tk> keys, Rows<Tv> values,
                      std::int64_t num_tokens, std::int64_t block, std::int64_t blocks_per_split, float scale, AttnLayout ws) {
  extern __shared__ float s_dyn[];  // [logits (kAttnHeads, block) if block <= kAttnSmemBlock][q (kAttnHeads, head_dim) if small]
  __shared__ float s_max[kAttnHeads], s_sum[kAttnHeads], s_alpha[kAttnHeads];
  __shared__ int s_mode[kAttnHeads];

  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const std::int64_t split = blockIdx.x;
  const std::int64_t g0 = static_cast<std::int64_t>(blockIdx.y) * kAttnHeads;
  const int gn = group - g0 < kAttnHeads ? static_cast<int>(group - g0) : kAttnHeads;
  const std::int64_t c_base = static_cast<std::int64_t>(blockIdx.z) * kAttnTile;

  // Logits (local head g, row t) at s[g*block + t]; queries (local head g, channel c) at qs[g*head_dim + c].
  float* s;
  float* s_next;
  if (block <= kAttnSmemBlock) {
    s = s_dyn;
    s_next = s_dyn + kAttnHeads * block;
  } else {
    s = ws.logits + (split * group + g0) * block;
    s_next = s_dyn;
  }
  const float* qs;
  if (head_dim <= kAttnSmemDim) {
    for (std::int64_t e = tid; e < gn * head_dim; e += kAttnThreads) s_next[e] = q[g0 * head_dim + e];
    qs = s_next;
  } else {
    qs = q + g0 * head_dim;
  }
  if (tid < kAttnHeads) {
    s_max[tid] = neg_inf();
    s_sum[tid] = 0.0f;
  }

  float acc[kAttnHeads][kAttnPerThread], pend[kAttnHeads][kAttnPerThread];
#pragma unroll
  for (int g = 0; g < kAttnHeads; ++g) {
#pragma unroll
    for (int k = 0; k < kAttnPerThread; ++k) acc[g][k] = pend[g][k] = 0.0f;
  }

  const std::int64_t t_begin = split * blocks_per_split * block;
  const std::int64_t t_span = blocks_per_split * block;
  const std::int64_t t_end = num_tokens - t_begin < t_span ? num_tokens : t_begin + t_span;
  for (std::int64_t j0 = t_begin; j0 < t_end; j0 += block) {
    const std::int64_t bn = t_end - j0 < block ? t_end - j0 : block;
    __syncthreads();  // queries / state initialised (first block); the previous block's logits consumed

    // (1) logits s[g][t] = scale * q_g . k_t
    {
      const Tk* kb = block_base(keys, j0, bn);
      for (std::int64_t t = warp; t < bn; t += kAttnWarps) {
        const Tk* kr = kb != nullptr ? kb + t * keys.row_stride : keys.row(j0 + t);
        float part[kAttnHeads];
#pragma unroll
        for (int g = 0; g < kAttnHeads; ++g) part[g] = 0.0f;
        for (std::int64_t c = lane; c < head_dim; c += 32) {
          const float kv = load_f32(kr + c);
#pragma unroll
          for (int g = 0; g < kAttnHeads; ++g)
            if (g < gn) part[g] = fmaf(qs[g * head_dim + c], kv, part[g]);
        }
#pragma unroll
        for (int g = 0; g < kAttnHeads; ++g) {
          if (g < gn) {  // gn is uniform: every lane shuffles the same heads
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) part[g] += __shfl_xor_sync(0xffffffffu, part[g], off);
          }
        }
        if (lane == 0) {
#pragma unroll
          for (int g = 0; g < kAttnHeads; ++g)
            if (g < gn) s[g * block + t] = part[g] * scale;
        }
      }
    }
    __syncthreads();

    // (2) per head (one warp each): block max / NaN, state update, p = exp(s - max) in place
    for (int g = warp; g < gn; g += kAttnWarps) {
      float* sg = s + g * block;
      float bmax = neg_inf();
      bool nan = false;
      for (std::int64_t t = lane; t < bn; t += 32) {
        const float x = sg[t];
        nan = nan || x != x;
        bmax = x > bmax ? x : bmax;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, bmax, off);
        bmax = o > bmax ? o : bmax;
      }
      nan = __any_sync(0xffffffffu, nan);
      const float old_max = s_max[g], old_sum = s_sum[g];
      __syncwarp();  // every lane has read the state before lane 0 rewrites it
      int mode;
      float alpha = 1.0f, new_max = old_max, new_sum = old_sum;
      if (old_sum != old_sum || nan) {
        mode = kModeDead;
        new_sum = f32_nan();
      } else {
        new_max = bmax > old_max ? bmax : old_max;
        if (new_max == neg_inf()) {
          mode = kModePending;
        } else {
          mode = kModeAccumulate;
          if (new_max != old_max) alpha = expf(old_max - new_max);  // 0 on the first accumulated block
          float sum = 0.0f;
          for (std::int64_t t = lane; t < bn; t += 32) {
            const float p = expf(sg[t] - new_max);
            sg[t] = p;
            sum += p;
          }
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
          new_sum = old_sum * alpha + sum;
        }
      }
      if (lane == 0) {
        s_mode[g] = mode;
        s_alpha[g] = alpha;
        s_max[g] = new_max;
        s_sum[g] = new_sum;
      }
    }
    __syncthreads();

    // (3) values: each thread its channels, rows in order
    {
      int mode[kAttnHeads];
      bool any_pending = false;
#pragma unroll
      for (int g = 0; g < kAttnHeads; ++g) {
        mode[g] = g < gn ? s_mode[g] : kModeDead;
        any_pending = any_pending || mode[g] == kModePending;
        if (mode[g] == kModeAccumulate) {
          const float a = s_alpha[g];
#pragma unroll
          for (int k = 0; k < kAttnPerThread; ++k) acc[g][k] *= a;
        }
      }
      const Tv* vb = block_base(values, j0, bn);
#pragma unroll 4
      for (std::int64_t t = 0; t < bn; ++t) {
        const Tv* vr = vb != nullptr ? vb + t * values.row_stride : values.row(j0 + t);
        float v[kAttnPerThread];
#pragma unroll
        for (int k = 0; k < kAttnPerThread; ++k) {
          const std::int64_t c = c_base + tid + k * kAttnThreads;
          v[k] = c < head_dim ? load_f32(vr + c) : 0.0f;
        }
#pragma unroll
        for (int g = 0; g < kAttnHeads; ++g) {
          if (mode[g] == kModeAccumulate) {
            const float p = s[g * block + t];
#pragma unroll
            for (int k = 0; k < kAttnPerThread; ++k) acc[g][k] = fmaf(p, v[k], acc[g][k]);
          }
        }
        if (any_pending) {
#pragma unroll
          for (int g = 0; g < kAttnHeads; ++g) {
            if (mode[g] == kModePending) {
#pragma unroll
              for (int k = 0; k < kAttnPerThread; ++k) pend[g][k] = __fadd_rn(pend[g][k], __fmul_rn(0.0f, v[k]));
            }
          }
        }
      }
    }
  }

  // Partial results of this split.
#pragma unroll
  for (int g = 0; g < kAttnHeads; ++g) {
    if (g < gn) {
      const std::int64_t row = split * group + g0 + g;
#pragma unroll
      for (int k = 0; k < kAttnPerThread; ++k) {
        const std::int64_t c = c_base + tid + k * kAttnThreads;
        if (c < head_dim) {
          ws.o[row * head_dim + c] = acc[g][k];
          ws.pend[row * head_dim + c] = pend[g][k];
        }
      }
    }
  }
  __syncthreads();  // the last state update is visible (and done) before it is written out
  if (blockIdx.z == 0 && tid < gn) {
    ws.m[split * group + g0 + tid] = s_max[tid];
    ws.l[split * group + g0 + tid] = s_sum[tid];
  }
}

/// One CTA per query head: merges the `nsplit` partial results (nsplit == 0: nothing attended).
/// NaN in any split's sum -> NaN everywhere; no split with a finite max -> out 0, lse -inf; otherwise the
/// splits are combined with weights exp(m_s - M), and `pend` of every split after the first one with a
/// finite max is added (those splits' leading all -inf blocks are accumulated by the reference).
__global__ void __launch_bounds__(kAttnThreads) attn_merge_kernel(AttnLayout ws, int nsplit, std::int64_t group, std::int64_t head_dim,
                                                                  float* __restrict__ out, float* __restrict__ lse) {
  __shared__ float s_w[kAttnMaxSplits];
  const std::int64_t g = blockIdx.x;
  const int tid = static_cast<int>(threadIdx.x);
  bool nan = false;
  int first = -1;
  float M = neg_inf();
  for (int s = 0; s < nsplit; ++s) {
    const float m = ws.m[s * group + g], l = ws.l[s * group + g];
    if (l != l) {
      nan = true;
    } else if (m > neg_inf()) {
      if (first < 0) first = s;
      M = m > M ? m : M;
    }
  }
  float* o = out + g * head_dim;
  if (nan || first < 0) {
    const float fill = nan ? f32_nan() : 0.0f;
    for (std::int64_t c = tid; c < head_dim; c += kAttnThreads) o[c] = fill;
    if (lse != nullptr && tid == 0) lse[g] = nan ? f32_nan() : neg_inf();
    return;
  }
  // Weight of split s: exp(m_s - M) when its max is finite (it may underflow to 0: then, as in the
  // reference's rescale by 0, a NaN or inf in its partial output still yields NaN); -1: no finite logit.
  for (int s = tid; s < nsplit; s += kAttnThreads) {
    const float m = ws.m[s * group + g];
    s_w[s] = m > neg_inf() ? expf(m - M) : -1.0f;
  }
  __syncthreads();
  float L = 0.0f;
  for (int s = 0; s < nsplit; ++s) {
    if (s_w[s] >= 0.0f) L = fmaf(s_w[s], ws.l[s * group + g], L);
  }
  const float inv = 1.0f / L;
  for (std::int64_t c = tid; c < head_dim; c += kAttnThreads) {
    float acc = 0.0f;
    for (int s = 0; s < nsplit; ++s) {
      const std::int64_t at = (s * group + g) * head_dim + c;
      if (s_w[s] >= 0.0f) acc = fmaf(s_w[s], ws.o[at], acc);
      if (s > first) acc += ws.pend[at];
    }
    o[c] = acc * inv;
  }
  if (lse != nullptr && tid == 0) lse[g] = M + logf(L);
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

// ---- page_meta_fold -------------------------------------------------------------

template <class Tk, class Tm>
void Cuda::page_meta_fold(const Tk* rows, std::int64_t row_stride, std::int64_t num_rows, std::int64_t head_dim, Tm* max, Tm* min,
                          bool fresh) noexcept {
  static_assert(PageMetaStorableFrom<Tk, Tm>, "metadata is stored in the key type or in float");
  using namespace cuda_detail;
  if (head_dim <= 0) return;
  if (max == nullptr || min == nullptr) return record_error(KVP_INVALID("cuda page_meta_fold: max or min is null"));
  if (num_rows < 0)
    return record_error(KVP_INVALID("cuda page_meta_fold: num_rows is %lld, must be >= 0", static_cast<long long>(num_rows)));
  if (num_rows > 0 && rows == nullptr) return record_error(KVP_INVALID("cuda page_meta_fold: rows is null"));
  const std::int64_t blocks = (head_dim + kFoldChannels - 1) / kFoldChannels;
  if (blocks > 2147483647) return record_error(KVP_INVALID("cuda page_meta_fold: head_dim is too large"));
  page_meta_fold_kernel<Tk, Tm><<<static_cast<unsigned>(blocks), dim3(kFoldChannels, kFoldSlices), 0, as_stream(current_stream())>>>(
      rows, row_stride, num_rows, head_dim, max, min, fresh);
  record_error(launch_status("cuda page_meta_fold"));
}

// ---- page_meta_append ------------------------------------------------------------

template <class Tk, class Tm>
void Cuda::page_meta_append(const Tk* k_data, const PageStrides& strides, std::int32_t page_size, std::int32_t num_kv_heads,
                            std::int64_t head_dim, const std::int32_t* pages, std::int64_t t0, std::int64_t t1,
                            PageMetaView<Tm> meta) noexcept {
  static_assert(PageMetaStorableFrom<Tk, Tm>, "metadata is stored in the key type or in float");
  using namespace cuda_detail;
  if (t1 <= t0 || head_dim <= 0 || num_kv_heads <= 0) return;
  if (page_size < 1 || t0 < 0)
    return record_error(KVP_INVALID("cuda page_meta_append: page_size %d or t0 %lld out of range", page_size, static_cast<long long>(t0)));
  if (k_data == nullptr || pages == nullptr || meta.max_data == nullptr || meta.min_data == nullptr)
    return record_error(KVP_INVALID("cuda page_meta_append: keys, page ids or metadata is null"));
  const std::int64_t first = t0 / page_size, last = (t1 - 1) / page_size, n = last - first + 1;
  if (n > 2147483647 || num_kv_heads > 65535)
    return record_error(Status::error(StatusCode::kUnsupported, "cuda page_meta_append: %lld pages x %d kv heads is too large",
                                      static_cast<long long>(n), num_kv_heads));
  page_meta_append_kernel<Tk, Tm>
      <<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(num_kv_heads)), kAppendThreads, 0, as_stream(current_stream())>>>(
          k_data, strides.page, strides.head, strides.slot, page_size, head_dim, pages, t0, t1, meta.max_data, meta.min_data,
          meta.page_stride, meta.head_stride);
  record_error(launch_status("cuda page_meta_append"));
}

// ---- page_bounds ----------------------------------------------------------------

std::size_t Cuda::page_bounds_workspace(std::int64_t num_q_rows, std::int64_t head_dim) noexcept {
  (void)num_q_rows;
  (void)head_dim;
  return 0;
}

template <class Tm>
void Cuda::page_bounds(const float* q, std::int64_t group, std::int64_t head_dim, PageMetaView<const Tm> meta, const std::int32_t* pages,
                       std::int64_t n, float* out, std::int64_t ld_out, Workspace ws) noexcept {
  using namespace cuda_detail;
  (void)ws;
  if (n <= 0 || group <= 0 || meta.num_kv_heads <= 0) return;
  if (head_dim < 0) return record_error(KVP_INVALID("cuda page_bounds: head_dim is %lld, must be >= 0", static_cast<long long>(head_dim)));
  if (out == nullptr) return record_error(KVP_INVALID("cuda page_bounds: out is null"));
  if (head_dim > 0 && (q == nullptr || meta.max_data == nullptr || meta.min_data == nullptr))
    return record_error(KVP_INVALID("cuda page_bounds: q or metadata is null"));
  const std::int64_t row_tiles = (group + kBoundRows - 1) / kBoundRows;
  const std::int64_t grid_x = (n + kBoundPages - 1) / kBoundPages;
  const std::int64_t grid_y = row_tiles * meta.num_kv_heads;
  if (grid_x > 2147483647 || grid_y > 65535) {
    return record_error(Status::error(StatusCode::kUnsupported, "cuda page_bounds: %lld pages x %d kv heads x group %lld is too large",
                                      static_cast<long long>(n), meta.num_kv_heads, static_cast<long long>(group)));
  }
  const unsigned rows_per_tile = static_cast<unsigned>(group < kBoundRows ? group : kBoundRows);
  page_bounds_kernel<Tm><<<dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)), dim3(kBoundPages, rows_per_tile), 0,
                           as_stream(current_stream())>>>(q, group, head_dim, meta.max_data, meta.min_data, meta.page_stride,
                                                          meta.head_stride, pages, n, out, ld_out, row_tiles);
  record_error(launch_status("cuda page_bounds"));
}

// ---- paged_decode_attention -----------------------------------------------------

std::size_t Cuda::paged_attention_workspace(std::int64_t group, std::int64_t block, std::int64_t head_dim) noexcept {
  if (group <= 0) return 0;
  WorkspacePlan plan;
  cuda_detail::attn_layout(plan, group, block, head_dim < 0 ? 0 : head_dim);
  return plan.total();
}

template <class Tk, class Tv>
void Cuda::paged_decode_attention(const float* q, std::int64_t group, std::int64_t head_dim, Rows<Tk> keys, Rows<Tv> values,
                                  std::int64_t num_tokens, float scale, float* out, float* lse, Workspace ws) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda paged_decode_attention";
  if (group <= 0) return;
  if (group > 2147483647) return record_error(Status::error(StatusCode::kUnsupported, "%s: group is too large", who));
  if (head_dim < 0 || num_tokens < 0) {
    return record_error(KVP_INVALID("%s: head_dim is %lld and num_tokens %lld, must be >= 0", who, static_cast<long long>(head_dim),
                                    static_cast<long long>(num_tokens)));
  }
  if (head_dim > 0 && out == nullptr) return record_error(KVP_INVALID("%s: out is null", who));
  const cudaStream_t stream = as_stream(current_stream());
  std::int64_t nsplit = 0;
  AttnLayout L;
  if (num_tokens > 0) {
    const std::int64_t block = attention_block(keys);
    if (block < 1 || (values.pages != nullptr && values.page_size < 1))
      return record_error(KVP_INVALID("%s: page_size must be >= 1 for paged rows", who));
    if ((head_dim > 0 && q == nullptr) || keys.base == nullptr || values.base == nullptr)
      return record_error(KVP_INVALID("%s: q, keys or values is null", who));
    const Status wst = check_workspace(who, ws, paged_attention_workspace(group, block, head_dim));
    if (!wst.is_ok()) return record_error(wst);
    WorkspaceCarver carver(ws);
    L = attn_layout(carver, group, block, head_dim);

    const std::int64_t nblocks = (num_tokens + block - 1) / block;
    std::int64_t want = (num_tokens + kAttnMinSplitTokens - 1) / kAttnMinSplitTokens;
    want = want < kAttnMaxSplits ? want : kAttnMaxSplits;
    want = want < nblocks ? want : nblocks;
    const std::int64_t bps = (nblocks + want - 1) / want;  // blocks per split
    nsplit = (nblocks + bps - 1) / bps;                    // every split non-empty, nsplit <= want
    const std::int64_t head_chunks = (group + kAttnHeads - 1) / kAttnHeads;
    const std::int64_t tiles = head_dim == 0 ? 1 : (head_dim + kAttnTile - 1) / kAttnTile;
    if (head_chunks > 65535 || tiles > 65535)
      return record_error(Status::error(StatusCode::kUnsupported, "%s: group %lld x head_dim %lld is too large", who,
                                        static_cast<long long>(group), static_cast<long long>(head_dim)));
    const std::size_t smem = sizeof(float) * static_cast<std::size_t>((block <= kAttnSmemBlock ? kAttnHeads * block : 0) +
                                                                      (head_dim <= kAttnSmemDim ? kAttnHeads * head_dim : 0));
    attn_split_kernel<Tk, Tv><<<dim3(static_cast<unsigned>(nsplit), static_cast<unsigned>(head_chunks), static_cast<unsigned>(tiles)),
                                kAttnThreads, smem, stream>>>(q, group, head_dim, keys, values, num_tokens, block, bps, scale, L);
    const Status st = launch_status(who);
    if (!st.is_ok()) return record_error(st);
  }
  attn_merge_kernel<<<static_cast<unsigned>(group), kAttnThreads, 0, stream>>>(L, static_cast<int>(nsplit), group, head_dim, out, lse);
  record_error(launch_status(who));
}

// ---- explicit instantiations ------------------------------------------------------

#define KVP_CUDA_PAGE_META_FOLD(TK, TM)                                                                                     \
  template void Cuda::page_meta_fold<TK, TM>(const TK*, std::int64_t, std::int64_t, std::int64_t, TM*, TM*, bool) noexcept; \
  template void Cuda::page_meta_append<TK, TM>(const TK*, const PageStrides&, std::int32_t, std::int32_t, std::int64_t,     \
                                               const std::int32_t*, std::int64_t, std::int64_t, PageMetaView<TM>) noexcept;
KVP_CUDA_PAGE_META_FOLD(float, float)
KVP_CUDA_PAGE_META_FOLD(half, half)
KVP_CUDA_PAGE_META_FOLD(half, float)
KVP_CUDA_PAGE_META_FOLD(bfloat16, bfloat16)
KVP_CUDA_PAGE_META_FOLD(bfloat16, float)
#undef KVP_CUDA_PAGE_META_FOLD

template void Cuda::page_bounds<float>(const float*, std::int64_t, std::int64_t, PageMetaView<const float>, const std::int32_t*,
                                       std::int64_t, float*, std::int64_t, Workspace) noexcept;
template void Cuda::page_bounds<half>(const float*, std::int64_t, std::int64_t, PageMetaView<const half>, const std::int32_t*, std::int64_t,
                                      float*, std::int64_t, Workspace) noexcept;
template void Cuda::page_bounds<bfloat16>(const float*, std::int64_t, std::int64_t, PageMetaView<const bfloat16>, const std::int32_t*,
                                          std::int64_t, float*, std::int64_t, Workspace) noexcept;

#define KVP_CUDA_PAGED_ATTENTION(TK, TV)                                                                                                \
  template void Cuda::paged_decode_attention<TK, TV>(const float*, std::int64_t, std::int64_t, Rows<TK>, Rows<TV>, std::int64_t, float, \
                                                     float*, float*, Workspace) noexcept;
KVP_CUDA_PAGED_ATTENTION(float, float)
KVP_CUDA_PAGED_ATTENTION(float, half)
KVP_CUDA_PAGED_ATTENTION(float, bfloat16)
KVP_CUDA_PAGED_ATTENTION(half, float)
KVP_CUDA_PAGED_ATTENTION(half, half)
KVP_CUDA_PAGED_ATTENTION(half, bfloat16)
KVP_CUDA_PAGED_ATTENTION(bfloat16, float)
KVP_CUDA_PAGED_ATTENTION(bfloat16, half)
KVP_CUDA_PAGED_ATTENTION(bfloat16, bfloat16)
#undef KVP_CUDA_PAGED_ATTENTION

}  // namespace backend
KVP_NAMESPACE_END
