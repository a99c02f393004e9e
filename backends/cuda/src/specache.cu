// SPDX-License-Identifier: Apache-2.0
// SpeCache's loops on device memory (ops/specache_ops.hpp: semantics and the
// host reference). The key copy is written a thread per (token, kv head,
// ggml block) with the ggml block algorithms compiled for the device (the
// host's bytes). The logits are a thread per (kv head, query head, token):
// the row dequantized block by block and dotted in the host's 8-lane order
// with its rounding (the same bits); then a block per kv head runs each query
// head's softmax (block_softmax.cuh: expf, a double sum) and the group mean in
// head order. The priorities are a thread per table entry adding its selected
// tokens' means in the host's order (kv heads, then ascending tokens found by
// binary search in the ascending top-k rows). No allocation, no
// synchronisation: every launch goes on the calling thread's current stream.
#include <cstdint>

#include "block_softmax.cuh"
#include "cuda_common.cuh"
#include "kvpolicy/backends/cuda.hpp"

KVP_NAMESPACE_BEGIN
namespace cuda_detail {
namespace {

#include "ggml_device.cuh"  // namespace ggml_dev

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t n) noexcept { return grid_blocks(n, kThreads); }

template <class Tk>
__global__ void encode_kernel(const Tk* __restrict__ k, PageStrides ks, const std::int32_t* __restrict__ seq_pages,
                              ops::KeyCopyGeometry geo, std::int64_t first, std::int64_t count, std::uint8_t* __restrict__ codes) {
  const std::int64_t blocks = geo.head_dim / kGgmlBlock, per_token = blocks * geo.num_kv_heads;
  const std::int32_t bb = ggml_block_bytes(geo.type);
  for (std::int64_t w = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; w < count * per_token;
       w += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = first + w / per_token, r = w % per_token;
    const auto g = static_cast<std::int32_t>(r / blocks);
    const std::int64_t blk = r % blocks;
    const std::int64_t page = seq_pages[t / geo.page_size], slot = t % geo.page_size;
    const Tk* x = k + page * ks.page + g * ks.head + slot * ks.slot + blk * kGgmlBlock;
    float v[kGgmlBlock];
#pragma unroll
    for (int j = 0; j < kGgmlBlock; ++j) v[j] = load_f32(x + j);
    ggml_dev::quantize_block(geo.type, v, codes + geo.offset(seq_pages, t, g) + blk * bb);
  }
}

template <class Tq>
__global__ void logits_kernel(const Tq* __restrict__ q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale,
                              const std::uint8_t* __restrict__ codes, const std::int32_t* __restrict__ seq_pages, ops::KeyCopyGeometry geo,
                              std::int64_t n, float* __restrict__ probs) {
  const std::int64_t blocks = geo.head_dim / kGgmlBlock, rows = static_cast<std::int64_t>(geo.num_kv_heads) * G;
  const std::int32_t bb = ggml_block_bytes(geo.type);
  for (std::int64_t w = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; w < rows * n;
       w += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t gj = w / n, t = w % n;  // probs row gj = g * G + j, token t
    const auto g = static_cast<std::int32_t>(gj / G);
    const Tq* qh = q + gj * qhs;
    const std::uint8_t* row = codes + geo.offset(seq_pages, t, g);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (std::int64_t blk = 0; blk < blocks; ++blk) {
      float y[kGgmlBlock];
      ggml_dev::dequantize_block(geo.type, row + blk * bb, y);
#pragma unroll
      for (int i = 0; i < kGgmlBlock; i += 8)
#pragma unroll
        for (int l = 0; l < 8; ++l)
          acc[l] = __fadd_rn(acc[l], __fmul_rn(__fmul_rn(load_f32(qh + (blk * kGgmlBlock + i + l) * qds), scale), y[i + l]));
    }
    probs[w] = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), __fadd_rn(acc[2], acc[3])),
                         __fadd_rn(__fadd_rn(acc[4], acc[5]), __fadd_rn(acc[6], acc[7])));
  }
}

