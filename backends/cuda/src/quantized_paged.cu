// SPDX-License-Identifier: Apache-2.0
// The paged quantized pool's ops (ops/quantized_paged_ops.hpp) on
// backend::Cuda: the code rows gathered from and scattered to a sequence's
// pages (page ids read on the device), Quest's metadata folded from decoded
// rows, and the log-sum-exp merge of chunked decode attention.
//
// Exactness: the copies move the same bytes; the metadata fold is the
// reference's max / min per channel in row order (the same bits); the merge
// rounds every product and sum alone, in the reference's order (this unit is
// compiled with -fmad=false), and its exp / log are CUDA's expf / logf (a few
// ulp from the host's), so merged outputs are within 1e-5 relative of the
// reference.
#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kMergeThreads = 128;

unsigned blocks_for(std::int64_t n) noexcept { return grid_blocks(n, kThreads); }

/// True when every row of the copy starts and ends on a 4-byte boundary, so it moves in words.
bool word_aligned(const std::uint8_t* a, const std::uint8_t* b, const ops::CodePageGeometry& g) noexcept {
  const auto al = [](std::int64_t v) { return v % 4 == 0; };
  return reinterpret_cast<std::uintptr_t>(a) % 4 == 0 && reinterpret_cast<std::uintptr_t>(b) % 4 == 0 && al(g.row_bytes) &&
         al(g.strides.page) && al(g.strides.head) && al(g.strides.slot);
}

/// Item i of (head, row, unit): the unit's byte offset in the pool and in the contiguous buffer.
template <class U>
__global__ void __launch_bounds__(kThreads)
    copy_rows_kernel(const U* __restrict__ src, U* __restrict__ dst, ops::CodePageGeometry geo, const std::int32_t* __restrict__ seq_pages,
                     std::int64_t first, std::int64_t count, bool to_pool) {
  const std::int64_t units = geo.row_bytes / static_cast<std::int64_t>(sizeof(U));
  const std::int64_t items = static_cast<std::int64_t>(geo.num_heads) * count * units;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    const std::int64_t u = i % units, row = i / units;
    const auto h = static_cast<std::int32_t>(row / count);
    const std::int64_t t = first + row % count;
    const std::int64_t pool_at = geo.offset(seq_pages, t, h) / static_cast<std::int64_t>(sizeof(U)) + u;
    if (to_pool)
      dst[pool_at] = src[i];
    else
      dst[i] = src[pool_at];
  }
}

bool copy_args_ok(const char* who, const void* a, const void* b, const std::int32_t* seq_pages, const ops::CodePageGeometry& geo,
                  std::int64_t first, std::int64_t count) noexcept {
  if (geo.page_size < 1 || geo.num_heads < 1 || geo.row_bytes < 1 || first < 0 || count < 0) {
    record_error(
        KVP_INVALID("%s: page_size %d, heads %d, row_bytes %lld, first %lld, count %lld: need positive page_size, heads and "
                    "row bytes, first and count >= 0",
                    who, geo.page_size, geo.num_heads, static_cast<long long>(geo.row_bytes), static_cast<long long>(first),
                    static_cast<long long>(count)));
    return false;
  }
  if (count == 0) return false;  // nothing to do
  if (a == nullptr || b == nullptr || seq_pages == nullptr) {
    record_error(KVP_INVALID("%s: the pool, the buffer or the page list is null", who));
    return false;
  }
  return true;
}

/// Copies between the pool and the contiguous buffer (to_pool: src is the buffer, dst the pool; else the reverse).
void launch_copy(const char* who, const std::uint8_t* src, std::uint8_t* dst, const ops::CodePageGeometry& geo,
                 const std::int32_t* seq_pages, std::int64_t first, std::int64_t count, bool to_pool) noexcept {
  const cudaStream_t st = as_stream(backend::Cuda::current_stream());
  if (word_aligned(src, dst, geo)) {
    const std::int64_t items = static_cast<std::int64_t>(geo.num_heads) * count * (geo.row_bytes / 4);
    copy_rows_kernel<std::uint32_t><<<blocks_for(items), kThreads, 0, st>>>(
        reinterpret_cast<const std::uint32_t*>(src), reinterpret_cast<std::uint32_t*>(dst), geo, seq_pages, first, count, to_pool);
  } else {
    const std::int64_t items = static_cast<std::int64_t>(geo.num_heads) * count * geo.row_bytes;
    copy_rows_kernel<std::uint8_t><<<blocks_for(items), kThreads, 0, st>>>(src, dst, geo, seq_pages, first, count, to_pool);
  }
  record_error(launch_status(who));
}

