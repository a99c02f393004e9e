// SPDX-License-Identifier: Apache-2.0
// InfiniGen's loops on device memory (ops/infinigen_ops.hpp: semantics and
// the host reference). Every product and sum is rounded as the host rounds it
// (no FMA contraction) in the host's order, the counts are integers and the
// selection compares exact (order key, token) composites, so every output is
// the host's bit for bit. The fold, the skewed queries and the logits are a
// thread per output element; the counts a block per row (max, then count);
// the selection a block per row (the call's k from the counts, then an 8-pass
// radix select of the row's k-th best composite) and a thread per table entry
// raising its selected tokens in the host's order (rows, then tokens). No
// allocation, no synchronisation: every launch goes on the calling thread's
// current stream.
#include <cub/block/block_reduce.cuh>

#include <cstdint>

#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t n) noexcept { return grid_blocks(n, kThreads); }

__device__ __forceinline__ unsigned long long composite(float s, std::int64_t t) {
  return (static_cast<unsigned long long>(score_order_key(s)) << 32) | static_cast<unsigned long long>(t);
}

template <class Tk>
__global__ void fold_kernel(const Tk* __restrict__ k, PageStrides ks, const std::int32_t* __restrict__ seq_pages,
                            ops::PartialKeyGeometry geo, const float* __restrict__ skew, const std::int32_t* __restrict__ channels,
                            std::int64_t first, std::int64_t count, float* __restrict__ partial_keys) {
  const std::int64_t d = geo.head_dim, r = geo.partial_dim, per_token = r * geo.num_kv_heads;
  for (std::int64_t w = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; w < count * per_token;
       w += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = first + w / per_token, rem = w % per_token;
    const auto g = static_cast<std::int32_t>(rem / r);
    const std::int64_t j = rem % r;
    const std::int64_t page = seq_pages[t / geo.page_size], slot = t % geo.page_size;
    const Tk* kr = k + page * ks.page + g * ks.head + slot * ks.slot;
    const float* A = skew + g * d * d;
    const std::int32_t c = channels[g * r + j];
    float v = 0.0f;
    for (std::int64_t i = 0; i < d; ++i) v = __fadd_rn(v, __fmul_rn(load_f32(kr + i), A[i * d + c]));
    partial_keys[geo.offset(seq_pages, t, g) + j] = v;
  }
}

template <class Tq>
__global__ void skewed_query_kernel(const Tq* __restrict__ q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale,
                                    const float* __restrict__ skew, const std::int32_t* __restrict__ channels, ops::PartialKeyGeometry geo,
                                    float* __restrict__ qt) {
  const std::int64_t d = geo.head_dim, r = geo.partial_dim, Hq = static_cast<std::int64_t>(geo.num_kv_heads) * G;
  for (std::int64_t w = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; w < Hq * r;
       w += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t h = w / r, c = w % r;
    const auto g = static_cast<std::int32_t>(h / G);
    const float* A = skew + g * d * d;
    const std::int32_t ch = channels[g * r + c];
    const Tq* qh = q + h * qhs;
    float v = 0.0f;
    for (std::int64_t i = 0; i < d; ++i) v = __fadd_rn(v, __fmul_rn(load_f32(qh + i * qds), A[i * d + ch]));
    qt[w] = __fmul_rn(v, scale);
  }
}

__global__ void logits_kernel(const float* __restrict__ qt, std::int32_t G, const float* __restrict__ partial_keys,
                              const std::int32_t* __restrict__ seq_pages, ops::PartialKeyGeometry geo, std::int64_t n,
                              float* __restrict__ out, std::int64_t ld) {
  const std::int64_t r = geo.partial_dim, Hq = static_cast<std::int64_t>(geo.num_kv_heads) * G;
  for (std::int64_t w = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; w < Hq * n;
       w += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t h = w / n, t = w % n;
    const float* qv = qt + h * r;
    const float* kp = partial_keys + geo.offset(seq_pages, t, static_cast<std::int32_t>(h / G));
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::int64_t i = 0;
    for (; i + 8 <= r; i += 8)
#pragma unroll
      for (int l = 0; l < 8; ++l) acc[l] = __fadd_rn(acc[l], __fmul_rn(qv[i + l], kp[i + l]));
    float s = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), __fadd_rn(acc[2], acc[3])),
                        __fadd_rn(__fadd_rn(acc[4], acc[5]), __fadd_rn(acc[6], acc[7])));
    for (; i < r; ++i) s = __fadd_rn(s, __fmul_rn(qv[i], kp[i]));
    out[h * ld + t] = s;
  }
}

