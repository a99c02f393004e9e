// The row codecs of backend::Cpu (Hadamard rotation, token-wise INT4 / INT8,
// fp8, KIVI) are bit-identical with backend::Scalar's reference on every ISA
// level this machine has, for shapes the kernels vectorise and shapes they
// hand back to the reference, on inputs built to hit the corner cases: rows
// whose minimum or maximum is a signed zero (the reference keeps the first
// of equal values), constant rows, subnormals, values at the fp16 and fp8
// limits, every fp8 code. Then the same through the policies (Int4Quant,
// GgmlQuant with rotation, Fp8Quant, KiviQuant one-shot and streaming).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"

using namespace kvpolicy;

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

/// rows x d values: random normals with, per row, one of several corner patterns.
std::vector<float> corner_rows(std::int64_t rows, std::int64_t d, std::uint32_t seed, bool fp16_valued) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(rows * d));
  for (std::int64_t r = 0; r < rows; ++r) {
    float* v = x.data() + r * d;
    const int kind = static_cast<int>(r % 9);
    for (std::int64_t c = 0; c < d; ++c) v[c] = nd(rng) * (kind == 5 ? 3000.0f : 1.0f);
    switch (kind) {
      case 1:  // minimum is zero, -0 first
        for (std::int64_t c = 0; c < d; ++c) v[c] = std::fabs(v[c]);
        v[d / 3] = -0.0f;
        v[d / 2] = 0.0f;
        break;
      case 2:  // minimum is zero, +0 first
        for (std::int64_t c = 0; c < d; ++c) v[c] = std::fabs(v[c]);
        v[d / 3] = 0.0f;
        v[d / 2] = -0.0f;
        break;
      case 3:  // maximum is zero, mixed signs
        for (std::int64_t c = 0; c < d; ++c) v[c] = -std::fabs(v[c]);
        v[d / 4] = -0.0f;
        v[d - 1] = 0.0f;
        break;
      case 4:  // constant
        for (std::int64_t c = 0; c < d; ++c) v[c] = 0.75f;
        break;
      case 6:  // subnormal and tiny
        for (std::int64_t c = 0; c < d; ++c) v[c] *= 1e-40f;
        break;
      case 7:  // all signed zeros
        for (std::int64_t c = 0; c < d; ++c) v[c] = (c % 3) ? 0.0f : -0.0f;
        break;
      case 8:  // a few outliers
        v[0] = 40.0f;
        v[d - 1] = -25.0f;
        break;
      default: break;
    }
    if (fp16_valued)
      for (std::int64_t c = 0; c < d; ++c) v[c] = to_float(to_half(v[c]));
  }
  return x;
}
/// rows x d fp16 values of random sign and exponent (2^-24 .. 2^14, subnormals included) and random mantissa:
/// group ranges over the whole fp16 span, some of them overflowing fp16.
std::vector<float> wide_rows(std::int64_t rows, std::int64_t d, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> e(-24, 14), m(0, 1023), sign(0, 1);
  std::vector<float> x(static_cast<std::size_t>(rows * d));
  for (auto& v : x) v = to_float(to_half(std::ldexp(1.0f + static_cast<float>(m(rng)) / 1024.0f, e(rng)) * (sign(rng) ? -1.0f : 1.0f)));
  return x;
}
std::vector<half> to_halves(const std::vector<float>& x) {
  std::vector<half> h(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) h[i] = to_half(x[i]);
  return h;
}

template <class T>
void require_same(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  REQUIRE(a.size() == b.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    bool same;
    if constexpr (std::is_same_v<T, float>)
      same = bits_of(a[i]) == bits_of(b[i]);
    else if constexpr (std::is_same_v<T, half>)
      same = a[i].bits == b[i].bits;
    else
      same = a[i] == b[i];
    if (!same && bad++ == 0) first = i;
  }
  INFO(what << ": " << bad << " of " << a.size() << " differ, first at " << first);
  REQUIRE(bad == 0);
}

template <class Fn>
void for_each_isa(Fn fn) {
  const CpuIsa saved = backend::Cpu::isa();
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!backend::Cpu::set_isa(isa)) continue;
    fn(std::string(backend::Cpu::isa_name()));
  }
  backend::Cpu::set_isa(saved);
}

constexpr std::int64_t kRows = 45;

}  // namespace

TEST_CASE("codecs: the finiteness scan finds the first NaN / inf as the reference does", "[quant][codec][cpu]") {
  // The scan tests 256-element blocks with a vector fold and searches only a block that holds a non-finite
  // value: lengths around the block and vector sizes, non-finite values at block edges, inside blocks and in
  // the tail, several per row (the first counts), and the largest finite values (exponent one below all ones).
  const std::vector<std::uint16_t> bad16 = {0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xffff};
  const std::vector<std::uint32_t> bad32 = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffffffffu};
  for_each_isa([&](const std::string& isa) {
    for (std::int64_t n : {0, 1, 15, 16, 31, 255, 256, 257, 511, 512, 513, 1000, 4097, 20000}) {
      std::vector<std::int64_t> spots = {0, 1, n / 2, n - 1, 255, 256, 257, 511, 512, n - 257};
      std::vector<half> h(static_cast<std::size_t>(n));
      std::vector<float> f(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) {  // finite, with the largest finite magnitudes mixed in
        h[static_cast<std::size_t>(i)].bits = static_cast<std::uint16_t>(i % 7 == 0 ? (i % 2 ? 0x7bff : 0xfbff) : (0x3c00 + i % 1000));
        const std::uint32_t u = i % 7 == 0 ? (i % 2 ? 0x7f7fffffu : 0xff7fffffu) : 0x3f800000u + static_cast<std::uint32_t>(i);
        std::memcpy(&f[static_cast<std::size_t>(i)], &u, 4);
      }
      const std::string what = isa + " n=" + std::to_string(n);
      CHECK(backend::Cpu::first_nonfinite(h.data(), n) == -1);
      CHECK(backend::Cpu::first_nonfinite(f.data(), n) == -1);
      for (std::size_t k = 0; k < spots.size(); ++k) {
        const std::int64_t at = spots[k];
        if (at < 0 || at >= n) continue;
        std::vector<half> hh = h;
        std::vector<float> ff = f;
        hh[static_cast<std::size_t>(at)].bits = bad16[k % bad16.size()];
        const std::uint32_t u = bad32[k % bad32.size()];
        std::memcpy(&ff[static_cast<std::size_t>(at)], &u, 4);
        if (at + 300 < n) {  // a later one changes nothing
          hh[static_cast<std::size_t>(at + 300)].bits = 0x7c00;
          ff[static_cast<std::size_t>(at + 300)] = std::numeric_limits<float>::infinity();
        }
        INFO(what << " at " << at);
        CHECK(backend::Scalar::first_nonfinite(hh.data(), n) == at);
        CHECK(backend::Cpu::first_nonfinite(hh.data(), n) == at);
        CHECK(backend::Scalar::first_nonfinite(ff.data(), n) == at);
        CHECK(backend::Cpu::first_nonfinite(ff.data(), n) == at);
        if (at > 0) {  // an unaligned start: the same value, one element earlier
          CHECK(backend::Cpu::first_nonfinite(hh.data() + 1, n - 1) == at - 1);
          CHECK(backend::Cpu::first_nonfinite(ff.data() + 1, n - 1) == at - 1);
        }
      }
    }
  });
}

