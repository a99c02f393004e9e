// The GGUF reader (kvpolicy/io/gguf.hpp): files built here byte by byte for
// every value type and every validation rule (each truncation of a valid file
// included), and, when the SmolLM2 file is installed (KVP_SMOLLM2_GGUF, set
// by tools/kvp.sh), its metadata and dequantized tensors against what gguf-py
// 0.19 reads (tests/data/fixtures/smollm2_gguf.json,
// tests/reference/make_gguf_fixtures.py).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvpolicy/io/gguf.hpp"

using namespace kvpolicy;
using namespace kvpolicy::io;
using Catch::Matchers::Contains;

namespace {

/// Writes GGUF files for the tests.
struct GgufBuilder {
  std::vector<std::byte> b;
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    put<std::uint64_t>(s.size());
    for (char c : s) b.push_back(static_cast<std::byte>(c));
  }
  void header(std::uint64_t tensors, std::uint64_t kvs, std::uint32_t version = 3) {
    for (char c : std::string("GGUF")) b.push_back(static_cast<std::byte>(c));
    put(version);
    put(tensors);
    put(kvs);
  }
  void kv_u32(const std::string& k, std::uint32_t v) {
    str(k);
    put<std::uint32_t>(4);
    put(v);
  }
  void kv_str(const std::string& k, const std::string& v) {
    str(k);
    put<std::uint32_t>(8);
    str(v);
  }
  void tensor(const std::string& name, std::vector<std::uint64_t> ne, std::uint32_t type, std::uint64_t offset) {
    str(name);
    put<std::uint32_t>(static_cast<std::uint32_t>(ne.size()));
    for (auto e : ne) put(e);
    put(type);
    put(offset);
  }
  void align(std::size_t a = 32) {
    while (b.size() % a) b.push_back(std::byte{0});
  }
  void raw(const void* p, std::size_t n) {
    const auto* q = static_cast<const std::byte*>(p);
    b.insert(b.end(), q, q + n);
  }
};

/// A valid file: metadata of every value type (nested array included) and four tensors (F32, F16, BF16, Q8_0).
struct ValidFile {
  GgufBuilder g;
  std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f};
  std::vector<float> q8_src;
  ValidFile() {
    for (int i = 0; i < 64; ++i) q8_src.push_back(std::sin(0.37f * static_cast<float>(i)) * 3.0f);
    g.header(4, 15);
    g.str("u8");
    g.put<std::uint32_t>(0);
    g.put<std::uint8_t>(200);
    g.str("i8");
    g.put<std::uint32_t>(1);
    g.put<std::int8_t>(-7);
    g.str("u16");
    g.put<std::uint32_t>(2);
    g.put<std::uint16_t>(60000);
    g.str("i16");
    g.put<std::uint32_t>(3);
    g.put<std::int16_t>(-300);
    g.kv_u32("u32", 123456);
    g.str("i32");
    g.put<std::uint32_t>(5);
    g.put<std::int32_t>(-5);
    g.str("f32");
    g.put<std::uint32_t>(6);
    g.put<float>(0.25f);
    g.str("bool");
    g.put<std::uint32_t>(7);
    g.put<std::uint8_t>(1);
    g.kv_str("name", "tiny");
    g.str("u64");
    g.put<std::uint32_t>(10);
    g.put<std::uint64_t>(1ull << 40);
    g.str("i64");
    g.put<std::uint32_t>(11);
    g.put<std::int64_t>(-(1ll << 40));
    g.str("f64");
    g.put<std::uint32_t>(12);
    g.put<double>(1e-300);
    g.str("strings");
    g.put<std::uint32_t>(9);
    g.put<std::uint32_t>(8);
    g.put<std::uint64_t>(3);
    g.str("a");
    g.str("");
    g.str("<|im_end|>");
    g.str("ints");
    g.put<std::uint32_t>(9);
    g.put<std::uint32_t>(5);
    g.put<std::uint64_t>(3);
    for (std::int32_t v : {3, -1, 7}) g.put(v);
    g.str("nested");
    g.put<std::uint32_t>(9);
    g.put<std::uint32_t>(9);
    g.put<std::uint64_t>(2);
    for (int k = 0; k < 2; ++k) {
      g.put<std::uint32_t>(0);
      g.put<std::uint64_t>(2);
      g.put<std::uint8_t>(static_cast<std::uint8_t>(k));
      g.put<std::uint8_t>(9);
    }
    g.tensor("a.f32", {4}, 0, 0);
    g.tensor("b.f16", {2, 2}, 1, 32);
    g.tensor("c.bf16", {4}, 30, 64);
    g.tensor("d.q8_0", {32, 2}, 8, 96);
    g.align();
    g.raw(f32.data(), 16);
    g.align();
    for (float v : {1.0f, -0.5f, 65504.0f, 0.0f}) g.put(from_float<half>(v).bits);
    g.align();
    for (float v : {1.0f, -3.0f, 0.5f, 256.0f}) g.put(from_float<bfloat16>(v).bits);
    g.align();
    std::uint8_t blk[34];
    for (int k = 0; k < 2; ++k) {
      ggml_quantize_block(GgmlType::kQ8_0, q8_src.data() + 32 * k, blk);
      g.raw(blk, 34);
    }
  }
};

