// SPDX-License-Identifier: Apache-2.0
// The contract-form ops of `backend::Cuda` (same signatures as
// `backend::Scalar`): the calling thread's current stream and error slot, and
// the small kernels policies need besides window scores and top-k: pooling,
// group reduction, query widening, row gather, index and value fills.
//
// Every kernel reproduces the scalar reference's arithmetic in the same order,
// so results are bit-identical to `backend::Scalar` (pool1d's ascending-order
// window sum included); tests/cuda/test_cuda_policies.cpp checks this.
#include <cmath>
#include <cstdint>
#include <limits>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

thread_local void* tl_stream = nullptr;
thread_local Status tl_error{};

constexpr int kThreads = 256;
constexpr std::int64_t kMaxGridX = 2147483647;

cudaStream_t current() noexcept { return as_stream(tl_stream); }

/// Record `s` in the calling thread's error slot unless an earlier error is there.
void record(const Status& s) noexcept {
  if (!s.is_ok() && tl_error.is_ok()) tl_error = s;
}

void record_launch(const char* who) noexcept { record(launch_status(who)); }

unsigned blocks_for(std::int64_t n) noexcept {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < kMaxGridX ? b : kMaxGridX);
}

// ---- pool1d -----------------------------------------------------------------

/// Row blockIdx.y of (rows, ld) `in` into the same row of `out`.
__global__ void pool1d_kernel(const float* __restrict__ in, std::int64_t n, int kernel, Pooling kind, float* __restrict__ out,
                              std::int64_t ld) {
  in += static_cast<std::int64_t>(blockIdx.y) * ld;
  out += static_cast<std::int64_t>(blockIdx.y) * ld;
  const std::int64_t r = kernel / 2;
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t lo = t - r > 0 ? t - r : 0, hi = t + r < n - 1 ? t + r : n - 1;
    if (kind == Pooling::kAvg) {
      out[t] = __fdiv_rn(detail::ascending_sum(in, lo, hi), static_cast<float>(kernel));  // the reference's own sum
    } else {
      float m = in[lo];
      for (std::int64_t u = lo + 1; u <= hi; ++u) m = (in[u] > m || m != m) ? in[u] : m;
      out[t] = m;
    }
  }
}

__global__ void copy_kernel(const float* __restrict__ in, std::int64_t n, float* __restrict__ out, std::int64_t stride) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i * stride] = in[i];
}

// ---- group_reduce -------------------------------------------------------------

__global__ void group_reduce_kernel(const float* __restrict__ in, std::int64_t group, std::int64_t n, std::int64_t ld, GroupReduce kind,
                                    float* __restrict__ out) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float acc = in[j];
    for (std::int64_t g = 1; g < group; ++g) {
      const float v = in[g * ld + j];
      acc = kind == GroupReduce::kMax ? ((v > acc || acc != acc) ? v : acc) : __fadd_rn(acc, v);
    }
    out[j] = kind == GroupReduce::kMean ? __fdiv_rn(acc, static_cast<float>(group)) : acc;
  }
}

// ---- widen_queries / gather / fills ---------------------------------------------

template <class Tq>
__global__ void widen_kernel(const Tq* __restrict__ q, std::int64_t s0, std::int64_t s1, std::int64_t s2, std::int64_t h0,
                             std::int64_t rows, std::int64_t i0, std::int64_t d, std::int64_t total, float* __restrict__ dst) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t k = e % d, gi = e / d, i = gi % rows, g = gi / rows;
    dst[e] = load_f32(q + (h0 + g) * s0 + (i0 + i) * s1 + k * s2);
  }
}

template <class T>
__global__ void gather_kernel(Rows<T> src, const std::int32_t* __restrict__ idx, std::int64_t n, std::int64_t dim, T* __restrict__ dst,
                              std::int64_t dst_stride) {
  const std::int64_t total = n * dim;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / dim, c = e % dim;
    dst[r * dst_stride + c] = src.row(idx[r])[c];
  }
}

__global__ void iota_kernel(std::int32_t* __restrict__ dst, std::int64_t first, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = static_cast<std::int32_t>(first + i);
}

__global__ void fill_kernel(float* __restrict__ dst, std::int64_t n, std::int64_t stride, float value) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i * stride] = value;
}

