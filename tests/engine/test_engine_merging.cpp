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
  CHECK_THROWS_WITH(h2o_merged_policy("lookm_pivot"), Catch::Matchers::Contains("expected d2o, nearest_kept or cam"));
}

namespace {
std::vector<TaskSample> merging_subset() {
  std::vector<TaskSample> subset;
  for (const char* task : {"passkey", "multikey"})
    for (std::size_t i : engine_test::samples_of(task, 2)) subset.push_back(engine_test::eval_samples()[i]);
  return subset;
}
std::vector<PolicyUnderTest> every_merge_policy() {
  std::vector<PolicyUnderTest> ps;
  for (const char* m : {"kvpress_merging", "lookm_pivot", "d2o", "nearest_kept", "cam"}) ps.push_back(snapkv_merged_policy(m));
  for (const char* m : {"d2o", "nearest_kept", "cam"}) ps.push_back(h2o_merged_policy(m));
  ps.push_back(kvpress_cam_policy());
  ps.push_back(d2o_policy());
  return ps;
}
}  // namespace

TEST_CASE("engine merging: every merge gives the same logits on the paged cache as on the contiguous one", "[engine][merging]") {
  const auto subset = merging_subset();
  const auto policies = every_merge_policy();
  const std::int64_t budgets[] = {48, 200};
  EvalOptions paged;
  paged.cache = CacheKind::kPaged;
  const auto c = run_task_eval(model(), subset, policies, budgets);
  const auto p = run_task_eval(model(), subset, policies, budgets, paged);
  REQUIRE(c.size() == 1 + 2 * policies.size());
  REQUIRE(p.size() == c.size());
  for (std::size_t i = 1; i < c.size(); ++i) {
    engine_test::check_paged_row(c[i], p[i]);  // bit-identical: the same merged rows reached the attention
    INFO(c[i].policy << " @" << c[i].budget);
    CHECK(c[i].mean_kl > 0.0);  // something was evicted and merged at these budgets
  }
}

TEST_CASE("engine merging: CaM, kvpress CAM and D2O are deterministic, hold their budgets and change the logits", "[engine][merging]") {
  const auto subset = merging_subset();
  const auto& cfg = model().config();
  const std::vector<PolicyUnderTest> policies = {find_policy(cfg, "snapkv"), find_policy(cfg, "h2o"), snapkv_merged_policy("cam"),
                                                 h2o_merged_policy("cam"),   kvpress_cam_policy(),    d2o_policy()};
  const std::int64_t budgets[] = {64};
  const auto a = run_task_eval(model(), subset, policies, budgets), b = run_task_eval(model(), subset, policies, budgets);
  REQUIRE(a.size() == 7);
  for (std::size_t i = 1; i < a.size(); ++i) {
    INFO(a[i].policy);
    CHECK(a[i].mean_kl == b[i].mean_kl);  // seeded draws: the same run twice
    CHECK(a[i].mean_attn_err == b[i].mean_attn_err);
    CHECK(a[i].mean_kl > 0.0);
  }
  // CaM merges values into kept slots: no more memory than the eviction it follows, different logits.
  CHECK(a[3].mean_kept_bytes == a[1].mean_kept_bytes);
  CHECK(a[3].mean_kl != a[1].mean_kl);
  CHECK(a[4].mean_kept_bytes == a[2].mean_kept_bytes);
  CHECK(a[4].mean_kl != a[2].mean_kl);
  // kvpress CAM is a decoding press: the prompt is whole after prefill (full bytes), cut at the first decode step.
  CHECK(a[5].mean_kept_bytes == a[0].mean_kept_bytes);
  // D2O: layers 0, 1 and the last keep the whole prompt, the others less than the prompt.
  CHECK(a[6].mean_kept_bytes < a[0].mean_kept_bytes);
  CHECK(a[6].mean_kept_bytes > a[1].mean_kept_bytes);
}

TEST_CASE("engine merging: kvpress CAM cuts every layer to the budget after interval decode steps", "[engine][merging]") {
  const TaskSample& s = engine_test::eval_samples()[engine_test::samples_of("passkey", 1)[0]];
  const std::int64_t T = static_cast<std::int64_t>(s.prompt.size()), budget = 100;
  const auto& cfg = model().config();
  for (std::int64_t interval : {1, 3}) {
    INFO("interval " << interval);
    PolicyUnderTest p = kvpress_cam_policy(interval);
    Session<ContiguousKVCache<float>> sess(model(), ContiguousKVCache<float>(engine_test::shape_for(T + 8)), p.contiguous(T, budget));
    sess.prefill(s.prompt);
    for (int l = 0; l < cfg.n_layers; ++l) CHECK(sess.cache().kept_tokens(l) == T * cfg.n_kv_heads);
    for (std::int64_t step = 1; step <= interval; ++step) {
      sess.decode(s.answer[0]);
      for (int l = 0; l < cfg.n_layers; ++l) CHECK(sess.cache().kept_tokens(l) == (step < interval ? T + step : budget) * cfg.n_kv_heads);
    }
  }
}

