// SPDX-License-Identifier: Apache-2.0
// First include of every per-ISA translation unit (src/*_<isa>.cpp) and of the
// kernel headers they include (internal). CMake defines KVP_CPU_TU_ISA
// (0 = sse2, 1 = avx2, 2 = avx512) together with that level's flags; from it
// this header names the level's namespace (`KVP_CPU_ISA_NS`: sse2, avx2,
// avx512), its xsimd architecture (`Arch`) and its `CpuIsa` (`kIsa`).
// Everything a per-ISA unit defines goes into
// `kvpolicy::cpu_detail::KVP_CPU_ISA_NS`, so the three compilations of one
// kernel header never share a symbol (see the rule in isa_dispatch.hpp).
#pragma once

#ifndef KVP_CPU_TU_ISA
#error "isa_arch.hpp is for per-ISA translation units (src/*_sse2.cpp, *_avx2.cpp, *_avx512.cpp)"
#endif

// GCC 12's AVX-512 intrinsics initialise their "undefined" operands from
// themselves, which -Wuninitialized reports at every inlined use (GCC bug
// 105593, fixed in GCC 13). The same kernel sources are compiled warning-clean
// for avx2 and sse2, so nothing of ours is hidden by silencing it here.
#if KVP_CPU_TU_ISA == 2 && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <xsimd/xsimd.hpp>

#include "isa_dispatch.hpp"

#if KVP_CPU_TU_ISA == 2
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512DQ__) || !defined(__AVX512VL__) || !defined(__FMA__) || \
    !defined(__F16C__)
#error "an *_avx512.cpp unit was compiled without the AVX-512 F/BW/DQ/VL + FMA + F16C flags"
#endif
#define KVP_CPU_ISA_NS avx512
#elif KVP_CPU_TU_ISA == 1
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "an *_avx2.cpp unit was compiled without the AVX2 + FMA + F16C flags"
#endif
#define KVP_CPU_ISA_NS avx2
#elif KVP_CPU_TU_ISA == 0
#define KVP_CPU_ISA_NS sse2
#else
#error "KVP_CPU_TU_ISA must be 0 (sse2), 1 (avx2) or 2 (avx512)"
#endif

KVP_NAMESPACE_BEGIN
namespace cpu_detail::KVP_CPU_ISA_NS {
/// Prefetch of the line holding p into L1 (prefetcht0). Through inline asm,
/// not `_mm_prefetch`: GCC 12 deletes a loop whose only effect is
/// `_mm_prefetch` / `__builtin_prefetch` when it sits behind an early return
/// in an inlined lambda (seen: every prefetch of the page-bounds and paged
/// attention kernels was missing from the object code).
__attribute__((always_inline)) inline void prefetch_l1(const void* p) noexcept {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
}
/// The same into L2 (prefetcht1), for data needed later than the L1 can hold it.
__attribute__((always_inline)) inline void prefetch_l2(const void* p) noexcept {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}
/// Every 64-byte line of bytes [0, bytes) of p, into L1 (or into L2 with kL2): the kernels' look-ahead.
template <bool kL2 = false>
inline void prefetch_lines(const void* p, std::int64_t bytes) noexcept {
  for (std::int64_t o = 0; o < bytes; o += 64) {
    if constexpr (kL2)
      prefetch_l2(static_cast<const char*>(p) + o);
    else
      prefetch_l1(static_cast<const char*>(p) + o);
  }
}

#if KVP_CPU_TU_ISA == 2
using Arch = xsimd::avx512bw;
inline constexpr CpuIsa kIsa = CpuIsa::kAvx512;
/// c[j] lane i <- r[i] lane j (a 16 x 16 transpose in registers).
inline void transpose16(const __m512* r, __m512* c) noexcept {
  __m512 t[16], u[16], v[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    u[4 * k] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    u[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    u[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    u[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  for (int g = 0; g < 2; ++g)
    for (int i = 0; i < 4; ++i) {
      v[8 * g + i] = _mm512_shuffle_f32x4(u[8 * g + i], u[8 * g + i + 4], 0x88);
      v[8 * g + i + 4] = _mm512_shuffle_f32x4(u[8 * g + i], u[8 * g + i + 4], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    c[i] = _mm512_shuffle_f32x4(v[i], v[i + 8], 0x88);
    c[i + 8] = _mm512_shuffle_f32x4(v[i], v[i + 8], 0xDD);
  }
}

#elif KVP_CPU_TU_ISA == 1
using Arch = xsimd::fma3<xsimd::avx2>;
inline constexpr CpuIsa kIsa = CpuIsa::kAvx2;
/// c[j] lane i <- r[i] lane j (an 8 x 8 transpose in registers).
inline void transpose8(const __m256* r, __m256* c) noexcept {
  __m256 t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {
    u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    c[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#else
using Arch = xsimd::sse2;
inline constexpr CpuIsa kIsa = CpuIsa::kSse2;
#endif
}  // namespace cpu_detail::KVP_CPU_ISA_NS
KVP_NAMESPACE_END
