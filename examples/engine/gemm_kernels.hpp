// SPDX-License-Identifier: Apache-2.0
// Kernel table of the engine's matrix products (internal to kvp_engine_lib):
// what each per-ISA unit (gemm_<isa>.cpp) provides to the entry points in
// gemm.cpp. Mirrors the backend's op families (backends/cpu/src/isa_dispatch.hpp).
#pragma once

#include <cstdint>

namespace kvp_engine::gemm_detail {

/// The products take m, n, k >= 1 (gemm.cpp handles empty shapes) and the
/// arguments of gemm_nt / gemm_nn; softmax those of softmax_causal (gemm.hpp).
struct GemmKernels {
  void (*nt)(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t m, std::int64_t n,
             std::int64_t k, bool accumulate) noexcept;
  void (*nn)(const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t m, std::int64_t n,
             std::int64_t k, bool accumulate) noexcept;
  void (*softmax)(float* s, std::int64_t lds, std::int64_t rows, std::int64_t cols, std::int64_t first, float scale) noexcept;
};

/// The table of one level, defined in gemm_sse2.cpp, gemm_avx2.cpp, gemm_avx512.cpp.
const GemmKernels& gemm_kernels_sse2() noexcept;
const GemmKernels& gemm_kernels_avx2() noexcept;
const GemmKernels& gemm_kernels_avx512() noexcept;

}  // namespace kvp_engine::gemm_detail
