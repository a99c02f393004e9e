// The token-row codec ops (`encode_token_rows` / `decode_token_rows`, quant/token_rows.hpp) and the device
// paths of GgmlQuant and Int4Quant built on them: on the emulated device backend (the scalar ops behind a
// CallScope, one launch-shaped op per kv head) every format, rotation, element type and row stride writes the
// host path's bytes and decodes to its values bit for bit; host views and bad codecs are refused, nothing written.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "../emulated_device.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {

/// A (H, T, row_bytes) code region with room for `pad` more bytes per row (a strided token axis).
struct CodeRegion {
  std::vector<std::uint8_t> bytes;
  QuantizedKV q;
  CodeRegion(const QuantLayout& layout, std::int64_t H, std::int64_t T, std::int64_t rb, std::int64_t pad, Device dev = {})
      : bytes(static_cast<std::size_t>(H * T * (rb + pad)), 0x5A) {
    q.layout = layout;
    q.codes = TensorView<std::uint8_t, 3>(bytes.data(), {H, T, rb}, {T * (rb + pad), rb + pad, 1}, dev);
    q.tokens = T;
  }
};

/// Quantizes `k` (H, T, d) with `policy` on Cpu (host) and on the emulated device with the token axis padded by
/// `pad` values (rows) and bytes (codes); requires identical codes and decoded rows, then refuses host views on
/// the device path without writing.
template <class Policy, class T>
void require_device_path_equal(const Policy& policy, const std::vector<T>& k, std::int64_t H, std::int64_t Tn, std::int64_t d,
                               std::int64_t pad) {
  using kvp_test::EmulatedDevice;
  using kvp_test::kEmulatedDevice;
  typename Policy::State st;
  const std::int64_t rb = policy.row_bytes(d);
  CodeRegion host(policy.layout(), H, Tn, rb, 0), dev(policy.layout(), H, Tn, rb, pad, kEmulatedDevice);
  REQUIRE(policy.quantize(Context<backend::Cpu>{}, TensorView<const T, 3>::contiguous(k.data(), {H, Tn, d}), st, host.q).is_ok());
  std::vector<T> padded(static_cast<std::size_t>(H * Tn * (d + pad)));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < Tn; ++t)
      std::memcpy(&padded[static_cast<std::size_t>((h * Tn + t) * (d + pad))], &k[static_cast<std::size_t>((h * Tn + t) * d)],
                  static_cast<std::size_t>(d) * sizeof(T));
  const TensorView<const T, 3> drows(padded.data(), {H, Tn, d}, {Tn * (d + pad), d + pad, 1}, kEmulatedDevice);
  const Status s = policy.quantize(Context<EmulatedDevice>{}, drows, st, dev.q);
  INFO(s.message());
  REQUIRE(s.is_ok());
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < Tn; ++t)
      REQUIRE(std::memcmp(&host.q.codes(h, t, 0), &dev.q.codes(h, t, 0), static_cast<std::size_t>(rb)) == 0);

  std::vector<T> want(k.size()), got(static_cast<std::size_t>(H * Tn * (d + pad)));
  REQUIRE(policy.dequantize(Context<backend::Cpu>{}, host.q, TensorView<T, 3>::contiguous(want.data(), {H, Tn, d})).is_ok());
  const TensorView<T, 3> dout(got.data(), {H, Tn, d}, {Tn * (d + pad), d + pad, 1}, kEmulatedDevice);
  REQUIRE(policy.dequantize(Context<EmulatedDevice>{}, dev.q, dout).is_ok());
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < Tn; ++t)
      REQUIRE(std::memcmp(&want[static_cast<std::size_t>((h * Tn + t) * d)], &dout(h, t, 0), static_cast<std::size_t>(d) * sizeof(T)) == 0);

  // Host views on the device path are refused by name; nothing is written.
  CodeRegion untouched(policy.layout(), H, Tn, rb, 0, kEmulatedDevice);
  const auto all_5a = [](const CodeRegion& r) {
    for (const std::uint8_t b : r.bytes)
      if (b != 0x5A) return false;
    return true;
  };
  const Status host_rows =
      policy.quantize(Context<EmulatedDevice>{}, TensorView<const T, 3>::contiguous(k.data(), {H, Tn, d}), st, untouched.q);
  CHECK_THAT(host_rows.message(), Contains("rows is a host tensor"));
  CodeRegion host_codes(policy.layout(), H, Tn, rb, 0);
  CHECK_THAT(policy.quantize(Context<EmulatedDevice>{}, drows, st, host_codes.q).message(), Contains("codes is a host tensor"));
  CHECK((all_5a(untouched) && all_5a(host_codes)));
  std::vector<T> sink(k.size());
  CHECK_THAT(policy.dequantize(Context<EmulatedDevice>{}, dev.q, TensorView<T, 3>::contiguous(sink.data(), {H, Tn, d})).message(),
             Contains("out is a host tensor"));
}

template <class T>
std::vector<T> random_rows(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = from_float<T>(nd(rng) * 2.5f);
  return v;
}

}  // namespace

