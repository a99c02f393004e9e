// SPDX-License-Identifier: Apache-2.0
// safetensors reader/writer: round trips, every validation rule, and
// fuzz-style corruption (truncation, header byte flips, random lengths):
// the reader must never crash and always return a clean error or a valid file.
#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include "kvpolicy/io/safetensors.hpp"

using namespace kvpolicy;
using io::SafetensorsFile;
using io::SafetensorsWriter;

namespace {

std::vector<std::byte> raw(const std::string& header, std::size_t data_bytes, std::uint64_t declared_len = ~0ull) {
  std::vector<std::byte> b(8 + header.size() + data_bytes, std::byte{0});
  const std::uint64_t n = declared_len == ~0ull ? header.size() : declared_len;
  std::memcpy(b.data(), &n, 8);
  std::memcpy(b.data() + 8, header.data(), header.size());
  for (std::size_t i = 0; i < data_bytes; ++i) b[8 + header.size() + i] = static_cast<std::byte>(i * 7 + 1);
  return b;
}

std::string open_error(const std::vector<std::byte>& b) {
  SafetensorsFile f;
  Status s = SafetensorsFile::from_memory(b.data(), b.size(), &f);
  return s ? std::string() : std::string(s.message());
}

std::vector<std::byte> sample_file() {
  SafetensorsWriter w;
  std::vector<float> a(2 * 3 * 4);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = 0.5f * static_cast<float>(i);
  std::vector<half> h(5);
  for (int i = 0; i < 5; ++i) h[i] = to_half(static_cast<float>(i) - 2.0f);
  std::vector<bfloat16> bf(3);
  for (int i = 0; i < 3; ++i) bf[i] = to_bfloat16(1.5f * static_cast<float>(i));
  std::vector<std::int32_t> i32{1, -2, 3};
  std::vector<std::int64_t> i64{10, 20};
  std::vector<std::uint8_t> u8{1, 2, 3, 4, 5, 6, 7};
  throw_if_error(w.add("a", {2, 3, 4}, a.data()));
  throw_if_error(w.add("h", {5}, h.data()));
  throw_if_error(w.add("bf", {3, 1}, bf.data()));
  throw_if_error(w.add("i32", {3}, i32.data()));
  throw_if_error(w.add("i64", {2}, i64.data()));
  throw_if_error(w.add("u8", {7}, u8.data()));
  throw_if_error(w.add<float>("empty", {0, 4}, nullptr));
  w.set_metadata("format", "test");
  return w.to_bytes();
}

/// Touch every byte of every tensor of a file that opened (ASan catches overruns).
std::uint64_t touch_all(const SafetensorsFile& f) {
  std::uint64_t sum = 0;
  for (const auto& e : f.tensors()) {
    const std::byte* p = f.bytes(e);
    for (std::uint64_t i = 0; i < e.end - e.begin; ++i) sum += static_cast<std::uint8_t>(p[i]);
    AnyTensorView v;
    if (f.tensor(e.name, &v)) {
      std::int64_t n = 1;
      for (int k = 0; k < v.rank; ++k) n *= v.extents[k];
      CHECK(static_cast<std::uint64_t>(n) * dtype_size(v.dtype) == e.end - e.begin);
    }
  }
  return sum;
}

}  // namespace