Status parse(std::vector<std::byte> b, GgufFile* f = nullptr) {
  GgufFile tmp;
  return GgufFile::from_bytes(std::move(b), f ? f : &tmp);
}

void expect_error(std::vector<std::byte> b, const char* needle) {
  GgufFile f;
  const Status s = GgufFile::from_bytes(std::move(b), &f);
  INFO(s.message());
  REQUIRE(!s.is_ok());
  REQUIRE_THAT(s.message(), Contains(needle));
  REQUIRE(f.tensors().empty());  // nothing kept from a failed parse
  REQUIRE(f.metadata().empty());
}

}  // namespace

TEST_CASE("gguf: metadata of every value type, tensor infos and dequantization of F32, F16, BF16, Q8_0", "[gguf]") {
  ValidFile v;
  GgufFile f;
  const Status s = GgufFile::from_bytes(v.g.b, &f);
  INFO(s.message());
  REQUIRE(s.is_ok());
  REQUIRE(f.version() == 3);
  REQUIRE(f.alignment() == 32);
  REQUIRE(f.metadata().size() == 15);
  std::uint64_t u = 0;
  REQUIRE((f.get_uint("u8", &u).is_ok() && u == 200));
  REQUIRE((f.get_uint("u16", &u).is_ok() && u == 60000));
  REQUIRE((f.get_uint("u32", &u).is_ok() && u == 123456));
  REQUIRE((f.get_uint("u64", &u).is_ok() && u == (1ull << 40)));
  REQUIRE(f.find("i8")->i == -7);
  REQUIRE(f.find("i16")->i == -300);
  REQUIRE(f.find("i64")->i == -(1ll << 40));
  REQUIRE_THAT(f.get_uint("i32", &u).message(), Contains("metadata 'i32' is -5, expected >= 0"));
  double x = 0;
  REQUIRE((f.get_float("f32", &x).is_ok() && x == 0.25));
  REQUIRE((f.get_float("f64", &x).is_ok() && x == 1e-300));
  REQUIRE((f.get_float("u32", &x).is_ok() && x == 123456.0));
  bool bo = false;
  REQUIRE((f.get_bool("bool", &bo).is_ok() && bo));
  std::string str;
  REQUIRE((f.get_string("name", &str).is_ok() && str == "tiny"));
  REQUIRE_THAT(f.get_string("u32", &str).message(), Contains("metadata 'u32' is u32, expected string"));
  REQUIRE_THAT(f.get_string("nope", &str).message(), Contains("metadata key 'nope' is missing"));
  std::vector<std::string> ss;
  REQUIRE(f.get_strings("strings", &ss).is_ok());
  REQUIRE(ss == std::vector<std::string>{"a", "", "<|im_end|>"});
  std::vector<std::int64_t> ii;
  REQUIRE(f.get_ints("ints", &ii).is_ok());
  REQUIRE(ii == std::vector<std::int64_t>{3, -1, 7});
  REQUIRE_THAT(f.get_strings("ints", &ss).message(), Contains("not an array of strings"));
  const GgufValue* nested = f.find("nested");
  REQUIRE(nested->items.size() == 2);
  REQUIRE(nested->items[1].items[0].u == 1);
  REQUIRE(nested->items[1].items[1].u == 9);

  REQUIRE(f.tensors().size() == 4);
  const GgufTensorInfo* q8 = f.find_tensor("d.q8_0");
  REQUIRE(q8 != nullptr);
  REQUIRE(q8->ne == std::vector<std::int64_t>{32, 2});
  REQUIRE(q8->rows() == 2);
  REQUIRE(q8->bytes == 68);
  std::vector<float> out(4);
  REQUIRE(f.dequantize(*f.find_tensor("a.f32"), out).is_ok());
  REQUIRE(out == v.f32);
  REQUIRE(f.dequantize(*f.find_tensor("b.f16"), out).is_ok());
  REQUIRE(out == std::vector<float>{1.0f, -0.5f, 65504.0f, 0.0f});
  REQUIRE(f.dequantize(*f.find_tensor("c.bf16"), out).is_ok());
  REQUIRE(out == std::vector<float>{1.0f, -3.0f, 0.5f, 256.0f});
  std::vector<float> q(64), want(64);
  REQUIRE(f.dequantize(*q8, q).is_ok());
  std::uint8_t blk[34];
  for (int k = 0; k < 2; ++k) {
    ggml_quantize_block(GgmlType::kQ8_0, v.q8_src.data() + 32 * k, blk);
    ggml_dequantize_block(GgmlType::kQ8_0, blk, want.data() + 32 * k);
  }
  REQUIRE(q == want);
  std::vector<float> small(3, -1.0f);
  REQUIRE_THAT(f.dequantize(*f.find_tensor("a.f32"), small).message(), Contains("has 4 elements, output holds 3"));
  REQUIRE(small == std::vector<float>(3, -1.0f));
}

