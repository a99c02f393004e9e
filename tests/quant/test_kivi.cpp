// KIVI: codes, scales, minimums and dequantized values bit-identical with the
// reference's torch arithmetic (tests/data/fixtures/kivi.bin, from
// tests/reference/make_kivi_fixtures.py); the streaming residual rule of the
// reference's decode loop; bad input rejected with nothing written.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../policy/emulated_device.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {

struct KiviCase {
  std::uint32_t role = 0, bits = 0, group = 0, H = 0, T = 0, D = 0;
  std::vector<std::uint16_t> x, scale, mn, deq;
  std::vector<std::int32_t> codes;
};

std::vector<KiviCase> load() {
  std::ifstream f(std::string(KVP_TEST_DATA_DIR) + "/fixtures/kivi.bin", std::ios::binary);
  REQUIRE(f.good());
  std::string header;
  std::getline(f, header);
  REQUIRE(header.rfind("kvpolicy-kivi-fixtures v1", 0) == 0);
  std::uint32_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 4);
  std::vector<KiviCase> out(n);
  auto rd = [&](auto& v, std::size_t count) {
    v.resize(count);
    f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(count * sizeof(v[0])));
  };
  for (auto& c : out) {
    std::uint32_t h[6];
    f.read(reinterpret_cast<char*>(h), sizeof h);
    c.role = h[0], c.bits = h[1], c.group = h[2], c.H = h[3], c.T = h[4], c.D = h[5];
    const std::size_t n_x = std::size_t{c.H} * c.T * c.D, f_w = 32 / c.bits;
    rd(c.x, n_x);
    rd(c.codes, n_x / f_w);
    const std::size_t n_s = c.role == 0 ? std::size_t{c.H} * (c.T / c.group) * c.D : std::size_t{c.H} * c.T * (c.D / c.group);
    rd(c.scale, n_s);
    rd(c.mn, n_s);
    rd(c.deq, n_x);
    REQUIRE(f.good());
  }
  return out;
}

/// Codes and scales of a KiviQuant region sized for `tokens` tokens.
struct Region {
  std::vector<std::uint8_t> codes, scales;
  QuantizedKV q;
  Region(const KiviQuant& p, std::int64_t H, std::int64_t tokens, std::int64_t d) {
    const std::int64_t rows = p.code_rows(tokens);
    codes.assign(static_cast<std::size_t>(H * rows * p.codes_row_bytes(d)), 0xA5);
    scales.assign(static_cast<std::size_t>(H * rows * p.scales_row_bytes(d)), 0x5A);
    q.layout = p.layout();
    q.codes = TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, rows, p.codes_row_bytes(d)});
    q.scales = TensorView<std::uint8_t, 3>::contiguous(scales.data(), {H, rows, p.scales_row_bytes(d)});
  }
};

std::uint16_t half_at(const std::uint8_t* p) {
  std::uint16_t b;
  std::memcpy(&b, p, 2);
  return b;
}
std::int32_t word_at(const std::uint8_t* p) {
  std::int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

}  // namespace

