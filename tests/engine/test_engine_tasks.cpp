// SPDX-License-Identifier: Apache-2.0
// End-to-end tasks through the C++ engine on the fixed evaluation set
// (tests/data/engine/eval_set.json: passkey, multikey, copy at 1024 tokens):
//  * the full-cache accuracy of the committed model equals PyTorch's (the
//    number in tools/model/README.md) within one sample per task, and the
//    contiguous and paged caches agree sample by sample (and bit for bit);
//  * with a budget >= the prompt every policy reproduces the full cache exactly;
//  * online H2O and TOVA hold the cache at their budget through decoding;
//  * the harness separates a bad policy from a good one: StreamingLLM cannot
//    answer when the needle lies outside sinks + recent window, H2O (passkey)
//    and SnapKV (multi-key) can.
// Sanitizer builds run a few samples per task (engine_fixture.hpp).
#include <catch2/catch.hpp>

#include <algorithm>

#include "engine_fixture.hpp"

using namespace kvp_engine;
using engine_test::model;

namespace {

void check_full_cache_accuracy(const std::string& task) {
  const auto& samples = engine_test::eval_samples();
  const auto idx = engine_test::samples_of(task);
  REQUIRE(!idx.empty());
  const auto& rows = engine_test::eval_fixture().at("samples");
  std::int64_t correct_c = 0, correct_p = 0, torch_correct = 0, agree_torch = 0;
  for (std::size_t i : idx) {
    const TaskSample& s = samples[i];
    const PrefillState pre = prefill(model(), s.prompt);
    const auto shape = engine_test::shape_for(static_cast<std::int64_t>(s.prompt.size() + s.answer.size()));
    SessionStats st;
    double kept = 0.0;
    const auto lc =
        detail::run_sample(model(), pre, s, ContiguousKVCache<float>(shape), kvpolicy::Hooks<ContiguousKVCache<float>>{}, &st, &kept);
    const auto lp = detail::run_sample(model(), pre, s, PagedKVCache<float>(shape, 16), kvpolicy::Hooks<PagedKVCache<float>>{}, &st, &kept);
    auto ok = [&](const std::vector<std::vector<float>>& steps) {
      for (std::size_t k = 0; k < steps.size(); ++k)
        if (argmax(steps[k]) != s.answer[k]) return false;
      return true;
    };
    INFO("sample " << i);
    CHECK(lc == lp);
    const bool oc = ok(lc), tc = rows.at(i).at("torch_correct").get<bool>();
    correct_c += oc;
    correct_p += ok(lp);
    torch_correct += tc;
    agree_torch += oc == tc;
  }
  const auto n = static_cast<std::int64_t>(idx.size());
  INFO(task << ": C++ " << correct_c << "/" << n << ", PyTorch " << torch_correct << "/" << n);
  CHECK(correct_c == correct_p);
  CHECK(std::abs(correct_c - torch_correct) <= 1);
  CHECK(agree_torch >= n - 1);
  if (n == engine_test::eval_fixture().at("torch_accuracy").at(task).at("count").get<std::int64_t>()) {
    // The whole set: the number in the model card.
    CHECK(std::abs(correct_c - engine_test::eval_fixture().at("torch_accuracy").at(task).at("correct").get<std::int64_t>()) <= 1);
  }
}

}  // namespace

TEST_CASE("engine tasks: full-cache passkey accuracy equals PyTorch's", "[engine][tasks]") { check_full_cache_accuracy("passkey"); }
TEST_CASE("engine tasks: full-cache multikey accuracy equals PyTorch's", "[engine][tasks]") { check_full_cache_accuracy("multikey"); }
TEST_CASE("engine tasks: full-cache copy accuracy equals PyTorch's", "[engine][tasks]") { check_full_cache_accuracy("copy"); }