TEST_CASE("codecs: first_not_below equals the reference for any bound", "[quant][codec][cpu][kivi]") {
  // The CPU scan compares magnitude bits against those of the least value of the format >= bound: bounds exact
  // and inexact in fp16, in the subnormal range, at and above the fp16 maximum, infinite, zero, negative, NaN;
  // values spread over many binades with signed zeros, subnormals, infinities and NaN; planted at varied spots.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> bounds = {32752.0f, 32744.0f, 1.0f, 1.0001f, 0.5f,  3.0e-6f, 6.0e-8f, 65504.0f,
                                     65505.0f, 70000.0f, inf,  0.0f,    -1.0f, nan,     1e30f};
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> ex(-26.0f, 17.0f);
  for_each_isa([&](const std::string& isa) {
    for (std::int64_t n : {0, 7, 255, 256, 700, 3000}) {
      for (float bound : bounds) {
        for (int trial = 0; trial < 4; ++trial) {
          std::vector<float> f(static_cast<std::size_t>(n));
          for (auto& v : f)
            v = std::ldexp(1.0f, static_cast<int>(ex(rng))) * (rng() % 2 ? -1.0f : 1.0f) *
                (1.0f + static_cast<float>(rng() % 1000) / 1000.0f);
          // Mostly below the bound, so the scan runs long before its first hit.
          if (bound > 0.0f && trial < 3)
            for (auto& v : f)
              if (!(std::fabs(v) < bound)) v = std::copysign(bound * 0.25f, v);
          if (n > 0) {
            const float specials[] = {0.0f, -0.0f, inf, -inf, nan, bound, -bound, std::nextafter(bound, 0.0f), 1e-7f, 65504.0f};
            f[static_cast<std::size_t>(rng() % static_cast<std::uint32_t>(n))] = specials[rng() % 10];
            if (trial == 3) f[static_cast<std::size_t>(n - 1)] = specials[rng() % 10];
          }
          const auto h = to_halves(f);
          INFO(isa << " n=" << n << " bound=" << bound << " trial " << trial);
          CHECK(backend::Cpu::first_not_below(f.data(), n, bound) == backend::Scalar::first_not_below(f.data(), n, bound));
          CHECK(backend::Cpu::first_not_below(h.data(), n, bound) == backend::Scalar::first_not_below(h.data(), n, bound));
          if (n > 1) {
            CHECK(backend::Cpu::first_not_below(f.data() + 1, n - 1, bound) ==
                  backend::Scalar::first_not_below(f.data() + 1, n - 1, bound));
            CHECK(backend::Cpu::first_not_below(h.data() + 1, n - 1, bound) ==
                  backend::Scalar::first_not_below(h.data() + 1, n - 1, bound));
          }
        }
      }
    }
  });
}

TEST_CASE("codecs: Hadamard rotation on the CPU equals the reference", "[quant][codec][cpu]") {
  for_each_isa([](const std::string& isa) {
    for (std::int64_t d : {16, 32, 40, 64, 128, 256, 576})
      for (std::int64_t n : {0, 8, 16, 32, 64, 128, 256}) {
        if (n > 1 && (d % n != 0)) continue;
        const std::string what = isa + " d=" + std::to_string(d) + " n=" + std::to_string(n);
        const auto x = corner_rows(kRows, d, 7, false);
        const auto xh = to_halves(x);
        std::vector<float> a(x.size()), b(x.size());
        backend::Scalar::rotate_rows_in(x.data(), kRows, d, d, n, a.data());
        backend::Cpu::rotate_rows_in(x.data(), kRows, d, d, n, b.data());
        require_same(a, b, what + " in f32");
        backend::Scalar::rotate_rows_in(xh.data(), kRows, d, d, n, a.data());
        backend::Cpu::rotate_rows_in(xh.data(), kRows, d, d, n, b.data());
        require_same(a, b, what + " in f16");
        std::vector<float> ya = x, yb = x, oa(x.size()), ob(x.size());
        std::vector<half> ha(x.size()), hb(x.size());
        backend::Scalar::rotate_rows_out(ya.data(), kRows, d, n, oa.data(), d);
        backend::Cpu::rotate_rows_out(yb.data(), kRows, d, n, ob.data(), d);
        require_same(oa, ob, what + " out f32");
        ya = x, yb = x;
        backend::Scalar::rotate_rows_out(ya.data(), kRows, d, n, ha.data(), d);
        backend::Cpu::rotate_rows_out(yb.data(), kRows, d, n, hb.data(), d);
        require_same(ha, hb, what + " out f16");
      }
  });
}

TEST_CASE("codecs: token-wise INT4 / INT8 on the CPU equals the reference", "[quant][codec][cpu]") {
  for_each_isa([](const std::string& isa) {
    for (int bits : {4, 8})
      for (std::int64_t d : {2, 16, 24, 32, 64, 128, 256}) {
        const std::string what = isa + " bits=" + std::to_string(bits) + " d=" + std::to_string(d);
        const auto x = corner_rows(kRows, d, 11, false);
        const std::int64_t rb = int4q::row_bytes(d, bits), stride = rb + 3;  // a row stride beyond the row
        std::vector<std::uint8_t> ca(static_cast<std::size_t>(kRows * stride), 0xAB), cb = ca;
        backend::Scalar::int4_quantize_rows(x.data(), kRows, d, bits, ca.data(), stride);
        backend::Cpu::int4_quantize_rows(x.data(), kRows, d, bits, cb.data(), stride);
        require_same(ca, cb, what + " codes");
        std::vector<float> ya(x.size()), yb(x.size());
        backend::Scalar::int4_dequantize_rows(ca.data(), kRows, stride, d, bits, ya.data(), d);
        backend::Cpu::int4_dequantize_rows(ca.data(), kRows, stride, d, bits, yb.data(), d);
        require_same(ya, yb, what + " decoded");
        std::vector<half> ha(x.size()), hb(x.size());
        backend::Scalar::int4_dequantize_rows(ca.data(), kRows, stride, d, bits, ha.data(), d);
        backend::Cpu::int4_dequantize_rows(ca.data(), kRows, stride, d, bits, hb.data(), d);
        require_same(ha, hb, what + " decoded f16");
      }
  });
}