__global__ void __launch_bounds__(kThreads)
    softmax_mean_kernel(std::int32_t G, std::int64_t n, float* __restrict__ probs, float* __restrict__ mean) {
  __shared__ typename BlockSoftmax<kThreads>::Shared sm;
  const std::int32_t g = blockIdx.x;
  float* pg = probs + static_cast<std::int64_t>(g) * G * n;
  for (std::int32_t j = 0; j < G; ++j)
    BlockSoftmax<kThreads>::run(
        pg + static_cast<std::int64_t>(j) * n, n, [](std::int64_t) { return false; }, sm);
  for (std::int64_t t = threadIdx.x; t < n; t += blockDim.x) {
    float acc = pg[t];
    for (std::int32_t j = 1; j < G; ++j) acc = __fadd_rn(acc, pg[static_cast<std::int64_t>(j) * n + t]);
    mean[static_cast<std::int64_t>(g) * n + t] = __fdiv_rn(acc, static_cast<float>(G));  // backend::Scalar::group_reduce's kMean
  }
}

__global__ void priorities_kernel(std::int32_t page_size, std::int64_t n, std::int32_t Hkv, const std::int32_t* __restrict__ idx,
                                  std::int64_t k, const float* __restrict__ mean, float* __restrict__ prio) {
  const std::int64_t entries = (n + page_size - 1) / page_size;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < entries;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float v = prio[e];
    const std::int64_t lo = e * page_size, hi = lo + page_size;
    for (std::int32_t g = 0; g < Hkv; ++g) {
      const std::int32_t* row = idx + static_cast<std::int64_t>(g) * k;
      for (std::int64_t p = sorted_lower_bound(row, k, lo); p < k && row[p] < hi; ++p) {
        const float m = mean[static_cast<std::int64_t>(g) * n + row[p]];
        v = __fadd_rn(v != v ? 0.0f : v, m != m ? 0.0f : m);
      }
    }
    prio[e] = v;
  }
}

Status check_geometry(const char* who, const ops::KeyCopyGeometry& geo) noexcept {
  KVP_REQUIRE(geo.page_size >= 1 && geo.num_kv_heads >= 1 && geo.head_dim >= kGgmlBlock && geo.head_dim % kGgmlBlock == 0 &&
                  geo.row_bytes == geo.head_dim / kGgmlBlock * ggml_block_bytes(geo.type),
              "%s: geometry (page_size %d, kv heads %d, head_dim %d, row bytes %lld): need positive sizes, head_dim a multiple of 32 "
              "and the format's row bytes",
              who, geo.page_size, geo.num_kv_heads, geo.head_dim, static_cast<long long>(geo.row_bytes));
  return Status::ok();
}

template <class Tk>
void launch_encode(const Tk* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::KeyCopyGeometry& geo, std::int64_t first,
                   std::int64_t count, std::uint8_t* codes) noexcept {
  constexpr const char* who = "cuda specache_encode";
  if (Status s = check_geometry(who, geo); !s.is_ok()) return record_error(s);
  if (first < 0 || count < 0)
    return record_error(
        KVP_INVALID("%s: first %lld and count %lld must be >= 0", who, static_cast<long long>(first), static_cast<long long>(count)));
  if (count == 0) return;
  if (k == nullptr || seq_pages == nullptr || codes == nullptr)
    return record_error(KVP_INVALID("%s: keys, seq_pages or codes is null", who));
  const std::int64_t work = count * geo.num_kv_heads * (geo.head_dim / kGgmlBlock);
  encode_kernel<<<blocks_for(work), kThreads, 0, as_stream(backend::Cuda::current_stream())>>>(k, ks, seq_pages, geo, first, count, codes);
  record_error(launch_status(who));
}