TEST_CASE("engine tasks: a budget >= the prompt reproduces the full cache exactly", "[engine][tasks]") {
  std::vector<TaskSample> subset;
  for (const char* task : {"passkey", "multikey", "copy"})
    for (std::size_t i : engine_test::samples_of(task, 2)) subset.push_back(engine_test::eval_samples()[i]);
  std::int64_t longest = 0;
  for (const auto& s : subset) longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(s.prompt.size() + s.answer.size()));
  const std::vector<PolicyUnderTest> policies = all_policies(model().config());
  const std::int64_t budgets[] = {longest, longest + 100};
  for (CacheKind kind : {CacheKind::kContiguous, CacheKind::kPaged}) {
    EvalOptions opt;
    opt.cache = kind;
    const auto results = run_task_eval(model(), subset, policies, budgets, opt);
    std::size_t runs = 0;
    for (const auto& p : policies)
      runs += (kind == CacheKind::kPaged ? static_cast<bool>(p.paged) : static_cast<bool>(p.contiguous)) ? 1 : 0;
    REQUIRE(runs >= 6);
    REQUIRE(results.size() == 1 + 2 * runs);
    for (const auto& r : results) {
      INFO(r.policy << " budget " << r.budget << (kind == CacheKind::kPaged ? " paged" : " contiguous"));
      const bool lossy =
          std::any_of(policies.begin(), policies.end(), [&](const PolicyUnderTest& p) { return p.name == r.policy && p.lossy; });
      if (lossy) {  // quantization: close to the full cache (KIVI-2 is not on kvp-tiny: head_dim 32 is one value group)
        if (r.policy.find("kivi:bits=2") == std::string::npos) CHECK(r.max_kl < 0.05);
        CHECK(r.mean_kept_bytes < results[0].mean_kept_bytes * 0.4);
        continue;
      }
      CHECK(r.identical_to_full == r.count);
      CHECK(r.correct == results[0].correct);
      CHECK(r.max_kl == 0.0);
      CHECK(r.mean_kept_bytes == results[0].mean_kept_bytes);
    }
  }
}

namespace {

/// Samples of `task` the full cache answers whose answer (its first occurrence in the prompt: the needle) lies
/// well outside the first tokens and the last `budget` tokens.
std::vector<TaskSample> needles_outside_window(const std::string& task, std::int64_t budget, std::size_t want) {
  const auto& samples = engine_test::eval_samples();
  const auto& rows = engine_test::eval_fixture().at("samples");
  std::vector<TaskSample> out;
  for (std::size_t i : engine_test::samples_of(task, 100)) {
    const TaskSample& s = samples[i];
    const auto T = static_cast<std::int64_t>(s.prompt.size());
    const auto at = std::search(s.prompt.begin(), s.prompt.end(), s.answer.begin(), s.answer.end()) - s.prompt.begin();
    if (rows.at(i).at("torch_correct").get<bool>() && at > 50 && at + 50 < T - budget) out.push_back(s);
    if (out.size() == want) break;
  }
  return out;
}

/// StreamingLLM keeps sinks + recent tokens only: it must fail every such sample; `good` must answer most.
void check_bad_and_good(const std::string& task, const PolicyUnderTest& good, std::int64_t budget) {
#ifdef KVP_SANITIZER_BUILD
  constexpr std::size_t kWant = 2;
#else
  constexpr std::size_t kWant = 12;
#endif
  const auto subset = needles_outside_window(task, budget, kWant);
  REQUIRE(subset.size() == kWant);
  const std::vector<PolicyUnderTest> policies = {find_policy(model().config(), "streaming_llm"), good};
  const std::int64_t budgets[] = {budget};
  for (CacheKind kind : {CacheKind::kContiguous, CacheKind::kPaged}) {
    EvalOptions opt;
    opt.cache = kind;
    const auto r = run_task_eval(model(), subset, policies, budgets, opt);
    REQUIRE(r.size() == 3);
    INFO(task << " @" << budget << ": full " << r[0].accuracy << ", streaming_llm " << r[1].accuracy << ", " << good.name << " "
              << r[2].accuracy);
    CHECK(r[0].accuracy == 1.0);
    CHECK(r[1].policy == "streaming_llm");
    CHECK(r[1].correct == 0);
    CHECK(r[2].policy == good.name);
    CHECK(r[2].accuracy >= 0.75);
    CHECK(r[1].mean_kl > r[2].mean_kl);
    CHECK(r[1].mean_kept_bytes == r[2].mean_kept_bytes);
    CHECK(r[1].mean_kept_bytes < r[0].mean_kept_bytes / 3);
  }
}

}  // namespace