template <class Tq>
void widen_impl(const TensorView<const Tq, 3>& q, std::int64_t h0, std::int64_t group, std::int64_t i0, std::int64_t rows,
                float* dst) noexcept {
  const std::int64_t d = q.extent(2), total = group * rows * d;
  if (total <= 0) return;
  if (q.data() == nullptr || dst == nullptr) return record(KVP_INVALID("cuda widen_queries: queries or dst is null"));
  widen_kernel<Tq>
      <<<blocks_for(total), kThreads, 0, current()>>>(q.data(), q.stride(0), q.stride(1), q.stride(2), h0, rows, i0, d, total, dst);
  record_launch("cuda widen_queries");
}

template <class T>
void gather_impl(Rows<T> src, const std::int32_t* idx, std::int64_t n, std::int64_t dim, T* dst, std::int64_t dst_stride) noexcept {
  if (n <= 0 || dim <= 0) return;
  if (src.base == nullptr || idx == nullptr || dst == nullptr) return record(KVP_INVALID("cuda gather_rows: src, idx or dst is null"));
  gather_kernel<T><<<blocks_for(n * dim), kThreads, 0, current()>>>(src, idx, n, dim, dst, dst_stride);
  record_launch("cuda gather_rows");
}

// ---- row edits of the online policies -------------------------------------------

__global__ void add_rows_kernel(float* __restrict__ dst, const float* __restrict__ src, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __fadd_rn(dst[i], src[i]);
}

constexpr int kEvictThreads = 1024;

/// One block: the lowest (order key, slot) of row[0..cand), then the kept ids,
/// then the tail shifted down one slot in ascending chunks (each chunk reads
/// before any thread writes, and writes only below what later chunks read).
__global__ void __launch_bounds__(kEvictThreads)
    evict_lowest_kernel(float* __restrict__ row, std::int64_t cand, std::int64_t n, std::int32_t* __restrict__ ids) {
  __shared__ unsigned long long best[kEvictThreads / 32];
  unsigned long long mine = ~0ull;
  for (std::int64_t j = threadIdx.x; j < cand; j += blockDim.x) {
    const unsigned long long key = (static_cast<unsigned long long>(score_order_key(row[j])) << 32) | static_cast<unsigned long long>(j);
    mine = key < mine ? key : mine;
  }
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned long long other = __shfl_down_sync(0xffffffffu, mine, off);
    mine = other < mine ? other : mine;
  }
  if ((threadIdx.x & 31) == 0) best[threadIdx.x / 32] = mine;
  __syncthreads();
  if (threadIdx.x < 32) {
    mine = threadIdx.x < blockDim.x / 32 ? best[threadIdx.x] : ~0ull;
    for (int off = 16; off > 0; off >>= 1) {
      const unsigned long long other = __shfl_down_sync(0xffffffffu, mine, off);
      mine = other < mine ? other : mine;
    }
    if (threadIdx.x == 0) best[0] = mine;
  }
  __syncthreads();
  const std::int64_t x = static_cast<std::int64_t>(best[0] & 0xffffffffull);
  for (std::int64_t r = threadIdx.x; r < n - 1; r += blockDim.x) ids[r] = static_cast<std::int32_t>(r < x ? r : r + 1);
  for (std::int64_t base = x; base < n - 1; base += blockDim.x) {
    const std::int64_t r = base + threadIdx.x;
    const float v = r < n - 1 ? row[r + 1] : 0.0f;
    __syncthreads();
    if (r < n - 1) row[r] = v;
    __syncthreads();
  }
}

__global__ void divide_by_tail_kernel(float* __restrict__ s, std::int64_t n) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    s[j] = __fdiv_rn(s[j], static_cast<float>(n - j));
}

__global__ void copy_ids_kernel(const std::int32_t* __restrict__ src, std::int64_t n, std::int32_t* __restrict__ dst) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

__global__ void gather_ids_kernel(const std::int32_t* __restrict__ table, const std::int32_t* __restrict__ sel, std::int64_t n,
                                  std::int32_t* __restrict__ dst) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = table[sel != nullptr ? sel[i] : i];
}

