// Fp8Quant: the three scale layouts (per tensor, per head, per (token, head)
// inline), round trips within fp8's relative precision, saturation, the
// inline trailer's bytes, Scalar == Cpu, and bad input (nothing written).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "../emulated_device.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {
struct Fp8Region {
  std::vector<std::uint8_t> bytes;
  QuantizedKV q;
  Fp8Region(const Fp8Quant& p, std::int64_t H, std::int64_t T, std::int64_t d)
      : bytes(static_cast<std::size_t>(H * T * p.row_bytes(d)), 0x5A) {
    q.layout = p.layout();
    q.codes = TensorView<std::uint8_t, 3>::contiguous(bytes.data(), {H, T, p.row_bytes(d)});
    q.tokens = T;
  }
};
}  // namespace

TEST_CASE("fp8 quant policy: scale layouts, round trips, inline scales, Scalar == Cpu", "[quant][policy][fp8]") {
  const std::int64_t H = 2, T = 5, d = 64;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<std::size_t>(H * T * d));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) * (i < k.size() / 2 ? 0.01f : 30.0f);  // head 1 is 3000x head 0
  const auto rows = TensorView<const float, 3>::contiguous(k.data(), {H, T, d});
  const float head_scales[2] = {0.01f / 100.0f, 30.0f / 100.0f};
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (Fp8Scale layout : {Fp8Scale::kPerTensor, Fp8Scale::kPerHead, Fp8Scale::kPerTokenHead}) {
      INFO(fp8_name(f) << " layout " << static_cast<int>(layout));
      const Fp8Quant policy(Fp8QuantParams{f, layout, 0.5f});
      Fp8Quant::State st{std::span<const float>(head_scales, 2)};
      REQUIRE(policy.bytes_per_token(d) == (layout == Fp8Scale::kPerTokenHead ? 80.0 : 64.0));
      Fp8Region a(policy, H, T, d), b(policy, H, T, d);
      REQUIRE(policy.quantize(Context<backend::Scalar>{}, rows, st, a.q).is_ok());
      REQUIRE(policy.quantize(Context<backend::Cpu>{}, rows, st, b.q).is_ok());
      REQUIRE(a.bytes == b.bytes);
      std::vector<float> y(k.size());
      REQUIRE(policy.dequantize(Context<backend::Cpu>{}, a.q, TensorView<float, 3>::contiguous(y.data(), {H, T, d}), st).is_ok());
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < T; ++t) {
          float scale = layout == Fp8Scale::kPerTensor ? 0.5f : head_scales[h];
          if (layout == Fp8Scale::kPerTokenHead) {
            float amax = 0.0f;
            for (std::int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(k[static_cast<std::size_t>((h * T + t) * d + c)]));
            scale = amax / fp8_max(f);
            float stored;
            std::memcpy(&stored, &a.q.codes(h, t, d), 4);
            REQUIRE(stored == scale);
            for (std::int64_t z = 4; z < 16; ++z) REQUIRE(a.q.codes(h, t, d + z) == 0);
          }
          for (std::int64_t c = 0; c < d; ++c) {
            const std::size_t i = static_cast<std::size_t>((h * T + t) * d + c);
            REQUIRE(a.q.codes(h, t, c) == fp8_encode(f, k[i] / scale));
            REQUIRE(y[i] == fp8_decode(f, a.q.codes(h, t, c)) * scale);
            // Within range, the error is at most half a step: 2^-4 (e4m3) / 2^-3 (e5m2) relative, or the subnormal step.
            const float xs = std::fabs(k[i] / scale);
            if (xs <= fp8_max(f)) {
              const double rel = f == Fp8Format::kE4M3 ? 0x1p-4 : 0x1p-3, sub = f == Fp8Format::kE4M3 ? 0x1p-10 : 0x1p-17;
              REQUIRE(std::fabs(y[i] - k[i]) <= (rel * std::fabs(k[i]) + sub * scale) * 1.0001);
            }
          }
        }
    }
  }
  // Per tensor at scale 0.01 saturates head 1 (|x| / 0.01 far above 448): codes are ±max, not NaN.
  const Fp8Quant sat(Fp8QuantParams{Fp8Format::kE4M3, Fp8Scale::kPerTensor, 0.01f});
  Fp8Quant::State none;
  Fp8Region r(sat, H, T, d);
  REQUIRE(sat.quantize(Context<backend::Scalar>{}, rows, none, r.q).is_ok());
  int saturated = 0;
  for (auto c : r.bytes) saturated += (c & 0x7f) == 0x7e ? 1 : 0;
  REQUIRE(saturated > 0);
  for (auto c : r.bytes) REQUIRE((c & 0x7f) != 0x7f);
}

