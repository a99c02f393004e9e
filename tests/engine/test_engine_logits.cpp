// SPDX-License-Identifier: Apache-2.0
// The C++ engine against PyTorch (tests/data/engine/logits.json): prompt
// logits, decode-step logits and greedy continuations, on contiguous and paged
// caches; fp16 caches; determinism; logical positions after eviction.
//
// Tolerance: fp32 everywhere, max |logit diff| <= 1e-3 against PyTorch (the
// two differ only in summation order; observed ~1e-5). Contiguous and paged
// caches run the same arithmetic in the same order: their logits are equal bit
// for bit. An fp16 cache stores K/V rounded to half: max diff <= 0.1.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "engine_fixture.hpp"

using namespace kvp_engine;
using engine_test::model;

namespace {

double max_abs_diff(std::span<const float> a, const nlohmann::json& b) {
  REQUIRE(a.size() == b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i].get<double>()));
  return m;
}

/// Greedy decode through a session, recording the logits of every decode step.
template <class Cache>
std::vector<std::vector<float>> run_greedy(Cache cache, const std::vector<std::int32_t>& prompt, int n, std::vector<std::int32_t>* gen,
                                           kvpolicy::Hooks<Cache> hooks = {}) {
  Session<Cache> s(model(), std::move(cache), std::move(hooks));
  auto lg = s.prefill(prompt);
  std::vector<std::vector<float>> steps{{lg.begin(), lg.end()}};
  for (int i = 0; i < n; ++i) {
    gen->push_back(argmax(s.logits()));
    if (i + 1 < n) {
      lg = s.decode(gen->back());
      steps.emplace_back(lg.begin(), lg.end());
    }
  }
  return steps;
}

constexpr double kTol = 1e-3;

}  // namespace

TEST_CASE("engine: prompt logits match PyTorch", "[engine]") {
  for (const auto& p : engine_test::logits_fixture().at("prompts")) {
    INFO("prompt " << p.at("name").get<std::string>());
    const auto ids = tokenize(p.at("prompt").get<std::string>());
    PrefillOptions opt;
    opt.logit_positions = p.at("positions").get<std::vector<std::int64_t>>();
    const PrefillState st = prefill(model(), ids, opt);
    REQUIRE(st.positions == opt.logit_positions);
    const auto V = static_cast<std::size_t>(model().config().vocab_size);
    for (std::size_t i = 0; i < st.positions.size(); ++i) {
      INFO("position " << st.positions[i]);
      CHECK(max_abs_diff(std::span<const float>(st.logits.data() + i * V, V), p.at("logits")[i]) <= kTol);
    }
  }
}

TEST_CASE("engine: greedy decoding matches PyTorch on contiguous and paged caches", "[engine]") {
  for (const auto& p : engine_test::logits_fixture().at("prompts")) {
    INFO("prompt " << p.at("name").get<std::string>());
    const auto ids = tokenize(p.at("prompt").get<std::string>());
    const auto want = p.at("greedy").get<std::vector<std::int32_t>>();
    const int n = static_cast<int>(want.size());
    const auto shape = engine_test::shape_for(static_cast<std::int64_t>(ids.size()) + n);
    std::vector<std::int32_t> gen_c, gen_p;
    const auto steps_c = run_greedy(ContiguousKVCache<float>(shape), ids, n, &gen_c);
    const auto steps_p = run_greedy(PagedKVCache<float>(shape, 16), ids, n, &gen_p);
    CHECK(gen_c == want);
    CHECK(gen_p == want);
    CHECK(steps_c == steps_p);  // same arithmetic in the same order
    const auto& dl = p.at("decode_step_logits");
    for (std::size_t i = 0; i < dl.size() && i + 1 < steps_c.size(); ++i) {
      INFO("decode step " << i);
      CHECK(max_abs_diff(steps_c[i + 1], dl[i]) <= kTol);
    }
  }
}

TEST_CASE("engine: fp16 caches stay close to fp32", "[engine]") {
  const auto& p = engine_test::logits_fixture().at("prompts").at(1);
  const auto ids = tokenize(p.at("prompt").get<std::string>());
  const auto shape = engine_test::shape_for(static_cast<std::int64_t>(ids.size()) + 8);
  std::vector<std::int32_t> g32, gc, gp;
  const auto ref = run_greedy(ContiguousKVCache<float>(shape), ids, 8, &g32);
  const auto c16 = run_greedy(ContiguousKVCache<half>(shape), ids, 8, &gc);
  const auto p16 = run_greedy(PagedKVCache<half>(shape, 16), ids, 8, &gp);
  CHECK(c16 == p16);
  // Compare while the continuations agree (a flipped near-tie would change the inputs).
  for (std::size_t i = 0; i < ref.size() && (i == 0 || g32[i - 1] == gc[i - 1]); ++i) {
    double m = 0.0;
    for (std::size_t v = 0; v < ref[i].size(); ++v) m = std::max(m, static_cast<double>(std::abs(ref[i][v] - c16[i][v])));
    INFO("step " << i);
    CHECK(m <= 0.1);
  }
}