TEST_CASE("safetensors: writer output round-trips through the reader (all dtypes, metadata)") {
  const auto bytes = sample_file();
  std::uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data(), 8);
  REQUIRE(hlen % 8 == 0);  // header padded so the data section starts 8-aligned
  SafetensorsFile f;
  REQUIRE(SafetensorsFile::from_memory(bytes.data(), bytes.size(), &f).is_ok());
  CHECK(f.tensors().size() == 7);
  CHECK(f.metadata().at("format") == "test");

  TensorView<const float, 3> a;
  REQUIRE(f.view("a", &a).is_ok());
  CHECK(a.extent(0) == 2);
  CHECK(a.extent(1) == 3);
  CHECK(a.extent(2) == 4);
  CHECK(a(1, 2, 3) == 0.5f * 23);
  TensorView<const half, 1> h;
  REQUIRE(f.view("h", &h).is_ok());
  CHECK(to_float(h(4)) == 2.0f);
  TensorView<const bfloat16, 2> bf;
  REQUIRE(f.view("bf", &bf).is_ok());
  CHECK(to_float(bf(2, 0)) == 3.0f);
  TensorView<const std::int32_t, 1> i32;
  REQUIRE(f.view("i32", &i32).is_ok());
  CHECK(i32(1) == -2);
  TensorView<const std::int64_t, 1> i64;
  REQUIRE(f.view("i64", &i64).is_ok());
  CHECK(i64(1) == 20);
  TensorView<const std::uint8_t, 1> u8;
  REQUIRE(f.view("u8", &u8).is_ok());
  CHECK(u8(6) == 7);
  TensorView<const float, 2> e;
  REQUIRE(f.view("empty", &e).is_ok());
  CHECK(e.size() == 0);

  // Owned copy: survives the source buffer.
  SafetensorsFile g;
  REQUIRE(SafetensorsFile::from_bytes(std::vector<std::byte>(bytes), &g).is_ok());
  TensorView<const float, 3> a2;
  REQUIRE(g.view("a", &a2).is_ok());
  CHECK(a2(0, 1, 2) == 0.5f * 6);
}

TEST_CASE("safetensors: typed views check dtype, rank and name") {
  const auto bytes = sample_file();
  SafetensorsFile f;
  REQUIRE(SafetensorsFile::from_memory(bytes.data(), bytes.size(), &f).is_ok());
  TensorView<const half, 3> wrong_dtype;
  Status s = f.view("a", &wrong_dtype);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Catch::Contains("'a'") && Catch::Contains("float32") && Catch::Contains("float16"));
  TensorView<const float, 2> wrong_rank;
  s = f.view("a", &wrong_rank);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Catch::Contains("rank 3"));
  s = f.view("nope", &wrong_rank);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Catch::Contains("no tensor named 'nope'"));
}

TEST_CASE("safetensors: file and directory I/O") {
  const std::string path = "test_safetensors_io.safetensors";
  SafetensorsWriter w;
  std::vector<float> x{1, 2, 3};
  REQUIRE(w.add("x", {3}, x.data()).is_ok());
  REQUIRE(w.write(path).is_ok());
  SafetensorsFile f;
  REQUIRE(SafetensorsFile::open(path, &f).is_ok());
  TensorView<const float, 1> v;
  REQUIRE(f.view("x", &v).is_ok());
  CHECK(v(2) == 3.0f);
  Status s = SafetensorsFile::open("does/not/exist.safetensors", &f);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Catch::Contains("cannot open"));

  // The file path validates like the buffer path: every truncation, an absurd length.
  const auto good = sample_file();
  for (std::size_t len : {std::size_t{0}, std::size_t{5}, std::size_t{8}, std::size_t{40}, good.size() - 1}) {
    {
      std::ofstream o(path, std::ios::binary | std::ios::trunc);
      o.write(reinterpret_cast<const char*>(good.data()), static_cast<std::streamsize>(len));
    }
    s = SafetensorsFile::open(path, &f);
    INFO("length " << len << ": " << s.message());
    CHECK_FALSE(s.is_ok());
    CHECK_THAT(s.message(), Catch::Contains(path));
  }
  auto bad = good;
  const std::uint64_t huge = 1ull << 50;
  std::memcpy(bad.data(), &huge, 8);
  {
    std::ofstream o(path, std::ios::binary | std::ios::trunc);
    o.write(reinterpret_cast<const char*>(bad.data()), static_cast<std::streamsize>(bad.size()));
  }
  s = SafetensorsFile::open(path, &f);
  CHECK_THAT(s.message(), Catch::Contains("exceeds"));
  {
    std::ofstream o(path, std::ios::binary | std::ios::trunc);
    o.write(reinterpret_cast<const char*>(good.data()), static_cast<std::streamsize>(good.size()));
  }
  REQUIRE(SafetensorsFile::open(path, &f).is_ok());
  TensorView<const std::int64_t, 1> i64;
  REQUIRE(f.view("i64", &i64).is_ok());
  CHECK(i64(1) == 20);
  std::remove(path.c_str());
}