struct MaxAsHost {  // std::max(a, b): b when a < b (rows start at -inf, NaN entries are skipped)
  __device__ __forceinline__ float operator()(float a, float b) const { return a < b ? b : a; }
};

__global__ void __launch_bounds__(kThreads)
    counts_kernel(const float* __restrict__ scores, std::int64_t n, std::int64_t ld, float alpha, std::int64_t* __restrict__ out) {
  using MaxReduce = cub::BlockReduce<float, kThreads>;
  using CountReduce = cub::BlockReduce<long long, kThreads>;
  __shared__ union {
    typename MaxReduce::TempStorage mx;
    typename CountReduce::TempStorage count;
  } tmp;
  __shared__ float s_max;
  const float* row = scores + blockIdx.x * ld;
  float m = neg_inf();
  for (std::int64_t t = threadIdx.x; t < n; t += blockDim.x) m = m < row[t] ? row[t] : m;
  m = MaxReduce(tmp.mx).Reduce(m, MaxAsHost{});
  if (threadIdx.x == 0) s_max = m;
  __syncthreads();
  const float bar = __fsub_rn(s_max, alpha);
  long long c = 0;
  for (std::int64_t t = threadIdx.x; t < n; t += blockDim.x) c += row[t] > bar ? 1 : 0;
  c = CountReduce(tmp.count).Sum(c);
  if (threadIdx.x == 0) out[blockIdx.x] = c;
}

/// Row blockIdx.x's k-th best (key, token) composite, k = min(the call's k, n); ~0 when k is 0.
__global__ void __launch_bounds__(kThreads)
    threshold_kernel(const float* __restrict__ scores, std::int64_t n, std::int64_t ld, const std::int64_t* __restrict__ counts,
                     std::int64_t count_rows, std::int64_t max_num_kv, unsigned long long* __restrict__ thr) {
  __shared__ unsigned int hist[256];
  __shared__ unsigned long long s_prefix, s_mask;
  __shared__ long long s_remaining;
  const float* row = scores + blockIdx.x * ld;
  if (threadIdx.x == 0) {
    long long total = 0;
    for (std::int64_t i = 0; i < count_rows; ++i) total += counts[i];
    long long k = count_rows == 0 ? 0 : total / count_rows;
    k = k < max_num_kv ? k : max_num_kv;
    s_remaining = k < n ? k : n;
    s_prefix = 0;
    s_mask = 0;
  }
  __syncthreads();
  if (s_remaining <= 0) {
    if (threadIdx.x == 0) thr[blockIdx.x] = ~0ull;
    return;
  }
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const unsigned long long prefix = s_prefix, mask = s_mask;
    for (std::int64_t t = threadIdx.x; t < n; t += blockDim.x) {
      const unsigned long long key = composite(row[t], t);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      long long rem = s_remaining;
      for (int dd = 255; dd >= 0; --dd) {
        const long long c = hist[dd];
        if (rem <= c) {
          s_prefix = prefix | (static_cast<unsigned long long>(dd) << shift);
          s_mask = mask | (0xffull << shift);
          s_remaining = rem;
          break;
        }
        rem -= c;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) thr[blockIdx.x] = s_prefix;  // keys are distinct (the token), so exactly one matches every digit
}

__global__ void raise_kernel(const float* __restrict__ scores, std::int64_t rows, std::int64_t n, std::int64_t ld,
                             const unsigned long long* __restrict__ thr, std::int32_t page_size, float* __restrict__ prio) {
  const std::int64_t entries = (n + page_size - 1) / page_size;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < entries;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float cur = prio[e];
    const std::int64_t lo = e * page_size, hi = lo + page_size < n ? lo + page_size : n;
    for (std::int64_t h = 0; h < rows; ++h) {
      const unsigned long long th = thr[h];
      if (th == ~0ull) continue;
      const float* row = scores + h * ld;
      for (std::int64_t t = lo; t < hi; ++t)
        if (composite(row[t], t) >= th) {
          float v = row[t];
          if (v != v) v = neg_inf();  // prefetch_detail::raise
          if (cur != cur || v > cur) cur = v;
        }
    }
    prio[e] = cur;
  }
}