__global__ void gather_page_rows_kernel(const std::int32_t* __restrict__ pages, const std::int32_t* __restrict__ sel, std::int64_t sel_ld,
                                        std::int64_t rows, std::int64_t k, std::int64_t last, std::int32_t* __restrict__ dst,
                                        std::int32_t* __restrict__ logical, std::int64_t dst_ld) {
  const std::int64_t width = k + (last >= 0 ? 1 : 0), total = rows * width;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / width, i = e % width;
    const std::int64_t s = i == k ? last : (sel != nullptr ? sel[r * sel_ld + i] : i);
    dst[r * dst_ld + i] = pages[s];
    if (logical != nullptr) logical[r * dst_ld + i] = static_cast<std::int32_t>(s);
  }
}

__global__ void iota_rows_kernel(std::int32_t* __restrict__ dst, std::int64_t dst_ld, std::int64_t rows, std::int64_t first,
                                 std::int64_t n) {
  const std::int64_t total = rows * n;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[(e / n) * dst_ld + e % n] = static_cast<std::int32_t>(first + e % n);
}

__global__ void gather_floats_kernel(const float* __restrict__ row, const std::int32_t* __restrict__ ids, std::int64_t keep,
                                     float* __restrict__ tmp) {
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; r < keep;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    tmp[r] = row[ids[r]];
}

/// `ScalarReduceOps::accumulate_column_sums`, one column per thread, adds in the reference's order.
template <class Tp>
__global__ void column_sums_kernel(float* __restrict__ state, std::int64_t len_prev, const Tp* __restrict__ p, std::int64_t s0,
                                   std::int64_t s1, std::int64_t rows, std::int64_t n, std::int64_t h0, std::int64_t G, bool mean) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float r = 0.0f;
    for (std::int64_t g = 0; g < G; ++g) {
      const Tp* src = p + (h0 + g) * s0 + j;
      if (g > 0 && rows == 1) {
        r = __fadd_rn(r, load_f32(src));
        continue;
      }
      float acc = load_f32(src);
      for (std::int64_t i = 1; i < rows; ++i) acc = __fadd_rn(acc, load_f32(src + i * s1));
      r = g == 0 ? acc : __fadd_rn(r, acc);
    }
    if (mean) r = __fdiv_rn(r, static_cast<float>(G));
    state[j] = j < len_prev ? __fadd_rn(state[j], r) : r;
  }
}

/// `ScalarReduceOps::mean_rows`: heads added in ascending order, then / H.
template <class Tp>
__global__ void mean_rows_kernel(const Tp* __restrict__ base, std::int64_t H, std::int64_t n, std::int64_t s0, std::int64_t st,
                                 float* __restrict__ mean) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float m = load_f32(base + j * st);
    for (std::int64_t h = 1; h < H; ++h) m = __fadd_rn(m, load_f32(base + h * s0 + j * st));
    mean[j] = __fdiv_rn(m, static_cast<float>(H));
  }
}

template <class T>
__global__ void neg_row_norms_kernel(Rows<T> rows, std::int64_t n, std::int64_t d, float* __restrict__ out, std::int64_t stride) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const T* r = rows.row(j);
    double ss = 0.0;
    for (std::int64_t i = 0; i < d; ++i) {
      const double x = load_f32(r + i);
      ss = __dadd_rn(ss, __dmul_rn(x, x));
    }
    out[j * stride] = -static_cast<float>(sqrt(ss));
  }
}

template <class T>
void neg_row_norms_impl(const Rows<T>& rows, std::int64_t n, std::int64_t d, float* out, std::int64_t stride) noexcept {
  if (n <= 0) return;
  if (rows.base == nullptr || out == nullptr) return record(KVP_INVALID("cuda neg_row_norms: rows or out is null"));
  neg_row_norms_kernel<T><<<blocks_for(n), kThreads, 0, current()>>>(rows, n, d, out, stride);
  record_launch("cuda neg_row_norms");
}