TEST_CASE("engine merging: D2O's layer budgets follow its layer ratios", "[engine][merging]") {
  const TaskSample& s = engine_test::eval_samples()[engine_test::samples_of("multikey", 1)[0]];
  const auto& cfg = model().config();
  PrefillOptions po;
  po.column_sums = true;  // D2O's layer ratios and its accumulated attention come from the prefill
  const PrefillState pre = prefill(model(), s.prompt, po);
  const std::int64_t T = pre.length;
  PolicyUnderTest p = d2o_policy();
  p.on_prefill(model(), pre);
  for (std::int64_t budget : {64, 256}) {
    INFO("budget " << budget);
    Session<ContiguousKVCache<float>> sess(model(), ContiguousKVCache<float>(engine_test::shape_for(T + 4)), p.contiguous(T, budget));
    sess.load(pre);
    for (int l = 0; l < cfg.n_layers; ++l) {
      INFO("layer " << l);
      const std::int64_t kept = sess.cache().kept_tokens(l) / cfg.n_kv_heads;
      if (l < 2 || l == cfg.n_layers - 1)
        CHECK(kept == T);  // never compressed
      else
        CHECK(kept < T);
    }
    sess.decode(s.answer[0]);  // a compressed layer stays at its budget while decoding
    for (int l = 2; l < cfg.n_layers - 1; ++l) CHECK(sess.cache().kept_tokens(l) < T * cfg.n_kv_heads);
  }
  // Every layer from the ratios: on average about the budget per layer, clamped to [0.01, 1] of the prompt.
  PolicyUnderTest all = d2o_policy(false);
  all.on_prefill(model(), pre);
  Session<ContiguousKVCache<float>> shared(model(), ContiguousKVCache<float>(engine_test::shape_for(T + 4)), all.contiguous(T, 128));
  shared.load(pre);
  std::int64_t total = 0;
  for (int l = 0; l < cfg.n_layers; ++l) {
    const std::int64_t kept = shared.cache().kept_tokens(l) / cfg.n_kv_heads;
    CHECK(kept < T);
    CHECK(kept >= T / 100);
    total += kept;
  }
  CHECK(total <= 128 * cfg.n_layers + cfg.n_layers);  // the clamp only lowers ratios; floor per layer
  PolicyUnderTest fresh = d2o_policy();
  Session<ContiguousKVCache<float>> no_prefill(model(), ContiguousKVCache<float>(engine_test::shape_for(T + 4)), fresh.contiguous(T, 64));
  CHECK_THROWS_WITH(no_prefill.load(pre), Catch::Matchers::Contains("no prefill seen"));
}

TEST_CASE("engine: the attention-output error is 0 for a whole cache and grows as the budget shrinks", "[engine][merging]") {
  const auto subset = merging_subset();
  const auto& cfg = model().config();
  std::int64_t longest = 0;
  for (const auto& s : subset) longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(s.prompt.size() + s.answer.size()));
  const std::vector<PolicyUnderTest> policies = {find_policy(cfg, "snapkv"), find_policy(cfg, "h2o"), find_policy(cfg, "ggml:type=q4_0"),
                                                 snapkv_merged_policy("kvpress_merging")};
  const std::int64_t budgets[] = {32, 256, longest};
  const auto r = run_task_eval(model(), subset, policies, budgets);
  REQUIRE(r.size() == 1 + 3 * policies.size());
  CHECK(r[0].mean_attn_err == 0.0);  // the reference itself measures nothing
  for (std::size_t p = 0; p < policies.size(); ++p) {
    const TaskEvalResult &small = r[1 + 3 * p], &mid = r[2 + 3 * p], &whole = r[3 + 3 * p];
    INFO(small.policy);
    if (policies[p].lossy) {  // q4_0 stores every token: the same error at every budget, > 0
      CHECK(whole.mean_attn_err > 0.0);
      CHECK(whole.mean_attn_err < 0.2);
      CHECK(small.mean_attn_err == whole.mean_attn_err);
      continue;
    }
    CHECK(whole.mean_attn_err == 0.0);  // nothing evicted: the cache is the shadow cache
    CHECK(whole.max_attn_err == 0.0);
    CHECK(small.mean_attn_err > mid.mean_attn_err);
    CHECK(mid.mean_attn_err > 0.0);
    CHECK(small.max_attn_err >= small.mean_attn_err);
  }
}

