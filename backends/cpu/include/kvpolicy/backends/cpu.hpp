// SPDX-License-Identifier: Apache-2.0
// `backend::Cpu`: the CPU SIMD backend (kvpolicy::cpu). Policies instantiated
// with it call the vectorised ops of `CpuScoreOps`, `CpuPageOps` and
// `CpuReduceOps` and fall
// back to the scalar reference, by inheritance, for every op they do not
// specialise.
//
// Instruction set: chosen once, at first use, as the best level this machine
// and OS support (cpuid + xgetbv), unless the environment variable
// KVP_CPU_ISA=sse2|avx2|avx512 asks for a lower one. `set_isa` changes it at
// run time (tests and benchmarks use it to compare levels).
#pragma once

#include "kvpolicy/backends/cpu_isa.hpp"
#include "kvpolicy/backends/cpu_page_ops.hpp"
#include "kvpolicy/backends/cpu_quant_ops.hpp"
#include "kvpolicy/backends/cpu_reduce_ops.hpp"
#include "kvpolicy/backends/cpu_score_ops.hpp"
#include "kvpolicy/ops/contract.hpp"
#include "kvpolicy/ops/scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

// Score ops, page ops and row reductions, one base per op family (each falls back to its scalar family).
struct Cpu : CpuScoreOps, CpuPageOps, CpuReduceOps, CpuQuantOps {
  /// Name of the instruction set in use ("sse2", "avx2", "avx512").
  static const char* isa_name() noexcept;

  /// The instruction set in use.
  static CpuIsa isa() noexcept;

  /// The best instruction set this machine and OS support.
  static CpuIsa best_isa() noexcept;

  /// Use `isa` from now on, process-wide; false (and no change) when the
  /// machine lacks it. Thread-safe, but calls running concurrently on other
  /// threads may still use the previous level: meant for tests and benchmarks.
  static bool set_isa(CpuIsa isa) noexcept;

  /// Times a vectorised op was handed a workspace smaller than its own
  /// `*_workspace()` and ran the scalar reference instead (process-wide,
  /// monotone). Policies never cause it: they size and check the workspace
  /// for the backend of their context and reject a short one with
  /// kWorkspaceTooSmall. Direct op callers can watch it (the benchmarks
  /// report it; tests assert it stays 0).
  static std::uint64_t reference_fallbacks() noexcept;
};

static_assert(HostBackend<Cpu>, "backend::Cpu must model the whole ops contract (ops/contract.hpp)");

}  // namespace backend
KVP_NAMESPACE_END
