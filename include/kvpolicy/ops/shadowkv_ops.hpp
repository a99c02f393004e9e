// SPDX-License-Identifier: Apache-2.0
// ShadowKV's loops as ops, so its device path (policy/prefetch/shadowkv.hpp)
// runs without a host round trip. Each op works on one sequence; its page ids
// (`seq_pages`, the sequence's slice of the page table) and every array are
// device memory on a device backend. Chunk ch of the sequence (tokens
// [ch * C, ch * C + C)) lives in page seq_pages[ch / cpp] at chunk slot
// ch % cpp (cpp = page_size / C); its state slot for kv head g is
// (page * cpp + ch % cpp) * Hkv + g, as `ShadowKVState::slot`.
//
//   shadowkv_landmarks       chunks [first, first + count): landmark (mean of
//                            the C keys, fp32, summed in token order) and
//                            outlier score (min over the keys of the cosine).
//   shadowkv_outlier_keys    out[g * cand + ch] = -outlier(ch, g), ch < cand:
//                            the top-k input that picks the lowest cosines.
//   shadowkv_chunk_scores    per kv head g: p_h = softmax over ch < cand of
//                            (q_h * scale) . L(ch, g) with the outlier chunks
//                            (oidx row g, ascending) masked, then the max over
//                            g's query heads; outliers -inf.
//   shadowkv_priorities      the sequence's entries raised (max; NaN values as
//                            -inf): +inf for the tail (tokens [cand * C, n))
//                            and every outlier chunk's page, the score of
//                            every selected chunk (sidx row g, ascending).
//
// The references below are the host path's loops, in its order, so the
// emulated device reproduces the host's bits. backend::Cuda's kernels
// (backends/cuda/src/shadowkv.cu) round every landmark and cosine operation
// as these do (the same bits); the scores use the device's expf and a
// parallel double sum, within a few ulp of the host.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/policy/prefetch/history.hpp"

