// Helpers shared by the CPU backend tests: the ISA loop, key layouts
// (contiguous, strided, paged), and the tolerance used against the scalar
// reference.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"

// Sanitizer builds (ASan/UBSan in CI) run the same matrix with the largest
// shapes scaled down; KVP_TEST_QUICK forces the same from the command line.
#if defined(__SANITIZE_ADDRESS__) || defined(KVP_TEST_QUICK)
#define KVP_CPU_TEST_SCALED_DOWN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define KVP_CPU_TEST_SCALED_DOWN 1
#endif
#endif
#ifndef KVP_CPU_TEST_SCALED_DOWN
#define KVP_CPU_TEST_SCALED_DOWN 0
#endif

namespace kvp_cpu_test {
using namespace kvpolicy;
using backend::Cpu;
using backend::Scalar;

inline constexpr bool kScaledDown = KVP_CPU_TEST_SCALED_DOWN != 0;

/// Every level this machine runs, lowest first.
inline std::vector<CpuIsa> available_isas() {
  std::vector<CpuIsa> v;
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (isa <= Cpu::best_isa()) v.push_back(isa);
  return v;
}

/// Restores the level in use when a test ends.
struct IsaGuard {
  CpuIsa saved = Cpu::isa();
  IsaGuard() = default;
  IsaGuard(const IsaGuard&) = delete;
  IsaGuard& operator=(const IsaGuard&) = delete;
  ~IsaGuard() { Cpu::set_isa(saved); }
};

/// The window-score tolerance: |got - ref| <= rel |ref| + 1e-9, rel = 1e-5 by
/// default. The relative part covers the different dot-product order (FMA,
/// vector lanes) and the chunked softmax sums; the absolute floor covers
/// probabilities below 1e-4, whose rounding noise is far below any use.
/// NaN must match NaN.
inline bool window_close(float got, float ref, double rel = 1e-5) {
  if (std::isnan(ref)) return std::isnan(got);
  return std::fabs(static_cast<double>(got) - ref) <= rel * std::fabs(static_cast<double>(ref)) + 1e-9;
}

/// Bit equality with NaN == NaN (payload ignored).
inline bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
}

enum class Layout { kContiguous, kStrided, kPaged1, kPaged16 };

inline const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kStrided: return "strided";
    case Layout::kPaged1: return "paged(page_size=1)";
    case Layout::kPaged16: return "paged(page_size=16)";
  }
  return "?";
}

/// T key rows of d values in one of the layouts. Every element outside the
/// rows (row padding, unused page slots and pages) is NaN, so a kernel that
/// reads outside the rows poisons its output.
template <class Tk>
struct KeyStore {
  std::vector<Tk> buf;
  std::vector<std::int32_t> pages;
  Rows<Tk> rows{};

  KeyStore(const std::vector<Tk>& dense, std::int64_t T, std::int64_t d, Layout layout, std::mt19937& rng) {
    const Tk poison = from_float<Tk>(std::numeric_limits<float>::quiet_NaN());
    if (layout == Layout::kContiguous || layout == Layout::kStrided) {
      const std::int64_t stride = layout == Layout::kStrided ? d + 7 : d;
      buf.assign(static_cast<std::size_t>(std::max<std::int64_t>(T, 1) * stride + 16), poison);
      for (std::int64_t j = 0; j < T; ++j) std::copy_n(dense.begin() + j * d, d, buf.begin() + j * stride);
      rows = Rows<Tk>{buf.data(), stride, nullptr, 0, 0};
      return;
    }
    const std::int32_t P = layout == Layout::kPaged1 ? 1 : 16;
    const std::int64_t slot_stride = d + 3, page_stride = P * slot_stride + 5;
    const auto used = static_cast<std::int32_t>((T + P - 1) / P);
    const std::int32_t pool_pages = used + 3;
    std::vector<std::int32_t> perm(static_cast<std::size_t>(pool_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    pages.assign(perm.begin(), perm.begin() + used);
    buf.assign(static_cast<std::size_t>(pool_pages * page_stride + 16), poison);
    for (std::int64_t j = 0; j < T; ++j) {
      const std::int64_t off = pages[static_cast<std::size_t>(j / P)] * page_stride + (j % P) * slot_stride;
      std::copy_n(dense.begin() + j * d, d, buf.begin() + off);
    }
    rows = Rows<Tk>{buf.data(), slot_stride, pages.data(), page_stride, P};
  }
};

}  // namespace kvp_cpu_test