// Which policy is "good" is a property of the model: kvp-tiny reads multi-token answers with an induction head
// whose attention from the question does not cover the needle, so SnapKV (which scores by the question's
// attention) keeps multi-key needles but not passkeys, while H2O (attention accumulated over the whole prompt)
// keeps passkeys (models/kvp-tiny/README.md, tools/compare/README.md).
TEST_CASE("engine tasks: StreamingLLM loses a passkey outside sinks + recent, H2O keeps it", "[engine][tasks]") {
  check_bad_and_good("passkey", h2o_policy(), 256);
}

TEST_CASE("engine tasks: StreamingLLM loses a multi-key needle outside sinks + recent, SnapKV keeps it", "[engine][tasks]") {
  check_bad_and_good("multikey", find_policy(model().config(), "snapkv"), 256);
}

TEST_CASE("engine tasks: online H2O and TOVA hold the cache at the budget on every decode step", "[engine][tasks]") {
  const TaskSample& s = engine_test::eval_samples().at(engine_test::samples_of("copy", 1).at(0));
  const auto shape = engine_test::shape_for(static_cast<std::int64_t>(s.prompt.size()) + 40);
  constexpr std::int64_t kBudget = 96;
  const int L = model().config().n_layers, Hkv = model().config().n_kv_heads;
  PrefillOptions po;
  po.query_window = static_cast<std::int64_t>(s.prompt.size());  // H2O reads the whole prompt's attention
  const PrefillState pre = prefill(model(), s.prompt, po);
  auto check = [&](auto cache, auto hooks, const char* name) {
    using Cache = decltype(cache);
    INFO(name << (Cache::kPaged ? " paged" : " contiguous"));
    Session<Cache> sess(model(), std::move(cache), std::move(hooks));
    sess.load(pre);
    for (int l = 0; l < L; ++l) CHECK(sess.cache().kept_tokens(l) == kBudget * Hkv);
    const auto before = sess.stats().evictions;
    for (int i = 0; i < 32; ++i) {
      sess.decode(argmax(sess.logits()));
      for (int l = 0; l < L; ++l) REQUIRE(sess.cache().kept_tokens(l) == kBudget * Hkv);
    }
    CHECK(sess.stats().evictions == before + 32 * L);  // one eviction per layer and step once full
    return std::vector<float>(sess.logits().begin(), sess.logits().end());
  };
  const kvpolicy::H2O h2o(kvpolicy::H2OParams::original(kBudget / 2, kBudget / 2));
  const kvpolicy::TOVA tova(kvpolicy::TOVAParams::original(kBudget));
  const auto hc = check(ContiguousKVCache<float>(shape), h2o_hooks<ContiguousKVCache<float>>(h2o), "h2o");
  const auto hp = check(PagedKVCache<float>(shape, 16), h2o_hooks<PagedKVCache<float>>(h2o), "h2o");
  const auto tc = check(ContiguousKVCache<float>(shape), tova_hooks<ContiguousKVCache<float>>(tova), "tova");
  const auto tp = check(PagedKVCache<float>(shape, 16), tova_hooks<PagedKVCache<float>>(tova), "tova");
  // Same decisions on both layouts: the same tokens in the same order give the same logits.
  CHECK(hc == hp);
  CHECK(tc == tp);
  // Deterministic run to run.
  CHECK(check(ContiguousKVCache<float>(shape), h2o_hooks<ContiguousKVCache<float>>(h2o), "h2o") == hc);
}

TEST_CASE("engine tasks: H2O without the whole prompt's queries is refused with a message", "[engine][tasks]") {
  const TaskSample& s = engine_test::eval_samples().at(0);
  const auto shape = engine_test::shape_for(static_cast<std::int64_t>(s.prompt.size()) + 4);
  Session<ContiguousKVCache<float>> sess(model(), ContiguousKVCache<float>(shape),
                                         h2o_hooks<ContiguousKVCache<float>>(kvpolicy::H2O(kvpolicy::H2OParams::original(32, 32))));
  CHECK_THROWS_WITH(sess.prefill(s.prompt), Catch::Contains("needs every prompt query"));
}