TEST_CASE("codecs: fp8 on the CPU equals the reference, every code decoded", "[quant][codec][cpu]") {
  for_each_isa([](const std::string& isa) {
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      // Every code, every scale kind: decode.
      std::vector<std::uint8_t> all(256 + 16);
      for (int c = 0; c < 256; ++c) all[static_cast<std::size_t>(c)] = static_cast<std::uint8_t>(c);
      const float trailer = 0.37f;
      std::memcpy(all.data() + 256, &trailer, 4);
      // Rows of codes decoded to fp32 and to fp16 on both backends.
      const auto decode_both = [&](const std::vector<std::uint8_t>& codes, std::int64_t rows, std::int64_t stride, std::int64_t d, float s,
                                   const std::string& what) {
        std::vector<float> ya(static_cast<std::size_t>(rows * d)), yb(ya.size());
        std::vector<half> ha(ya.size()), hb(ya.size());
        backend::Scalar::fp8_dequantize_rows(f, codes.data(), rows, stride, d, s, ya.data(), d);
        backend::Cpu::fp8_dequantize_rows(f, codes.data(), rows, stride, d, s, yb.data(), d);
        require_same(ya, yb, what + " f32");
        backend::Scalar::fp8_dequantize_rows(f, codes.data(), rows, stride, d, s, ha.data(), d);
        backend::Cpu::fp8_dequantize_rows(f, codes.data(), rows, stride, d, s, hb.data(), d);
        require_same(ha, hb, what + " f16");
      };
      for (float s : {1.0f, 0.0f, 3.5e-3f}) decode_both(all, 1, 272, 256, s, isa + " fp8 all codes");
      // Every code again in rows of d (per level: whole pairs of vectors, single vectors, a mix), with scales at
      // the edges of the kernel's folded scale (2^8 s exact up to FLT_MAX / 2^8; beyond it, and for inf / NaN,
      // the per-code path), as the parameter and as each row's trailer (negative ones included).
      const float huge = std::numeric_limits<float>::max(), inf = std::numeric_limits<float>::infinity();
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (std::int64_t d : {8, 16, 24, 32, 48, 64}) {
        const std::int64_t rows = (256 + d - 1) / d, stride = d + 16;
        for (float s : {1e-40f, 1.3e36f, huge / 256.0f, 3.0e38f, 0.0f})
          for (float trailer : {0.37f, -2.5f, 1e-40f, huge / 256.0f, huge, -huge, inf, nan}) {
            if (s > 0.0f && trailer != 0.37f) continue;  // the trailers matter only for the per-row kind
            std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * stride));
            for (std::int64_t r = 0; r < rows; ++r) {
              for (std::int64_t j = 0; j < d; ++j)
                codes[static_cast<std::size_t>(r * stride + j)] = static_cast<std::uint8_t>((r * d + j) % 256);
              std::memcpy(codes.data() + r * stride + d, &trailer, 4);
            }
            decode_both(
                codes, rows, stride, d, s,
                isa + " " + fp8_name(f) + " d=" + std::to_string(d) + " s=" + std::to_string(s) + " trailer=" + std::to_string(trailer));
          }
      }
      // Encode: rows with corner values, plus every midpoint between neighbouring codes and values beyond the max.
      for (std::int64_t d : {16, 40, 64, 128}) {
        auto x = corner_rows(kRows, d, 13, false);
        const float fmax = fp8_max(f);
        for (std::int64_t i = 0; i < d; ++i)
          x[static_cast<std::size_t>(i)] = (i % 2 ? -1.0f : 1.0f) * fmax * (1.0f + 0.01f * static_cast<float>(i));
        std::vector<float> mids;
        for (int c = 0; c < 127; ++c) {
          const float lo = fp8_decode(f, static_cast<std::uint8_t>(c)), hi = fp8_decode(f, static_cast<std::uint8_t>(c + 1));
          if (std::isfinite(lo) && std::isfinite(hi))
            mids.push_back(0.5f * (lo + hi)), mids.push_back(-0.5f * (lo + hi)), mids.push_back(lo);
        }
        for (std::size_t i = 0; i < mids.size() && i + 2 * static_cast<std::size_t>(d) < x.size(); ++i)
          x[2 * static_cast<std::size_t>(d) + i] = mids[i];
        const auto xh = to_halves(x);
        const std::int64_t stride = d + 16;
        for (float s : {0.0f, 1.0f, 0.02f, 0.25f, 4096.0f, 0x1p-120f, 0x1p-126f}) {  // powers of two: the product path
          const std::string what = isa + " " + fp8_name(f) + " d=" + std::to_string(d) + " scale=" + std::to_string(s);
          std::vector<std::uint8_t> ca(static_cast<std::size_t>(kRows * stride), 0xCD), cb = ca;
          backend::Scalar::fp8_quantize_rows(f, x.data(), kRows, d, d, s, ca.data(), stride);
          backend::Cpu::fp8_quantize_rows(f, x.data(), kRows, d, d, s, cb.data(), stride);
          require_same(ca, cb, what + " f32 codes");
          backend::Scalar::fp8_quantize_rows(f, xh.data(), kRows, d, d, s, ca.data(), stride);
          backend::Cpu::fp8_quantize_rows(f, xh.data(), kRows, d, d, s, cb.data(), stride);
          require_same(ca, cb, what + " f16 codes");
        }
      }
    }
  });
}

