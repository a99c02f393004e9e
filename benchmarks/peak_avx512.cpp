// SPDX-License-Identifier: Apache-2.0
// Peak-probe kernels for AVX-512 (built with -mavx512f -mfma; called only
// when the CPU has AVX-512).
// GCC 12's AVX-512 reductions trip -Wuninitialized on their own "undefined"
// operands (GCC bug 105593, fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include "peak_kernels.hpp"

namespace kvp_bench::detail {

float fma_chains_avx512(std::int64_t iters) noexcept {
  __m512 acc[kFmaChains];
  for (int j = 0; j < kFmaChains; ++j) acc[j] = _mm512_set1_ps(1.0f + 1e-3f * static_cast<float>(j));
  __m512 mul = _mm512_set1_ps(0.999999f), add = _mm512_set1_ps(1e-6f);
  KVP_BENCH_KEEP(mul, "+v");
  KVP_BENCH_KEEP(add, "+v");
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < kFmaChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], mul, add);
  }
  __m512 s = acc[0];
  for (int j = 1; j < kFmaChains; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
}

float read_pass_avx512(const float* p, std::size_t n) noexcept {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}

}  // namespace kvp_bench::detail
