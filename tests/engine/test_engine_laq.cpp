// SPDX-License-Identifier: Apache-2.0
// LAQ and LAQ++ inside the engine loop (examples/engine/laq.hpp) on kvp-tiny:
// the pseudo-token decode is the stage-1 cache's greedy continuation of the
// prefill argmax, the hooks leave every layer at the budget with the last W2
// prompt tokens, errors are refused with a message, and on passkey retrieval
// the lookahead queries find the needle SnapKV's observation window misses.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <vector>

#include "engine_fixture.hpp"

using namespace kvp_engine;
using Catch::Matchers::Contains;
using engine_test::model;

namespace {

PrefillState prefill_of(const TaskSample& s, std::int64_t window = 32) {
  PrefillOptions po;
  po.query_window = window;
  return prefill(model(), s.prompt, po);
}

}  // namespace

TEST_CASE("engine laq: the pseudo tokens are the stage-1 cache's greedy continuation of the prefill argmax", "[engine][laq]") {
  const TaskSample& s = engine_test::eval_samples()[engine_test::samples_of("passkey", 1)[0]];
  const PrefillState p = prefill_of(s);
  const kvpolicy::LAQ laq(kvpolicy::LAQParams::laq_plus_plus(64));
  const LaqLookahead la = laq_lookahead(model(), p, laq);
  const ModelConfig& c = model().config();

  // The same stage 1 built by hand: SnapKV(stage1) after the prefill, then greedy decoding.
  using C = ContiguousKVCache<float>;
  Session<C> ref(model(), C(CacheShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, p.length + 8}),
                 eviction_hooks<C>(kvpolicy::SnapKV(laq.stage1())));
  ref.load(p);
  const std::vector<std::int32_t> greedy = ref.greedy(8);
  REQUIRE(la.tokens.front() == argmax(p.last_logits()));
  const auto eos = std::find(greedy.begin(), greedy.end(), c.eos_id);
  const std::int64_t expect_n = eos == greedy.end() ? 8 : eos - greedy.begin();
  REQUIRE(la.count == expect_n);
  REQUIRE(std::equal(la.tokens.begin(), la.tokens.end(), greedy.begin()));
  for (int l = 0; l < c.n_layers; ++l) {
    REQUIRE(la.stage1_kept[static_cast<std::size_t>(l)] == 64);
    const auto q = la.layer_queries(l, c.n_heads, c.head_dim);
    REQUIRE(q.extent(0) == c.n_heads);
    REQUIRE(q.extent(1) == la.count);
    double norm = 0.0;
    for (std::int64_t h = 0; h < q.extent(0); ++h)
      for (std::int64_t i = 0; i < q.extent(1); ++i)
        for (std::int64_t j = 0; j < q.extent(2); ++j) norm += std::abs(q(h, i, j));
    REQUIRE(std::isfinite(norm));
    REQUIRE(norm > 0.0);
  }
}

TEST_CASE("engine laq: every layer ends at the budget, LAQ++ keeps the last W2 prompt tokens, decoding starts from the prefill",
          "[engine][laq]") {
  const TaskSample& s = engine_test::eval_samples()[engine_test::samples_of("multikey", 1)[0]];
  const PrefillState p = prefill_of(s);
  const ModelConfig& c = model().config();
  using C = ContiguousKVCache<float>;
  auto req = std::make_shared<LaqRequest>();
  Session<C> sess(model(), C(CacheShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, p.length + 4}),
                  laq_hooks<C>(kvpolicy::LAQ(kvpolicy::LAQParams::laq_plus_plus(96)), req));
  req->bind(model(), p);
  const auto logits = sess.load(p);
  REQUIRE(std::equal(logits.begin(), logits.end(), p.last_logits().begin()));  // the first real token is the prefill argmax
  REQUIRE(sess.position() == p.length);                                        // pseudo tokens are not in this session
  REQUIRE(sess.stats().evictions == c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    REQUIRE(sess.cache().kept_tokens(l) == 96 * c.n_kv_heads);
    const auto pos = sess.cache().positions(l);
    for (int h = 0; h < c.n_kv_heads; ++h) {
      std::vector<std::int32_t> kept(pos.data() + h * pos.stride(0), pos.data() + h * pos.stride(0) + 96);
      std::sort(kept.begin(), kept.end());
      for (std::int64_t t = p.length - 8; t < p.length; ++t)
        REQUIRE(std::binary_search(kept.begin(), kept.end(), static_cast<std::int32_t>(t)));
    }
  }
  sess.decode(argmax(p.last_logits()));  // decoding continues at the prompt length
  REQUIRE(sess.position() == p.length + 1);
}

TEST_CASE("engine laq: an unbound request or a prefill without the stage-1 queries is refused with a message", "[engine][laq]") {
  const TaskSample& s = engine_test::eval_samples()[engine_test::samples_of("passkey", 1)[0]];
  const ModelConfig& c = model().config();
  using C = ContiguousKVCache<float>;
  const CacheShape shape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, static_cast<std::int64_t>(s.prompt.size()) + 4};
  const kvpolicy::LAQ laq(kvpolicy::LAQParams::laq(64));
  const PrefillState p = prefill_of(s);
  {
    Session<C> sess(model(), C(shape), laq_hooks<C>(laq, std::make_shared<LaqRequest>()));
    REQUIRE_THROWS_WITH(sess.load(p), Contains("engine laq: no request bound"));
  }
  const PrefillState narrow = prefill_of(s, 8);
  REQUIRE_THROWS_WITH(laq_lookahead(model(), narrow, laq),
                      Contains("the prefill kept 8 queries per layer, stage 1 needs stage1_window = 32"));
  auto req = std::make_shared<LaqRequest>();
  Session<C> sess(model(), C(shape), laq_hooks<C>(laq, req));
  req->bind(model(), narrow);
  REQUIRE_THROWS_WITH(sess.load(narrow), Contains("stage 1 needs stage1_window = 32"));
  kvpolicy::LAQParams bad = kvpolicy::LAQParams::laq_plus_plus(64);
  bad.lookahead = 0;
  REQUIRE_THROWS_WITH(laq_lookahead(model(), p, kvpolicy::LAQ(bad)), Contains("laq: lookahead is 0, must be >= 1"));
}

TEST_CASE("engine laq: on passkey retrieval at a tight budget LAQ++ answers where SnapKV does not", "[engine][laq][tasks]") {
  // Measured on the first 40 passkey samples at 64 tokens per kv head: SnapKV (LAQ's stage-1 form) 0/40,
  // LAQ++ 40/40; here a few samples, with a margin.
  std::vector<TaskSample> subset;
  for (std::size_t i : engine_test::samples_of("passkey", std::min(engine_test::kSamplesPerTask, 4)))
    subset.push_back(engine_test::eval_samples()[i]);
  const std::vector<PolicyUnderTest> pols = {snapkv_original_policy(), laq_policy(8)};
  const std::int64_t budgets[] = {64};
  const auto r = run_task_eval(model(), subset, pols, budgets);
  REQUIRE(r.size() == 3);
  REQUIRE(r[0].correct == static_cast<std::int64_t>(subset.size()));  // the full cache answers all
  INFO("snapkv_original " << r[1].correct << ", laq++ " << r[2].correct << " of " << subset.size());
  REQUIRE(r[2].policy == "laq++");
  REQUIRE(r[2].correct == static_cast<std::int64_t>(subset.size()));
  REQUIRE(r[1].correct < r[2].correct);
  REQUIRE(r[2].decision_seconds > 0.0);  // the lookahead decode runs inside the hooks
}
