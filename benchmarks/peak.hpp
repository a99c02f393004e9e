// SPDX-License-Identifier: Apache-2.0
// In-process peak probe for the benchmarks: the single-core FP32 FMA rate and
// the single-core read bandwidth of this machine, measured once per process
// (on first use) so that every benchmark can report its throughput as a
// fraction of what this core can do right now.
//
//  * FMA rate: 24 independent FMA chains (enough to cover the latency of two
//    FMA pipes) with the widest vectors the CPU has — the kernel lives in an
//    AVX-512 (or AVX2) translation unit chosen at run time; the AVX2 kernel's
//    rate too, the peak that rows run at the AVX2 level are compared with.
//  * Read bandwidth: a vectorised sum over a buffer several times the
//    last-level cache (KVP_BENCH_BW_MIB overrides its size in MiB).
//  * Both are timed in thread CPU time, best of several runs, so that time
//    spent descheduled on a shared machine does not count (the benchmarks
//    report CPU-time rates as well, see bench_util.hpp).
//
// Every benchmark program in benchmarks/ is linked with this probe
// (benchmarks/CMakeLists.txt), so `#include "peak.hpp"` is all it takes.
#pragma once

#include <cstddef>

namespace kvp_bench {

struct Peak {
  double fma_flops_per_second = 0;   ///< FP32 flops/s (an FMA counts 2), one core
  double read_bytes_per_second = 0;  ///< bytes/s streamed from memory, one core
  const char* fma_isa = "";          ///< vector ISA of the FMA probe: "avx512", "avx2" or "sse2" (mul + add)
  /// The AVX2 FMA kernel's rate on this core (0 without AVX2 and FMA): the peak of a kernel run at the AVX2
  /// level, i.e. what an AVX2-only machine with this core's pipes would reach (on a machine with AVX-512 it
  /// is about half of fma_flops_per_second).
  double fma_avx2_flops_per_second = 0;
  std::size_t read_buffer_bytes = 0;  ///< size of the bandwidth probe's buffer
  std::size_t llc_bytes = 0;          ///< last-level cache size reported by the OS (0 if unknown)
};

/// The probe's result; measured on the first call (about a second), thread-safe.
const Peak& peak();

/// Sum of p[0..n) with the widest vectors available: one read pass, the
/// baseline that streaming kernels are compared with.
float read_pass(const float* p, std::size_t n) noexcept;

}  // namespace kvp_bench