template <class Tq>
void launch_scores(const Tq* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const std::uint8_t* codes,
                   const std::int32_t* seq_pages, const ops::KeyCopyGeometry& geo, std::int64_t n, float* probs, float* mean) noexcept {
  constexpr const char* who = "cuda specache_scores";
  if (Status s = check_geometry(who, geo); !s.is_ok()) return record_error(s);
  if (G < 1 || n < 0)
    return record_error(KVP_INVALID("%s: group %d and n %lld: need group >= 1 and n >= 0", who, G, static_cast<long long>(n)));
  if (n == 0) return;
  if (q == nullptr || codes == nullptr || seq_pages == nullptr || probs == nullptr || mean == nullptr)
    return record_error(KVP_INVALID("%s: q, codes, seq_pages, probs or mean is null", who));
  const cudaStream_t s = as_stream(backend::Cuda::current_stream());
  logits_kernel<<<blocks_for(static_cast<std::int64_t>(geo.num_kv_heads) * G * n), kThreads, 0, s>>>(q, qhs, qds, G, scale, codes,
                                                                                                     seq_pages, geo, n, probs);
  softmax_mean_kernel<<<static_cast<unsigned>(geo.num_kv_heads), kThreads, 0, s>>>(G, n, probs, mean);
  record_error(launch_status(who));
}

}  // namespace
}  // namespace cuda_detail

namespace backend {

void Cuda::specache_encode(const float* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::KeyCopyGeometry& geo,
                           std::int64_t first, std::int64_t count, std::uint8_t* codes) noexcept {
  cuda_detail::launch_encode(k, ks, seq_pages, geo, first, count, codes);
}
void Cuda::specache_encode(const half* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::KeyCopyGeometry& geo,
                           std::int64_t first, std::int64_t count, std::uint8_t* codes) noexcept {
  cuda_detail::launch_encode(k, ks, seq_pages, geo, first, count, codes);
}
void Cuda::specache_encode(const bfloat16* k, const PageStrides& ks, const std::int32_t* seq_pages, const ops::KeyCopyGeometry& geo,
                           std::int64_t first, std::int64_t count, std::uint8_t* codes) noexcept {
  cuda_detail::launch_encode(k, ks, seq_pages, geo, first, count, codes);
}

void Cuda::specache_scores(const float* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const std::uint8_t* codes,
                           const std::int32_t* seq_pages, const ops::KeyCopyGeometry& geo, std::int64_t n, float* probs,
                           float* mean) noexcept {
  cuda_detail::launch_scores(q, qhs, qds, G, scale, codes, seq_pages, geo, n, probs, mean);
}
void Cuda::specache_scores(const half* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const std::uint8_t* codes,
                           const std::int32_t* seq_pages, const ops::KeyCopyGeometry& geo, std::int64_t n, float* probs,
                           float* mean) noexcept {
  cuda_detail::launch_scores(q, qhs, qds, G, scale, codes, seq_pages, geo, n, probs, mean);
}
void Cuda::specache_scores(const bfloat16* q, std::int64_t qhs, std::int64_t qds, std::int32_t G, float scale, const std::uint8_t* codes,
                           const std::int32_t* seq_pages, const ops::KeyCopyGeometry& geo, std::int64_t n, float* probs,
                           float* mean) noexcept {
  cuda_detail::launch_scores(q, qhs, qds, G, scale, codes, seq_pages, geo, n, probs, mean);
}

void Cuda::specache_priorities(std::int32_t page_size, std::int64_t n, std::int32_t num_kv_heads, const std::int32_t* idx, std::int64_t k,
                               const float* mean, float* prio) noexcept {
  using namespace cuda_detail;
  constexpr const char* who = "cuda specache_priorities";
  if (page_size < 1 || num_kv_heads < 1 || n < 0 || k < 0 || k > n)
    return record_error(KVP_INVALID("%s: page_size %d, kv heads %d, n %lld, k %lld: need positive page_size and heads, 0 <= k <= n", who,
                                    page_size, num_kv_heads, static_cast<long long>(n), static_cast<long long>(k)));
  if (n == 0) return;
  if (prio == nullptr || (k > 0 && (idx == nullptr || mean == nullptr)))
    return record_error(KVP_INVALID("%s: prio, or idx / mean where used, is null", who));
  const std::int64_t entries = (n + page_size - 1) / page_size;
  priorities_kernel<<<blocks_for(entries), kThreads, 0, as_stream(current_stream())>>>(page_size, n, num_kv_heads, idx, k, mean, prio);
  record_error(launch_status(who));
}

}  // namespace backend
KVP_NAMESPACE_END