TEST_CASE("codecs: KIVI keys and values on the CPU equal the reference", "[quant][codec][cpu][kivi]") {
  for_each_isa([](const std::string& isa) {
    for (int bits : {2, 4, 8})
      for (std::int64_t d : {16, 32, 48, 64, 128})
        for (int group : {8, 16, 32, 64}) {
          for (const int kind : {0, 1, 2}) {
            const bool wide = kind == 1;
            const std::string what = isa + " bits=" + std::to_string(bits) + " d=" + std::to_string(d) + " G=" + std::to_string(group) +
                                     (kind == 0   ? " corners"
                                      : kind == 1 ? " wide"
                                                  : " flat");
            auto raw = wide ? wide_rows(group, d, 19 + static_cast<std::uint32_t>(d + group + bits)) : corner_rows(group, d, 17, false);
            if (kind == 2) {  // zero scales: constant groups (x - mn = 0 -> code 0) and groups spanning one subnormal
              // step, whose scale rounds to 0 while their values differ (the reference's x / 0 = inf -> the top code).
              // Values: rows 0 and 1 past their first group; keys: channels 0 / 1 and channel 2.
              for (std::int64_t c = 0; c < d; ++c) {
                raw[static_cast<std::size_t>(c)] = c % 2 ? 0x1p-24f : -0.0f;
                raw[static_cast<std::size_t>(d + c)] = 0.25f;
              }
              for (std::int64_t t = 0; t < group; ++t) {
                raw[static_cast<std::size_t>(t * d + 0)] = 0.75f;
                raw[static_cast<std::size_t>(t * d + 1)] = 0.0f;
                raw[static_cast<std::size_t>(t * d + 2)] = (t % 3 == 0) ? 0x1p-24f : 0.0f;
              }
            }
            std::vector<float> x(raw.size()), xb(raw.size());
            backend::Scalar::kivi_r16_rows(raw.data(), group, d, d, x.data());
            backend::Cpu::kivi_r16_rows(raw.data(), group, d, d, xb.data());
            require_same(x, xb, what + " r16");
            if (group % (32 / bits) == 0) {  // keys pack tokens into words
              const std::int64_t cbytes = kivi::key_group_code_bytes(d, group, bits), sbytes = kivi::key_group_scale_bytes(d);
              std::vector<std::uint8_t> ca(static_cast<std::size_t>(cbytes), 0x11), cb = ca, sa(static_cast<std::size_t>(sbytes), 0x22),
                                                                                    sb = sa;
              backend::Scalar::kivi_quantize_keys(x.data(), d, group, bits, ca.data(), sa.data());
              backend::Cpu::kivi_quantize_keys(x.data(), d, group, bits, cb.data(), sb.data());
              require_same(ca, cb, what + " key codes");
              require_same(sa, sb, what + " key scales");
              std::vector<float> ya(x.size()), yb(x.size());
              backend::Scalar::kivi_dequantize_keys(ca.data(), sa.data(), d, group, bits, ya.data(), d);
              backend::Cpu::kivi_dequantize_keys(ca.data(), sa.data(), d, group, bits, yb.data(), d);
              require_same(ya, yb, what + " keys decoded");
              // fp16 rows with a padded stride: the same values, the padding untouched
              const std::int64_t ys = d + 8;
              std::vector<half> ha(static_cast<std::size_t>(group * ys), to_half(-7.0f)), hb = ha;
              backend::Scalar::kivi_dequantize_keys(ca.data(), sa.data(), d, group, bits, ha.data(), ys);
              backend::Cpu::kivi_dequantize_keys(ca.data(), sa.data(), d, group, bits, hb.data(), ys);
              require_same(ha, hb, what + " keys decoded to fp16");
              for (std::int64_t t = 0; t < group; ++t)
                for (std::int64_t c = 0; c < ys; ++c)
                  REQUIRE(to_float(ha[static_cast<std::size_t>(t * ys + c)]) == (c < d ? ya[static_cast<std::size_t>(t * d + c)] : -7.0f));
            }
            if (d % group == 0 && d % (32 / bits) == 0) {
              const std::int64_t rows = group, cs = kivi::value_row_code_bytes(d, bits) + 4, ss = kivi::value_row_scale_bytes(d, group) + 2;
              std::vector<std::uint8_t> ca(static_cast<std::size_t>(rows * cs), 0x33),
                  cb = ca, sa(static_cast<std::size_t>(rows * ss), 0x44), sb = sa;
              backend::Scalar::kivi_quantize_value_rows(x.data(), rows, d, group, bits, ca.data(), cs, sa.data(), ss);
              backend::Cpu::kivi_quantize_value_rows(x.data(), rows, d, group, bits, cb.data(), cs, sb.data(), ss);
              require_same(ca, cb, what + " value codes");
              require_same(sa, sb, what + " value scales");
              std::vector<float> ya(x.size()), yb(x.size());
              backend::Scalar::kivi_dequantize_value_rows(ca.data(), cs, sa.data(), ss, rows, d, group, bits, ya.data(), d);
              backend::Cpu::kivi_dequantize_value_rows(ca.data(), cs, sa.data(), ss, rows, d, group, bits, yb.data(), d);
              require_same(ya, yb, what + " values decoded");
              const std::int64_t ys = d + 8;
              std::vector<half> ha(static_cast<std::size_t>(rows * ys), to_half(-7.0f)), hb = ha;
              backend::Scalar::kivi_dequantize_value_rows(ca.data(), cs, sa.data(), ss, rows, d, group, bits, ha.data(), ys);
              backend::Cpu::kivi_dequantize_value_rows(ca.data(), cs, sa.data(), ss, rows, d, group, bits, hb.data(), ys);
              require_same(ha, hb, what + " values decoded to fp16");
              for (std::int64_t t = 0; t < rows; ++t)
                for (std::int64_t c = 0; c < ys; ++c)
                  REQUIRE(to_float(ha[static_cast<std::size_t>(t * ys + c)]) == (c < d ? ya[static_cast<std::size_t>(t * d + c)] : -7.0f));
            }
          }
        }
    // first_not_below: NaN, infinities and the bound itself, at every position of a long row.
    std::vector<float> v(333, 1.0f);
    for (std::size_t at : {0u, 17u, 64u, 200u, 332u})
      for (float bad : {__builtin_nanf(""), __builtin_inff(), -__builtin_inff(), 32752.0f, -40000.0f}) {
        v.assign(333, 1.0f);
        v[at] = bad;
        REQUIRE(backend::Cpu::first_not_below(v.data(), 333, 32752.0f) == static_cast<std::int64_t>(at));
        REQUIRE(backend::Scalar::first_not_below(v.data(), 333, 32752.0f) == static_cast<std::int64_t>(at));
      }
    v.assign(333, -32751.0f);
    REQUIRE(backend::Cpu::first_not_below(v.data(), 333, 32752.0f) == -1);
    // The same scan over fp16 values (KIVI's check of fp16 rows as they are).
    std::vector<half> vh(333, to_half(1.0f));
    for (std::size_t at : {0u, 17u, 64u, 200u, 332u})
      for (float bad : {__builtin_nanf(""), __builtin_inff(), -__builtin_inff(), 32752.0f, -40000.0f}) {
        vh.assign(333, to_half(1.0f));
        vh[at] = to_half(bad);
        REQUIRE(backend::Cpu::first_not_below(vh.data(), 333, 32752.0f) == static_cast<std::int64_t>(at));
        REQUIRE(backend::Scalar::first_not_below(vh.data(), 333, 32752.0f) == static_cast<std::int64_t>(at));
      }
    vh.assign(333, to_half(-32736.0f));  // the largest fp16 magnitude below 32752
    REQUIRE(backend::Cpu::first_not_below(vh.data(), 333, 32752.0f) == -1);
  });
}