TEST_CASE("engine merging: evict, merge and quantize as one composed policy hold the bytes of SnapKV then q4_0", "[engine][merging]") {
  const auto subset = merging_subset();
  const auto& cfg = model().config();
  const std::vector<PolicyUnderTest> policies = {find_policy(cfg, "snapkv+ggml:type=q4_0"),
                                                 snapkv_merged_quantized_policy("kvpress_merging", "ggml:type=q4_0", cfg.head_dim)};
  const std::int64_t budgets[] = {16, 48};
  const auto r = run_task_eval(model(), subset, policies, budgets);
  REQUIRE(r.size() == 5);
  for (int b = 0; b < 2; ++b) {
    const TaskEvalResult &evict_quant = r[1 + b], &pipeline = r[3 + b];
    INFO(pipeline.policy << " @" << pipeline.budget);
    CHECK(pipeline.mean_kept_bytes == evict_quant.mean_kept_bytes);  // the same tokens' worth of bytes
    CHECK(pipeline.mean_kept_bytes < r[0].mean_kept_bytes / 4);
    CHECK(pipeline.mean_kl != evict_quant.mean_kl);  // the merged values reached the attention
    CHECK(pipeline.mean_attn_err > 0.0);
  }
  // The hook compacts through the pipeline itself: the cache holds n tokens per kv head, n from the byte budget.
  const TaskSample& s = subset[0];
  const std::int64_t T = static_cast<std::int64_t>(s.prompt.size());
  const auto p = snapkv_merged_quantized_policy("kvpress_merging", "ggml:type=q4_0", cfg.head_dim);
  Session<ContiguousKVCache<float>> sess(model(), ContiguousKVCache<float>(engine_test::shape_for(T + 4)), p.contiguous(T, 16));
  sess.prefill(s.prompt);
  const std::int64_t n = 16 * 2 * 4 * cfg.head_dim / (2 * (cfg.head_dim / 32) * 18);  // q4_0: 18 bytes per 32 values
  for (int l = 0; l < cfg.n_layers; ++l) CHECK(sess.cache().kept_tokens(l) == n * cfg.n_kv_heads);
  sess.decode(s.answer[0]);
  for (int l = 0; l < cfg.n_layers; ++l) CHECK(sess.cache().kept_tokens(l) == (n + 1) * cfg.n_kv_heads);
  CHECK_THROWS_WITH(snapkv_merged_quantized_policy("lookm_pivot", "ggml:type=q4_0", cfg.head_dim),
                    Catch::Matchers::Contains("expected kvpress_merging"));
  CHECK_THROWS_WITH(snapkv_merged_quantized_policy("kvpress_merging", "ggml:type=q4_0|ggml:type=q8_0", cfg.head_dim),
                    Catch::Matchers::Contains("one format"));
}

TEST_CASE("engine: H2O and ObservedAttention from the prefill's column sums keep what they keep recomputing them from every query",
          "[engine][merging]") {
  const TaskSample& s = engine_test::eval_samples()[engine_test::samples_of("passkey", 1)[0]];
  const auto& cfg = model().config();
  const std::int64_t T = static_cast<std::int64_t>(s.prompt.size());
  PrefillOptions po;
  po.column_sums = true;
  po.query_window = T;
  const PrefillState pre = prefill(model(), s.prompt, po);
  REQUIRE(pre.column_sums.size() == static_cast<std::size_t>(cfg.n_layers));
  for (const auto& cs : pre.column_sums) {  // each query row's probabilities sum to 1: the columns sum to T
    double total = 0.0;
    for (float x : cs) total += x;
    CHECK(total == Approx(static_cast<double>(T * cfg.n_heads)).epsilon(1e-4));
  }
  using C = ContiguousKVCache<float>;
  auto kept = [&](const PolicyUnderTest& p) {
    Session<C> sess(model(), C(engine_test::shape_for(T + 4)), p.contiguous(T, 64));
    sess.load(pre);
    std::vector<std::int32_t> pos;
    for (int l = 0; l < cfg.n_layers; ++l)
      for (std::int64_t h = 0; h < cfg.n_kv_heads; ++h)
        for (std::int64_t j = 0; j < sess.cache().length(l, static_cast<int>(h)); ++j) pos.push_back(sess.cache().positions(l)(h, j));
    return pos;
  };
  for (const auto& [with_sums, recomputed] :
       {std::pair{h2o_policy(true), h2o_policy(false)}, std::pair{observed_attention_policy(true), observed_attention_policy(false)}}) {
    INFO(with_sums.name);
    REQUIRE(with_sums.column_sums);
    REQUIRE(with_sums.query_window == 1);
    const auto a = kept(with_sums), b = kept(recomputed);
    REQUIRE(a.size() == b.size());
    REQUIRE(a.size() == static_cast<std::size_t>(cfg.n_layers * cfg.n_kv_heads * 64));
    std::size_t same = 0;
    for (std::size_t i = 0; i < a.size(); ++i) same += a[i] == b[i] ? 1 : 0;
    CHECK(same >= a.size() * 99 / 100);  // fp32 sums in another order may swap a near-tie
  }
}

TEST_CASE("engine: ObservedAttention from column sums fails clearly when the prefill kept none", "[engine][merging]") {
  const TaskSample& s = engine_test::eval_samples()[engine_test::samples_of("passkey", 1)[0]];
  const std::int64_t T = static_cast<std::int64_t>(s.prompt.size());
  PrefillOptions po;  // no column sums
  po.query_window = 1;
  const PrefillState pre = prefill(model(), s.prompt, po);
  using C = ContiguousKVCache<float>;
  Session<C> sess(model(), C(engine_test::shape_for(T + 4)), observed_attention_policy(true).contiguous(T, 64));
  CHECK_THROWS_WITH(sess.load(pre), Catch::Matchers::Contains("column sums"));
}
