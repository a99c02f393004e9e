// SPDX-License-Identifier: Apache-2.0
// `backend::CpuScoreOps`: the scoring / selection ops of the contract,
// vectorised (xsimd, SSE2 / AVX2 / AVX-512 chosen at run time) and compiled
// into kvpolicy::cpu. Same signatures and semantics as `ScalarScoreOps`; the
// ops not re-declared here (`group_reduce`, `gather_rows`) are inherited from
// the scalar reference.
//
// Agreement with the reference (what tests/cpu pins):
//  * `topk`: bit-identical indices (same `score_order_key` total order).
//  * `pool1d`: bit-identical (same summation order per output, same NaN rule).
//  * `window_scores`: |cpu - scalar| <= 1e-5 * |scalar| + 1e-9 per element;
//    the dot products run in a different order (and fused on FMA ISAs).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

struct CpuScoreOps : ScalarScoreOps {
  /// Workspace of `window_scores`: O(group*window * (kv_len + head_dim)) floats
  /// (the softmax numerators of every (query, key) pair are kept between the
  /// two passes: 16 MiB for G*w = 128 queries and 32K keys). Independent of
  /// the selected ISA. A smaller workspace (e.g. sized for the reference op)
  /// makes the call compute with the reference and is counted in
  /// `Cpu::reference_fallbacks()`; policies reject it before calling.
  static std::size_t window_scores_workspace(const WindowScoreShape& s) noexcept;

  /// out: (group, num_cols) fp32, contiguous. See `WindowScoreShape`.
  /// Keys are read in place in their storage type (float, half, bfloat16),
  /// contiguous, strided or paged, 64 rows at a time widened into an L1
  /// buffer. Requires kv_len < 2^31. Pass 1 computes the logits with the G*w
  /// queries as the SIMD dimension (register tiles of keys x query vectors,
  /// broadcast FMAs) and stores exp(logit - reference) per chunk of keys, the
  /// reference being the running max; pass 2 rescales by exp(reference -
  /// max) / denominator (denominators summed in double) and reduces each
  /// head's window. Probabilities below ~e^-55 of a row's max may come out as
  /// 0. At most 8 queries (group x window, e.g. TOVA's) run the AVX2 level's kernel on the AVX-512 level
  /// (a quarter of an AVX-512 vector would hold them), so they get the AVX2 level's bits there.
  /// Thread-safe (no shared state); defined for Tk in {float, half, bfloat16}.
  template <class Tk>
  static void window_scores(const WindowScoreShape& s, const float* q, Rows<Tk> keys, float* out, Workspace ws) noexcept;

  /// Same as the reference (avg with count_include_pad, max ignoring padding
  /// and NaN as the scalar comparison does); `out` must not alias `in` unless
  /// `kind` is `kNone`. O(n * kernel) with SIMD over outputs.
  static void pool1d(const float* in, std::int64_t n, int kernel, Pooling kind, float* out) noexcept;

  /// Workspace of `topk` for n scores: O(n) bytes (about 16 n).
  static std::size_t topk_workspace(std::int64_t n) noexcept;

  /// The k best of scores[0..n) under `score_order_key`, ascending indices,
  /// identical to the reference. For k <= n/8: a sample of 2048 scores (256
  /// runs of 8 neighbours) gives a threshold that about 1.5-2 k scores pass;
  /// one SIMD pass collects their indices (if fewer than k pass, the search
  /// below runs on all scores instead); histogram rounds on the candidates'
  /// order keys find the k-th largest (key, index) pair; one SIMD compaction
  /// writes the survivors in index order. Larger k and n <= 4096 skip the
  /// sample. Expected O(n) with one read pass over the scores plus O(k) work.
  static void topk(const float* scores, std::int64_t n, std::int64_t k, std::int32_t* out, Workspace ws) noexcept;
};

// Explicit specialisations, defined in the library (src/cpu_score_ops.cpp).
template <>
void CpuScoreOps::window_scores<float>(const WindowScoreShape& s, const float* q, Rows<float> keys, float* out, Workspace ws) noexcept;
template <>
void CpuScoreOps::window_scores<half>(const WindowScoreShape& s, const float* q, Rows<half> keys, float* out, Workspace ws) noexcept;
template <>
void CpuScoreOps::window_scores<bfloat16>(const WindowScoreShape& s, const float* q, Rows<bfloat16> keys, float* out,
                                          Workspace ws) noexcept;

}  // namespace backend
KVP_NAMESPACE_END