namespace {

template <class P>
std::vector<std::uint8_t> policy_codes(const P& p, const Context<backend::Cpu>* cpu, const std::vector<half>& x, std::int64_t H,
                                       std::int64_t T, std::int64_t d, std::vector<half>* decoded, std::int64_t pad = 0) {
  // pad > 0: code rows `pad` bytes apart beyond their length (the strided-codes paths).
  const std::int64_t rb = p.row_bytes(d);
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(H * T * (rb + pad)), 0);
  QuantizedKV q{p.layout(), TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, T, rb + pad}).narrow(2, 0, rb), {}, T};
  typename P::State st{};
  const auto in = TensorView<const half, 3>::contiguous(x.data(), {H, T, d});
  decoded->assign(x.size(), half{});
  const auto out = TensorView<half, 3>::contiguous(decoded->data(), {H, T, d});
  if (cpu != nullptr) {
    REQUIRE(p.quantize(*cpu, in, st, q).is_ok());
    REQUIRE(p.dequantize(*cpu, q, out).is_ok());
  } else {
    const Context<backend::Scalar> sc{};
    REQUIRE(p.quantize(sc, in, st, q).is_ok());
    REQUIRE(p.dequantize(sc, q, out).is_ok());
  }
  return codes;
}

}  // namespace

TEST_CASE("codecs: the quantization policies give the same bytes on Scalar and Cpu", "[quant][codec][cpu]") {
  const std::int64_t H = 3, T = 64, d = 128;
  const auto x = to_halves(corner_rows(H * T, d, 23, false));
  const Context<backend::Cpu> cpu{};
  for_each_isa([&](const std::string& isa) {
    std::vector<half> da, db;
    for (HadamardMode rot : {HadamardMode::kNone, HadamardMode::kLlamaCpp, HadamardMode::kBlock}) {
      // Code rows back to back, then 8 bytes apart: the same values decoded either way (the policies pick
      // their one-call paths by the stride, for both backends alike).
      std::vector<half> flat_int4[2], flat_q4;
      for (std::int64_t pad : {0, 8}) {
        const std::string at = " pad=" + std::to_string(pad);
        for (int bits : {4, 8}) {
          const Int4Quant p(Int4QuantParams{bits, rot, 32, QuantRole::kKeys});
          require_same(policy_codes(p, nullptr, x, H, T, d, &da, pad), policy_codes(p, &cpu, x, H, T, d, &db, pad),
                       isa + " int4 codes" + at);
          require_same(da, db, isa + " int4 decoded" + at);
          if (pad == 0)
            flat_int4[bits / 8] = da;
          else
            require_same(da, flat_int4[bits / 8], isa + " int4 decoded, strided codes");
        }
        const GgmlQuant g(GgmlQuantParams{GgmlType::kQ4_0, rot, 64, QuantRole::kValues});
        require_same(policy_codes(g, nullptr, x, H, T, d, &da, pad), policy_codes(g, &cpu, x, H, T, d, &db, pad), isa + " q4_0 codes" + at);
        require_same(da, db, isa + " q4_0 decoded" + at);
        if (pad == 0)
          flat_q4 = da;
        else
          require_same(da, flat_q4, isa + " q4_0 decoded, strided codes");
      }
    }
    for (Fp8Scale sc : {Fp8Scale::kPerTensor, Fp8Scale::kPerTokenHead}) {
      const Fp8Quant p(Fp8QuantParams{Fp8Format::kE4M3, sc, 0.05f});
      require_same(policy_codes(p, nullptr, x, H, T, d, &da), policy_codes(p, &cpu, x, H, T, d, &db), isa + " fp8 codes");
      require_same(da, db, isa + " fp8 decoded");
    }
    // KIVI, streaming: the prompt then 40 single-token appends, K and V, 2 and 4 bits.
    for (QuantRole role : {QuantRole::kKeys, QuantRole::kValues})
      for (int bits : {2, 4}) {
        const KiviQuant p(KiviQuantParams{role, bits, 32, 32});
        const std::int64_t cap = T + 40, rows = p.code_rows(cap);
        std::vector<std::uint8_t> c[2], s[2];
        std::vector<half> res[2];
        KiviState st[2];
        QuantizedKV q[2];
        for (int k = 0; k < 2; ++k) {
          c[k].assign(static_cast<std::size_t>(H * rows * p.codes_row_bytes(d)), 0);
          s[k].assign(static_cast<std::size_t>(H * rows * p.scales_row_bytes(d)), 0);
          res[k].assign(static_cast<std::size_t>(H * 64 * d), half{});
          st[k] = KiviState{TensorView<half, 3>::contiguous(res[k].data(), {H, 64, d}), 0};
          q[k] = QuantizedKV{p.layout(), TensorView<std::uint8_t, 3>::contiguous(c[k].data(), {H, rows, p.codes_row_bytes(d)}),
                             TensorView<std::uint8_t, 3>::contiguous(s[k].data(), {H, rows, p.scales_row_bytes(d)}), 0};
        }
        const auto stream = to_halves(corner_rows(H * 40, d, 29, false));
        const auto prompt = TensorView<const half, 3>::contiguous(x.data(), {H, T, d});
        const Context<backend::Scalar> scx{};
        REQUIRE(p.append(scx, prompt, st[0], q[0]).is_ok());
        REQUIRE(p.append(cpu, prompt, st[1], q[1]).is_ok());
        for (std::int64_t t = 0; t < 40; ++t) {
          const auto step = TensorView<const half, 3>::contiguous(stream.data(), {H, 40, d}).narrow(1, t, 1);
          REQUIRE(p.append(scx, step, st[0], q[0]).is_ok());
          REQUIRE(p.append(cpu, step, st[1], q[1]).is_ok());
        }
        REQUIRE(q[0].tokens == q[1].tokens);
        REQUIRE(q[0].tokens > 0);
        const std::string what = isa + " kivi role=" + std::to_string(static_cast<int>(role)) + " bits=" + std::to_string(bits);
        require_same(c[0], c[1], what + " codes");
        require_same(s[0], s[1], what + " scales");
        require_same(res[0], res[1], what + " residual");
        std::vector<float> ya(static_cast<std::size_t>(H * q[0].tokens * d)), yb(ya.size());
        REQUIRE(p.dequantize(scx, q[0], TensorView<float, 3>::contiguous(ya.data(), {H, q[0].tokens, d})).is_ok());
        REQUIRE(p.dequantize(cpu, q[1], TensorView<float, 3>::contiguous(yb.data(), {H, q[1].tokens, d})).is_ok());
        require_same(ya, yb, what + " decoded");
      }
  });
}

