// Token-wise INT4 / INT8 (SAW-INT4's writer) byte-exact against a numpy float32
// transcription, the block-diagonal Hadamard rotation against the float64
// matrix product (both conventions' block sizes), rotation in front of INT4 and
// the ggml formats (quantizer bit-exact after the rotation, decode rotated
// back), and bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {

struct QuantCase {
  std::uint32_t bits = 0, rows = 0, d = 0;
  std::vector<float> x, dec;
  std::vector<std::uint8_t> bytes;
};
struct RotCase {
  std::uint32_t n = 0, rows = 0, d = 0;
  std::vector<float> x;
  std::vector<double> y;
};

void load(std::vector<QuantCase>& quant, std::vector<RotCase>& rot) {
  std::ifstream f(std::string(KVP_TEST_DATA_DIR) + "/fixtures/int4.bin", std::ios::binary);
  REQUIRE(f.good());
  std::string header;
  std::getline(f, header);
  REQUIRE(header.rfind("kvpolicy-int4-fixtures v1", 0) == 0);
  auto rd = [&](auto& v, std::size_t count) {
    v.resize(count);
    f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(count * sizeof(v[0])));
  };
  std::uint32_t n = 0, h[3];
  f.read(reinterpret_cast<char*>(&n), 4);
  quant.resize(n);
  for (auto& c : quant) {
    f.read(reinterpret_cast<char*>(h), sizeof h);
    c.bits = h[0], c.rows = h[1], c.d = h[2];
    rd(c.x, std::size_t{c.rows} * c.d);
    rd(c.bytes, std::size_t{c.rows} * static_cast<std::size_t>(int4q::row_bytes(c.d, static_cast<int>(c.bits))));
    rd(c.dec, std::size_t{c.rows} * c.d);
  }
  f.read(reinterpret_cast<char*>(&n), 4);
  rot.resize(n);
  for (auto& c : rot) {
    f.read(reinterpret_cast<char*>(h), sizeof h);
    c.n = h[0], c.rows = h[1], c.d = h[2];
    rd(c.x, std::size_t{c.rows} * c.d);
    rd(c.y, std::size_t{c.rows} * c.d);
  }
  REQUIRE(f.good());
}

template <class P>
struct Region {
  std::vector<std::uint8_t> bytes;
  QuantizedKV q;
  Region(const P& p, std::int64_t H, std::int64_t T, std::int64_t d) : bytes(static_cast<std::size_t>(H * T * p.row_bytes(d)), 0x5A) {
    q.layout = p.layout();
    q.codes = TensorView<std::uint8_t, 3>::contiguous(bytes.data(), {H, T, p.row_bytes(d)});
    q.tokens = T;
  }
};

}  // namespace

TEST_CASE("int4: token-wise INT4 / INT8 rows byte-exact with the SAW-INT4 formula", "[quant][int4]") {
  std::vector<QuantCase> quant;
  std::vector<RotCase> rot;
  load(quant, rot);
  REQUIRE(quant.size() == 4);
  std::size_t rows = 0;
  for (const auto& c : quant) {
    INFO("bits " << c.bits << " d " << c.d);
    const std::int64_t d = c.d, T = c.rows;
    const Int4Quant p(Int4QuantParams{static_cast<std::int32_t>(c.bits), HadamardMode::kNone, 128, QuantRole::kKeys});
    REQUIRE(p.bytes_per_token(d) == static_cast<double>(d * c.bits / 8 + 8));
    Region<Int4Quant> r(p, 1, T, d);
    Int4Quant::State st;
    REQUIRE(p.quantize(Context<backend::Cpu>{}, TensorView<const float, 3>::contiguous(c.x.data(), {1, T, d}), st, r.q).is_ok());
    REQUIRE(r.bytes == c.bytes);
    std::vector<float> y(c.x.size());
    REQUIRE(p.dequantize(Context<backend::Scalar>{}, r.q, TensorView<float, 3>::contiguous(y.data(), {1, T, d})).is_ok());
    REQUIRE(y == c.dec);
    rows += c.rows;
  }
  WARN("int4/int8: " << rows << " rows byte-exact, decoded bit-exact");
}