TEST_CASE("kivi: keys and values bit-identical with the reference's fp16 torch arithmetic", "[quant][kivi]") {
  const auto cases = load();
  REQUIRE(cases.size() == 18);
  ThreadPool pool(2);
  std::size_t words = 0, scales = 0, values = 0;
  for (const auto& c : cases) {
    INFO("role " << c.role << " bits " << c.bits << " group " << c.group << " T " << c.T << " D " << c.D);
    const std::int64_t H = c.H, T = c.T, D = c.D, G = c.group, f = 32 / c.bits;
    const KiviQuant p(KiviQuantParams{c.role == 0 ? QuantRole::kKeys : QuantRole::kValues, static_cast<std::int32_t>(c.bits),
                                      static_cast<std::int32_t>(c.group), static_cast<std::int32_t>(c.group)});
    REQUIRE(p.validate_params().is_ok());
    std::vector<half> xh(c.x.size());
    std::vector<float> xf(c.x.size());
    for (std::size_t i = 0; i < xh.size(); ++i) xh[i] = half::from_bits(c.x[i]), xf[i] = to_float(xh[i]);
    Region r(p, H, T, D), rf(p, H, T, D);
    KiviState st;
    REQUIRE(p.quantize(Context<backend::Cpu>{{}, pool.context()}, TensorView<const half, 3>::contiguous(xh.data(), {H, T, D}), st, r.q)
                .is_ok());
    REQUIRE(p.quantize(Context<backend::Scalar>{}, TensorView<const float, 3>::contiguous(xf.data(), {H, T, D}), st, rf.q).is_ok());
    REQUIRE(r.codes == rf.codes);
    REQUIRE(r.scales == rf.scales);
    for (std::int64_t h = 0; h < H; ++h) {
      if (c.role == 0) {
        for (std::int64_t g = 0; g < T / G; ++g)
          for (std::int64_t c2 = 0; c2 < D; ++c2) {
            for (std::int64_t w = 0; w < G / f; ++w, ++words)
              REQUIRE(word_at(&r.q.codes(h, g, 4 * (w * D + c2))) ==
                      c.codes[static_cast<std::size_t>((h * (T / f) + g * G / f + w) * D + c2)]);
            const std::size_t si = static_cast<std::size_t>((h * (T / G) + g) * D + c2);
            REQUIRE(half_at(&r.q.scales(h, g, 2 * c2)) == c.scale[si]);
            REQUIRE(half_at(&r.q.scales(h, g, 2 * (D + c2))) == c.mn[si]);
            scales += 2;
          }
      } else {
        for (std::int64_t t = 0; t < T; ++t) {
          for (std::int64_t w = 0; w < D / f; ++w, ++words)
            REQUIRE(word_at(&r.q.codes(h, t, 4 * w)) == c.codes[static_cast<std::size_t>((h * T + t) * (D / f) + w)]);
          for (std::int64_t gi = 0; gi < D / G; ++gi) {
            const std::size_t si = static_cast<std::size_t>((h * T + t) * (D / G) + gi);
            REQUIRE(half_at(&r.q.scales(h, t, 2 * gi)) == c.scale[si]);
            REQUIRE(half_at(&r.q.scales(h, t, 2 * (D / G + gi))) == c.mn[si]);
            scales += 2;
          }
        }
      }
    }
    r.q.tokens = T;
    std::vector<half> back(c.x.size());
    std::vector<float> backf(c.x.size());
    REQUIRE(p.dequantize(Context<backend::Cpu>{{}, pool.context()}, r.q, TensorView<half, 3>::contiguous(back.data(), {H, T, D})).is_ok());
    REQUIRE(p.dequantize(Context<backend::Scalar>{}, r.q, TensorView<float, 3>::contiguous(backf.data(), {H, T, D})).is_ok());
    for (std::size_t i = 0; i < back.size(); ++i, ++values) {
      REQUIRE(back[i].bits == c.deq[i]);
      REQUIRE(backf[i] == to_float(back[i]));
    }
  }
  WARN("kivi fixtures: " << words << " code words, " << scales << " scales/minimums, " << values << " dequantized values bit-identical");
}

TEST_CASE("kivi: memory per token, layouts and the documented constant-group rule", "[quant][kivi]") {
  const KiviQuant k2(KiviQuantParams{QuantRole::kKeys, 2, 32, 128});
  REQUIRE(k2.bytes_per_token(128) == 48.0);  // 32 code bytes + 4 * 128 / 32 scale bytes
  REQUIRE(k2.layout().bytes_per_token(128) == 48.0);
  REQUIRE(std::string(k2.layout().name) == "kivi_k2");
  const KiviQuant v4(KiviQuantParams{QuantRole::kValues, 4, 32, 128});
  REQUIRE(v4.bytes_per_token(128) == 80.0);
  REQUIRE(v4.layout().bytes_per_token(128) == 80.0);
  REQUIRE(v4.residual_bytes(128) == 128 * 128 * 2);
  // A constant value group decodes to its value exactly (code 0, scale 0).
  const KiviQuant v2(KiviQuantParams{QuantRole::kValues, 2, 32, 0});
  std::vector<float> x(32, -1.25f), y(32, 0.0f);
  Region r(v2, 1, 1, 32);
  KiviState st;
  REQUIRE(v2.quantize(Context<backend::Scalar>{}, TensorView<const float, 3>::contiguous(x.data(), {1, 1, 32}), st, r.q).is_ok());
  REQUIRE(word_at(&r.q.codes(0, 0, 0)) == 0);
  r.q.tokens = 1;
  REQUIRE(v2.dequantize(Context<backend::Scalar>{}, r.q, TensorView<float, 3>::contiguous(y.data(), {1, 1, 32})).is_ok());
  REQUIRE(y == x);
}

