// fp8 e4m3 / e5m2: every code decodes as ml_dtypes (and PyTorch) decode it,
// every value within ±max (all midpoints between neighbours, both sides of
// them, 4000 log-uniform values, subnormals) encodes to ml_dtypes' nearest-even
// code (tests/data/fixtures/fp8.bin); saturation and NaN as documented.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "kvpolicy/quant/fp8.hpp"

using namespace kvpolicy;

namespace {
struct Fp8Fixture {
  std::vector<float> decoded, x;
  std::vector<std::uint8_t> code;
};
std::vector<Fp8Fixture> load() {
  std::ifstream f(std::string(KVP_TEST_DATA_DIR) + "/fixtures/fp8.bin", std::ios::binary);
  REQUIRE(f.good());
  std::string header;
  std::getline(f, header);
  REQUIRE(header.rfind("kvpolicy-fp8-fixtures v1", 0) == 0);
  std::vector<Fp8Fixture> out(2);
  for (auto& fx : out) {
    fx.decoded.resize(256);
    f.read(reinterpret_cast<char*>(fx.decoded.data()), 256 * 4);
    std::uint32_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 4);
    fx.x.resize(n);
    fx.code.resize(n);
    f.read(reinterpret_cast<char*>(fx.x.data()), static_cast<std::streamsize>(n) * 4);
    f.read(reinterpret_cast<char*>(fx.code.data()), n);
    REQUIRE(f.good());
  }
  return out;
}
}  // namespace

TEST_CASE("fp8: all 256 codes decode and every in-range value encodes as ml_dtypes does", "[quant][fp8]") {
  const auto fx = load();
  const Fp8Format formats[2] = {Fp8Format::kE4M3, Fp8Format::kE5M2};
  for (int i = 0; i < 2; ++i) {
    const Fp8Format f = formats[i];
    INFO(fp8_name(f));
    int nan_codes = 0;
    for (int c = 0; c < 256; ++c) {
      const float got = fp8_decode(f, static_cast<std::uint8_t>(c)), want = fx[i].decoded[static_cast<std::size_t>(c)];
      INFO("code " << c);
      if (want != want) {
        REQUIRE(got != got);
        ++nan_codes;
        continue;
      }
      REQUIRE(std::memcmp(&got, &want, sizeof got) == 0);
      // Every non-NaN code is its own nearest value (incl. -0 and, for e5m2, ±inf saturating to ±max).
      const std::uint8_t back = fp8_encode(f, got);
      if (std::isinf(got))
        REQUIRE(back == ((c & 0x80) | fp8_traits(f).max_code));
      else
        REQUIRE(back == c);
    }
    REQUIRE(nan_codes == (f == Fp8Format::kE4M3 ? 2 : 6));
    std::int64_t bad = 0;
    for (std::size_t k = 0; k < fx[i].x.size(); ++k) bad += fp8_encode(f, fx[i].x[k]) != fx[i].code[k] ? 1 : 0;
    INFO(fx[i].x.size() << " values");
    REQUIRE(bad == 0);
    // Saturation (CUDA SATFINITE), NaN.
    const float mx = fp8_max(f), inf = std::numeric_limits<float>::infinity();
    REQUIRE(fp8_encode(f, mx * 1.01f) == fp8_traits(f).max_code);
    REQUIRE(fp8_encode(f, -1e30f) == (0x80 | fp8_traits(f).max_code));
    REQUIRE(fp8_encode(f, inf) == fp8_traits(f).max_code);
    REQUIRE(fp8_decode(f, fp8_encode(f, std::numeric_limits<float>::quiet_NaN())) != fp8_decode(f, 0));
  }
  REQUIRE(fp8_decode(Fp8Format::kE4M3, 0x7e) == 448.0f);
  REQUIRE(fp8_decode(Fp8Format::kE4M3, 0x01) == 0x1p-9f);
  REQUIRE(fp8_decode(Fp8Format::kE5M2, 0x7b) == 57344.0f);
  REQUIRE(fp8_decode(Fp8Format::kE5M2, 0x01) == 0x1p-16f);
}

TEST_CASE("fp8: the integer codec (host and device) equals the reference codec", "[quant][fp8][device]") {
  for (const kvpolicy::Fp8Format f : {kvpolicy::Fp8Format::kE4M3, kvpolicy::Fp8Format::kE5M2}) {
    INFO(kvpolicy::fp8_name(f));
    const auto bits_of = [](float x) {
      std::uint32_t u;
      std::memcpy(&u, &x, 4);
      return u;
    };
    for (int c = 0; c < 256; ++c) {
      const float want = kvpolicy::fp8_decode(f, static_cast<std::uint8_t>(c)),
                  got = kvpolicy::fp8_decode_bits(f, static_cast<std::uint8_t>(c));
      INFO("code " << c);
      if (want != want)
        REQUIRE(bits_of(got) == bits_of(want));  // the same quiet NaN
      else
        REQUIRE(bits_of(got) == bits_of(want));  // signed zeros included
    }
    std::int64_t checked = 0;
    const auto same = [&](std::uint32_t u) {
      float x;
      std::memcpy(&x, &u, 4);
      const std::uint8_t want = kvpolicy::fp8_encode(f, x), got = kvpolicy::fp8_encode_bits(f, x);
      if (want != got) {
        INFO("x bits 0x" << std::hex << u << " want " << int(want) << " got " << int(got));
        REQUIRE(want == got);
      }
      ++checked;
    };
    // Every float within 3 ulp of every code's value and of every midpoint between neighbouring codes.
    for (int c = 0; c < 127; ++c) {
      const float a = kvpolicy::fp8_decode(f, static_cast<std::uint8_t>(c)), b = kvpolicy::fp8_decode(f, static_cast<std::uint8_t>(c + 1));
      if (!(a == a) || !(b == b) || std::isinf(b)) continue;
      for (const float v : {a, (a + b) / 2.0f})
        for (std::int32_t k = -3; k <= 3; ++k)
          for (const std::uint32_t sign : {0u, 0x80000000u}) {
            const std::int64_t ub = static_cast<std::int64_t>(bits_of(v)) + k;
            if (ub >= 0 && ub <= 0x7fffffff) same(static_cast<std::uint32_t>(ub) | sign);
          }
    }
    // A sweep of the whole float range (every 251st bit pattern: both signs, subnormals, inf, NaN).
    for (std::uint64_t u = 0; u <= 0xffffffffull; u += 251) same(static_cast<std::uint32_t>(u));
    for (const std::uint32_t u : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x00000001u, 0x80000001u}) same(u);
    CHECK(checked > 17000000);
  }
}