TEST_CASE("int4: block-diagonal Hadamard = the float64 Sylvester product, llama.cpp and SAW block sizes", "[quant][int4][hadamard]") {
  std::vector<QuantCase> quant;
  std::vector<RotCase> rot;
  load(quant, rot);
  double worst = 0.0;
  for (const auto& c : rot) {
    INFO("n " << c.n << " d " << c.d);
    for (std::uint32_t i = 0; i < c.rows; ++i) {
      std::vector<float> x(c.x.begin() + i * c.d, c.x.begin() + (i + 1) * c.d), back = x;
      hadamard_rotate(x.data(), c.d, c.n);
      double amax = 0.0;
      for (std::uint32_t j = 0; j < c.d; ++j) amax = std::max(amax, std::fabs(c.y[i * c.d + j]));
      for (std::uint32_t j = 0; j < c.d; ++j) {
        const double e = std::fabs(x[j] - c.y[i * c.d + j]) / amax;
        worst = std::max(worst, e);
        REQUIRE(e < 1e-6);
      }
      hadamard_rotate(x.data(), c.d, c.n);  // involutory
      for (std::uint32_t j = 0; j < c.d; ++j) REQUIRE(std::fabs(x[j] - back[j]) <= 1e-5f * (1.0f + std::fabs(back[j])));
    }
  }
  WARN("hadamard: worst error relative to the row's max |y|: " << worst);
  std::int64_t n = -1;
  REQUIRE(hadamard_block(HadamardMode::kLlamaCpp, 0, true, 128, "t", &n).is_ok());
  REQUIRE(n == 128);
  REQUIRE(hadamard_block(HadamardMode::kLlamaCpp, 0, true, 576, "t", &n).is_ok());
  REQUIRE(n == 64);
  REQUIRE(hadamard_block(HadamardMode::kLlamaCpp, 0, true, 256, "t", &n).is_ok());
  REQUIRE(n == 256);
  REQUIRE(hadamard_block(HadamardMode::kLlamaCpp, 0, false, 256, "t", &n).is_ok());
  REQUIRE(n == 64);
  REQUIRE(hadamard_block(HadamardMode::kLlamaCpp, 0, true, 96, "t", &n).is_ok());  // llama.cpp: not rotated
  REQUIRE(n == 0);
  REQUIRE(hadamard_block(HadamardMode::kBlock, 16, true, 128, "t", &n).is_ok());
  REQUIRE(n == 16);
  REQUIRE_THAT(hadamard_block(HadamardMode::kBlock, 256, true, 128, "t", &n).message(), Contains("power of two dividing head_dim 128"));
  REQUIRE_THAT(hadamard_block(HadamardMode::kBlock, 48, true, 96, "t", &n).message(), Contains("block 48"));
  REQUIRE(hadamard_block(HadamardMode::kNone, 0, true, 100, "t", &n).is_ok());
  REQUIRE(n == 0);
}

TEST_CASE("int4 and ggml with rotation: quantizer bit-exact after R, decode rotated back, outliers spread", "[quant][int4][hadamard]") {
  const std::int64_t H = 2, T = 9, d = 128;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<std::size_t>(H * T * d));
  for (auto& v : x) v = nd(rng);
  for (std::int64_t r = 0; r < H * T; ++r) x[static_cast<std::size_t>(r * d + 17)] = 40.0f;  // an outlier channel, as keys have
  const auto rows = TensorView<const float, 3>::contiguous(x.data(), {H, T, d});
  ThreadPool pool(2);
  auto mean_sq_err = [&](const std::vector<float>& y) {
    double e = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) e += (y[i] - x[i]) * (y[i] - x[i]);
    return e / static_cast<double>(x.size());
  };
  double err_plain = 0.0, err_rot = 0.0;
  for (HadamardMode mode : {HadamardMode::kNone, HadamardMode::kLlamaCpp, HadamardMode::kBlock}) {
    const Int4Quant p(Int4QuantParams{4, mode, 16, QuantRole::kKeys});
    REQUIRE(p.rotation_block(d) == (mode == HadamardMode::kNone ? 0 : mode == HadamardMode::kLlamaCpp ? 128 : 16));
    Region<Int4Quant> a(p, H, T, d), b(p, H, T, d);
    Int4Quant::State st;
    REQUIRE(p.quantize(Context<backend::Scalar>{}, rows, st, a.q).is_ok());
    REQUIRE(p.quantize(Context<backend::Cpu>{{}, pool.context()}, rows, st, b.q).is_ok());
    REQUIRE(a.bytes == b.bytes);
    for (std::int64_t r = 0; r < H * T; ++r) {
      std::vector<float> xr(x.begin() + r * d, x.begin() + (r + 1) * d);
      p.rotate(xr.data(), d);
      std::vector<std::uint8_t> want(static_cast<std::size_t>(p.row_bytes(d)));
      int4q::quantize_row(xr.data(), d, 4, want.data());
      REQUIRE(std::memcmp(want.data(), &a.q.codes(r / T, r % T, 0), want.size()) == 0);
    }
    std::vector<float> y(x.size());
    REQUIRE(p.dequantize(Context<backend::Cpu>{{}, pool.context()}, a.q, TensorView<float, 3>::contiguous(y.data(), {H, T, d})).is_ok());
    if (mode == HadamardMode::kNone) err_plain = mean_sq_err(y);
    if (mode == HadamardMode::kLlamaCpp) err_rot = mean_sq_err(y);
  }
  // The outlier sets every plain row's scale; rotated, it is spread over 128 channels.
  REQUIRE(err_rot < 0.5 * err_plain);
  WARN("int4 mean squared error with an outlier channel: plain " << err_plain << ", llama_cpp rotation " << err_rot);

  for (GgmlType t : {GgmlType::kQ4_0, GgmlType::kQ8_0}) {
    const GgmlQuant g(GgmlQuantParams{t, HadamardMode::kLlamaCpp, 64, QuantRole::kValues});
    REQUIRE(g.rotation_block(d) == 64);
    Region<GgmlQuant> a(g, H, T, d), b(g, H, T, d);
    GgmlQuant::State st;
    REQUIRE(g.quantize(Context<backend::Scalar>{}, rows, st, a.q).is_ok());
    REQUIRE(g.quantize(Context<backend::Cpu>{{}, pool.context()}, rows, st, b.q).is_ok());
    REQUIRE(a.bytes == b.bytes);
    for (std::int64_t r = 0; r < H * T; ++r) {
      std::vector<float> xr(x.begin() + r * d, x.begin() + (r + 1) * d);
      g.rotate(xr.data(), d);
      for (std::int64_t blk = 0; blk < d / 32; ++blk) {
        std::uint8_t want[34];
        ggml_quantize_block(t, xr.data() + blk * 32, want);
        REQUIRE(std::memcmp(want, &a.q.codes(r / T, r % T, blk * ggml_block_bytes(t)), static_cast<std::size_t>(ggml_block_bytes(t))) == 0);
      }
    }
    std::vector<float> y(x.size()), yc(x.size());
    REQUIRE(g.dequantize(Context<backend::Scalar>{}, a.q, TensorView<float, 3>::contiguous(y.data(), {H, T, d})).is_ok());
    REQUIRE(g.dequantize(Context<backend::Cpu>{{}, pool.context()}, a.q, TensorView<float, 3>::contiguous(yc.data(), {H, T, d})).is_ok());
    REQUIRE(y == yc);
    const GgmlQuant plain(GgmlQuantParams{t});
    Region<GgmlQuant> c(plain, H, T, d);
    REQUIRE(plain.quantize(Context<backend::Cpu>{}, rows, st, c.q).is_ok());
    std::vector<float> yp(x.size());
    REQUIRE(plain.dequantize(Context<backend::Cpu>{}, c.q, TensorView<float, 3>::contiguous(yp.data(), {H, T, d})).is_ok());
    REQUIRE(mean_sq_err(y) < mean_sq_err(yp));
  }
}