TEST_CASE("kivi: streaming append follows the reference's residual rule and equals one-shot quantization", "[quant][kivi]") {
  const std::int64_t H = 2, D = 64, prompt = 150, steps = 70, total = prompt + steps;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<std::size_t>(H * total * D));
  for (auto& v : x) v = nd(rng);
  // (H, T, D) view of tokens [from, from + n) of the stream.
  auto slice = [&](std::int64_t from, std::int64_t n) {
    return TensorView<const float, 3>(x.data() + from * D, {H, n, D}, {total * D, D, 1});
  };
  ThreadPool pool(2);
  const Context<backend::Cpu> ctx{{}, pool.context()};
  for (QuantRole role : {QuantRole::kKeys, QuantRole::kValues}) {
    const std::int64_t R = role == QuantRole::kKeys ? 64 : 16;
    INFO((role == QuantRole::kKeys ? "keys" : "values"));
    const KiviQuant p(KiviQuantParams{role, 4, 32, static_cast<std::int32_t>(R)});
    Region r(p, H, total, D);
    std::vector<half> res(static_cast<std::size_t>(H * R * D));
    KiviState st{TensorView<half, 3>::contiguous(res.data(), {H, R, D}), 0};
    REQUIRE(p.append(ctx, slice(0, prompt), st, r.q).is_ok());
    // The prompt: keys keep T mod R in full precision, values the last R.
    REQUIRE(r.q.tokens == (role == QuantRole::kKeys ? prompt / R * R : prompt - R));
    for (std::int64_t s = 0; s < steps; ++s) {
      const std::int64_t before = r.q.tokens, len = st.residual_len;
      REQUIRE(p.append(ctx, slice(prompt + s, 1), st, r.q).is_ok());
      if (role == QuantRole::kKeys) {
        REQUIRE(r.q.tokens == (len + 1 == R ? before + R : before));  // a whole block the moment it reaches R
        REQUIRE(st.residual_len == (len + 1) % R);
      } else {
        REQUIRE(r.q.tokens == before + 1);  // the oldest one slides out
        REQUIRE(st.residual_len == R);
      }
      REQUIRE(r.q.tokens + st.residual_len == prompt + s + 1);
    }
    // Residual = fp16 of the newest tokens, oldest first; codes = one-shot quantization of the rest.
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < st.residual_len; ++i)
        for (std::int64_t c = 0; c < D; ++c)
          REQUIRE(st.residual(h, i, c).bits == to_half(x[static_cast<std::size_t>(h * total * D + (r.q.tokens + i) * D + c)]).bits);
    Region once(p, H, r.q.tokens, D);
    KiviState none;
    REQUIRE(p.quantize(ctx, slice(0, r.q.tokens), none, once.q).is_ok());
    const std::int64_t rows = p.code_rows(r.q.tokens);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < rows; ++i) {
        REQUIRE(std::memcmp(&r.q.codes(h, i, 0), &once.q.codes(h, i, 0), static_cast<std::size_t>(p.codes_row_bytes(D))) == 0);
        REQUIRE(std::memcmp(&r.q.scales(h, i, 0), &once.q.scales(h, i, 0), static_cast<std::size_t>(p.scales_row_bytes(D))) == 0);
      }
  }
}