TEST_CASE("gguf: every truncation of a valid file is a clear error", "[gguf][errors]") {
  ValidFile v;
  const auto& full = v.g.b;
  for (std::size_t n = 0; n < full.size(); ++n) {
    INFO("prefix of " << n << " bytes");
    GgufFile f;
    const Status s = GgufFile::from_bytes(std::vector<std::byte>(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n)), &f);
    REQUIRE(!s.is_ok());
    REQUIRE(f.tensors().empty());
  }
}

TEST_CASE("gguf: each validation rule gives a clear message", "[gguf][errors]") {
  auto file = [](auto&& body) {
    GgufBuilder g;
    body(g);
    return g.b;
  };
  expect_error(file([](GgufBuilder& g) { g.str("not a gguf file at all"); }), "not a GGUF file");
  expect_error(file([](GgufBuilder& g) { g.header(0, 0, 1); }), "version 1 is not supported");
  expect_error(file([](GgufBuilder& g) { g.header(0, 1ull << 60); }), "header claims 1152921504606846976 metadata keys");
  expect_error(file([](GgufBuilder& g) { g.header(1ull << 40, 0); }), "header claims 1099511627776 tensors");
  expect_error(file([](GgufBuilder& g) {
                 g.header(0, 1);
                 g.put<std::uint64_t>(1ull << 50);
                 g.put<std::uint64_t>(0);
               }),
               "a metadata key has length 1125899906842624");
  expect_error(file([](GgufBuilder& g) {
                 g.header(0, 1);
                 g.str("k");
                 g.put<std::uint32_t>(13);
               }),
               "metadata 'k' has unknown value type 13");
  expect_error(file([](GgufBuilder& g) {
                 g.header(0, 2);
                 g.kv_u32("k", 1);
                 g.kv_u32("k", 2);
               }),
               "metadata key 'k' appears twice");
  expect_error(file([](GgufBuilder& g) {
                 g.header(0, 1);
                 g.str("arr");
                 g.put<std::uint32_t>(9);
                 g.put<std::uint32_t>(6);
                 g.put<std::uint64_t>(1ull << 40);
               }),
               "metadata 'arr' claims 1099511627776 elements");
  expect_error(file([](GgufBuilder& g) {
                 g.header(0, 1);
                 g.str("deep");
                 g.put<std::uint32_t>(9);
                 for (int i = 0; i < 10; ++i) {
                   g.put<std::uint32_t>(9);
                   g.put<std::uint64_t>(1);
                 }
                 g.put<std::uint32_t>(0);
                 g.put<std::uint64_t>(1);
                 g.put<std::uint8_t>(1);
               }),
               "metadata 'deep' nests arrays deeper than 8");
  expect_error(file([](GgufBuilder& g) {
                 g.header(0, 1);
                 g.str("b");
                 g.put<std::uint32_t>(7);
                 g.put<std::uint8_t>(2);
               }),
               "metadata 'b' is a bool of value 2, must be 0 or 1");
  expect_error(file([](GgufBuilder& g) {
                 g.header(0, 1);
                 g.kv_u32("general.alignment", 24);
               }),
               "general.alignment must be a power of two");
  auto one_tensor = [&](std::vector<std::uint64_t> ne, std::uint32_t type, std::uint64_t offset, std::size_t data_bytes) {
    return file([&](GgufBuilder& g) {
      g.header(1, 0);
      g.tensor("t", ne, type, offset);
      g.align();
      for (std::size_t i = 0; i < data_bytes; ++i) g.b.push_back(std::byte{0});
    });
  };
  expect_error(one_tensor({}, 0, 0, 16), "tensor 't' has 0 dimensions, must be 1..4");
  expect_error(one_tensor({1, 1, 1, 1, 1}, 0, 0, 16), "tensor 't' has 5 dimensions");
  expect_error(one_tensor({4, 0}, 0, 0, 16), "tensor 't' has extent 0 in dimension 1");
  expect_error(one_tensor({1ull << 40, 1ull << 40}, 0, 0, 16), "tensor 't' has too many elements");
  expect_error(one_tensor({4}, 99, 0, 16), "tensor 't' has unknown ggml type 99");
  expect_error(one_tensor({48}, 8, 0, 64), "tensor 't' has ne[0] = 48, not a multiple of the Q8_0 block of 32");
  expect_error(one_tensor({4}, 0, 8, 64), "tensor 't' offset 8 is not a multiple of the alignment 32");
  expect_error(one_tensor({4}, 0, 0, 15), "tensor 't' data [0, +16) lies past the end of the 15-byte data section");
  expect_error(file([](GgufBuilder& g) {
                 g.header(2, 0);
                 g.tensor("t", {8}, 0, 0);
                 g.tensor("t", {8}, 0, 32);
                 g.align();
                 for (int i = 0; i < 64; ++i) g.b.push_back(std::byte{0});
               }),
               "tensor 't' appears twice");
  expect_error(file([](GgufBuilder& g) {
                 g.header(2, 0);
                 g.tensor("a", {16}, 0, 0);
                 g.tensor("b", {16}, 0, 32);
                 g.align();
                 for (int i = 0; i < 96; ++i) g.b.push_back(std::byte{0});
               }),
               "tensors 'a' and 'b' overlap");
  // A K-quant is parsed and sized, dequantizing it is refused by name.
  GgufFile f;
  REQUIRE(parse(one_tensor({256}, 14, 0, 210), &f).is_ok());
  std::vector<float> out(256, 7.0f);
  REQUIRE_THAT(f.dequantize(f.tensors()[0], out).message(), Contains("dequantizing tensor 't' of type Q6_K is not implemented"));
  REQUIRE(out == std::vector<float>(256, 7.0f));
  REQUIRE_THAT(GgufFile::open("/nonexistent/model.gguf", &f).message(), Contains("cannot open '/nonexistent/model.gguf'"));
}