TEST_CASE("int4: bad input is rejected by name and nothing is written", "[quant][int4][errors]") {
  const std::int64_t H = 1, T = 2, d = 64;
  std::vector<float> x(static_cast<std::size_t>(H * T * d), 1.0f);
  const Int4Quant p{};
  Region<Int4Quant> r(p, H, T, d);
  const auto before = r.bytes;
  Int4Quant::State st;
  const Context<backend::Cpu> ctx{};
  x[70] = std::numeric_limits<float>::infinity();
  REQUIRE_THAT(p.quantize(ctx, TensorView<const float, 3>::contiguous(x.data(), {H, T, d}), st, r.q).message(),
               Contains("head 0 token 1 channel 6 is not finite"));
  x[70] = 1.0f;
  REQUIRE(p.rotation_block(96) == 0);  // llama.cpp's rule: head_dim 96 is not rotated
  const Int4Quant blk(Int4QuantParams{4, HadamardMode::kBlock, 128, QuantRole::kKeys});
  REQUIRE_THAT(blk.quantize(ctx, TensorView<const float, 3>::contiguous(x.data(), {H, T, d}), st, r.q).message(),
               Contains("block 128 must be a power of two dividing head_dim 64"));
  const Int4Quant none(Int4QuantParams{4, HadamardMode::kNone, 128, QuantRole::kKeys});
  REQUIRE_THAT(none.quantize(ctx, TensorView<const float, 3>::contiguous(x.data(), {H, 1, 63}), st, r.q).message(), Contains("even"));
  REQUIRE_THAT(p.quantize(ctx, TensorView<const float, 3>::contiguous(x.data(), {2, 1, d}), st, r.q).message(),
               Contains("codes is (1, 2, 40), expected (2 kv heads"));
  REQUIRE_THAT(Int4Quant(Int4QuantParams{3}).validate_params().message(), Contains("bits is 3"));
  REQUIRE_THAT(Int4Quant(Int4QuantParams{4, HadamardMode::kBlock, 24}).validate_params().message(), Contains("block 24"));
  REQUIRE(r.bytes == before);
  QuantizedKV wrong = r.q;
  wrong.layout.name = "q4_0";
  std::vector<float> y(x.size());
  REQUIRE_THAT(p.dequantize(ctx, wrong, TensorView<float, 3>::contiguous(y.data(), {H, T, d})).message(), Contains("layout is 'q4_0'"));
}