TEMPLATE_TEST_CASE("ggml quant policy: the device path (encode / decode_token_rows per kv head) writes the host path's bytes and values",
                   "[quant][policy][ggml][device]", float, half, bfloat16) {
  const std::int64_t H = 3, T = 21, d = 128;
  const auto k = random_rows<TestType>(H * T * d, 5);
  const struct {
    HadamardMode mode;
    std::int32_t block;
    QuantRole role;
  } rotations[] = {{HadamardMode::kNone, 64, QuantRole::kKeys},
                   {HadamardMode::kLlamaCpp, 64, QuantRole::kKeys},
                   {HadamardMode::kLlamaCpp, 64, QuantRole::kValues},
                   {HadamardMode::kBlock, 16, QuantRole::kKeys}};
  for (const GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kIQ4_NL})
    for (const auto& r : rotations) {
      INFO(ggml_name(t) << " rotation " << static_cast<int>(r.mode) << " block " << r.block << " role " << static_cast<int>(r.role));
      const GgmlQuant policy(GgmlQuantParams{t, r.mode, r.block, r.role});
      require_device_path_equal(policy, k, H, T, d, 0);
      require_device_path_equal(policy, k, H, T, d, 32);  // strided token axis: row strides reach the op
    }
}

TEMPLATE_TEST_CASE("int4 quant policy: the device path (encode / decode_token_rows per kv head) writes the host path's bytes and values",
                   "[quant][policy][int4][device]", float, half, bfloat16) {
  const std::int64_t H = 2, T = 19, d = 192;
  const auto k = random_rows<TestType>(H * T * d, 6);
  for (const std::int32_t bits : {4, 8})
    for (const HadamardMode mode : {HadamardMode::kNone, HadamardMode::kLlamaCpp, HadamardMode::kBlock})
      for (const QuantRole role : {QuantRole::kKeys, QuantRole::kValues}) {
        INFO("bits " << bits << " rotation " << static_cast<int>(mode) << " role " << static_cast<int>(role));
        const Int4Quant policy(Int4QuantParams{bits, mode, 32, role});
        require_device_path_equal(policy, k, H, T, d, 0);
        require_device_path_equal(policy, k, H, T, d, 6);
      }
}

TEST_CASE("token-row codecs: encode_token_rows == the policies' host steps, chunked long ggml rows, refusals", "[quant][ops][token_rows]") {
  // A 4-block ggml row longer than the scalar scratch: the reference encodes it in chunks, block for block.
  const std::int64_t n = kMaxRotatedHeadDim + 4 * kGgmlBlock;
  const auto x = random_rows<float>(n, 7);
  const TokenRowCodec c = TokenRowCodec::ggml_blocks(GgmlType::kQ4_1);
  std::vector<std::uint8_t> a(static_cast<std::size_t>(c.row_bytes(n))), b(a.size());
  backend::Scalar::encode_token_rows(c, x.data(), 1, n, n, a.data(), c.row_bytes(n));
  backend::Scalar::ggml_quantize_row(GgmlType::kQ4_1, x.data(), n, b.data());
  REQUIRE(a == b);
  std::vector<float> ya(static_cast<std::size_t>(n)), yb(ya.size());
  backend::Scalar::decode_token_rows(c, a.data(), 1, c.row_bytes(n), n, ya.data(), n);
  backend::Scalar::ggml_dequantize_row(GgmlType::kQ4_1, a.data(), n, yb.data());
  REQUIRE(std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)) == 0);

  // What each codec cannot encode, by name (the device launchers record these; the policies check first).
  CHECK(TokenRowCodec::ggml_blocks(GgmlType::kQ8_0).unsupported(128) == nullptr);
  CHECK_THAT(TokenRowCodec::ggml_blocks(GgmlType::kQ8_0).unsupported(48), Contains("multiple of the ggml block"));
  CHECK_THAT(TokenRowCodec::ggml_blocks(static_cast<GgmlType>(9)).unsupported(64), Contains("not a block format"));
  CHECK_THAT(TokenRowCodec::int_tokens(3).unsupported(64), Contains("bits must be 4 or 8"));
  CHECK_THAT(TokenRowCodec::int_tokens(4).unsupported(63), Contains("even"));
  CHECK_THAT(TokenRowCodec::int_tokens(8).unsupported(8192), Contains("<= 4096"));
  CHECK_THAT(TokenRowCodec::int_tokens(4, 48).unsupported(96), Contains("power of two dividing head_dim"));
  CHECK_THAT(TokenRowCodec::ggml_blocks(GgmlType::kQ8_0, 64).unsupported(8192), Contains("<= 4096"));
  CHECK(TokenRowCodec::ggml_blocks(GgmlType::kQ8_0).unsupported(8192) == nullptr);  // unrotated ggml rows have no length limit
  CHECK_THAT(TokenRowCodec::int_tokens(4).unsupported(0), Contains("> 0"));
  CHECK(TokenRowCodec::int_tokens(4).row_bytes(128) == 72);
  CHECK(TokenRowCodec::ggml_blocks(GgmlType::kQ5_1).row_bytes(128) == 96);
}