TEST_CASE("safetensors: writer rejects bad tensors") {
  SafetensorsWriter w;
  std::vector<float> x{1, 2, 3};
  CHECK_FALSE(w.add("x", DType::kF32, {4}, x.data(), 12).is_ok());
  CHECK_FALSE(w.add("__metadata__", {3}, x.data()).is_ok());
  REQUIRE(w.add("x", {3}, x.data()).is_ok());
  CHECK_THAT(w.add("x", {3}, x.data()).message(), Catch::Contains("duplicate"));
}

TEST_CASE("safetensors: each validation rule gives a clear message") {
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  CHECK(open_error(raw("{" + ok_entry + "}", 8)).empty());

  struct Case {
    std::vector<std::byte> bytes;
    const char* expect;
  };
  std::vector<std::byte> tiny(5, std::byte{0});
  const Case cases[] = {
      {tiny, "too short"},
      {raw("{" + ok_entry + "}", 8, 200'000'000), "exceeds"},
      {raw("{" + ok_entry + "}", 8, 4096), "past the end"},
      {raw("{" + ok_entry + "}", 4), "past the 4-byte data section"},
      {raw("[1,2]", 0), "not an object"},
      {raw("{\"t\":", 0), "not valid JSON"},
      {raw("{" + ok_entry + "," + ok_entry + "}", 8), "duplicate tensor name 't'"},
      {raw(R"({"t":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype 'F33'"},
      {raw(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "'t' has 8 bytes but shape x F32 needs 12"},
      {raw(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "'t' shape[0] is not a non-negative integer"},
      {raw(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "end before they begin"},
      {raw(R"({"t":{"dtype":"F32","shape":[2]}})", 8), "'t' has no 2-element array 'data_offsets'"},
      {raw(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8), "'t' has no string 'dtype'"},
      {raw(R"({"t":3})", 8), "entry 't' is not an object"},
      {raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "overlap"},
      {raw(R"({"__metadata__":{"k":1}})", 0), "__metadata__ value of 'k'"},
      {raw(R"({"__metadata__":[1]})", 0), "__metadata__ is not an object"},
      {raw(R"({"t":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,8]}})", 8), "absurd"},
      {raw(R"({"t":{"dtype":"F32","shape":[2147483648,2147483648],"data_offsets":[0,8]}})", 8), "overflows"},
  };
  for (const auto& c : cases) {
    INFO(c.expect);
    const std::string msg = open_error(c.bytes);
    CHECK_THAT(msg, Catch::Contains(c.expect));
  }
}

TEST_CASE("safetensors: spec dtypes kvpolicy lacks are listed but not viewable") {
  const auto b = raw(R"({"d":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8);
  SafetensorsFile f;
  REQUIRE(SafetensorsFile::from_memory(b.data(), b.size(), &f).is_ok());
  REQUIRE(f.find("d") != nullptr);
  CHECK_FALSE(f.find("d")->supported);
  AnyTensorView v;
  Status s = f.tensor("d", &v);
  CHECK(s.code() == StatusCode::kUnsupported);
  CHECK_THAT(s.message(), Catch::Contains("'d'") && Catch::Contains("F64"));
}

TEST_CASE("safetensors: unaligned offsets are rejected for typed views, not read") {
  // An F32 tensor at data offset 1 (never produced by the official writers).
  const auto b = raw(R"({"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"t":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}})", 5);
  SafetensorsFile f;
  REQUIRE(SafetensorsFile::from_bytes(std::vector<std::byte>(b), &f).is_ok());
  TensorView<const float, 1> v;
  Status s = f.view("t", &v);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Catch::Contains("aligned"));
}

TEST_CASE("safetensors fuzz: truncations at every length never crash") {
  const auto good = sample_file();
  int ok = 0;
  for (std::size_t len = 0; len <= good.size(); ++len) {
    std::vector<std::byte> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(len));
    SafetensorsFile f;
    Status s = SafetensorsFile::from_bytes(std::move(b), &f);
    if (s) {
      ++ok;
      touch_all(f);
    } else {
      CHECK(std::strlen(s.message()) > 0);
    }
  }
  CHECK(ok == 1);  // only the full file (no trailing slack in writer output)
}

TEST_CASE("safetensors fuzz: random header byte flips and random lengths") {
  const auto good = sample_file();
  std::uint64_t hlen = 0;
  std::memcpy(&hlen, good.data(), 8);
  std::mt19937_64 rng(1234);
  int ok = 0, err = 0;
  for (int it = 0; it < 4000; ++it) {
    std::vector<std::byte> b = good;
    const int mode = it % 4;
    if (mode == 0 || mode == 1) {  // flip 1..4 bytes inside the JSON header
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int k = 0; k < flips; ++k) {
        const std::size_t pos = 8 + rng() % hlen;
        b[pos] = mode == 0 ? static_cast<std::byte>(rng() & 0xff) : static_cast<std::byte>("0123456789[]{},:\"-e."[rng() % 20]);
      }
    } else if (mode == 2) {  // random header length
      const std::uint64_t n = (rng() % 3 == 0) ? rng() : rng() % (b.size() + 16);
      std::memcpy(b.data(), &n, 8);
    } else {  // random truncation plus a flip anywhere
      b.resize(rng() % (b.size() + 1));
      if (!b.empty()) b[rng() % b.size()] ^= static_cast<std::byte>(1u << (rng() % 8));
    }
    SafetensorsFile f;
    const Status s = SafetensorsFile::from_memory(b.data(), b.size(), &f);
    if (s) {
      ++ok;
      touch_all(f);
    } else {
      ++err;
      CHECK(std::strlen(s.message()) > 0);
    }
  }
  CHECK(err > 0);
  CHECK(ok + err == 4000);
}

