// SPDX-License-Identifier: Apache-2.0
// Trace reader: a well-formed trace round-trips; every malformed variant is
// rejected with a message naming the tensor or key; the trace exported from a
// randomly initialised Llama model (tests/data/traces/) reproduces the model's
// own attention output when attention is recomputed from its Q/K/V.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "kvpolicy/io/trace.hpp"

using namespace kvpolicy;
using io::SafetensorsWriter;
using io::Trace;

namespace {

struct TraceSpec {
  int layers = 2, hq = 4, hkv = 2, d = 8, t = 10, dec = 3;
  bool decode_kv = true;
};

/// A valid trace; `mutate(writer_args)` hooks let a test damage one piece.
struct TraceBuilder {
  TraceSpec s;
  std::map<std::string, std::string> meta;
  std::map<std::string, std::pair<std::vector<std::int64_t>, DType>> shapes;  // name -> (shape, dtype)

  explicit TraceBuilder(TraceSpec spec = {}) : s(spec) {
    meta = {{"format", "kvpolicy-trace"},
            {"version", "1"},
            {"num_layers", std::to_string(s.layers)},
            {"num_q_heads", std::to_string(s.hq)},
            {"num_kv_heads", std::to_string(s.hkv)},
            {"head_dim", std::to_string(s.d)},
            {"num_tokens", std::to_string(s.t)},
            {"num_decode", std::to_string(s.dec)},
            {"rope_theta", "10000"}};
    for (int i = 0; i < s.layers; ++i) {
      const std::string p = "layer." + std::to_string(i) + ".";
      shapes[p + "q"] = {{s.hq, s.t, s.d}, DType::kF32};
      shapes[p + "k"] = {{s.hkv, s.t, s.d}, DType::kF32};
      shapes[p + "v"] = {{s.hkv, s.t, s.d}, DType::kF32};
      if (s.dec) shapes[p + "q_decode"] = {{s.hq, s.dec, s.d}, DType::kF32};
      if (s.dec && s.decode_kv) {
        shapes[p + "k_decode"] = {{s.hkv, s.dec, s.d}, DType::kF32};
        shapes[p + "v_decode"] = {{s.hkv, s.dec, s.d}, DType::kF32};
      }
    }
    shapes["positions"] = {{s.t}, DType::kI64};
  }