template <class Tp>
void column_sums_impl(float* state, std::int64_t len_prev, const TensorView<const Tp, 3>& p, std::int64_t h0, std::int64_t G,
                      bool mean_over_group) noexcept {
  const std::int64_t n = p.extent(2);
  if (n <= 0) return;
  if (state == nullptr || p.data() == nullptr) return record(KVP_INVALID("cuda accumulate_column_sums: state or p is null"));
  column_sums_kernel<Tp><<<blocks_for(n), kThreads, 0, current()>>>(state, len_prev, p.data(), p.stride(0), p.stride(1), p.extent(1), n, h0,
                                                                    G, mean_over_group && G > 1);
  record_launch("cuda accumulate_column_sums");
}

template <class Tp>
void mean_rows_impl(const TensorView<const Tp, 2>& rows, float* mean) noexcept {
  const std::int64_t H = rows.extent(0), n = rows.extent(1);
  if (n <= 0 || H <= 0) return;
  if (rows.data() == nullptr || mean == nullptr) return record(KVP_INVALID("cuda mean_rows: rows or mean is null"));
  mean_rows_kernel<Tp><<<blocks_for(n), kThreads, 0, current()>>>(rows.data(), H, n, rows.stride(0), rows.stride(1), mean);
  record_launch("cuda mean_rows");
}
}  // namespace

void record_error(const Status& s) noexcept { record(s); }

}  // namespace cuda_detail

namespace backend {

void* Cuda::current_stream() noexcept { return cuda_detail::tl_stream; }

Cuda::CallScope::CallScope(void* stream, int workers) noexcept
    : previous_stream_(cuda_detail::tl_stream), previous_error_(cuda_detail::tl_error), workers_(workers) {
  cuda_detail::tl_stream = stream;
  cuda_detail::tl_error = Status::ok();
}

Cuda::CallScope::~CallScope() {
  cuda_detail::tl_stream = previous_stream_;
  if (!previous_error_.is_ok()) cuda_detail::tl_error = previous_error_;
}

Status Cuda::CallScope::begin() const noexcept {
  if (workers_ > 1) {
    return Status::error(StatusCode::kUnsupported,
                         "cuda: the context's ExecContext has %d workers; device ops enqueue from the calling thread, use 1", workers_);
  }
  return Status::ok();
}

Status Cuda::CallScope::end() const noexcept { return cuda_detail::tl_error; }

void Cuda::window_scores(const WindowScoreShape& s, const float* q, Rows<float> keys, float* out, Workspace ws) noexcept {
  cuda_detail::record(window_scores(s, q, keys, out, ws, cuda_detail::tl_stream));
}
void Cuda::window_scores(const WindowScoreShape& s, const float* q, Rows<half> keys, float* out, Workspace ws) noexcept {
  cuda_detail::record(window_scores(s, q, keys, out, ws, cuda_detail::tl_stream));
}
void Cuda::window_scores(const WindowScoreShape& s, const float* q, Rows<bfloat16> keys, float* out, Workspace ws) noexcept {
  cuda_detail::record(window_scores(s, q, keys, out, ws, cuda_detail::tl_stream));
}

void Cuda::pool1d(const float* in, std::int64_t n, int kernel, Pooling kind, float* out) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (in == nullptr || out == nullptr) return record(KVP_INVALID("cuda pool1d: in or out is null"));
  if (kind == Pooling::kNone || kernel <= 1) {
    if (in != out) {
      copy_kernel<<<blocks_for(n), kThreads, 0, current()>>>(in, n, out, 1);
      record_launch("cuda pool1d");
    }
    return;
  }
  if (kernel % 2 == 0) return record(KVP_INVALID("cuda pool1d: kernel is %d, must be odd", kernel));
  pool1d_kernel<<<blocks_for(n), kThreads, 0, current()>>>(in, n, kernel, kind, out, 0);
  record_launch("cuda pool1d");
}