TEST_CASE("safetensors fuzz: random garbage buffers") {
  std::mt19937_64 rng(99);
  for (int it = 0; it < 2000; ++it) {
    std::vector<std::byte> b(rng() % 64);
    for (auto& x : b) x = static_cast<std::byte>(rng() & 0xff);
    if (b.size() >= 8 && it % 2) {  // plausible length
      const std::uint64_t n = rng() % (b.size() - 7);
      std::memcpy(b.data(), &n, 8);
      if (n > 0) b[8] = std::byte{'{'};
    }
    SafetensorsFile f;
    const Status s = SafetensorsFile::from_memory(b.data(), b.size(), &f);
    if (s) touch_all(f);
  }
  SUCCEED();
}

TEST_CASE("safetensors: an empty tensor whose strides overflow int64 is rejected at parse time") {
  // 0 elements and 0 bytes, but the row-major stride of axis 0 would be 2^61 * 2^61 * 4 = 2^124 (INT64_MIN once wrapped).
  const std::string e =
      open_error(raw(R"({"x":{"dtype":"F32","shape":[0,2305843009213693952,2305843009213693952,4],"data_offsets":[0,0]}})", 0));
  INFO(e);
  CHECK_THAT(e, Catch::Contains("tensor 'x'") && Catch::Contains("strides overflow int64"));
  // Element count alone overflowing (every extent non-zero) is rejected too.
  CHECK_THAT(open_error(raw(R"({"y":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0)),
             Catch::Contains("tensor 'y'"));
  // Empty tensors of sane extents still parse and view.
  SafetensorsFile f;
  REQUIRE(SafetensorsFile::from_bytes(raw(R"({"z":{"dtype":"F32","shape":[0,1024,4],"data_offsets":[0,0]}})", 0), &f).is_ok());
  TensorView<const float, 3> v;
  const Status s = f.view("z", &v);
  INFO(s.message());
  REQUIRE(s.is_ok());
  CHECK(v.stride(0) == 4096);
  CHECK(v.size() == 0);
}

TEST_CASE("safetensors: an empty tensor whose offset falls inside another tensor is accepted (it occupies no bytes)") {
  // Found by fuzz_safetensors: the reader's rule is that empty tensors occupy
  // no bytes, so [4, 4) inside 'a' = [0, 8) is not an overlap.
  SafetensorsFile f;
  const Status s = SafetensorsFile::from_bytes(
      raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})", 8), &f);
  INFO(s.message());
  REQUIRE(s.is_ok());
  REQUIRE(f.tensors().size() == 2);
  CHECK(f.find("e") != nullptr);
  CHECK(f.find("e")->begin == 4);
  // A non-empty tensor in the same place still overlaps.
  CHECK_THAT(
      open_error(raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)),
      Catch::Contains("overlap"));
}
