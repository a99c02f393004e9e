// SPDX-License-Identifier: Apache-2.0
// Peak-probe kernels for AVX2 + FMA (called only when the CPU has them).
#include <immintrin.h>

#include "peak_kernels.hpp"

namespace kvp_bench::detail {
namespace {
float hsum(__m256 v) noexcept {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
}  // namespace

float fma_chains_avx2(std::int64_t iters) noexcept {
  // 24 chains need 24 registers; AVX2 has 16, so 12 chains (still 6 per FMA
  // pipe, enough for a 4-cycle latency) run twice per step.
  __m256 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_ps(1.0f + 1e-3f * static_cast<float>(j));
  __m256 mul = _mm256_set1_ps(0.999999f), add = _mm256_set1_ps(1e-6f);
  KVP_BENCH_KEEP(mul, "+x");
  KVP_BENCH_KEEP(add, "+x");
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], mul, add);
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], mul, add);
  }
  __m256 s = acc[0];
  for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, acc[j]);
  return hsum(s);
}

float read_pass_avx2(const float* p, std::size_t n) noexcept {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
  }
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}

}  // namespace kvp_bench::detail