TEST_CASE("engine: runs are deterministic", "[engine]") {
  const auto& s = engine_test::eval_samples().at(engine_test::samples_of("multikey", 1).at(0));
  const auto shape = engine_test::shape_for(static_cast<std::int64_t>(s.prompt.size()) + 8);
  auto hooks = [] {
    return kvpolicy::combine(eviction_hooks<PagedKVCache<float>>(snapkv_with_budget(256)), quest_hooks<float>(quest_with_budget(128)));
  };
  std::vector<std::int32_t> g1, g2;
  const auto a = run_greedy(PagedKVCache<float>(shape, 16), s.prompt, 8, &g1, hooks());
  const auto b = run_greedy(PagedKVCache<float>(shape, 16), s.prompt, 8, &g2, hooks());
  CHECK(g1 == g2);
  CHECK(a == b);
}

TEST_CASE("engine: eviction keeps logical positions and decoding continues at the next position", "[engine]") {
  const auto& s = engine_test::eval_samples().at(engine_test::samples_of("passkey", 1).at(0));
  const auto T = static_cast<std::int64_t>(s.prompt.size());
  const auto shape = engine_test::shape_for(T + 4);
  const std::int64_t budget = 100;

  Session<ContiguousKVCache<float>> c(model(), ContiguousKVCache<float>(shape),
                                      eviction_hooks<ContiguousKVCache<float>>(snapkv_with_budget(budget)));
  Session<PagedKVCache<float>> p(model(), PagedKVCache<float>(shape, 16), eviction_hooks<PagedKVCache<float>>(snapkv_with_budget(budget)));
  const PrefillState st = prefill(model(), s.prompt);
  c.load(st);
  p.load(st);
  CHECK(c.position() == T);
  for (int l = 0; l < model().config().n_layers; ++l) {
    auto pos = c.cache().positions(l);
    for (int h = 0; h < model().config().n_kv_heads; ++h) {
      REQUIRE(c.cache().length(l, h) == budget);
      for (std::int64_t j = 1; j < budget; ++j) CHECK(pos(h, j) > pos(h, j - 1));
      CHECK(pos(h, budget - 1) == T - 1);  // the observation window (last tokens) is always kept
    }
    CHECK(p.cache().length(l) == budget);
    CHECK(p.cache().pages_in_use(l) == (budget + 15) / 16);
  }
  // The same decision on both layouts gives the same logits; the new token sits at position T.
  const auto lc = c.decode(s.answer[0]);
  const std::vector<float> vc(lc.begin(), lc.end());
  const auto lp = p.decode(s.answer[0]);
  CHECK(vc == std::vector<float>(lp.begin(), lp.end()));
  auto pos = c.cache().positions(0);
  CHECK(pos(0, budget) == T);
  CHECK(c.position() == T + 1);
}

TEST_CASE("engine: a bad model directory is refused with a message naming the problem", "[engine]") {
  namespace fs = std::filesystem;
  const fs::path src = engine_test::model_dir();
  const fs::path dir = fs::temp_directory_path() / ("kvp_engine_bad_model_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(src / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  const std::string weights = read_text_file((src / "model.safetensors").string());
  auto write = [&](const std::string& bytes) {
    std::ofstream f(dir / "model.safetensors", std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  };
  write(weights.substr(0, weights.size() / 2));  // truncated data section
  CHECK_THROWS_WITH(Model::load(dir.string()), Catch::Contains("model.safetensors") && Catch::Contains("data"));
  write(weights.substr(0, 5));  // shorter than the header length
  CHECK_THROWS_WITH(Model::load(dir.string()), Catch::Contains("model.safetensors"));
  // A config that disagrees with the tensors (one more layer than the file holds).
  auto cfg = nlohmann::json::parse(read_text_file((src / "config.json").string()));
  cfg["n_layers"] = cfg["n_layers"].get<int>() + 1;
  write(weights);
  std::ofstream(dir / "config.json", std::ios::trunc) << cfg.dump();
  CHECK_THROWS_WITH(Model::load(dir.string()), Catch::Contains("missing tensor"));
  CHECK_THROWS_WITH(Model::load((dir / "nope").string()), Catch::Contains("cannot open"));
  fs::remove_all(dir);
}