KVP_NAMESPACE_BEGIN
namespace ops {
namespace shadowkv_ref {

template <class Tk>
void landmarks(const Tk* k_data, const PageStrides& ks, const std::int32_t* seq_pages, const ChunkGeometry& geo, std::int64_t first,
               std::int64_t count, float* landmarks_out, float* outlier_out) noexcept {
  const std::int32_t C = geo.chunk_size;
  const std::int64_t d = geo.head_dim;
  for (std::int64_t ch = first; ch < first + count; ++ch) {
    const std::int64_t t0 = ch * C;
    const std::int32_t page = seq_pages[t0 / geo.page_size];
    const auto slot0 = static_cast<std::int32_t>(t0 % geo.page_size);
    for (std::int32_t g = 0; g < geo.num_kv_heads; ++g) {
      auto key = [&](std::int32_t j) { return k_data + page * ks.page + g * ks.head + (slot0 + j) * ks.slot; };
      float* L = landmarks_out + geo.slot(seq_pages, ch, g) * d;
      for (std::int64_t i = 0; i < d; ++i) {
        float s = 0.0f;
        for (std::int32_t j = 0; j < C; ++j) s += to_float(key(j)[i]);
        L[i] = s / static_cast<float>(C);
      }
      float ln = 0.0f;
      for (std::int64_t i = 0; i < d; ++i) ln += L[i] * L[i];
      float mn = 1.0f;
      for (std::int32_t j = 0; j < C; ++j) {
        const Tk* k = key(j);
        float dot = 0.0f, kn = 0.0f;
        for (std::int64_t i = 0; i < d; ++i) {
          dot += L[i] * to_float(k[i]);
          kn += to_float(k[i]) * to_float(k[i]);
        }
        const float cs = ln > 0.0f && kn > 0.0f ? dot / (std::sqrt(ln) * std::sqrt(kn)) : 1.0f;
        mn = std::min(mn, cs);
      }
      outlier_out[geo.slot(seq_pages, ch, g)] = mn;
    }
  }
}

inline void outlier_keys(const float* outlier, const std::int32_t* seq_pages, const ChunkGeometry& geo, std::int64_t cand,
                         float* out) noexcept {
  for (std::int32_t g = 0; g < geo.num_kv_heads; ++g)
    for (std::int64_t ch = 0; ch < cand; ++ch) out[g * cand + ch] = -outlier[geo.slot(seq_pages, ch, g)];
}

/// True when `ch` is in the ascending row idx[0..n).
inline bool in_sorted(const std::int32_t* idx, std::int64_t n, std::int64_t ch) noexcept {
  return n > 0 && std::binary_search(idx, idx + n, static_cast<std::int32_t>(ch));
}

/// `q` is sequence b's (Hq, d) slice; `logits`: Hkv * G * cand floats of scratch.
template <class Tq>
void chunk_scores(const Tq* q, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale,
                  const float* landmarks_in, const std::int32_t* seq_pages, const ChunkGeometry& geo, std::int64_t cand,
                  const std::int32_t* oidx, std::int64_t no, float* logits, float* score) noexcept {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const std::int64_t d = geo.head_dim;
  for (std::int32_t g = 0; g < geo.num_kv_heads; ++g) {
    float* lgg = logits + static_cast<std::int64_t>(g) * G * cand;
    const std::int32_t* orow = oidx + g * no;
    for (std::int32_t j = 0; j < G; ++j) {
      const Tq* qh = q + static_cast<std::int64_t>(g * G + j) * q_head_stride;
      for (std::int64_t ch = 0; ch < cand; ++ch) {
        if (in_sorted(orow, no, ch)) {
          lgg[j * cand + ch] = -kInf;
          continue;
        }
        // prefetch_detail::dot's order over (q_i * scale) and the landmark.
        const float* Lm = landmarks_in + geo.slot(seq_pages, ch, g) * d;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        std::int64_t i = 0;
        for (; i + 8 <= d; i += 8)
          for (int l = 0; l < 8; ++l) acc[l] += (to_float(qh[(i + l) * q_dim_stride]) * scale) * Lm[i + l];
        float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        for (; i < d; ++i) s += (to_float(qh[i * q_dim_stride]) * scale) * Lm[i];
        lgg[j * cand + ch] = s;
      }
    }
    for (std::int32_t j = 0; j < G; ++j)
      prefetch_detail::softmax(lgg + j * cand, cand, [&](std::int64_t ch) { return in_sorted(orow, no, ch); });
    float* sc = score + g * cand;
    for (std::int64_t ch = 0; ch < cand; ++ch) {  // backend::Scalar::group_reduce's kMax
      float acc = lgg[ch];
      for (std::int32_t j = 1; j < G; ++j) {
        const float v = lgg[j * cand + ch];
        acc = (v > acc || acc != acc) ? v : acc;
      }
      sc[ch] = in_sorted(orow, no, ch) ? -kInf : acc;
    }
  }
}

/// `prio`: the sequence's entries (its first table entry at prio[0]); n >= 1 tokens.
inline void priorities(const ChunkGeometry& geo, std::int64_t n, std::int64_t cand, const std::int32_t* oidx, std::int64_t no,
                       const std::int32_t* sidx, std::int64_t k, const float* score, float* prio) noexcept {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const std::int32_t C = geo.chunk_size, ps = geo.page_size;
  for (std::int64_t t = cand * C; t < n; t += C) prefetch_detail::raise(prio, t / ps, kInf);
  prefetch_detail::raise(prio, (n - 1) / ps, kInf);
  for (std::int32_t g = 0; g < geo.num_kv_heads; ++g) {
    for (std::int64_t i = 0; i < no; ++i) prefetch_detail::raise(prio, static_cast<std::int64_t>(oidx[g * no + i]) * C / ps, kInf);
    for (std::int64_t i = 0; i < k; ++i) {
      const std::int32_t ch = sidx[g * k + i];
      prefetch_detail::raise(prio, static_cast<std::int64_t>(ch) * C / ps, score[g * cand + ch]);
    }
  }
}

}  // namespace shadowkv_ref

/// Landmarks and outlier scores of chunks [first, first + count) of one sequence (file comment).
template <class B, class Tk>
void shadowkv_landmarks(const Tk* k_data, const PageStrides& ks, const std::int32_t* seq_pages, const ChunkGeometry& geo,
                        std::int64_t first, std::int64_t count, float* landmarks_out, float* outlier_out) noexcept {
  if constexpr (requires { B::shadowkv_landmarks(k_data, ks, seq_pages, geo, first, count, landmarks_out, outlier_out); })
    B::shadowkv_landmarks(k_data, ks, seq_pages, geo, first, count, landmarks_out, outlier_out);
  else
    shadowkv_ref::landmarks(k_data, ks, seq_pages, geo, first, count, landmarks_out, outlier_out);
}

/// out (Hkv, cand) = -outlier score of chunk ch, kv head g.
template <class B>
void shadowkv_outlier_keys(const float* outlier, const std::int32_t* seq_pages, const ChunkGeometry& geo, std::int64_t cand,
                           float* out) noexcept {
  if constexpr (requires { B::shadowkv_outlier_keys(outlier, seq_pages, geo, cand, out); })
    B::shadowkv_outlier_keys(outlier, seq_pages, geo, cand, out);
  else
    shadowkv_ref::outlier_keys(outlier, seq_pages, geo, cand, out);
}

/// score (Hkv, cand): the group max of the masked chunk softmax (file comment);
/// `q` is one sequence's (Hq, d) queries; `logits`: Hkv * G * cand floats.
template <class B, class Tq>
void shadowkv_chunk_scores(const Tq* q, std::int64_t q_head_stride, std::int64_t q_dim_stride, std::int32_t G, float scale,
                           const float* landmarks_in, const std::int32_t* seq_pages, const ChunkGeometry& geo, std::int64_t cand,
                           const std::int32_t* oidx, std::int64_t no, float* logits, float* score) noexcept {
  if constexpr (requires {
                  B::shadowkv_chunk_scores(q, q_head_stride, q_dim_stride, G, scale, landmarks_in, seq_pages, geo, cand, oidx, no, logits,
                                           score);
                })
    B::shadowkv_chunk_scores(q, q_head_stride, q_dim_stride, G, scale, landmarks_in, seq_pages, geo, cand, oidx, no, logits, score);
  else
    shadowkv_ref::chunk_scores(q, q_head_stride, q_dim_stride, G, scale, landmarks_in, seq_pages, geo, cand, oidx, no, logits, score);
}

/// Raises one sequence's entries (file comment).
template <class B>
void shadowkv_priorities(const ChunkGeometry& geo, std::int64_t n, std::int64_t cand, const std::int32_t* oidx, std::int64_t no,
                         const std::int32_t* sidx, std::int64_t k, const float* score, float* prio) noexcept {
  if constexpr (requires { B::shadowkv_priorities(geo, n, cand, oidx, no, sidx, k, score, prio); })
    B::shadowkv_priorities(geo, n, cand, oidx, no, sidx, k, score, prio);
  else
    shadowkv_ref::priorities(geo, n, cand, oidx, no, sidx, k, score, prio);
}

}  // namespace ops
KVP_NAMESPACE_END
