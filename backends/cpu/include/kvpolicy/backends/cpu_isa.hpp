// SPDX-License-Identifier: Apache-2.0
// Instruction-set levels of the CPU backend (`backend::Cpu`).
#pragma once

#include <cstdint>

#include "kvpolicy/core/version.hpp"

KVP_NAMESPACE_BEGIN

/// The instruction sets `kvpolicy::cpu` carries kernels for, in increasing order.
/// Each level is compiled in its own translation units; the library itself is
/// built without `-march`, and the level is chosen at run time.
enum class CpuIsa : std::uint8_t {
  kSse2,    ///< x86-64 baseline (no FMA, no F16C: fp16 keys are widened with integer SIMD)
  kAvx2,    ///< AVX2 + FMA + F16C
  kAvx512,  ///< AVX-512 F/BW/DQ/VL + FMA + F16C
};

/// "sse2", "avx2", "avx512".
constexpr const char* cpu_isa_name(CpuIsa isa) noexcept {
  switch (isa) {
    case CpuIsa::kSse2: return "sse2";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

KVP_NAMESPACE_END
