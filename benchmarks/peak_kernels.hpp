// SPDX-License-Identifier: Apache-2.0
// Kernels of the peak probe, one set per ISA (peak_avx512.cpp, peak_avx2.cpp,
// and the SSE2 baseline in peak.cpp); peak.cpp picks one at run time.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvp_bench::detail {

/// Runs `iters` steps of kFmaChains independent vector FMA chains; returns a
/// value depending on every chain (so nothing is optimised away).
inline constexpr int kFmaChains = 24;
float fma_chains_avx512(std::int64_t iters) noexcept;  // 16 lanes
float fma_chains_avx2(std::int64_t iters) noexcept;    // 8 lanes

float read_pass_avx512(const float* p, std::size_t n) noexcept;
float read_pass_avx2(const float* p, std::size_t n) noexcept;

}  // namespace kvp_bench::detail
