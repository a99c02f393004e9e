// SPDX-License-Identifier: Apache-2.0
// SpeCache's prediction loops as ops, so its device path
// (policy/prefetch/specache.hpp) runs without a host round trip. Each op
// works on one sequence of n tokens; its page ids (`seq_pages`) and every
// array are device memory on a device backend; the low-bit key copy is
// addressed by `KeyCopyGeometry` (ops/prefetch_ops.hpp).
//
//   specache_encode      tokens [first, first + count): each kv head's key row
//                        quantized into the copy (ggml_quantize_row's bytes).
//   specache_scores      per kv head g and query head j of g's group:
//                        logits[t] = (q_j * scale) . deq(k_t) (the 8-lane
//                        order of prefetch_detail::dot, a row dequantized
//                        block by block), the softmax over t (max-subtracted,
//                        double sum), then mean[g * n + t] = the group's mean
//                        (backend::Scalar::group_reduce's kMean: summed in
//                        head order, divided by G). `probs`: Hkv * G * n floats.
//   specache_priorities  the sequence's entries: for every kv head g (in
//                        order) and selected token (ascending, `idx` row g of
//                        k), prio[entry] = (NaN ? 0 : prio) + (NaN ? 0 : mean),
//                        the host's additions in the host's order.
//
// The references are the host path's loops, so the emulated device
// reproduces the host's bits; backend::Cuda (backends/cuda/src/specache.cu)
// computes the logits with the host's rounding (the same bits) and the
// softmax with expf and a block-wide double sum (a few ulp from the host).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/ops/prefetch_ops.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/quant/ggml.hpp"

KVP_NAMESPACE_BEGIN
namespace ops {
namespace specache_ref {

template <class Tk>
void encode(const Tk* k_data, const PageStrides& ks, const std::int32_t* seq_pages, const KeyCopyGeometry& geo, std::int64_t first,
            std::int64_t count, std::uint8_t* codes) noexcept {
  for (std::int64_t t = first; t < first + count; ++t) {
    const std::int64_t page = seq_pages[t / geo.page_size], slot = t % geo.page_size;
    for (std::int32_t g = 0; g < geo.num_kv_heads; ++g)
      backend::Scalar::ggml_quantize_row(geo.type, k_data + page * ks.page + g * ks.head + slot * ks.slot, geo.head_dim,
                                         codes + geo.offset(seq_pages, t, g));
  }
}

template <class Tq>
void scores(const Tq* q, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale, const std::uint8_t* codes,
            const std::int32_t* seq_pages, const KeyCopyGeometry& geo, std::int64_t n, float* probs, float* mean) noexcept {
  const std::int64_t d = geo.head_dim, blocks = d / kGgmlBlock;
  const std::int32_t bb = ggml_block_bytes(geo.type);
  for (std::int32_t g = 0; g < geo.num_kv_heads; ++g) {
    float* pg = probs + static_cast<std::int64_t>(g) * G * n;
    for (std::int64_t t = 0; t < n; ++t) {
      const std::uint8_t* row = codes + geo.offset(seq_pages, t, g);
      for (std::int32_t j = 0; j < G; ++j) {
        const Tq* qh = q + static_cast<std::int64_t>(g * G + j) * q_head_stride;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (std::int64_t blk = 0; blk < blocks; ++blk) {
          float y[kGgmlBlock] = {};  // (the type is valid: the block is written before it is read)
          ggml_dequantize_block(geo.type, row + blk * bb, y);
          for (int i = 0; i < kGgmlBlock; i += 8)
            for (int l = 0; l < 8; ++l) acc[l] += (to_float(qh[(blk * kGgmlBlock + i + l) * q_dim_stride]) * scale) * y[i + l];
        }
        pg[j * n + t] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      }
    }
    for (std::int32_t j = 0; j < G; ++j) prefetch_detail::softmax(pg + j * n, n);
    for (std::int64_t t = 0; t < n; ++t) {
      float acc = pg[t];
      for (std::int32_t j = 1; j < G; ++j) acc = acc + pg[j * n + t];
      mean[g * n + t] = acc / static_cast<float>(G);
    }
  }
}

inline void priorities(std::int32_t page_size, std::int64_t n, std::int32_t num_kv_heads, const std::int32_t* idx, std::int64_t k,
                       const float* mean, float* prio) noexcept {
  for (std::int32_t g = 0; g < num_kv_heads; ++g)
    for (std::int64_t i = 0; i < k; ++i) {
      const std::int64_t t = idx[g * k + i], e = t / page_size;
      const float m = mean[g * n + t];
      prio[e] = (std::isnan(prio[e]) ? 0.0f : prio[e]) + (std::isnan(m) ? 0.0f : m);
    }
}

}  // namespace specache_ref

/// Quantizes tokens [first, first + count) of one sequence into the key copy (file comment).
template <class B, class Tk>
void specache_encode(const Tk* k_data, const PageStrides& ks, const std::int32_t* seq_pages, const KeyCopyGeometry& geo, std::int64_t first,
                     std::int64_t count, std::uint8_t* codes) noexcept {
  if constexpr (requires { B::specache_encode(k_data, ks, seq_pages, geo, first, count, codes); })
    B::specache_encode(k_data, ks, seq_pages, geo, first, count, codes);
  else
    specache_ref::encode(k_data, ks, seq_pages, geo, first, count, codes);
}

/// probs (Hkv, G, n) scratch and mean (Hkv, n) of one sequence (file comment); `q`: its (Hq, d) queries.
template <class B, class Tq>
void specache_scores(const Tq* q, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale,
                     const std::uint8_t* codes, const std::int32_t* seq_pages, const KeyCopyGeometry& geo, std::int64_t n, float* probs,
                     float* mean) noexcept {
  if constexpr (requires { B::specache_scores(q, q_head_stride, q_dim_stride, G, scale, codes, seq_pages, geo, n, probs, mean); })
    B::specache_scores(q, q_head_stride, q_dim_stride, G, scale, codes, seq_pages, geo, n, probs, mean);
  else
    specache_ref::scores(q, q_head_stride, q_dim_stride, G, scale, codes, seq_pages, geo, n, probs, mean);
}

/// Adds the selected tokens' means into one sequence's entries (file comment).
template <class B>
void specache_priorities(std::int32_t page_size, std::int64_t n, std::int32_t num_kv_heads, const std::int32_t* idx, std::int64_t k,
                         const float* mean, float* prio) noexcept {
  if constexpr (requires { B::specache_priorities(page_size, n, num_kv_heads, idx, k, mean, prio); })
    B::specache_priorities(page_size, n, num_kv_heads, idx, k, mean, prio);
  else
    specache_ref::priorities(page_size, n, num_kv_heads, idx, k, mean, prio);
}

}  // namespace ops
KVP_NAMESPACE_END