void Cuda::pool1d_rows(const float* in, std::int64_t rows, std::int64_t n, std::int64_t ld, int kernel, Pooling kind, float* out) noexcept {
  using namespace cuda_detail;
  if (rows < 0) return record(KVP_INVALID("cuda pool1d_rows: rows=%lld, must be >= 0", static_cast<long long>(rows)));
  if (rows == 0 || n <= 0) return;  // n <= 0: nothing, as `pool1d`
  if (in == nullptr || out == nullptr) return record(KVP_INVALID("cuda pool1d_rows: in or out is null"));
  if (rows > 1 && ld < n)
    return record(KVP_INVALID("cuda pool1d_rows: ld %lld < n %lld", static_cast<long long>(ld), static_cast<long long>(n)));
  if (rows > 65535)
    return record(Status::error(StatusCode::kUnsupported, "cuda pool1d_rows: %lld rows, at most 65535", static_cast<long long>(rows)));
  if (kind == Pooling::kNone || kernel <= 1) {
    if (in != out)
      for (std::int64_t r = 0; r < rows; ++r) pool1d(in + r * ld, n, kernel, kind, out + r * ld);
    return;
  }
  if (kernel % 2 == 0) return record(KVP_INVALID("cuda pool1d_rows: kernel is %d, must be odd", kernel));
  pool1d_kernel<<<dim3(blocks_for(n), static_cast<unsigned>(rows)), kThreads, 0, current()>>>(in, n, kernel, kind, out, ld);
  record_launch("cuda pool1d_rows");
}

void Cuda::group_reduce(const float* in, std::int64_t group, std::int64_t n, std::int64_t ld, GroupReduce kind, float* out) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (in == nullptr || out == nullptr) return record(KVP_INVALID("cuda group_reduce: in or out is null"));
  if (group < 1) return record(KVP_INVALID("cuda group_reduce: group is %lld, must be >= 1", static_cast<long long>(group)));
  group_reduce_kernel<<<blocks_for(n), kThreads, 0, current()>>>(in, group, n, ld, kind, out);
  record_launch("cuda group_reduce");
}

void Cuda::topk(const float* scores, std::int64_t n, std::int64_t k, std::int32_t* out, Workspace ws) noexcept {
  cuda_detail::record(topk(scores, n, k, out, ws, cuda_detail::tl_stream));
}

void Cuda::gather_rows(Rows<float> src, const std::int32_t* idx, std::int64_t n, std::int64_t dim, float* dst, std::int64_t ld) noexcept {
  cuda_detail::gather_impl(src, idx, n, dim, dst, ld);
}
void Cuda::gather_rows(Rows<half> src, const std::int32_t* idx, std::int64_t n, std::int64_t dim, half* dst, std::int64_t ld) noexcept {
  cuda_detail::gather_impl(src, idx, n, dim, dst, ld);
}
void Cuda::gather_rows(Rows<bfloat16> src, const std::int32_t* idx, std::int64_t n, std::int64_t dim, bfloat16* dst,
                       std::int64_t ld) noexcept {
  cuda_detail::gather_impl(src, idx, n, dim, dst, ld);
}

void Cuda::widen_queries(const TensorView<const float, 3>& q, std::int64_t h0, std::int64_t group, std::int64_t i0, std::int64_t rows,
                         float* dst) noexcept {
  cuda_detail::widen_impl(q, h0, group, i0, rows, dst);
}
void Cuda::widen_queries(const TensorView<const half, 3>& q, std::int64_t h0, std::int64_t group, std::int64_t i0, std::int64_t rows,
                         float* dst) noexcept {
  cuda_detail::widen_impl(q, h0, group, i0, rows, dst);
}
void Cuda::widen_queries(const TensorView<const bfloat16, 3>& q, std::int64_t h0, std::int64_t group, std::int64_t i0, std::int64_t rows,
                         float* dst) noexcept {
  cuda_detail::widen_impl(q, h0, group, i0, rows, dst);
}

void Cuda::iota(std::int32_t* dst, std::int64_t first, std::int64_t n) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (dst == nullptr) return record(KVP_INVALID("cuda iota: dst is null"));
  iota_kernel<<<blocks_for(n), kThreads, 0, current()>>>(dst, first, n);
  record_launch("cuda iota");
}

void Cuda::fill(float* dst, std::int64_t n, std::int64_t dst_stride, float value) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (dst == nullptr) return record(KVP_INVALID("cuda fill: dst is null"));
  fill_kernel<<<blocks_for(n), kThreads, 0, current()>>>(dst, n, dst_stride, value);
  record_launch("cuda fill");
}

void Cuda::copy_strided(const float* src, std::int64_t n, float* dst, std::int64_t dst_stride) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (src == nullptr || dst == nullptr) return record(KVP_INVALID("cuda copy_strided: src or dst is null"));
  copy_kernel<<<blocks_for(n), kThreads, 0, current()>>>(src, n, dst, dst_stride);
  record_launch("cuda copy_strided");
}