TEST_CASE("codecs: ggml block quantizers on the CPU equal the reference on corner rows", "[quant][codec][cpu][ggml]") {
  for_each_isa([](const std::string& isa) {
    for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kIQ4_NL})
      for (std::int64_t d : {32, 64, 128}) {
        auto x = corner_rows(kRows, d, 31, false);
        // Ties of |x| with both signs (q4_0 / q5_0 keep the first), and exact .5 products for q8_0's rounding.
        for (std::int64_t c = 0; c < d; ++c) x[static_cast<std::size_t>(d + c)] = (c % 5 == 0) ? ((c % 2) ? -2.0f : 2.0f) : 0.5f;
        for (std::int64_t c = 0; c < d; ++c) x[static_cast<std::size_t>(2 * d + c)] = static_cast<float>(c % 17) * 0.5f - 4.0f;
        const auto xh = to_halves(x);
        const std::int64_t rb = d / 32 * ggml_block_bytes(t);
        std::vector<std::uint8_t> ca(static_cast<std::size_t>(kRows * rb)), cb(ca.size());
        for (std::int64_t r = 0; r < kRows; ++r) {
          backend::Scalar::ggml_quantize_row(t, x.data() + r * d, d, ca.data() + r * rb);
          backend::Cpu::ggml_quantize_row(t, x.data() + r * d, d, cb.data() + r * rb);
        }
        require_same(ca, cb, isa + " " + ggml_name(t) + " f32 d=" + std::to_string(d));
        // All rows in one call: the AVX-512 level's 16-block group kernel (and the block kernel for the tail).
        std::fill(cb.begin(), cb.end(), std::uint8_t{0xAA});
        backend::Cpu::ggml_quantize_row(t, x.data(), kRows * d, cb.data());
        require_same(ca, cb, isa + " " + ggml_name(t) + " f32 one call d=" + std::to_string(d));
        for (std::int64_t r = 0; r < kRows; ++r) {
          backend::Scalar::ggml_quantize_row(t, xh.data() + r * d, d, ca.data() + r * rb);
          backend::Cpu::ggml_quantize_row(t, xh.data() + r * d, d, cb.data() + r * rb);
        }
        require_same(ca, cb, isa + " " + ggml_name(t) + " f16 d=" + std::to_string(d));
        std::fill(cb.begin(), cb.end(), std::uint8_t{0xAA});
        backend::Cpu::ggml_quantize_row(t, xh.data(), kRows * d, cb.data());
        require_same(ca, cb, isa + " " + ggml_name(t) + " f16 one call d=" + std::to_string(d));
        // Decoding: random bytes with their scales forced finite, and the codes just written.
        std::mt19937 rng(37);
        std::vector<std::uint8_t> any(ca.size());
        for (auto& b : any) b = static_cast<std::uint8_t>(rng());
        for (std::size_t blk = 0; blk < any.size(); blk += static_cast<std::size_t>(ggml_block_bytes(t))) {
          any[blk + 1] &= 0x3b;  // d (and m) exponents below the fp16 maximum
          if (t == GgmlType::kQ4_1 || t == GgmlType::kQ5_1) any[blk + 3] &= 0x3b;
        }
        for (const auto* codes : {&ca, &any}) {
          std::vector<float> ya(x.size()), yb(x.size());
          std::vector<half> ha(x.size()), hb(x.size());
          for (std::int64_t r = 0; r < kRows; ++r) {
            backend::Scalar::ggml_dequantize_row(t, codes->data() + r * rb, d, ya.data() + r * d);
            backend::Cpu::ggml_dequantize_row(t, codes->data() + r * rb, d, yb.data() + r * d);
            backend::Scalar::ggml_dequantize_row(t, codes->data() + r * rb, d, ha.data() + r * d);
            backend::Cpu::ggml_dequantize_row(t, codes->data() + r * rb, d, hb.data() + r * d);
          }
          require_same(ya, yb, isa + " " + ggml_name(t) + " decoded f32 d=" + std::to_string(d));
          require_same(ha, hb, isa + " " + ggml_name(t) + " decoded f16 d=" + std::to_string(d));
        }
      }
  });
}