/// Block (run r, head y): the run's rows folded into the page's max / min rows, a thread per channel.
__global__ void __launch_bounds__(kThreads)
    meta_fold_kernel(const float* __restrict__ rows, std::int64_t d, std::int32_t P, const std::int32_t* __restrict__ seq_pages,
                     std::int64_t first, std::int64_t count, float* max_data, float* min_data, std::int64_t page_stride,
                     std::int64_t head_stride) {
  const std::int64_t r = blockIdx.x;
  const auto h = static_cast<std::int32_t>(blockIdx.y);
  const std::int64_t p0 = first / P, end = first + count;
  const std::int64_t t0 = r == 0 ? first : (p0 + r) * P;
  const std::int64_t t1 = (p0 + r + 1) * P < end ? (p0 + r + 1) * P : end;
  const bool fresh = t0 % P == 0;
  const std::int64_t page = seq_pages[t0 / P];
  float* mx = max_data + page * page_stride + h * head_stride;
  float* mn = min_data + page * page_stride + h * head_stride;
  const float* base = rows + (h * count + (t0 - first)) * d;
  for (std::int64_t c = threadIdx.x; c < d; c += kThreads) {
    float hi = fresh ? neg_inf() : mx[c];
    float lo = fresh ? pos_inf() : mn[c];
    for (std::int64_t t = 0; t < t1 - t0; ++t) {
      const float v = base[t * d + c];
      hi = v > hi ? v : hi;
      lo = v < lo ? v : lo;
    }
    mx[c] = hi;
    mn[c] = lo;
  }
}

/// Block g: query head g's state and the chunk's weights (thread 0), then every channel.
__global__ void __launch_bounds__(kMergeThreads)
    merge_kernel(const float* __restrict__ po, const float* __restrict__ pl, std::int64_t d, bool first, float* out, float* m, float* sum) {
  constexpr int kKeep = 0, kNaN = 1, kUpdate = 2;
  __shared__ int s_mode;
  __shared__ float s_a, s_w;
  const std::int64_t g = blockIdx.x;
  if (threadIdx.x == 0) {
    const float m0 = first ? neg_inf() : m[g], s0 = first ? 0.0f : sum[g], l = pl[g];
    int mode = kKeep;
    float nm = m0, s1 = s0, a = 0.0f, w = 0.0f;
    if (s0 != s0) {
      mode = kKeep;
    } else if (l != l) {
      mode = kNaN;
      s1 = __int_as_float(0x7fc00000);
    } else if (l != neg_inf()) {
      mode = kUpdate;
      nm = l > m0 ? l : m0;
      a = expf(m0 - nm);
      w = expf(l - nm);
      s1 = __fadd_rn(__fmul_rn(s0, a), w);
    }
    m[g] = nm;
    sum[g] = s1;
    s_mode = mode, s_a = a, s_w = w;
  }
  __syncthreads();
  const int mode = s_mode;
  const float a = s_a, w = s_w;
  float* o = out + g * d;
  const float* op = po + g * d;
  for (std::int64_t c = threadIdx.x; c < d; c += kMergeThreads) {
    const float prev = first ? 0.0f : o[c];
    if (mode == kNaN)
      o[c] = __int_as_float(0x7fc00000);
    else if (mode == kUpdate)
      o[c] = __fadd_rn(__fmul_rn(prev, a), __fmul_rn(w, op[c]));
    else if (first)
      o[c] = prev;
  }
}

__global__ void __launch_bounds__(kThreads) finish_kernel(float* out, const float* __restrict__ m, const float* __restrict__ sum,
                                                          std::int64_t group, std::int64_t d, bool empty, float* lse) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < group * d;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    const std::int64_t g = i / d;
    const bool none = empty || sum[g] == 0.0f;
    const float inv = none ? 0.0f : __fdiv_rn(1.0f, sum[g]);
    out[i] = empty ? 0.0f : __fmul_rn(out[i], inv);
    if (lse != nullptr && i % d == 0) lse[g] = none ? neg_inf() : __fadd_rn(m[g], logf(sum[g]));
  }
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

