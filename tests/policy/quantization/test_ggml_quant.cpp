// GgmlQuant, the ggml block formats as a QuantizationPolicy: rows of a cache
// into codes and back on Scalar and Cpu (identical bytes, any thread count),
// fp16 / bf16 inputs, bytes per token, and bad input (nothing written).
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {

constexpr GgmlType kTypes[] = {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kIQ4_NL};

struct Region {
  std::vector<std::uint8_t> bytes;
  QuantizedKV q;
  Region(const GgmlQuant& p, std::int64_t H, std::int64_t T, std::int64_t d)
      : bytes(static_cast<std::size_t>(H * T * p.row_bytes(d)), 0x5A) {
    q.layout = p.layout();
    q.codes = TensorView<std::uint8_t, 3>::contiguous(bytes.data(), {H, T, p.row_bytes(d)});
    q.tokens = T;
  }
};

}  // namespace

TEST_CASE("ggml quant policy: quantize == the block reference per row, Scalar == Cpu, any threads, round trip", "[quant][policy]") {
  const std::int64_t H = 3, T = 7, d = 96;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<std::size_t>(H * T * d));
  for (auto& v : k) v = nd(rng) * 2.0f;
  std::vector<half> kh(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) kh[i] = from_float<half>(k[i]);
  ThreadPool pool(2);
  for (GgmlType t : kTypes) {
    INFO(ggml_name(t));
    const GgmlQuant policy(GgmlQuantParams{t});
    REQUIRE(policy.bytes_per_token(d) == 3.0 * ggml_block_bytes(t));
    REQUIRE(policy.requirements(Context<backend::Scalar>{}, ProblemShape{8, H, d, T, 1}).status.is_ok());
    GgmlQuant::State st;
    Region ref(policy, H, T, d), cpu(policy, H, T, d), half_in(policy, H, T, d);
    const auto rows = TensorView<const float, 3>::contiguous(k.data(), {H, T, d});
    REQUIRE(policy.quantize(Context<backend::Scalar>{}, rows, st, ref.q).is_ok());
    REQUIRE(policy.quantize(Context<backend::Cpu>{{}, pool.context()}, rows, st, cpu.q).is_ok());
    REQUIRE(ref.bytes == cpu.bytes);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t tok = 0; tok < T; ++tok)
        for (std::int64_t b = 0; b < d / 32; ++b) {
          std::uint8_t blk[34];
          ggml_quantize_block(t, &k[static_cast<std::size_t>((h * T + tok) * d + b * 32)], blk);
          REQUIRE(std::memcmp(blk, &ref.q.codes(h, tok, b * ggml_block_bytes(t)), static_cast<std::size_t>(ggml_block_bytes(t))) == 0);
        }
    // fp16 input: widened exactly, so equal to quantizing the widened floats.
    std::vector<float> kw(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) kw[i] = to_float(kh[i]);
    Region wide(policy, H, T, d);
    REQUIRE(policy.quantize(Context<backend::Cpu>{}, TensorView<const half, 3>::contiguous(kh.data(), {H, T, d}), st, half_in.q).is_ok());
    REQUIRE(policy.quantize(Context<backend::Cpu>{}, TensorView<const float, 3>::contiguous(kw.data(), {H, T, d}), st, wide.q).is_ok());
    REQUIRE(half_in.bytes == wide.bytes);
    // Dequantize: Scalar == Cpu, fp32 and bf16 outputs; error within one step of the block's scale.
    std::vector<float> a(k.size()), b(k.size());
    REQUIRE(policy.dequantize(Context<backend::Scalar>{}, ref.q, TensorView<float, 3>::contiguous(a.data(), {H, T, d})).is_ok());
    REQUIRE(
        policy.dequantize(Context<backend::Cpu>{{}, pool.context()}, cpu.q, TensorView<float, 3>::contiguous(b.data(), {H, T, d})).is_ok());
    REQUIRE(a == b);
    std::vector<bfloat16> bb(k.size());
    REQUIRE(policy.dequantize(Context<backend::Cpu>{}, cpu.q, TensorView<bfloat16, 3>::contiguous(bb.data(), {H, T, d})).is_ok());
    for (std::size_t i = 0; i < k.size(); ++i) REQUIRE(to_float(bb[i]) == to_float(from_float<bfloat16>(a[i])));
    double err = 0.0;
    for (std::size_t i = 0; i < k.size(); ++i) err = std::max(err, static_cast<double>(std::fabs(a[i] - k[i])));
    REQUIRE(err < (t == GgmlType::kQ8_0 ? 0.1 : 1.5));
  }
}