  std::vector<std::byte> bytes() const {
    SafetensorsWriter w;
    for (const auto& [k, v] : meta) w.set_metadata(k, v);
    std::uint32_t seed = 1;
    for (const auto& [name, sd] : shapes) {
      std::size_t n = 1;
      for (auto e : sd.first) n *= static_cast<std::size_t>(e);
      std::vector<std::byte> buf(n * dtype_size(sd.second));
      if (sd.second == DType::kI64) {
        auto* p = reinterpret_cast<std::int64_t*>(buf.data());
        for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::int64_t>(i);
      } else if (sd.second == DType::kF32) {
        auto* p = reinterpret_cast<float*>(buf.data());
        for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<float>((seed = seed * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f;
      }
      throw_if_error(w.add(name, sd.second, sd.first, buf.data(), buf.size()));
    }
    return w.to_bytes();
  }

  std::string error() const {
    Trace t;
    Status st = Trace::from_bytes(bytes(), &t);
    return st ? std::string() : std::string(st.message());
  }
};

std::string trace_path() { return std::string(KVP_TEST_DATA_DIR) + "/traces/tiny_llama_random.safetensors"; }

}  // namespace

TEST_CASE("trace: a well-formed trace opens and exposes typed layer views") {
  TraceBuilder b;
  Trace t;
  REQUIRE(Trace::from_bytes(b.bytes(), &t).is_ok());
  CHECK(t.info().num_layers == 2);
  CHECK(t.info().num_q_heads == 4);
  CHECK(t.info().num_kv_heads == 2);
  CHECK(t.info().head_dim == 8);
  CHECK(t.info().num_tokens == 10);
  CHECK(t.info().num_decode == 3);
  CHECK(t.info().rope_theta == 10000.0);
  CHECK(t.info().attn_scale == Approx(1.0 / std::sqrt(8.0)));
  CHECK(t.dtype() == DType::kF32);
  CHECK(t.has_decode_kv());
  CHECK(t.positions().size() == 10);
  CHECK(t.decode_positions() == std::vector<std::int64_t>{10, 11, 12});
  io::TraceLayerView<float> l;
  REQUIRE(t.layer(1, &l).is_ok());
  CHECK(l.q.extent(0) == 4);
  CHECK(l.k.extent(1) == 10);
  CHECK(l.q_decode.extent(1) == 3);
  CHECK(l.v_decode.extent(0) == 2);
  CHECK(l.out.empty());
  io::TraceLayerView<half> wrong;
  CHECK_THAT(t.layer(0, &wrong).message(), Catch::Contains("float32") && Catch::Contains("float16"));
  CHECK_THAT(t.layer(2, &l).message(), Catch::Contains("layer 2 out of range"));
}

TEST_CASE("trace: malformed traces are rejected with clear messages") {
  struct Case {
    const char* expect;
    std::function<void(TraceBuilder&)> damage;
  };
  const Case cases[] = {
      {"metadata 'format' is missing", [](TraceBuilder& b) { b.meta.erase("format"); }},
      {"'version' is '2'", [](TraceBuilder& b) { b.meta["version"] = "2"; }},
      {"'num_kv_heads' is missing", [](TraceBuilder& b) { b.meta.erase("num_kv_heads"); }},
      {"'head_dim' = '8x' is not a decimal integer", [](TraceBuilder& b) { b.meta["head_dim"] = "8x"; }},
      {"'num_layers' = 0 out of range", [](TraceBuilder& b) { b.meta["num_layers"] = "0"; }},
      {"num_q_heads 4 is not a multiple of num_kv_heads 3", [](TraceBuilder& b) { b.meta["num_kv_heads"] = "3"; }},
      {"'layer.1.v' is missing", [](TraceBuilder& b) { b.shapes.erase("layer.1.v"); }},
      {"'layer.1.k' has shape (2, 9, 8), expected (num_kv_heads, num_tokens, head_dim) = (2, 10, 8)",
       [](TraceBuilder& b) {
         b.shapes["layer.1.k"].first = {2, 9, 8};
       }},
      {"'layer.0.q' has shape (2, 10, 8), expected (num_q_heads",  // q vs k heads
       [](TraceBuilder& b) {
         b.shapes["layer.0.q"].first = {2, 10, 8};
       }},
      {"'layer.1.q' has dtype F16, other layer tensors are F32", [](TraceBuilder& b) { b.shapes["layer.1.q"].second = DType::kF16; }},
      {"'layer.0.k' has dtype I32, expected F32, F16 or BF16", [](TraceBuilder& b) { b.shapes["layer.0.k"].second = DType::kI32; }},
      {"'layer.2.q' names layer 2, outside [0, num_layers=2)",
       [](TraceBuilder& b) {
         b.shapes["layer.2.q"] = {{4, 10, 8}, DType::kF32};
       }},
      {"layer 1 has k_decode without v_decode", [](TraceBuilder& b) { b.shapes.erase("layer.1.v_decode"); }},
      {"'layer.0.q_decode' is missing", [](TraceBuilder& b) { b.shapes.erase("layer.0.q_decode"); }},
      {"'positions' has shape (9), expected (num_tokens) = (10)", [](TraceBuilder& b) { b.shapes["positions"].first = {9}; }},
      {"'positions' has dtype I32, expected I64", [](TraceBuilder& b) { b.shapes["positions"].second = DType::kI32; }},
      {"not layer.<i>.<what>",
       [](TraceBuilder& b) {
         b.shapes["layer.x"] = {{1}, DType::kF32};
       }},
  };
  for (const auto& c : cases) {
    TraceBuilder b;
    c.damage(b);
    INFO(c.expect);
    CHECK_THAT(b.error(), Catch::Contains(c.expect));
  }
}

TEST_CASE("trace: file-level corruption is caught by the safetensors layer") {
  const auto good = TraceBuilder().bytes();
  Trace t;
  // truncated file
  std::vector<std::byte> cut(good.begin(), good.end() - 100);
  Status s = Trace::from_bytes(cut, &t);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Catch::Contains("past the") && Catch::Contains("data section"));
  // absurd header length
  std::vector<std::byte> bad = good;
  const std::uint64_t huge = 1ull << 40;
  std::memcpy(bad.data(), &huge, 8);
  s = Trace::from_bytes(bad, &t);
  REQUIRE_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Catch::Contains("exceeds"));
  // missing file
  s = Trace::open("no/such/trace.safetensors", &t);
  CHECK_THAT(s.message(), Catch::Contains("cannot open"));
}

