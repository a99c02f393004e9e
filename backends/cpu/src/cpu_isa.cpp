// SPDX-License-Identifier: Apache-2.0
// CPU feature detection and the process-wide choice of instruction set.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__GNUC__) || defined(__clang__)
#include <cpuid.h>
#elif defined(_MSC_VER)
#include <immintrin.h>
#include <intrin.h>
#endif

#include "isa_dispatch.hpp"
#include "kvpolicy/backends/cpu.hpp"

KVP_NAMESPACE_BEGIN
namespace cpu_detail {
namespace {

struct CpuidRegs {
  std::uint32_t a = 0, b = 0, c = 0, d = 0;
};

bool cpuid(std::uint32_t leaf, std::uint32_t subleaf, CpuidRegs* r) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  return __get_cpuid_count(leaf, subleaf, &r->a, &r->b, &r->c, &r->d) != 0;
#elif defined(_MSC_VER)
  int v[4];
  __cpuidex(v, static_cast<int>(leaf), static_cast<int>(subleaf));
  r->a = static_cast<std::uint32_t>(v[0]);
  r->b = static_cast<std::uint32_t>(v[1]);
  r->c = static_cast<std::uint32_t>(v[2]);
  r->d = static_cast<std::uint32_t>(v[3]);
  return true;
#else
  return false;
#endif
}

// XCR0: which register states the OS saves on context switches. Only
// executed after cpuid reported OSXSAVE.
std::uint64_t read_xcr0() noexcept {
#if defined(__GNUC__) || defined(__clang__)
  std::uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
#elif defined(_MSC_VER)
  return _xgetbv(0);
#else
  return 0;
#endif
}

constexpr bool bit(std::uint32_t v, int i) noexcept { return ((v >> i) & 1u) != 0; }

CpuIsa detect() noexcept {
  CpuidRegs r1, r7, r0;
  if (!cpuid(0, 0, &r0) || r0.a < 7 || !cpuid(1, 0, &r1) || !cpuid(7, 0, &r7)) return CpuIsa::kSse2;
  const bool fma = bit(r1.c, 12), osxsave = bit(r1.c, 27), avx = bit(r1.c, 28), f16c = bit(r1.c, 29);
  if (!osxsave || !avx) return CpuIsa::kSse2;
  const std::uint64_t xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6u) == 0x6u;    // SSE + AVX state
  const bool os_zmm = (xcr0 & 0xe6u) == 0xe6u;  // + opmask, ZMM_Hi256, Hi16_ZMM
  const bool avx2 = bit(r7.b, 5), avx512f = bit(r7.b, 16), avx512dq = bit(r7.b, 17), avx512bw = bit(r7.b, 30), avx512vl = bit(r7.b, 31);
  if (!os_ymm || !avx2 || !fma || !f16c) return CpuIsa::kSse2;
  if (os_zmm && avx512f && avx512dq && avx512bw && avx512vl) return CpuIsa::kAvx512;
  return CpuIsa::kAvx2;
}

// The level at first use: the best one, lowered by KVP_CPU_ISA when it names a
// level this machine has (unknown values and unavailable levels are ignored).
CpuIsa initial_isa() noexcept {
  const CpuIsa best = detected_isa();
  const char* env = std::getenv("KVP_CPU_ISA");
  if (env == nullptr) return best;
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (std::strcmp(env, cpu_isa_name(isa)) == 0 && isa <= best) return isa;
  }
  return best;
}

constexpr int kUnset = -1;
std::atomic<int> g_active_isa{kUnset};

}  // namespace

CpuIsa detected_isa() noexcept {
  static const CpuIsa best = detect();  // thread-safe one-time initialisation
  return best;
}

CpuIsa active_isa() noexcept {
  int v = g_active_isa.load(std::memory_order_relaxed);
  if (v != kUnset) return static_cast<CpuIsa>(v);
  static const int first = static_cast<int>(initial_isa());
  int expected = kUnset;
  g_active_isa.compare_exchange_strong(expected, first, std::memory_order_relaxed);
  return static_cast<CpuIsa>(g_active_isa.load(std::memory_order_relaxed));
}

bool set_active_isa(CpuIsa isa) noexcept {
  if (isa > detected_isa()) return false;
  g_active_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
  return true;
}

bool detected_bf16_dot() noexcept {
  static const bool has = [] {
    CpuidRegs r0, r71;
    if (detected_isa() != CpuIsa::kAvx512 || !cpuid(0, 0, &r0) || r0.a < 7 || !cpuid(7, 1, &r71)) return false;
    return ((r71.a >> 5) & 1u) != 0;  // CPUID.(EAX=7,ECX=1):EAX[5] AVX512_BF16
  }();
  return has;
}

namespace {
/// A process-wide on/off switch: its setter's value once set; before that, on where the environment variable
/// `var` is "1" and the machine has what the switch needs (`available`), fixed at first use.
bool switch_on(std::atomic<int>& flag, const char* var, bool available) noexcept {
  const int v = flag.load(std::memory_order_relaxed);
  if (v != kUnset) return v != 0;
  const char* env = std::getenv(var);
  int expected = kUnset;
  flag.compare_exchange_strong(expected, (env != nullptr && std::strcmp(env, "1") == 0 && available) ? 1 : 0, std::memory_order_relaxed);
  return flag.load(std::memory_order_relaxed) != 0;
}

std::atomic<int> g_bf16_dot{kUnset};
std::atomic<int> g_streaming_stores{kUnset};
}  // namespace

bool bf16_dot_active() noexcept { return switch_on(g_bf16_dot, "KVP_CPU_BF16_DOT", detected_bf16_dot()); }

bool set_bf16_dot_active(bool on) noexcept {
  if (on && !detected_bf16_dot()) return false;
  g_bf16_dot.store(on ? 1 : 0, std::memory_order_relaxed);
  return true;
}

bool streaming_stores_active() noexcept { return switch_on(g_streaming_stores, "KVP_CPU_STREAMING_STORES", true); }

void set_streaming_stores_active(bool on) noexcept { g_streaming_stores.store(on ? 1 : 0, std::memory_order_relaxed); }

namespace {
std::atomic<std::uint64_t> g_reference_fallbacks{0};
}  // namespace

void note_reference_fallback() noexcept { g_reference_fallbacks.fetch_add(1, std::memory_order_relaxed); }

}  // namespace cpu_detail

namespace backend {
std::uint64_t Cpu::reference_fallbacks() noexcept { return cpu_detail::g_reference_fallbacks.load(std::memory_order_relaxed); }
const char* Cpu::isa_name() noexcept { return cpu_isa_name(cpu_detail::active_isa()); }
CpuIsa Cpu::isa() noexcept { return cpu_detail::active_isa(); }
CpuIsa Cpu::best_isa() noexcept { return cpu_detail::detected_isa(); }
bool Cpu::set_isa(CpuIsa isa) noexcept { return cpu_detail::set_active_isa(isa); }
bool Cpu::has_bf16_dot() noexcept { return cpu_detail::detected_bf16_dot(); }
bool Cpu::bf16_dot() noexcept { return cpu_detail::bf16_dot_active(); }
bool Cpu::set_bf16_dot(bool on) noexcept { return cpu_detail::set_bf16_dot_active(on); }
bool Cpu::streaming_stores() noexcept { return cpu_detail::streaming_stores_active(); }
void Cpu::set_streaming_stores(bool on) noexcept { cpu_detail::set_streaming_stores_active(on); }
}  // namespace backend

KVP_NAMESPACE_END