TEST_CASE("gguf: the SmolLM2 file reads as gguf-py 0.19 reads it (skipped when the model is not installed)", "[gguf][smollm2]") {
  const char* path = std::getenv("KVP_SMOLLM2_GGUF");
  if (path == nullptr || *path == '\0' || !std::ifstream(path)) {
    WARN("KVP_SMOLLM2_GGUF is not set to an installed SmolLM2-135M-Instruct.Q4_1.gguf (tools/kvp.sh installs it): skipped");
    return;
  }
  std::ifstream fx(std::string(KVP_TEST_DATA_DIR) + "/fixtures/smollm2_gguf.json");
  REQUIRE(fx);
  const nlohmann::json j = nlohmann::json::parse(fx);
  GgufFile f;
  const Status s = GgufFile::open(path, &f);
  INFO(s.message());
  REQUIRE(s.is_ok());
  REQUIRE(f.tensors().size() == j.at("tensor_count").get<std::size_t>());
  REQUIRE(f.metadata().size() == j.at("kv_count").get<std::size_t>());
  std::vector<std::string> tokens, merges;
  REQUIRE(f.get_strings("tokenizer.ggml.tokens", &tokens).is_ok());
  REQUIRE(f.get_strings("tokenizer.ggml.merges", &merges).is_ok());
  REQUIRE(tokens.size() == j.at("tokens").get<std::size_t>());
  REQUIRE(merges.size() == j.at("merges").get<std::size_t>());
  for (const auto& [k, v] : j.at("metadata").items()) {
    INFO(k);
    if (v.is_string()) {
      std::string got;
      REQUIRE(f.get_string(k, &got).is_ok());
      REQUIRE(got == v.get<std::string>());
    } else if (v.is_boolean()) {
      bool got = !v.get<bool>();
      REQUIRE(f.get_bool(k, &got).is_ok());
      REQUIRE(got == v.get<bool>());
    } else if (v.is_number_integer()) {
      std::uint64_t got = 0;
      REQUIRE(f.get_uint(k, &got).is_ok());
      REQUIRE(got == v.get<std::uint64_t>());
    } else {
      double got = 0;
      REQUIRE(f.get_float(k, &got).is_ok());
      REQUIRE(got == v.get<double>());
    }
  }
  for (const auto& t : j.at("tensors")) {
    const std::string name = t.at("name");
    INFO(name);
    const GgufTensorInfo* info = f.find_tensor(name);
    REQUIRE(info != nullptr);
    REQUIRE(std::string(info->type->name) == t.at("type").get<std::string>());
    REQUIRE(info->ne == t.at("ne").get<std::vector<std::int64_t>>());
    std::vector<float> x(static_cast<std::size_t>(info->elements));
    REQUIRE(f.dequantize(*info, x).is_ok());
    std::uint64_t chk = 0;
    double sum = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &x[i], 4);
      chk += static_cast<std::uint64_t>(bits) * (2 * static_cast<std::uint64_t>(i) + 1);
      sum += x[i];
    }
    REQUIRE(chk == t.at("bits_checksum").get<std::uint64_t>());  // every value bit-exact (with the first 16 below)
    const auto first = t.at("first").get<std::vector<double>>();
    for (std::size_t i = 0; i < first.size(); ++i) REQUIRE(static_cast<double>(x[i]) == first[i]);
    REQUIRE(sum == Approx(t.at("sum").get<double>()).epsilon(1e-9));
  }
}