TEST_CASE("kivi: bad input is rejected by name and nothing is written", "[quant][kivi][errors]") {
  const std::int64_t H = 2, D = 64, T = 32;
  const KiviQuant keys(KiviQuantParams{QuantRole::kKeys, 2, 32, 32});
  std::vector<float> x(static_cast<std::size_t>(H * T * D), 0.5f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) - 3.0f;
  const auto rows = TensorView<const float, 3>::contiguous(x.data(), {H, T, D});
  const Context<backend::Scalar> ctx{};
  auto expect_error = [&](const KiviQuant& p, TensorView<const float, 3> in, Region& r, KiviState& st, const char* needle) {
    const auto codes = r.codes, scales = r.scales;
    const std::int64_t tokens = r.q.tokens, len = st.residual_len;
    const Status s = p.append(ctx, in, st, r.q);
    REQUIRE_FALSE(s.is_ok());
    REQUIRE_THAT(s.message(), Contains(needle));
    REQUIRE(r.codes == codes);
    REQUIRE(r.scales == scales);
    REQUIRE(r.q.tokens == tokens);
    REQUIRE(st.residual_len == len);
  };
  std::vector<half> res(static_cast<std::size_t>(H * 32 * D));
  {
    Region r(keys, H, T, D);
    KiviState st{TensorView<half, 3>::contiguous(res.data(), {H, 32, D}), 0};
    auto bad = x;
    bad[100] = std::numeric_limits<float>::quiet_NaN();
    expect_error(keys, TensorView<const float, 3>::contiguous(bad.data(), {H, T, D}), r, st, "channel 36 is nan");
    bad[100] = 7.0e4f;  // beyond fp16
    expect_error(keys, TensorView<const float, 3>::contiguous(bad.data(), {H, T, D}), r, st, "not finite in fp16");
    bad[100] = 60000.0f;  // in range, but the group spans more than fp16 holds
    bad[100 + D] = -60000.0f;
    expect_error(keys, TensorView<const float, 3>::contiguous(bad.data(), {H, T, D}), r, st, "span more than the fp16 range");
    Region one_head(keys, 1, T, D);
    expect_error(keys, rows, one_head, st, "codes is (1, 1, 512)");
    KiviState short_res{TensorView<half, 3>::contiguous(res.data(), {H, 16, D}), 0};
    expect_error(keys, rows, r, short_res, "state residual is (2, 16, 64)");
    KiviState full{TensorView<half, 3>::contiguous(res.data(), {H, 32, D}), 32};
    expect_error(keys, rows, r, full, "residual_len is 32, must be in [0, 31] for keys");
  }
  {
    // The heads' scan runs in parallel; the message still names the first bad value in (head, token,
    // channel) order: a range overflow in head 1 (keys: channel 11 over tokens 4 and 5; values: token 4 over
    // channels 11 and 12) before a NaN in head 3, and before a NaN in head 2.
    ThreadPool pool(2);
    const Context<backend::Cpu> cx2{{}, pool.context()};
    const std::int64_t H4 = 4;
    std::vector<float> big(static_cast<std::size_t>(H4 * T * D));
    for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i % 5) - 2.0f;
    big[static_cast<std::size_t>((3 * T + 2) * D + 9)] = std::numeric_limits<float>::quiet_NaN();
    big[static_cast<std::size_t>((1 * T + 4) * D + 11)] = 60000.0f;
    const auto overflow = [&](bool on) {
      big[static_cast<std::size_t>((1 * T + 5) * D + 11)] = on ? -60000.0f : 0.0f;
      big[static_cast<std::size_t>((1 * T + 4) * D + 12)] = on ? -60000.0f : 0.0f;
    };
    overflow(true);
    // fp32 rows, and the same values as fp16 rows (scanned as they are)
    std::vector<half> bigh(big.size());
    const auto quantize = [&](const KiviQuant& p, bool fp16, Region& r) {
      KiviState st;
      if (!fp16) return p.quantize(cx2, TensorView<const float, 3>::contiguous(big.data(), {H4, T, D}), st, r.q);
      for (std::size_t i = 0; i < big.size(); ++i) bigh[i] = to_half(big[i]);
      return p.quantize(cx2, TensorView<const half, 3>::contiguous(bigh.data(), {H4, T, D}), st, r.q);
    };
    for (const bool fp16 : {false, true})
      for (const KiviQuant& p : {keys, KiviQuant(KiviQuantParams{QuantRole::kValues, 2, 32, 0})}) {
        Region r(p, H4, T, D);
        const auto codes = r.codes, scales = r.scales;
        Status s = quantize(p, fp16, r);
        REQUIRE_THAT(s.message(), Contains("head 1 token"));
        REQUIRE_THAT(s.message(), Contains("span more than the fp16 range"));
        big[static_cast<std::size_t>((2 * T + 7) * D + 3)] = std::numeric_limits<float>::quiet_NaN();
        s = quantize(p, fp16, r);
        REQUIRE_THAT(s.message(), Contains("head 1 token"));  // head 1's overflow still comes first
        overflow(false);
        s = quantize(p, fp16, r);
        REQUIRE_THAT(s.message(), Contains("rows head 2 token 7 channel 3 is nan"));
        overflow(true);
        big[static_cast<std::size_t>((2 * T + 7) * D + 3)] = 0.0f;
        REQUIRE(r.codes == codes);
        REQUIRE(r.scales == scales);
      }
  }
  REQUIRE_THAT(KiviQuant(KiviQuantParams{QuantRole::kKeys, 3, 32, 128}).validate_params().message(), Contains("bits is 3"));
  REQUIRE_THAT(KiviQuant(KiviQuantParams{QuantRole::kKeys, 2, 24, 48}).validate_params().message(), Contains("not a multiple of 16"));
  REQUIRE_THAT(KiviQuant(KiviQuantParams{QuantRole::kKeys, 2, 32, 48}).validate_params().message(), Contains("multiple of group 32"));
  const KiviQuant values(KiviQuantParams{QuantRole::kValues, 4, 48, 0});
  REQUIRE(values.validate_params().is_ok());
  Region rv(values, H, T, D);
  KiviState none;
  expect_error(values, rows, rv, none, "head_dim 64 is not a multiple of the values group 48");
  Region rk(keys, H, T, D);
  KiviState st;
  const Status one = keys.quantize(ctx, TensorView<const float, 3>::contiguous(x.data(), {H, 31, D}), st, rk.q);
  REQUIRE_THAT(one.message(), Contains("31 tokens, not a multiple of group 32"));
}

