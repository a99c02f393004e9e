// Shared helpers of the libFuzzer targets: a contract check that aborts (so
// libFuzzer records the input as a crash) and poisoned buffers that tell
// whether a call wrote anything.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

/// A broken library contract: print it and abort, which libFuzzer reports as a crash.
#define KVP_FUZZ_CHECK(cond, ...)                                                        \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: contract violated: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                 \
      std::fprintf(stderr, "\n");                                                        \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

namespace kvp_fuzz {

inline constexpr std::int32_t kPoison = -7;

/// An int32 output buffer filled with kPoison; `untouched()` after a failed call.
struct Poisoned {
  std::vector<std::int32_t> v;
  explicit Poisoned(std::size_t n) : v(n, kPoison) {}
  std::int32_t* data() noexcept { return v.empty() ? nullptr : v.data(); }
  bool untouched() const noexcept {
    return std::all_of(v.begin(), v.end(), [](std::int32_t x) { return x == kPoison; });
  }
};

/// Bytes of a buffer, to compare a buffer before and after a failed call.
template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) noexcept {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// A value the fuzzer chooses, usually in range, sometimes any int32 (bad input).
inline std::int32_t mostly_in(FuzzedDataProvider& fdp, std::int32_t lo, std::int32_t hi) {
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) return fdp.ConsumeIntegral<std::int32_t>();
  return fdp.ConsumeIntegralInRange<std::int32_t>(lo, hi);
}

/// A float the fuzzer chooses: small values, with NaN / infinities / huge ones now and then.
inline float fuzz_float(FuzzedDataProvider& fdp) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 31)) {
    case 0: return __builtin_nanf("");
    case 1: return __builtin_inff();
    case 2: return -__builtin_inff();
    case 3: return 6.0e4f * (fdp.ConsumeBool() ? 1.f : -1.f);
    default: return fdp.ConsumeFloatingPointInRange<float>(-4.f, 4.f);
  }
}

}  // namespace kvp_fuzz