void Cuda::add_rows(float* dst, const float* src, std::int64_t n) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (dst == nullptr || src == nullptr) return record(KVP_INVALID("cuda add_rows: dst or src is null"));
  add_rows_kernel<<<blocks_for(n), kThreads, 0, current()>>>(dst, src, n);
  record_launch("cuda add_rows");
}

void Cuda::divide_by_tail(float* s, std::int64_t n) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (s == nullptr) return record(KVP_INVALID("cuda divide_by_tail: s is null"));
  divide_by_tail_kernel<<<blocks_for(n), kThreads, 0, current()>>>(s, n);
  record_launch("cuda divide_by_tail");
}

void Cuda::gather_ids(const std::int32_t* table, const std::int32_t* sel, std::int64_t n, std::int32_t* dst) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (table == nullptr || dst == nullptr) return record(KVP_INVALID("cuda gather_ids: table or dst is null"));
  gather_ids_kernel<<<blocks_for(n), kThreads, 0, current()>>>(table, sel, n, dst);
  record_launch("cuda gather_ids");
}

void Cuda::topk_rows_strided(const float* scores, std::int64_t ld, std::int64_t rows, std::int64_t n, std::int64_t k, std::int32_t* out,
                             std::int64_t out_ld, Workspace ws) noexcept {
  // topk_rows checks rows, n, k and the strides first, and enqueues nothing for empty work.
  cuda_detail::record(topk_rows(scores, rows, n, ld, k, out, out_ld, ws, cuda_detail::tl_stream));
}

void Cuda::gather_page_rows(const std::int32_t* pages, const std::int32_t* sel, std::int64_t sel_ld, std::int64_t rows, std::int64_t k,
                            std::int64_t last, std::int32_t* dst, std::int32_t* logical, std::int64_t dst_ld) noexcept {
  using namespace cuda_detail;
  if (rows < 0 || k < 0)
    return record(
        KVP_INVALID("cuda gather_page_rows: rows=%lld, k=%lld, must be >= 0", static_cast<long long>(rows), static_cast<long long>(k)));
  const std::int64_t width = k + (last >= 0 ? 1 : 0);
  if (rows == 0 || width == 0) return;
  if (pages == nullptr || dst == nullptr) return record(KVP_INVALID("cuda gather_page_rows: pages or dst is null"));
  if ((rows > 1 && dst_ld < width) || (sel != nullptr && rows > 1 && sel_ld < k))
    return record(KVP_INVALID("cuda gather_page_rows: k=%lld, dst_ld=%lld, sel_ld=%lld: rows would overlap", static_cast<long long>(k),
                              static_cast<long long>(dst_ld), static_cast<long long>(sel_ld)));
  gather_page_rows_kernel<<<blocks_for(rows * width), kThreads, 0, current()>>>(pages, sel, sel_ld, rows, k, last, dst, logical, dst_ld);
  record_launch("cuda gather_page_rows");
}

void Cuda::iota_rows(std::int32_t* dst, std::int64_t dst_ld, std::int64_t rows, std::int64_t first, std::int64_t n) noexcept {
  using namespace cuda_detail;
  if (rows < 0) return record(KVP_INVALID("cuda iota_rows: rows=%lld, must be >= 0", static_cast<long long>(rows)));
  if (rows == 0 || n <= 0) return;  // n <= 0: nothing, as `iota`
  if (dst == nullptr) return record(KVP_INVALID("cuda iota_rows: dst is null"));
  if (rows > 1 && dst_ld < n)
    return record(KVP_INVALID("cuda iota_rows: dst_ld %lld < n %lld", static_cast<long long>(dst_ld), static_cast<long long>(n)));
  iota_rows_kernel<<<blocks_for(rows * n), kThreads, 0, current()>>>(dst, dst_ld, rows, first, n);
  record_launch("cuda iota_rows");
}

void Cuda::copy_ids(const std::int32_t* src, std::int64_t n, std::int32_t* dst) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (src == nullptr || dst == nullptr) return record(KVP_INVALID("cuda copy_ids: src or dst is null"));
  copy_ids_kernel<<<blocks_for(n), kThreads, 0, current()>>>(src, n, dst);
  record_launch("cuda copy_ids");
}

