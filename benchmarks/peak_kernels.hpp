// SPDX-License-Identifier: Apache-2.0
// Kernels of the peak probe, one set per ISA (peak_avx512.cpp, peak_avx2.cpp,
// and the SSE2 baseline in peak.cpp); peak.cpp picks one at run time.
#pragma once

#include <cstddef>
#include <cstdint>

// Makes the compiler treat a value as unknown (and emit nothing): with opaque
// multiplier and addend no step of a probe's recurrence can be folded away
// (clang folds the converging FMA chains of constant operands).
#if defined(__GNUC__) || defined(__clang__)
#define KVP_BENCH_KEEP(x, constraint) __asm__ volatile("" : constraint(x))
#else
#define KVP_BENCH_KEEP(x, constraint) ((void)0)
#endif

namespace kvp_bench::detail {

/// Runs `iters` steps of kFmaChains independent vector FMA chains; returns a
/// value depending on every chain (so nothing is optimised away).
inline constexpr int kFmaChains = 24;
float fma_chains_avx512(std::int64_t iters) noexcept;  // 16 lanes
float fma_chains_avx2(std::int64_t iters) noexcept;    // 8 lanes

float read_pass_avx512(const float* p, std::size_t n) noexcept;
float read_pass_avx2(const float* p, std::size_t n) noexcept;

}  // namespace kvp_bench::detail
