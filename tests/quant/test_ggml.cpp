// ggml block formats: byte-exact quantization and bit-exact dequantization
// against gguf-py 0.19's reference quantizers (tests/data/fixtures/ggml_quants.bin,
// written by tests/reference/make_quant_fixtures.py), on every CPU level.
#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/quant/ggml.hpp"

using namespace kvpolicy;

namespace {

struct TypeFixture {
  GgmlType type{};
  std::uint32_t block_bytes = 0;
  std::vector<std::uint8_t> quantized;  // (n_blocks, block_bytes)
  std::vector<std::uint8_t> raw;        // (n_raw, block_bytes)
  std::vector<float> raw_dequantized;   // (n_raw, 32)
  std::uint32_t n_raw = 0;
};
struct Fixtures {
  std::string header;
  std::uint32_t n_blocks = 0;
  std::vector<float> inputs;
  std::vector<TypeFixture> types;
};

template <class T>
void read(std::ifstream& f, T* dst, std::size_t n) {
  f.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(n * sizeof(T)));
  REQUIRE(f.good());
}

const Fixtures& fixtures() {
  static const Fixtures fx = [] {
    Fixtures r;
    std::ifstream f(std::string(KVP_TEST_DATA_DIR) + "/fixtures/ggml_quants.bin", std::ios::binary);
    REQUIRE(f.good());
    std::getline(f, r.header);
    REQUIRE(r.header.rfind("kvpolicy-ggml-fixtures v1", 0) == 0);
    std::uint32_t nt = 0;
    read(f, &r.n_blocks, 1);
    read(f, &nt, 1);
    r.inputs.resize(static_cast<std::size_t>(r.n_blocks) * 32);
    read(f, r.inputs.data(), r.inputs.size());
    for (std::uint32_t i = 0; i < nt; ++i) {
      TypeFixture t;
      std::uint32_t id = 0;
      read(f, &id, 1);
      read(f, &t.block_bytes, 1);
      t.type = static_cast<GgmlType>(id);
      t.quantized.resize(static_cast<std::size_t>(r.n_blocks) * t.block_bytes);
      read(f, t.quantized.data(), t.quantized.size());
      read(f, &t.n_raw, 1);
      t.raw.resize(static_cast<std::size_t>(t.n_raw) * t.block_bytes);
      read(f, t.raw.data(), t.raw.size());
      t.raw_dequantized.resize(static_cast<std::size_t>(t.n_raw) * 32);
      read(f, t.raw_dequantized.data(), t.raw_dequantized.size());
      r.types.push_back(std::move(t));
    }
    return r;
  }();
  return fx;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0 || (a != a && b != b); }

template <class B>
void check_backend(const char* what) {
  const Fixtures& fx = fixtures();
  REQUIRE(fx.types.size() == 6);
  for (const TypeFixture& t : fx.types) {
    INFO(what << " " << ggml_name(t.type));
    REQUIRE(static_cast<std::int32_t>(t.block_bytes) == ggml_block_bytes(t.type));
    // Quantize: the whole fixture as one row of n_blocks * 32 values, byte for byte.
    std::vector<std::uint8_t> got(t.quantized.size(), 0xAA);
    B::ggml_quantize_row(t.type, fx.inputs.data(), static_cast<std::int64_t>(fx.inputs.size()), got.data());
    std::int64_t mismatched = 0, first = -1;
    for (std::uint32_t b = 0; b < fx.n_blocks; ++b)
      if (std::memcmp(got.data() + b * t.block_bytes, t.quantized.data() + b * t.block_bytes, t.block_bytes) != 0) {
        ++mismatched;
        if (first < 0) first = b;
      }
    INFO("first mismatching block " << first);
    REQUIRE(mismatched == 0);
    // Dequantize arbitrary blocks: bit for bit what gguf-py computes.
    std::vector<float> y(t.raw_dequantized.size());
    B::ggml_dequantize_row(t.type, t.raw.data(), static_cast<std::int64_t>(y.size()), y.data());
    for (std::size_t i = 0; i < y.size(); ++i) {
      INFO("raw value " << i);
      REQUIRE(same_bits(y[i], t.raw_dequantized[i]));
    }
  }
}

}  // namespace

TEST_CASE("ggml formats: quantize byte-exact and dequantize bit-exact with gguf-py (scalar reference)", "[quant][ggml]") {
  check_backend<backend::Scalar>("scalar");
}

TEST_CASE("ggml formats: the CPU backend equals gguf-py on every ISA level", "[quant][ggml][cpu]") {
  const CpuIsa saved = backend::Cpu::isa();
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!backend::Cpu::set_isa(isa)) continue;
    check_backend<backend::Cpu>(backend::Cpu::isa_name());
  }
  backend::Cpu::set_isa(saved);
}

TEST_CASE("ggml formats: layouts, code packing and round trips", "[quant][ggml]") {
  REQUIRE(ggml_block_bytes(GgmlType::kQ8_0) == 34);
  REQUIRE(ggml_block_bytes(GgmlType::kQ4_0) == 18);
  REQUIRE(ggml_block_bytes(GgmlType::kQ4_1) == 20);
  REQUIRE(ggml_block_bytes(GgmlType::kQ5_0) == 22);
  REQUIRE(ggml_block_bytes(GgmlType::kQ5_1) == 24);
  REQUIRE(ggml_block_bytes(GgmlType::kIQ4_NL) == 18);
  // q4_0 by hand: max = -8 -> d = 1, q = trunc(x + 8.5); element j in the low nibble, j + 16 in the high one.
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j % 16) - 8.0f;
  x[0] = -8.0f;
  std::uint8_t b[18];
  ggml_quantize_block(GgmlType::kQ4_0, x, b);
  REQUIRE(b[0] == 0x00);
  REQUIRE(b[1] == 0x3c);  // fp16 1.0
  for (int j = 0; j < 16; ++j) REQUIRE(b[2 + j] == static_cast<std::uint8_t>(j | (j << 4)));
  float y[32];
  ggml_dequantize_block(GgmlType::kQ4_0, b, y);
  for (int j = 0; j < 32; ++j) REQUIRE(y[j] == x[j]);
  // q5_0: bit 4 of q[j] is bit j of the little-endian qh word.
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j) - 16.0f;
  std::uint8_t b5[22];
  ggml_quantize_block(GgmlType::kQ5_0, x, b5);  // max = -16 -> d = 1, q = j
  REQUIRE((b5[2] | b5[3] << 8 | b5[4] << 16 | static_cast<std::uint32_t>(b5[5]) << 24) == 0xffff0000u);
  ggml_dequantize_block(GgmlType::kQ5_0, b5, y);
  for (int j = 0; j < 32; ++j) REQUIRE(y[j] == x[j]);
  // Error bound of every format on smooth data: |x - x^| <= d (one quantization step) per block.
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kIQ4_NL}) {
    INFO(ggml_name(t));
    double err = 0.0, amax = 0.0;
    for (int rep = 0; rep < 200; ++rep) {
      for (float& v : x) v = nd(rng);
      std::uint8_t q[34];
      ggml_quantize_block(t, x, q);
      ggml_dequantize_block(t, q, y);
      for (int j = 0; j < 32; ++j) {
        err = std::max(err, static_cast<double>(std::fabs(x[j] - y[j])));
        amax = std::max(amax, static_cast<double>(std::fabs(x[j])));
      }
    }
    const double step = t == GgmlType::kQ8_0 ? amax / 127 : (t == GgmlType::kQ5_0 || t == GgmlType::kQ5_1) ? amax / 8 : amax / 4;
    REQUIRE(err <= step);
  }
}
