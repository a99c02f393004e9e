// SPDX-License-Identifier: Apache-2.0
// gemm.hpp's entry points (baseline flags): empty shapes, then the kernels of
// the level the kvpolicy CPU backend uses. The kernels themselves are in the
// per-ISA units gemm_sse2.cpp, gemm_avx2.cpp, gemm_avx512.cpp.
#include "gemm.hpp"

#include <cassert>
#include <cstring>

#include "gemm_kernels.hpp"
#include "kvpolicy/backends/cpu.hpp"

namespace kvp_engine {
namespace {

// Follows the backend's level (one relaxed atomic load per call), so that
// KVP_CPU_ISA and Cpu::set_isa steer the engine's products and the policies'
// ops together.
const gemm_detail::GemmKernels& kernels() noexcept {
  switch (kvpolicy::backend::Cpu::isa()) {
    case kvpolicy::CpuIsa::kAvx512: return gemm_detail::gemm_kernels_avx512();
    case kvpolicy::CpuIsa::kAvx2: return gemm_detail::gemm_kernels_avx2();
    case kvpolicy::CpuIsa::kSse2: break;
  }
  return gemm_detail::gemm_kernels_sse2();
}

/// Handles m, n or k = 0; true when nothing is left for a kernel.
bool trivial(float* c, std::int64_t ldc, std::int64_t m, std::int64_t n, std::int64_t k, bool accumulate) noexcept {
  if (m <= 0 || n <= 0) return true;
  if (k > 0) return false;
  if (!accumulate)  // an empty sum is zero; accumulating adds nothing (and keeps a -0.0 as it is)
    for (std::int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, static_cast<std::size_t>(n) * sizeof(float));
  return true;
}

}  // namespace

void gemm_nt(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t m, std::int64_t n,
             std::int64_t k, bool accumulate) noexcept {
  assert(m <= 1 || lda >= k);
  assert(n <= 1 || ldb >= k);
  assert(m <= 1 || ldc >= n);
  if (trivial(c, ldc, m, n, k, accumulate)) return;
  kernels().nt(a, lda, b, ldb, c, ldc, m, n, k, accumulate);
}

void gemm_nn(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t m, std::int64_t n,
             std::int64_t k, bool accumulate) noexcept {
  assert(m <= 1 || lda >= k);
  assert(k <= 1 || ldb >= n);
  assert(m <= 1 || ldc >= n);
  if (trivial(c, ldc, m, n, k, accumulate)) return;
  kernels().nn(a, lda, b, ldb, c, ldc, m, n, k, accumulate);
}

void softmax_causal(float* s, std::int64_t lds, std::int64_t rows, std::int64_t cols, std::int64_t first, float scale) noexcept {
  assert(rows <= 0 || (first >= 1 && first + rows - 1 <= cols && (rows == 1 || lds >= cols) && scale > 0.0f));
  if (rows <= 0) return;
  kernels().softmax(s, lds, rows, cols, first, scale);
}

}  // namespace kvp_engine