void Cuda::evict_lowest(float* row, std::int64_t cand, std::int64_t n, std::int32_t* ids) noexcept {
  using namespace cuda_detail;
  if (n <= 0) return;
  if (row == nullptr || ids == nullptr) return record(KVP_INVALID("cuda evict_lowest: row or ids is null"));
  if (cand < 1 || cand > n || n > 2147483647) {
    return record(
        KVP_INVALID("cuda evict_lowest: cand %lld out of range [1, n=%lld]", static_cast<long long>(cand), static_cast<long long>(n)));
  }
  evict_lowest_kernel<<<1, kEvictThreads, 0, current()>>>(row, cand, n, ids);
  record_launch("cuda evict_lowest");
}

std::size_t Cuda::compact_row_workspace(std::int64_t keep) noexcept {
  return WorkspacePlan{}.add<float>(static_cast<std::size_t>(keep > 0 ? keep : 0)).total();
}

void Cuda::compact_row(float* row, const std::int32_t* ids, std::int64_t keep, Workspace ws) noexcept {
  using namespace cuda_detail;
  if (keep <= 0) return;
  if (row == nullptr || ids == nullptr) return record(KVP_INVALID("cuda compact_row: row or ids is null"));
  WorkspaceCarver carve(ws);
  float* tmp = carve.take<float>(static_cast<std::size_t>(keep));
  if (tmp == nullptr)
    return record(Status::error(StatusCode::kWorkspaceTooSmall, "cuda compact_row: workspace holds fewer than %lld floats",
                                static_cast<long long>(keep)));
  gather_floats_kernel<<<blocks_for(keep), kThreads, 0, current()>>>(row, ids, keep, tmp);
  copy_kernel<<<blocks_for(keep), kThreads, 0, current()>>>(tmp, keep, row, 1);
  record_launch("cuda compact_row");
}

void Cuda::accumulate_column_sums(float* state, std::int64_t len_prev, const TensorView<const float, 3>& p, std::int64_t h0, std::int64_t G,
                                  bool mean_over_group) noexcept {
  cuda_detail::column_sums_impl(state, len_prev, p, h0, G, mean_over_group);
}
void Cuda::accumulate_column_sums(float* state, std::int64_t len_prev, const TensorView<const half, 3>& p, std::int64_t h0, std::int64_t G,
                                  bool mean_over_group) noexcept {
  cuda_detail::column_sums_impl(state, len_prev, p, h0, G, mean_over_group);
}
void Cuda::accumulate_column_sums(float* state, std::int64_t len_prev, const TensorView<const bfloat16, 3>& p, std::int64_t h0,
                                  std::int64_t G, bool mean_over_group) noexcept {
  cuda_detail::column_sums_impl(state, len_prev, p, h0, G, mean_over_group);
}

void Cuda::neg_row_norms(const Rows<float>& rows, std::int64_t n, std::int64_t d, float* out, std::int64_t stride) noexcept {
  cuda_detail::neg_row_norms_impl(rows, n, d, out, stride);
}
void Cuda::neg_row_norms(const Rows<half>& rows, std::int64_t n, std::int64_t d, float* out, std::int64_t stride) noexcept {
  cuda_detail::neg_row_norms_impl(rows, n, d, out, stride);
}
void Cuda::neg_row_norms(const Rows<bfloat16>& rows, std::int64_t n, std::int64_t d, float* out, std::int64_t stride) noexcept {
  cuda_detail::neg_row_norms_impl(rows, n, d, out, stride);
}

void Cuda::mean_rows(const TensorView<const float, 2> rows, float* mean) noexcept { cuda_detail::mean_rows_impl(rows, mean); }
void Cuda::mean_rows(const TensorView<const half, 2> rows, float* mean) noexcept { cuda_detail::mean_rows_impl(rows, mean); }
void Cuda::mean_rows(const TensorView<const bfloat16, 2> rows, float* mean) noexcept { cuda_detail::mean_rows_impl(rows, mean); }

}  // namespace backend
KVP_NAMESPACE_END