TEST_CASE("fp8 quant policy: bad input gets a clear message and writes nothing", "[quant][policy][fp8][errors]") {
  const std::int64_t H = 2, T = 3, d = 16;
  std::vector<float> k(static_cast<std::size_t>(H * T * d), 1.0f);
  const auto rows = TensorView<const float, 3>::contiguous(k.data(), {H, T, d});
  const Context<backend::Scalar> cx{};
  auto untouched = [](const Fp8Region& r) {
    for (auto b : r.bytes) REQUIRE(b == 0x5A);
  };
  const Fp8Quant per_head(Fp8QuantParams{Fp8Format::kE4M3, Fp8Scale::kPerHead, 1.0f});
  Fp8Region r(per_head, H, T, d);
  Fp8Quant::State st;
  REQUIRE_THAT(per_head.quantize(cx, rows, st, r.q).message(), Contains("per_head scales has 0 entries, expected 2"));
  const float bad_scales[2] = {1.0f, 0.0f};
  st.head_scales = std::span<const float>(bad_scales, 2);
  REQUIRE_THAT(per_head.quantize(cx, rows, st, r.q).message(), Contains("per_head scale of head 1 is 0, must be finite and > 0"));
  untouched(r);
  const Fp8Quant dyn{};
  Fp8Region r2(dyn, H, T, d);
  Fp8Quant::State none;
  k[5] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THAT(dyn.quantize(cx, rows, none, r2.q).message(), Contains("rows head 0 token 0 channel 5 is not finite"));
  untouched(r2);
  k[5] = 1.0f;
  Fp8Region small(Fp8Quant(Fp8QuantParams{Fp8Format::kE4M3, Fp8Scale::kPerTensor, 1.0f}), H, T, d);  // rows lack the trailer
  REQUIRE_THAT(dyn.quantize(cx, rows, none, small.q).message(),
               Contains("codes is (2, 3, 16), expected (2 kv heads, >= 3 tokens, 32 bytes per row)"));
  untouched(small);
  REQUIRE_THAT(Fp8Quant(Fp8QuantParams{Fp8Format::kE4M3, Fp8Scale::kPerTensor, -1.0f}).validate_params().message(),
               Contains("scale is -1, must be finite and > 0"));
}

TEST_CASE("fp8 quant policy: the device path (one op per kv head) writes the host path's bytes and values",
          "[quant][policy][fp8][device]") {
  const std::int64_t H = 3, T = 37, d = 48;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  std::vector<half> k(static_cast<std::size_t>(H * T * d));
  for (auto& x : k) x = to_half(nd(rng) * 3.0f);
  const float head_scales[3] = {0.02f, 0.5f, 3.0f};
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2})
    for (Fp8Scale layout : {Fp8Scale::kPerTensor, Fp8Scale::kPerHead, Fp8Scale::kPerTokenHead}) {
      INFO(fp8_name(f) << " layout " << static_cast<int>(layout));
      const Fp8Quant policy(Fp8QuantParams{f, layout, 0.25f});
      Fp8Quant::State st{std::span<const float>(head_scales, 3)};
      Fp8Region host(policy, H, T, d), dev(policy, H, T, d);
      REQUIRE(policy.quantize(Context<backend::Scalar>{}, TensorView<const half, 3>::contiguous(k.data(), {H, T, d}), st, host.q).is_ok());
      QuantizedKV dq = dev.q;
      dq.codes = TensorView<std::uint8_t, 3>::contiguous(dev.bytes.data(), {H, T, policy.row_bytes(d)}, kvp_test::kEmulatedDevice);
      const Status s = policy.quantize(Context<kvp_test::EmulatedDevice>{},
                                       TensorView<const half, 3>::contiguous(k.data(), {H, T, d}, kvp_test::kEmulatedDevice), st, dq);
      INFO(s.message());
      REQUIRE(s.is_ok());
      REQUIRE(host.bytes == dev.bytes);
      std::vector<half> yh(k.size()), yd(k.size());
      REQUIRE(policy.dequantize(Context<backend::Scalar>{}, host.q, TensorView<half, 3>::contiguous(yh.data(), {H, T, d}), st).is_ok());
      REQUIRE(policy
                  .dequantize(Context<kvp_test::EmulatedDevice>{}, dq,
                              TensorView<half, 3>::contiguous(yd.data(), {H, T, d}, kvp_test::kEmulatedDevice), st)
                  .is_ok());
      REQUIRE(std::memcmp(yh.data(), yd.data(), yh.size() * sizeof(half)) == 0);
      // Host views on the device path are refused by name; nothing is written.
      Fp8Region untouched(policy, H, T, d);
      QuantizedKV uq = untouched.q;
      uq.codes = TensorView<std::uint8_t, 3>::contiguous(untouched.bytes.data(), {H, T, policy.row_bytes(d)}, kvp_test::kEmulatedDevice);
      const Status refused =
          policy.quantize(Context<kvp_test::EmulatedDevice>{}, TensorView<const half, 3>::contiguous(k.data(), {H, T, d}), st, uq);
      CHECK(refused.code() == StatusCode::kInvalidArgument);
      CHECK_THAT(refused.message(), Contains("rows is a host tensor"));
      CHECK(std::all_of(untouched.bytes.begin(), untouched.bytes.end(), [](std::uint8_t b) { return b == 0x5A; }));
    }
}
