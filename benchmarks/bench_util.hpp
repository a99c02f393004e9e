// SPDX-License-Identifier: Apache-2.0
// Shared helpers of bench_ops / bench_policies: throughput counters relative
// to the peak probe, and deterministic inputs.
#pragma once

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "peak.hpp"

namespace kvp_bench {

/// Timing convention. The machine may be shared, so rates are per CPU-second
/// by default: single-threaded benchmarks use the thread's CPU time (Google
/// Benchmark's default), multi-threaded ones MeasureProcessCPUTime() (the sum
/// over all threads, i.e. a per-core rate). The wall-clock variants of the
/// multi-threaded runs (UseRealTime(), name suffix /real_time) show the
/// scaling; for those pass `cores` = threads.
///
/// GFLOP/s and pct_peak_fma (percent of `cores` x the single-core FMA peak).
inline void report_flops(benchmark::State& st, double flops_per_iteration, int cores = 1) {
  const double total = flops_per_iteration * static_cast<double>(st.iterations());
  st.counters["GFLOP/s"] = benchmark::Counter(total * 1e-9, benchmark::Counter::kIsRate);
  st.counters["pct_peak_fma"] = benchmark::Counter(100.0 * total / (peak().fma_flops_per_second * cores), benchmark::Counter::kIsRate);
}

/// report_flops for a kernel run at a given level; a row at the AVX2 level also reports pct_peak_fma_avx2,
/// its share of the AVX2 FMA kernel's rate (the peak of an AVX2 machine with this core's pipes).
inline void report_flops_at(benchmark::State& st, double flops_per_iteration, kvpolicy::CpuIsa isa, int cores = 1) {
  report_flops(st, flops_per_iteration, cores);
  if (isa == kvpolicy::CpuIsa::kAvx2 && peak().fma_avx2_flops_per_second > 0) {
    const double total = flops_per_iteration * static_cast<double>(st.iterations());
    st.counters["pct_peak_fma_avx2"] =
        benchmark::Counter(100.0 * total / (peak().fma_avx2_flops_per_second * cores), benchmark::Counter::kIsRate);
  }
}

/// GB/s and pct_peak_bw (percent of the single-core read bandwidth probe; data
/// resident in a cache can exceed 100).
inline void report_bytes(benchmark::State& st, double bytes_per_iteration) {
  const double total = bytes_per_iteration * static_cast<double>(st.iterations());
  st.counters["GB/s"] = benchmark::Counter(total * 1e-9, benchmark::Counter::kIsRate);
  st.counters["pct_peak_bw"] = benchmark::Counter(100.0 * total / peak().read_bytes_per_second, benchmark::Counter::kIsRate);
}

/// Measures the peaks (if not done yet) and records them, with the ISA in
/// use, in the benchmark context (console header and JSON "context").
inline void add_peak_context() {
  const Peak& p = peak();
  benchmark::AddCustomContext("peak_fma_gflops", std::to_string(p.fma_flops_per_second * 1e-9));
  benchmark::AddCustomContext("peak_fma_isa", p.fma_isa);
  benchmark::AddCustomContext("peak_fma_avx2_gflops", std::to_string(p.fma_avx2_flops_per_second * 1e-9));
  benchmark::AddCustomContext("peak_read_gbps", std::to_string(p.read_bytes_per_second * 1e-9));
  benchmark::AddCustomContext("kvpolicy_cpu_best_isa", kvpolicy::cpu_isa_name(kvpolicy::backend::Cpu::best_isa()));
}

/// Levels to benchmark: every level this machine runs, best first.
inline std::vector<kvpolicy::CpuIsa> isas() {
  std::vector<kvpolicy::CpuIsa> v;
  for (auto isa : {kvpolicy::CpuIsa::kAvx512, kvpolicy::CpuIsa::kAvx2, kvpolicy::CpuIsa::kSse2})
    if (isa <= kvpolicy::backend::Cpu::best_isa()) v.push_back(isa);
  return v;
}

/// Selects `isa` for the benchmark (skipping it when unavailable).
inline bool use_isa(benchmark::State& st, kvpolicy::CpuIsa isa) {
  if (!kvpolicy::backend::Cpu::set_isa(isa)) {
    st.SkipWithError("ISA not available on this machine");
    return false;
  }
  return true;
}

template <class T>
std::vector<T> normal_values(std::size_t n, unsigned seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<T> v(n);
  for (auto& x : v) x = kvpolicy::from_float<T>(nd(rng));
  return v;
}

/// Attention-like scores: positive, heavy-tailed (exp of a scaled exponential).
inline std::vector<float> score_values(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::exponential_distribution<float> ex(1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = std::exp(-4.0f * ex(rng));
  return v;
}

template <class T>
constexpr const char* dtype_tag() {
  if constexpr (std::is_same_v<T, kvpolicy::half>)
    return "f16";
  else if constexpr (std::is_same_v<T, kvpolicy::bfloat16>)
    return "bf16";
  else
    return "f32";
}

}  // namespace kvp_bench