TEST_CASE("trace fuzz: random truncations and header flips never crash") {
  const auto good = TraceBuilder().bytes();
  std::uint64_t hlen = 0;
  std::memcpy(&hlen, good.data(), 8);
  std::mt19937_64 rng(7);
  for (int it = 0; it < 1500; ++it) {
    std::vector<std::byte> b = good;
    if (it % 2)
      b.resize(rng() % b.size());
    else
      b[8 + rng() % hlen] = static_cast<std::byte>(rng() & 0xff);
    Trace t;
    if (Trace::from_bytes(std::move(b), &t)) {
      // An accepted trace must give in-bounds views of every layer.
      for (int i = 0; i < t.info().num_layers; ++i) {
        io::TraceLayerView<float> l;
        if (t.layer(i, &l)) {
          double acc = 0;
          for (std::int64_t j = 0; j < l.k.size(); ++j) acc += l.k.data()[j];
          CHECK(std::isfinite(acc) | !std::isfinite(acc));
        }
      }
    }
  }
  SUCCEED();
}

TEST_CASE("trace: the exported random-Llama trace reproduces the model's attention output") {
  Trace t;
  const Status s = Trace::open(trace_path(), &t);
  REQUIRE(s.is_ok());
  const auto& info = t.info();
  CHECK(info.num_layers >= 2);
  CHECK(info.num_q_heads % info.num_kv_heads == 0);
  CHECK(info.num_q_heads > info.num_kv_heads);  // GQA exercised
  CHECK(info.num_decode > 0);
  REQUIRE(t.has_decode_kv());
  REQUIRE(t.has_attention_output());
  REQUIRE(t.dtype() == DType::kF32);
  CHECK(t.inv_freq().size() == static_cast<std::size_t>(info.head_dim / 2));
  const int G = info.num_q_heads / info.num_kv_heads, d = info.head_dim;
  const std::int64_t T = info.num_tokens, D = info.num_decode;
  double worst = 0;
  for (int li = 0; li < info.num_layers; ++li) {
    io::TraceLayerView<float> l;
    REQUIRE(t.layer(li, &l).is_ok());
    // Causal attention of every prompt query and every decode query.
    for (int h = 0; h < info.num_q_heads; ++h) {
      const int g = h / G;
      for (std::int64_t i = 0; i < T + D; ++i) {
        const bool dec = i >= T;
        auto qv = [&](int c) { return dec ? l.q_decode(h, i - T, c) : l.q(h, i, c); };
        auto key = [&](std::int64_t j, int c) { return j < T ? l.k(g, j, c) : l.k_decode(g, j - T, c); };
        auto val = [&](std::int64_t j, int c) { return j < T ? l.v(g, j, c) : l.v_decode(g, j - T, c); };
        std::vector<double> logit(static_cast<std::size_t>(i + 1));
        double mx = -1e300;
        for (std::int64_t j = 0; j <= i; ++j) {
          double a = 0;
          for (int c = 0; c < d; ++c) a += static_cast<double>(qv(c)) * key(j, c);
          logit[static_cast<std::size_t>(j)] = a * info.attn_scale;
          mx = std::max(mx, logit[static_cast<std::size_t>(j)]);
        }
        double den = 0;
        std::vector<double> o(static_cast<std::size_t>(d), 0.0);
        for (std::int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(logit[static_cast<std::size_t>(j)] - mx);
          den += p;
          for (int c = 0; c < d; ++c) o[static_cast<std::size_t>(c)] += p * val(j, c);
        }
        for (int c = 0; c < d; ++c) {
          const double ref = dec ? l.out_decode(h, i - T, c) : l.out(h, i, c);
          worst = std::max(worst, std::abs(o[static_cast<std::size_t>(c)] / den - ref));
        }
      }
    }
  }
  INFO("max |recomputed - model| = " << worst);
  CHECK(worst < 1e-4);
}
