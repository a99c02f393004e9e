// SPDX-License-Identifier: Apache-2.0
// Peak probe: run-time choice of the kernel set, timing, one-time measurement.
#include "peak.hpp"

#include <emmintrin.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "peak_kernels.hpp"

namespace kvp_bench {
namespace {

enum class Level { kSse2, kAvx2, kAvx512 };

Level level() noexcept {
  static const Level l = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return Level::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Level::kAvx2;
    return Level::kSse2;
  }();
  return l;
}

// Baseline (no FMA): 12 multiply + add chains of 4 lanes.
float mul_add_chains_sse2(std::int64_t iters) noexcept {
  __m128 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm_set1_ps(1.0f + 1e-3f * static_cast<float>(j));
  __m128 mul = _mm_set1_ps(0.999999f), add = _mm_set1_ps(1e-6f);
  KVP_BENCH_KEEP(mul, "+x");
  KVP_BENCH_KEEP(add, "+x");
  for (std::int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < 12; ++j) acc[j] = _mm_add_ps(_mm_mul_ps(acc[j], mul), add);
  }
  __m128 s = acc[0];
  for (int j = 1; j < 12; ++j) s = _mm_add_ps(s, acc[j]);
  alignas(16) float v[4];
  _mm_store_ps(v, s);
  return v[0] + v[1] + v[2] + v[3];
}

float read_pass_sse2(const float* p, std::size_t n) noexcept {
  __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm_add_ps(a0, _mm_loadu_ps(p + i));
    a1 = _mm_add_ps(a1, _mm_loadu_ps(p + i + 4));
    a2 = _mm_add_ps(a2, _mm_loadu_ps(p + i + 8));
    a3 = _mm_add_ps(a3, _mm_loadu_ps(p + i + 12));
  }
  alignas(16) float v[4];
  _mm_store_ps(v, _mm_add_ps(_mm_add_ps(a0, a1), _mm_add_ps(a2, a3)));
  float s = v[0] + v[1] + v[2] + v[3];
  for (; i < n; ++i) s += p[i];
  return s;
}

// Thread CPU time: the machine may be shared, and time spent descheduled
// must not count against the probe (the benchmarks measure CPU time too).
double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

volatile float g_sink = 0;

// Flops per CPU-second of an FMA kernel: calibrate to ~50 ms per run (which
// also warms the clocks up), keep the best of 7 runs.
double measure_fma_kernel(float (*kernel)(std::int64_t) noexcept, double flops_per_iter) {
  std::int64_t iters = 1 << 16;
  for (;;) {
    const double t0 = thread_seconds();
    g_sink = g_sink + kernel(iters);
    if ((thread_seconds() - t0) > 0.05 || iters > (std::int64_t{1} << 40)) break;
    iters *= 2;
  }
  double best = 0;
  for (int r = 0; r < 7; ++r) {
    const double t0 = thread_seconds();
    g_sink = g_sink + kernel(iters);
    best = std::max(best, static_cast<double>(iters) * flops_per_iter / (thread_seconds() - t0));
  }
  return best;
}

// The widest FMA kernel's rate.
double measure_fma(const char** isa) {
  if (level() == Level::kAvx512) {
    *isa = "avx512";
    return measure_fma_kernel(detail::fma_chains_avx512, detail::kFmaChains * 16.0 * 2);
  }
  if (level() == Level::kAvx2) {
    *isa = "avx2";
    return measure_fma_kernel(detail::fma_chains_avx2, detail::kFmaChains * 8.0 * 2);
  }
  *isa = "sse2";
  return measure_fma_kernel(mul_add_chains_sse2, 12.0 * 4 * 2);
}

std::size_t llc_size() {
  long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 <= 0) l3 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l3 > 0 ? static_cast<std::size_t>(l3) : 0;
}

// Bytes per CPU-second of one read pass over a buffer of max(4 x LLC, 256 MiB),
// capped at 4 GiB (KVP_BENCH_BW_MIB overrides); best of 3 passes.
double measure_read(std::size_t llc, std::size_t* bytes_out) {
  std::size_t bytes = std::clamp<std::size_t>(4 * llc, std::size_t{256} << 20, std::size_t{4} << 30);
  if (const char* env = std::getenv("KVP_BENCH_BW_MIB")) {
    const long mib = std::atol(env);
    if (mib > 0) bytes = static_cast<std::size_t>(mib) << 20;
  }
  const std::size_t n = bytes / sizeof(float);
  std::unique_ptr<float[]> buf(new float[n]);
  std::fill_n(buf.get(), n, 1.0f);
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    const double t0 = thread_seconds();
    g_sink = g_sink + read_pass(buf.get(), n);
    best = std::max(best, static_cast<double>(n * sizeof(float)) / (thread_seconds() - t0));
  }
  *bytes_out = n * sizeof(float);
  return best;
}

}  // namespace

float read_pass(const float* p, std::size_t n) noexcept {
  switch (level()) {
    case Level::kAvx512: return detail::read_pass_avx512(p, n);
    case Level::kAvx2: return detail::read_pass_avx2(p, n);
    case Level::kSse2: break;
  }
  return read_pass_sse2(p, n);
}

const Peak& peak() {
  static const Peak p = [] {
    Peak r;
    r.fma_flops_per_second = measure_fma(&r.fma_isa);
    if (level() == Level::kAvx2) {
      r.fma_avx2_flops_per_second = r.fma_flops_per_second;
    } else if (level() == Level::kAvx512) {
      r.fma_avx2_flops_per_second = measure_fma_kernel(detail::fma_chains_avx2, detail::kFmaChains * 8.0 * 2);
    }
    r.llc_bytes = llc_size();
    r.read_bytes_per_second = measure_read(r.llc_bytes, &r.read_buffer_bytes);
    std::fprintf(
        stderr,
        "peak probe: %.1f GFLOP/s FP32 FMA (%s, 1 core; AVX2 kernel %.1f), %.2f GB/s read (1 core, %.0f MiB buffer, LLC %.0f MiB)\n",
        r.fma_flops_per_second * 1e-9, r.fma_isa, r.fma_avx2_flops_per_second * 1e-9, r.read_bytes_per_second * 1e-9,
        static_cast<double>(r.read_buffer_bytes) / 1048576.0, static_cast<double>(r.llc_bytes) / 1048576.0);
    return r;
  }();
  return p;
}

}  // namespace kvp_bench