TEST_CASE("ggml quant policy: bad input gets a clear message and writes nothing", "[quant][policy][errors]") {
  const GgmlQuant policy(GgmlQuantParams{GgmlType::kQ4_0});
  GgmlQuant::State st;
  const std::int64_t H = 2, T = 4, d = 64;
  std::vector<float> k(static_cast<std::size_t>(H * T * d), 0.5f);
  const auto rows = TensorView<const float, 3>::contiguous(k.data(), {H, T, d});
  const Context<backend::Cpu> cx{};
  auto expect = [&](Status s, const char* text, const Region& r) {
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(text));
    for (auto byte : r.bytes) REQUIRE(byte == 0x5A);
  };
  {
    Region r(policy, H, T, d);
    k[static_cast<std::size_t>((1 * T + 3) * d + 17)] = std::numeric_limits<float>::quiet_NaN();
    expect(policy.quantize(cx, rows, st, r.q), "rows head 1 token 3 channel 17 is not finite", r);
    k[static_cast<std::size_t>((1 * T + 3) * d + 17)] = std::numeric_limits<float>::infinity();
    expect(policy.quantize(cx, rows, st, r.q), "is not finite (inf)", r);
    k[static_cast<std::size_t>((1 * T + 3) * d + 17)] = 0.5f;
  }
  {
    // Heads checked in parallel: the message still names the first bad value in (head, token, channel)
    // order, for contiguous rows (one scan per head) and for rows with a token stride (one scan per row).
    ThreadPool pool(2);
    const Context<backend::Cpu> cx2{{}, pool.context()};
    std::vector<float> big(static_cast<std::size_t>(4 * 40 * d * 2), 0.25f);
    big[static_cast<std::size_t>(((3 * 40 + 1) * d) * 2 + 5)] = std::numeric_limits<float>::infinity();
    big[static_cast<std::size_t>(((2 * 40 + 9) * d) * 2 + 7)] = std::numeric_limits<float>::quiet_NaN();
    big[static_cast<std::size_t>(((2 * 40 + 9) * d) * 2 + 70)] = std::numeric_limits<float>::quiet_NaN();
    Region r(policy, 4, 80, d), rs(policy, 4, 40, d);
    expect(policy.quantize(cx2, TensorView<const float, 3>::contiguous(big.data(), {4, 80, d}), st, r.q),
           "rows head 2 token 18 channel 7 is not finite", r);
    expect(policy.quantize(cx2, TensorView<const float, 3>(big.data(), {4, 40, d}, {80 * d, 2 * d, 1}), st, rs.q),
           "rows head 2 token 9 channel 7 is not finite", rs);
  }
  {
    Region r(policy, H, T, 48);
    expect(policy.quantize(cx, TensorView<const float, 3>(k.data(), {H, T, 48}, {T * d, d, 1}), st, r.q),
           "head_dim 48 is not a multiple of the q4_0 block (32 values)", r);
  }
  {
    Region r(policy, H, T - 1, d);
    expect(policy.quantize(cx, rows, st, r.q), "codes is (2, 3, 36), expected (2 kv heads, >= 4 tokens, 36 bytes per q4_0 row)", r);
    Region wrong(GgmlQuant(GgmlQuantParams{GgmlType::kQ8_0}), H, T, d);
    expect(policy.quantize(cx, rows, st, wrong.q), "expected (2 kv heads, >= 4 tokens, 36 bytes per q4_0 row)", wrong);
  }
  {
    Region r(policy, H, T, d);
    REQUIRE(policy.quantize(cx, rows, st, r.q).is_ok());
    std::vector<float> out(k.size(), -1.0f);
    QuantizedKV other = r.q;
    other.layout = GgmlQuant(GgmlQuantParams{GgmlType::kQ8_0}).layout();
    REQUIRE_THAT(policy.dequantize(cx, other, TensorView<float, 3>::contiguous(out.data(), {H, T, d})).message(),
                 Contains("layout is 'q8_0', the policy's is 'q4_0'"));
    REQUIRE_THAT(policy.dequantize(cx, r.q, TensorView<float, 3>::contiguous(out.data(), {H, T - 1, d})).message(),
                 Contains("out has 3 tokens, the quantized region holds 4"));
    for (float v : out) REQUIRE(v == -1.0f);
  }
  REQUIRE_THAT(GgmlQuant(GgmlQuantParams{static_cast<GgmlType>(9)}).validate_params().message(),
               Contains("type is 9, not one of q8_0 | q4_0"));
}
