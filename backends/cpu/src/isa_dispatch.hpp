// SPDX-License-Identifier: Apache-2.0
// Run-time ISA dispatch shared by every op family of kvpolicy::cpu (internal).
//
// How an op family is laid out (the score ops are the example; paged ops and
// later families follow the same steps):
//
//  1. A table of function pointers for the family, in an internal header:
//       struct ScoreKernels { void (*pool1d_range)(...) noexcept; ... };
//       KVP_CPU_DECLARE_KERNELS(ScoreKernels, score_kernels)
//     The macro declares one accessor per level, `score_kernels_sse2()`,
//     `score_kernels_avx2()`, `score_kernels_avx512()`, and the selector
//     `score_kernels()` that returns the table of the level in use.
//  2. The kernels, written once, in an internal header that starts by
//     including "isa_arch.hpp": it opens `namespace cpu_detail::KVP_CPU_ISA_NS`
//     and provides `Arch` (the xsimd architecture of the translation unit).
//  3. One translation unit per level, `src/<family>_sse2.cpp`,
//     `src/<family>_avx2.cpp`, `src/<family>_avx512.cpp`, each including the
//     kernel header and defining its accessor with KVP_CPU_DEFINE_KERNELS.
//     CMake (backends/cpu/CMakeLists.txt) gives files with these suffixes the
//     level's flags and KVP_CPU_TU_ISA; nothing else needs registering.
//  4. The public entry points live in a baseline translation unit (no suffix)
//     and call `score_kernels().op(...)`.
//
// Rule for per-ISA translation units: code there may only call functions of
// its own `KVP_CPU_ISA_NS` namespace, xsimd templates instantiated on `Arch`,
// intrinsics and libc. An inline non-template function or a std:: algorithm
// instantiated in a per-ISA unit is emitted there with that level's
// instructions, and the linker may keep that copy for every caller — a
// machine without the level would then fault in code that looks portable.
#pragma once

#include "kvpolicy/backends/cpu_isa.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {

/// Counts a vectorised op that fell back to the reference (Cpu::reference_fallbacks).
void note_reference_fallback() noexcept;

/// Best level this machine and OS support (cpuid + xgetbv; computed once).
CpuIsa detected_isa() noexcept;

/// Level in use. The first call picks `detected_isa()`, lowered to the
/// environment variable KVP_CPU_ISA (sse2|avx2|avx512) when it names a level
/// the machine has; later calls are one relaxed atomic load.
CpuIsa active_isa() noexcept;

/// Switch the level in use; false (no change) when the machine lacks it.
bool set_active_isa(CpuIsa isa) noexcept;

/// Whether the machine has AVX512_BF16 (on top of the AVX-512 level; computed once).
bool detected_bf16_dot() noexcept;

/// Whether window_scores on bf16 keys uses the bf16 dot form (Cpu::set_bf16_dot; at first use the environment
/// variable KVP_CPU_BF16_DOT=1 turns it on where the machine has it). Only the AVX-512 level acts on it.
bool bf16_dot_active() noexcept;
bool set_bf16_dot_active(bool on) noexcept;

/// Whether the ggml, INT4 and KIVI-value decoders write large outputs with streaming (non-temporal) stores (Cpu::set_streaming_stores;
/// at first use the environment variable KVP_CPU_STREAMING_STORES=1 turns them on).
bool streaming_stores_active() noexcept;
void set_streaming_stores_active(bool on) noexcept;

template <class Table>
using KernelTableFn = const Table& (*)() noexcept;

/// The table of the level in use.
template <class Table>
const Table& select_kernels(KernelTableFn<Table> sse2, KernelTableFn<Table> avx2, KernelTableFn<Table> avx512) noexcept {
  switch (active_isa()) {
    case CpuIsa::kAvx512: return avx512();
    case CpuIsa::kAvx2: return avx2();
    case CpuIsa::kSse2: break;
  }
  return sse2();
}

}  // namespace cpu_detail
KVP_NAMESPACE_END

/// Declares the three per-level accessors of kernel table `Table` and the
/// selector `name()`; use inside `namespace cpu_detail`.
#define KVP_CPU_DECLARE_KERNELS(Table, name) \
  const Table& name##_sse2() noexcept;       \
  const Table& name##_avx2() noexcept;       \
  const Table& name##_avx512() noexcept;     \
  inline const Table& name() noexcept { return select_kernels<Table>(&name##_sse2, &name##_avx2, &name##_avx512); }

#define KVP_CPU_CAT_(a, b) a##_##b
#define KVP_CPU_CAT(a, b) KVP_CPU_CAT_(a, b)

/// In a per-ISA translation unit (inside `namespace cpu_detail`): defines the
/// accessor of this level, returning the table `{kernels...}`.
#define KVP_CPU_DEFINE_KERNELS(Table, name, ...)              \
  const Table& KVP_CPU_CAT(name, KVP_CPU_ISA_NS)() noexcept { \
    static constexpr Table kTable{__VA_ARGS__};               \
    return kTable;                                            \
  }