TEST_CASE("codecs: ggml rows decoded with streaming stores equal the normal stores", "[quant][codec][cpu][ggml]") {
  // Cpu::set_streaming_stores(true): decoded outputs of 64 KiB and more are decoded 4096 values at a time and
  // streamed. Lengths below, at and above the threshold, not a multiple of the piece; codes and outputs at
  // several offsets from a 64-byte line (the copy's head and tail take normal stores); values around the
  // output untouched. Then GgmlQuant end to end (the quantizers keep normal stores; codes must not change).
  const bool saved = backend::Cpu::streaming_stores();
  const auto x = corner_rows(64, 4096 + 96, 41, false);  // 274,944 values
  const auto xh = to_halves(x);
  for_each_isa([&](const std::string& isa) {
    for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kIQ4_NL})
      for (std::int64_t n : {std::int64_t{1024}, std::int64_t{32768}, std::int64_t{65536 + 32}, static_cast<std::int64_t>(x.size())}) {
        const std::int64_t bb = ggml_block_bytes(t), cb = n / 32 * bb;
        for (std::int64_t off : {0, 1, 17, 63}) {
          const std::string what = isa + " " + ggml_name(t) + " n=" + std::to_string(n) + " offset " + std::to_string(off);
          std::vector<std::uint8_t> want(static_cast<std::size_t>(cb + 128), 0x5A);
          backend::Cpu::set_streaming_stores(false);
          backend::Cpu::ggml_quantize_row(t, xh.data(), n, want.data() + off);
          // Decoding to fp16 (2-byte steps of misalignment) and fp32 (4-byte steps).
          const std::int64_t eh = off / 2 + 1, ef = off / 4 + 1;
          std::vector<half> ha(static_cast<std::size_t>(n + 64), half::from_bits(0x1234)), hb = ha;
          std::vector<float> fa(static_cast<std::size_t>(n + 64), -3.0f), fb = fa;
          backend::Cpu::ggml_dequantize_row(t, want.data() + off, n, ha.data() + eh);
          backend::Cpu::ggml_dequantize_row(t, want.data() + off, n, fa.data() + ef);
          backend::Cpu::set_streaming_stores(true);
          backend::Cpu::ggml_dequantize_row(t, want.data() + off, n, hb.data() + eh);
          backend::Cpu::ggml_dequantize_row(t, want.data() + off, n, fb.data() + ef);
          require_same(ha, hb, what + " dequantize f16");
          require_same(fa, fb, what + " dequantize f32");
        }
      }
  });
  // Through GgmlQuant: one call per head for contiguous rows, codes and outputs.
  const std::int64_t H = 3, T = 690, d = 128;  // 264,960 values of the 268,288 in xh
  REQUIRE(xh.size() >= static_cast<std::size_t>(H * T * d));
  std::vector<half> rows(xh.begin(), xh.begin() + H * T * d);
  const auto in = TensorView<const half, 3>::contiguous(rows.data(), {H, T, d});
  for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_1}) {
    const GgmlQuant p(GgmlQuantParams{t});
    std::vector<std::uint8_t> ca(static_cast<std::size_t>(H * T * p.row_bytes(d))), cs(ca.size());
    std::vector<half> ya(rows.size()), ys(rows.size());
    GgmlQuant::State st;
    auto run = [&](bool streaming, std::vector<std::uint8_t>& codes, std::vector<half>& y) {
      backend::Cpu::set_streaming_stores(streaming);
      QuantizedKV q;
      q.layout = p.layout();
      q.codes = TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, T, p.row_bytes(d)});
      q.tokens = T;
      REQUIRE(p.quantize(Context<backend::Cpu>{}, in, st, q).is_ok());
      REQUIRE(p.dequantize(Context<backend::Cpu>{}, q, TensorView<half, 3>::contiguous(y.data(), {H, T, d})).is_ok());
    };
    run(false, ca, ya);
    run(true, cs, ys);
    require_same(ca, cs, std::string("GgmlQuant ") + ggml_name(t) + " codes");
    require_same(ya, ys, std::string("GgmlQuant ") + ggml_name(t) + " decoded");
  }
  backend::Cpu::set_streaming_stores(saved);
}

TEST_CASE("codecs: INT4 and KIVI value rows decoded with streaming stores equal the normal stores", "[quant][codec][cpu][kivi]") {
  // Contiguous output rows of 64 KiB and more go out 4096 / d rows at a time through a stack buffer; row counts
  // below and above the threshold and not a multiple of the piece, padded code strides, head dims that give
  // pieces of 32, 16 and 4 rows, an output starting off a 64-byte line; the values around it untouched.
  const bool saved = backend::Cpu::streaming_stores();
  for_each_isa([&](const std::string& isa) {
    for (std::int64_t d : {128, 256, 1024})
      for (std::int64_t rows : {std::int64_t{8}, std::int64_t{300}, std::int64_t{1000}}) {
        const auto x = corner_rows(rows, d, 43, false);
        for (int bits : {4, 8}) {  // token-wise INT4 / INT8
          const std::string what = isa + " int" + std::to_string(bits) + " d=" + std::to_string(d) + " rows=" + std::to_string(rows);
          const std::int64_t is = int4q::row_bytes(d, bits) + 5;
          std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * is), 0x11);
          backend::Cpu::int4_quantize_rows(x.data(), rows, d, bits, codes.data(), is);
          std::vector<half> ha(static_cast<std::size_t>(rows * d + 64), half::from_bits(0x2222)), hb = ha;
          std::vector<float> fa(static_cast<std::size_t>(rows * d + 64), -5.0f), fb = fa;
          backend::Cpu::set_streaming_stores(false);
          backend::Cpu::int4_dequantize_rows(codes.data(), rows, is, d, bits, ha.data() + 3, d);
          backend::Cpu::int4_dequantize_rows(codes.data(), rows, is, d, bits, fa.data() + 5, d);
          backend::Cpu::set_streaming_stores(true);
          backend::Cpu::int4_dequantize_rows(codes.data(), rows, is, d, bits, hb.data() + 3, d);
          backend::Cpu::int4_dequantize_rows(codes.data(), rows, is, d, bits, fb.data() + 5, d);
          require_same(ha, hb, what + " f16");
          require_same(fa, fb, what + " f32");
        }
        for (int bits : {2, 4}) {  // KIVI values, group 32
          const int group = 32;
          const std::string what = isa + " kivi v" + std::to_string(bits) + " d=" + std::to_string(d) + " rows=" + std::to_string(rows);
          const std::int64_t cs = kivi::value_row_code_bytes(d, bits) + 4, ss = kivi::value_row_scale_bytes(d, group) + 2;
          std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * cs), 0x33), scales(static_cast<std::size_t>(rows * ss), 0x44);
          backend::Cpu::kivi_quantize_value_rows(x.data(), rows, d, group, bits, codes.data(), cs, scales.data(), ss);
          std::vector<half> ha(static_cast<std::size_t>(rows * d + 64), half::from_bits(0x2222)), hb = ha;
          std::vector<float> fa(static_cast<std::size_t>(rows * d + 64), -5.0f), fb = fa;
          backend::Cpu::set_streaming_stores(false);
          backend::Cpu::kivi_dequantize_value_rows(codes.data(), cs, scales.data(), ss, rows, d, group, bits, ha.data() + 3, d);
          backend::Cpu::kivi_dequantize_value_rows(codes.data(), cs, scales.data(), ss, rows, d, group, bits, fa.data() + 5, d);
          backend::Cpu::set_streaming_stores(true);
          backend::Cpu::kivi_dequantize_value_rows(codes.data(), cs, scales.data(), ss, rows, d, group, bits, hb.data() + 3, d);
          backend::Cpu::kivi_dequantize_value_rows(codes.data(), cs, scales.data(), ss, rows, d, group, bits, fb.data() + 5, d);
          require_same(ha, hb, what + " f16");
          require_same(fa, fb, what + " f32");
        }
      }
  });
  backend::Cpu::set_streaming_stores(saved);
}

