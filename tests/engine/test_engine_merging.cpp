// Engine: eviction with and without merging at the same token budget (SnapKV, then kvpress MergingPress,
// LOOK-M, D2O or the nearest-kept merge through merge_hooks): the same memory, deterministic, and the merge
// does change what the model sees once tokens are evicted (and nothing when the budget holds the prompt).
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "engine_fixture.hpp"

using namespace kvp_engine;
using engine_test::model;

TEST_CASE("engine merging: SnapKV plus each merge holds the same bytes, is deterministic and changes the answers' logits",
          "[engine][merging]") {
  std::vector<TaskSample> subset;
  for (const char* task : {"passkey", "multikey"})
    for (std::size_t i : engine_test::samples_of(task, 2)) subset.push_back(engine_test::eval_samples()[i]);
  const auto& c = model().config();
  std::vector<PolicyUnderTest> policies = {find_policy(c, "snapkv")};
  for (const char* m : {"kvpress_merging", "lookm_pivot", "d2o", "nearest_kept"}) policies.push_back(snapkv_merged_policy(m));
  const std::int64_t budgets[] = {48};
  const auto a = run_task_eval(model(), subset, policies, budgets);
  const auto b = run_task_eval(model(), subset, policies, budgets);
  REQUIRE(a.size() == 1 + policies.size());
  const TaskEvalResult& snap = a[1];
  REQUIRE(snap.policy == "snapkv");
  for (std::size_t i = 2; i < a.size(); ++i) {
    INFO(a[i].policy);
    CHECK(a[i].mean_kept_bytes == snap.mean_kept_bytes);  // merging adds no memory
    CHECK(a[i].mean_kl == b[i].mean_kl);                  // deterministic
    CHECK(a[i].correct == b[i].correct);
    CHECK(a[i].mean_kl != snap.mean_kl);  // the merged rows reached the attention
  }
  // Online: H2O evicting at every decode step, with D2O / the nearest-kept merge folding each victim in.
  std::vector<PolicyUnderTest> online = {find_policy(c, "h2o"), h2o_merged_policy("d2o"), h2o_merged_policy("nearest_kept")};
  const auto o1 = run_task_eval(model(), subset, online, budgets), o2 = run_task_eval(model(), subset, online, budgets);
  for (std::size_t i = 2; i < o1.size(); ++i) {
    INFO(o1[i].policy);
    CHECK(o1[i].mean_kept_bytes == o1[1].mean_kept_bytes);
    CHECK(o1[i].mean_kl == o2[i].mean_kl);
    CHECK(o1[i].mean_kl != o1[1].mean_kl);
  }
  CHECK_THROWS_WITH(snapkv_merged_policy("tome"), Catch::Matchers::Contains("no merge policy named 'tome'"));
  CHECK_THROWS_WITH(h2o_merged_policy("lookm_pivot"), Catch::Matchers::Contains("expected d2o or nearest_kept"));
}