Status check_geometry(const char* who, const ops::PartialKeyGeometry& geo) noexcept {
  KVP_REQUIRE(geo.page_size >= 1 && geo.num_kv_heads >= 1 && geo.head_dim >= 1 && geo.partial_dim >= 1 && geo.partial_dim <= geo.head_dim,
              "%s: geometry (page_size %d, kv heads %d, head_dim %d, partial_dim %d): need positive sizes and partial_dim <= head_dim", who,
              geo.page_size, geo.num_kv_heads, geo.head_dim, geo.partial_dim);
  return Status::ok();
}

template <class Tk>
void launch_fold(const Tk* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::PartialKeyGeometry& geo, const float* skew,
                 const std::int32_t* channels, std::int64_t first, std::int64_t count, float* partial_keys) noexcept {
  constexpr const char* who = "cuda infinigen_fold";
  if (Status s = check_geometry(who, geo); !s.is_ok()) return record_error(s);
  if (first < 0 || count < 0)
    return record_error(
        KVP_INVALID("%s: first %lld and count %lld must be >= 0", who, static_cast<long long>(first), static_cast<long long>(count)));
  if (count == 0) return;
  if (k == nullptr || seq_pages == nullptr || skew == nullptr || channels == nullptr || partial_keys == nullptr)
    return record_error(KVP_INVALID("%s: keys, seq_pages, skew, channels or partial_keys is null", who));
  const std::int64_t work = count * geo.num_kv_heads * geo.partial_dim;
  fold_kernel<<<blocks_for(work), kThreads, 0, as_stream(backend::Cuda::current_stream())>>>(k, ks, seq_pages, geo, skew, channels, first,
                                                                                             count, partial_keys);
  record_error(launch_status(who));
}