namespace {
/// The CPU KIVI quantizers' quotient (quant_codec_impl.hpp, div_fp16_by_recip) in scalar form: a / s through
/// r = 1 / s, q = a r, then q + (a - q s) r with fused multiply-adds. Returns how many fp16 a >= 0 (all of them)
/// give a different fp32 value than a / s, for each fp16 bit pattern s in `scales`.
std::int64_t recip_quotient_mismatches(const std::vector<std::uint16_t>& scales) {
  std::vector<float> a(0x7C00);
  for (std::uint32_t i = 0; i < 0x7C00; ++i) a[i] = to_float(half::from_bits(static_cast<std::uint16_t>(i)));
  std::int64_t bad = 0;
  for (const std::uint16_t sb : scales) {
    const float s = to_float(half::from_bits(sb)), r = 1.0f / s;
    for (const float x : a) {
      const float q = x * r, q2 = std::fma(std::fma(-q, s, x), r, q), want = x / s;
      bad += bits_of(q2) != bits_of(want);
    }
  }
  return bad;
}
}  // namespace

TEST_CASE("codecs: KIVI's reciprocal quotient equals the fp32 division for fp16 operands (sampled scales)", "[quant][codec][kivi]") {
  // Every fp16 a >= 0 against every 97th positive fp16 s and the edges: subnormals, 1, 1/3 and its neighbours, the largest.
  std::vector<std::uint16_t> scales{0x0001, 0x0002, 0x03FF, 0x0400, 0x3C00, 0x3555, 0x3554, 0x3556, 0x7BFF, 0x7BFE};
  for (std::uint32_t sb = 1; sb < 0x7C00; sb += 97) scales.push_back(static_cast<std::uint16_t>(sb));
  REQUIRE(recip_quotient_mismatches(scales) == 0);
}

TEST_CASE("codecs: KIVI's reciprocal quotient equals the fp32 division for every pair of fp16 operands", "[.exhaustive][quant][kivi]") {
  std::vector<std::uint16_t> scales;
  for (std::uint32_t sb = 1; sb < 0x7C00; ++sb) scales.push_back(static_cast<std::uint16_t>(sb));
  REQUIRE(recip_quotient_mismatches(scales) == 0);  // 31,743 x 31,744 = 1,007,649,792 pairs
}

namespace {
/// Finite floats x where iq4_nl's bucket search (kIq4nlBucket*, the AVX-512 kernel's) and ggml's
/// best_index_int8 (the reference) disagree, over the bit patterns [first, last) in steps of `step`.
std::int64_t iq4nl_bucket_mismatches(std::uint64_t first, std::uint64_t last, std::uint64_t step) {
  std::int64_t bad = 0;
  for (std::uint64_t u = first; u < last; u += step) {
    const auto w = static_cast<std::uint32_t>(u);
    float x;
    std::memcpy(&x, &w, sizeof x);
    if (std::isfinite(x)) bad += iq4nl_bucket_index(x) != ggml_ref::iq4nl_index(x);
  }
  return bad;
}
}  // namespace

TEST_CASE("codecs: iq4_nl's bucket search equals ggml's nearest-level search (sampled, and around every level and midpoint)",
          "[quant][codec][ggml]") {
  REQUIRE(iq4nl_bucket_mismatches(0, std::uint64_t{1} << 32, 4099) == 0);
  std::int64_t bad = 0;
  for (int k = 0; k < 16; ++k) {
    std::vector<float> centres{static_cast<float>(kIq4nlValues[k])};
    if (k < 15) centres.push_back(0.5f * static_cast<float>(kIq4nlValues[k] + kIq4nlValues[k + 1]));
    for (const float c : centres) {
      float x = c;
      for (int i = 0; i < 4096; ++i) x = std::nextafter(x, -1e30f);
      for (int i = 0; i < 8192; ++i, x = std::nextafter(x, 1e30f)) bad += iq4nl_bucket_index(x) != ggml_ref::iq4nl_index(x);
    }
  }
  REQUIRE(bad == 0);
}

TEST_CASE("codecs: iq4_nl's bucket search equals ggml's nearest-level search for every finite float", "[.exhaustive][quant][ggml]") {
  REQUIRE(iq4nl_bucket_mismatches(0, std::uint64_t{1} << 32, 1) == 0);  // 4,278,190,080 finite floats
}

TEST_CASE("codecs: iq4_nl on the CPU equals the reference where the scaled values sit on levels and midpoints",
          "[quant][codec][cpu][ggml]") {
  // A block led by -127 has d0 = 1, so its values reach the level search unscaled: each midpoint between two
  // levels, its lower neighbour, each level and its upper neighbour, in 16 blocks shifted so every lane sees them.
  std::vector<float> pool;
  for (int k = 0; k < 16; ++k) {
    const auto l = static_cast<float>(kIq4nlValues[k]);
    pool.push_back(l);
    pool.push_back(std::nextafter(l, 1e30f));
    if (k < 15) {
      const float m = 0.5f * (l + static_cast<float>(kIq4nlValues[k + 1]));
      pool.push_back(m);
      pool.push_back(std::nextafter(m, -1e30f));
    }
  }
  const std::int64_t blocks = 48, d = 32 * blocks;
  std::vector<float> x(static_cast<std::size_t>(d));
  for (std::int64_t b = 0; b < blocks; ++b) {
    x[static_cast<std::size_t>(32 * b)] = -127.0f;
    for (std::int64_t j = 1; j < 32; ++j) x[static_cast<std::size_t>(32 * b + j)] = pool[static_cast<std::size_t>(b + 3 * j) % pool.size()];
  }
  const std::int64_t bytes = blocks * ggml_block_bytes(GgmlType::kIQ4_NL);
  std::vector<std::uint8_t> want(static_cast<std::size_t>(bytes)), got(want.size());
  backend::Scalar::ggml_quantize_row(GgmlType::kIQ4_NL, x.data(), d, want.data());
  for_each_isa([&](const std::string& isa) {
    std::fill(got.begin(), got.end(), std::uint8_t{0xAA});
    backend::Cpu::ggml_quantize_row(GgmlType::kIQ4_NL, x.data(), d, got.data());  // 16-block groups, then blocks
    require_same(want, got, isa + " iq4_nl levels and midpoints");
  });
}
