// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the engine tests: where the model and the fixtures are,
// loaded once per process.
//
// The committed model is models/kvp-tiny; the fixtures tests/data/engine/*.json
// were written from it by tools/model/export_fixtures.py. KVP_ENGINE_MODEL_DIR
// and KVP_ENGINE_FIXTURE_DIR in the environment override both (to test a
// retrained model before committing it).
//
// Sanitizer builds (KVP_SANITIZER_BUILD) run the same checks on a few samples
// per task instead of the whole evaluation set.
#pragma once

#include <catch2/catch.hpp>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/eval.hpp"

namespace engine_test {

inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}
inline std::string model_dir() { return env_or("KVP_ENGINE_MODEL_DIR", KVP_ENGINE_DEFAULT_MODEL_DIR); }
inline std::string fixture_dir() { return env_or("KVP_ENGINE_FIXTURE_DIR", std::string(KVP_TEST_DATA_DIR) + "/engine"); }

inline const kvp_engine::Model& model() {
  static const kvp_engine::Model m = kvp_engine::Model::load(model_dir());
  return m;
}
inline const nlohmann::json& logits_fixture() {
  static const nlohmann::json j = nlohmann::json::parse(kvp_engine::read_text_file(fixture_dir() + "/logits.json"));
  return j;
}
inline const nlohmann::json& eval_fixture() {
  static const nlohmann::json j = nlohmann::json::parse(kvp_engine::read_text_file(fixture_dir() + "/eval_set.json"));
  return j;
}
inline const std::vector<kvp_engine::TaskSample>& eval_samples() {
  static const std::vector<kvp_engine::TaskSample> s = kvp_engine::load_task_set(fixture_dir() + "/eval_set.json");
  return s;
}

#ifdef KVP_SANITIZER_BUILD
inline constexpr int kSamplesPerTask = 2;
#else
inline constexpr int kSamplesPerTask = 1 << 30;
#endif

/// Indices of the first `per_task` samples of `task` in the evaluation set.
inline std::vector<std::size_t> samples_of(const std::string& task, int per_task = kSamplesPerTask) {
  std::vector<std::size_t> out;
  const auto& s = eval_samples();
  for (std::size_t i = 0; i < s.size() && static_cast<int>(out.size()) < per_task; ++i)
    if (s[i].task == task) out.push_back(i);
  return out;
}

inline kvp_engine::CacheShape shape_for(std::int64_t capacity) {
  const auto& c = model().config();
  return kvp_engine::CacheShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, capacity};
}

/// One row of a paged-cache run against the same row on the contiguous cache: the same policy, and
/// bit-identical logits, answers, attention error and bytes (the same rows reached the attention).
inline void check_paged_row(const kvp_engine::TaskEvalResult& contiguous, const kvp_engine::TaskEvalResult& paged) {
  INFO(contiguous.policy << " @" << contiguous.budget);
  REQUIRE(paged.policy == contiguous.policy);
  CHECK(paged.mean_kl == contiguous.mean_kl);
  CHECK(paged.max_kl == contiguous.max_kl);
  CHECK(paged.correct == contiguous.correct);
  CHECK(paged.identical_to_full == contiguous.identical_to_full);
  CHECK(paged.mean_attn_err == contiguous.mean_attn_err);
  CHECK(paged.mean_kept_bytes == contiguous.mean_kept_bytes);
}

}  // namespace engine_test