template <class Tq>
void launch_scores(const Tq* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const float* skew,
                   const std::int32_t* channels, const float* partial_keys, const std::int32_t* seq_pages,
                   const ops::PartialKeyGeometry& geo, std::int64_t n, float* qt, float* out, std::int64_t ld) noexcept {
  constexpr const char* who = "cuda infinigen_scores";
  if (Status s = check_geometry(who, geo); !s.is_ok()) return record_error(s);
  if (G < 1 || n < 0 || ld < n)
    return record_error(KVP_INVALID("%s: group %d, n %lld, ld %lld: need group >= 1 and 0 <= n <= ld", who, G, static_cast<long long>(n),
                                    static_cast<long long>(ld)));
  if (n == 0) return;
  if (q == nullptr || skew == nullptr || channels == nullptr || partial_keys == nullptr || seq_pages == nullptr || qt == nullptr ||
      out == nullptr)
    return record_error(KVP_INVALID("%s: q, skew, channels, partial_keys, seq_pages, qt or out is null", who));
  const cudaStream_t s = as_stream(backend::Cuda::current_stream());
  const std::int64_t Hq = static_cast<std::int64_t>(geo.num_kv_heads) * G;
  skewed_query_kernel<<<blocks_for(Hq * geo.partial_dim), kThreads, 0, s>>>(q, qhs, qds, G, scale, skew, channels, geo, qt);
  logits_kernel<<<blocks_for(Hq * n), kThreads, 0, s>>>(qt, G, partial_keys, seq_pages, geo, n, out, ld);
  record_error(launch_status(who));
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

void Cuda::infinigen_fold(const float* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::PartialKeyGeometry& geo,
                          const float* skew, const std::int32_t* channels, std::int64_t first, std::int64_t count,
                          float* partial_keys) noexcept {
  cuda_detail::launch_fold(k, ks, seq_pages, geo, skew, channels, first, count, partial_keys);
}
void Cuda::infinigen_fold(const half* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::PartialKeyGeometry& geo,
                          const float* skew, const std::int32_t* channels, std::int64_t first, std::int64_t count,
                          float* partial_keys) noexcept {
  cuda_detail::launch_fold(k, ks, seq_pages, geo, skew, channels, first, count, partial_keys);
}
void Cuda::infinigen_fold(const bfloat16* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::PartialKeyGeometry& geo,
                          const float* skew, const std::int32_t* channels, std::int64_t first, std::int64_t count,
                          float* partial_keys) noexcept {
  cuda_detail::launch_fold(k, ks, seq_pages, geo, skew, channels, first, count, partial_keys);
}

void Cuda::infinigen_scores(const float* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const float* skew,
                            const std::int32_t* channels, const float* partial_keys, const std::int32_t* seq_pages,
                            const ops::PartialKeyGeometry& geo, std::int64_t n, float* qt, float* out, std::int64_t ld) noexcept {
  cuda_detail::launch_scores(q, qhs, qds, G, scale, skew, channels, partial_keys, seq_pages, geo, n, qt, out, ld);
}
void Cuda::infinigen_scores(const half* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const float* skew,
                            const std::int32_t* channels, const float* partial_keys, const std::int32_t* seq_pages,
                            const ops::PartialKeyGeometry& geo, std::int64_t n, float* qt, float* out, std::int64_t ld) noexcept {
  cuda_detail::launch_scores(q, qhs, qds, G, scale, skew, channels, partial_keys, seq_pages, geo, n, qt, out, ld);
}
void Cuda::infinigen_scores(const bfloat16* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const float* skew,
                            const std::int32_t* channels, const float* partial_keys, const std::int32_t* seq_pages,
                            const ops::PartialKeyGeometry& geo, std::int64_t n, float* qt, float* out, std::int64_t ld) noexcept {
  cuda_detail::launch_scores(q, qhs, qds, G, scale, skew, channels, partial_keys, seq_pages, geo, n, qt, out, ld);
}

void Cuda::infinigen_counts(const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, float alpha,
                            std::int64_t* out) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda infinigen_counts";
  if (rows < 0 || n < 0 || (rows > 1 && ld < n) || rows > 2147483647)
    return record_error(KVP_INVALID("%s: rows %lld, n %lld, ld %lld: need 0 <= rows < 2^31, n >= 0 and ld >= n", who,
                                    static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(ld)));
  if (rows == 0) return;
  if (scores == nullptr || out == nullptr) return record_error(KVP_INVALID("%s: scores or out is null", who));
  counts_kernel<<<static_cast<unsigned>(rows), kThreads, 0, as_stream(current_stream())>>>(scores, n, ld, alpha, out);
  record_error(launch_status(who));
}

void Cuda::infinigen_select(const float* scores, std::int64_t rows, std::int64_t n, std::int64_t ld, const std::int64_t* counts,
                            std::int64_t count_rows, std::int64_t max_num_kv, std::int32_t page_size, std::uint64_t* thr,
                            float* prio) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda infinigen_select";
  if (rows < 0 || rows > 2147483647 || n < 0 || (rows > 1 && ld < n) || count_rows < 0 || max_num_kv < 1 || page_size < 1 ||
      n >= (std::int64_t{1} << 32))
    return record_error(
        KVP_INVALID("%s: rows %lld, n %lld, ld %lld, count rows %lld, max_num_kv %lld, page_size %d: need sizes >= 0, ld >= n, n < 2^32, "
                    "max_num_kv and page_size >= 1",
                    who, static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(ld),
                    static_cast<long long>(count_rows), static_cast<long long>(max_num_kv), page_size));
  if (rows == 0 || n == 0) return;
  if (scores == nullptr || thr == nullptr || prio == nullptr || (count_rows > 0 && counts == nullptr))
    return record_error(KVP_INVALID("%s: scores, thr, prio or counts is null", who));
  const cudaStream_t s = as_stream(current_stream());
  auto* th = reinterpret_cast<unsigned long long*>(thr);
  threshold_kernel<<<static_cast<unsigned>(rows), kThreads, 0, s>>>(scores, n, ld, counts, count_rows, max_num_kv, th);
  raise_kernel<<<blocks_for((n + page_size - 1) / page_size), kThreads, 0, s>>>(scores, rows, n, ld, th, page_size, prio);
  record_error(launch_status(who));
}

}  // namespace backend
KVP_NAMESPACE_END