TEMPLATE_TEST_CASE("kivi: the device path (kivi_*_tokens per kv head) writes the host path's codes, scales, residual and values",
                   "[quant][kivi][device]", float, half, bfloat16) {
  using kvp_test::EmulatedDevice;
  using kvp_test::kEmulatedDevice;
  const std::int64_t H = 2, D = 64, prompt = 150, steps = 40, total = prompt + steps;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<TestType> x(static_cast<std::size_t>(H * total * D));
  for (auto& v : x) v = from_float<TestType>(nd(rng) * 3.0f);
  auto slice = [&](std::int64_t from, std::int64_t n, Device dev) {
    return TensorView<const TestType, 3>(x.data() + from * D, {H, n, D}, {total * D, D, 1}, dev);
  };
  const auto tag = [](QuantizedKV q) {
    q.codes = TensorView<std::uint8_t, 3>(q.codes.data(), q.codes.extents(), q.codes.strides(), kEmulatedDevice);
    q.scales = TensorView<std::uint8_t, 3>(q.scales.data(), q.scales.extents(), q.scales.strides(), kEmulatedDevice);
    return q;
  };
  for (QuantRole role : {QuantRole::kKeys, QuantRole::kValues})
    for (std::int32_t bits : {2, 4, 8}) {
      const std::int64_t R = role == QuantRole::kKeys ? 64 : 16;
      INFO((role == QuantRole::kKeys ? "keys" : "values") << " bits " << bits);
      const KiviQuant p(KiviQuantParams{role, bits, 32, static_cast<std::int32_t>(R)});
      // One shot, then decode.
      const std::int64_t T = 128;
      Region host(p, H, T, D), dev(p, H, T, D);
      host.q.tokens = dev.q.tokens = 0;
      KiviState none;
      REQUIRE(p.quantize(Context<backend::Cpu>{}, slice(0, T, {}), none, host.q).is_ok());
      QuantizedKV dq = tag(dev.q);
      const Status s = p.quantize(Context<EmulatedDevice>{}, slice(0, T, kEmulatedDevice), none, dq);
      INFO(s.message());
      REQUIRE(s.is_ok());
      REQUIRE(host.codes == dev.codes);
      REQUIRE(host.scales == dev.scales);
      host.q.tokens = dq.tokens = T;
      std::vector<TestType> want(static_cast<std::size_t>(H * T * D)), got(want.size());
      REQUIRE(p.dequantize(Context<backend::Cpu>{}, host.q, TensorView<TestType, 3>::contiguous(want.data(), {H, T, D})).is_ok());
      REQUIRE(
          p.dequantize(Context<EmulatedDevice>{}, dq, TensorView<TestType, 3>::contiguous(got.data(), {H, T, D}, kEmulatedDevice)).is_ok());
      REQUIRE(std::memcmp(want.data(), got.data(), want.size() * sizeof(TestType)) == 0);

      // Streaming: the prompt, then one token per step; every step leaves identical regions and residuals.
      Region hs(p, H, total, D), ds(p, H, total, D);
      hs.q.tokens = ds.q.tokens = 0;
      QuantizedKV dsq = tag(ds.q);
      std::vector<half> hres(static_cast<std::size_t>(H * R * D)), dres(hres.size());
      KiviState hst{TensorView<half, 3>::contiguous(hres.data(), {H, R, D}), 0};
      KiviState dst{TensorView<half, 3>::contiguous(dres.data(), {H, R, D}, kEmulatedDevice), 0};
      for (std::int64_t s0 = 0; s0 < total; s0 = s0 == 0 ? prompt : s0 + 1) {
        const std::int64_t n = s0 == 0 ? prompt : 1;
        REQUIRE(p.append(Context<backend::Cpu>{}, slice(s0, n, {}), hst, hs.q).is_ok());
        REQUIRE(p.append(Context<EmulatedDevice>{}, slice(s0, n, kEmulatedDevice), dst, dsq).is_ok());
        REQUIRE(dsq.tokens == hs.q.tokens);
        REQUIRE(dst.residual_len == hst.residual_len);
        REQUIRE(std::memcmp(hres.data(), dres.data(), static_cast<std::size_t>(H * R * D) * sizeof(half)) == 0);
      }
      REQUIRE(hs.codes == ds.codes);
      REQUIRE(hs.scales == ds.scales);

      // Host views on the device path are refused by name; nothing is written.
      Region untouched(p, H, T, D);
      QuantizedKV uq = tag(untouched.q);
      uq.tokens = 0;
      CHECK_THAT(p.quantize(Context<EmulatedDevice>{}, slice(0, T, {}), none, uq).message(), Contains("rows is a host tensor"));
      QuantizedKV host_scales = uq;
      host_scales.scales = untouched.q.scales;
      CHECK_THAT(p.quantize(Context<EmulatedDevice>{}, slice(0, T, kEmulatedDevice), none, host_scales).message(),
                 Contains("scales is a host tensor"));
      KiviState host_res{TensorView<half, 3>::contiguous(hres.data(), {H, R, D}), 0};
      CHECK_THAT(p.append(Context<EmulatedDevice>{}, slice(0, 8, kEmulatedDevice), host_res, uq).message(),
                 Contains("state residual is a host tensor"));
      CHECK(std::all_of(untouched.codes.begin(), untouched.codes.end(), [](std::uint8_t b) { return b == 0xA5; }));
      CHECK(std::all_of(untouched.scales.begin(), untouched.scales.end(), [](std::uint8_t b) { return b == 0x5A; }));
    }
}