void Cuda::code_rows_gather(const std::uint8_t* pool, const ops::CodePageGeometry& geo, const std::int32_t* seq_pages, std::int64_t first,
                            std::int64_t count, std::uint8_t* dst) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda code_rows_gather";
  if (!copy_args_ok(who, pool, dst, seq_pages, geo, first, count)) return;
  launch_copy(who, pool, dst, geo, seq_pages, first, count, /*to_pool=*/false);
}

void Cuda::code_rows_scatter(const std::uint8_t* src, const ops::CodePageGeometry& geo, const std::int32_t* seq_pages, std::int64_t first,
                             std::int64_t count, std::uint8_t* pool) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda code_rows_scatter";
  if (!copy_args_ok(who, src, pool, seq_pages, geo, first, count)) return;
  launch_copy(who, src, pool, geo, seq_pages, first, count, /*to_pool=*/true);
}

void Cuda::code_page_meta_fold(const float* rows, std::int64_t head_dim, const ops::CodePageGeometry& geo, const std::int32_t* seq_pages,
                               std::int64_t first, std::int64_t count, PageMetaView<float> meta) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda code_page_meta_fold";
  if (geo.page_size < 1 || geo.num_heads < 1 || geo.num_heads > 65535 || head_dim < 1 || first < 0 || count < 0)
    return record_error(KVP_INVALID(
        "%s: page_size %d, heads %d, head_dim %lld, first %lld, count %lld: need positive page_size and "
        "head_dim, 1 to 65535 heads, first and count >= 0",
        who, geo.page_size, geo.num_heads, static_cast<long long>(head_dim), static_cast<long long>(first), static_cast<long long>(count)));
  if (count == 0) return;
  if (rows == nullptr || seq_pages == nullptr || meta.max_data == nullptr || meta.min_data == nullptr)
    return record_error(KVP_INVALID("%s: rows, the page list or the metadata is null", who));
  const std::int64_t runs = (first + count - 1) / geo.page_size - first / geo.page_size + 1;
  if (runs > 2147483647)
    return record_error(
        Status::error(StatusCode::kUnsupported, "%s: %lld page runs, at most 2^31 - 1 per call", who, static_cast<long long>(runs)));
  const dim3 grid(static_cast<unsigned>(runs), static_cast<unsigned>(geo.num_heads));
  meta_fold_kernel<<<grid, kThreads, 0, as_stream(current_stream())>>>(rows, head_dim, geo.page_size, seq_pages, first, count,
                                                                       meta.max_data, meta.min_data, meta.page_stride, meta.head_stride);
  record_error(launch_status(who));
}

void Cuda::lse_merge_chunk(const float* po, const float* pl, std::int64_t group, std::int64_t d, bool first, float* out, float* m,
                           float* sum) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda lse_merge_chunk";
  if (group < 1 || group > 2147483647 || d < 1)
    return record_error(KVP_INVALID("%s: group %lld, d %lld: need 1 <= group < 2^31 and d >= 1", who, static_cast<long long>(group),
                                    static_cast<long long>(d)));
  if (po == nullptr || pl == nullptr || out == nullptr || m == nullptr || sum == nullptr)
    return record_error(KVP_INVALID("%s: a chunk or state buffer is null", who));
  merge_kernel<<<static_cast<unsigned>(group), kMergeThreads, 0, as_stream(current_stream())>>>(po, pl, d, first, out, m, sum);
  record_error(launch_status(who));
}

void Cuda::lse_merge_finish(float* out, const float* m, const float* sum, std::int64_t group, std::int64_t d, bool empty,
                            float* lse) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda lse_merge_finish";
  if (group < 1 || d < 1)
    return record_error(
        KVP_INVALID("%s: group %lld, d %lld: need both >= 1", who, static_cast<long long>(group), static_cast<long long>(d)));
  if (out == nullptr || (!empty && (m == nullptr || sum == nullptr)))
    return record_error(KVP_INVALID("%s: out, or the state where read, is null", who));
  finish_kernel<<<blocks_for(group * d), kThreads, 0, as_stream(current_stream())>>>(out, m, sum, group, d, empty, lse);
  record_error(launch_status(who));
}

}  // namespace backend
KVP_NAMESPACE_END
