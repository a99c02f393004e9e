// The prefetch loop inside the engine (examples/engine/prefetch.hpp) on the
// committed kvp-tiny model: the four policies through the lifecycle hooks,
// against Quest's selection and the exact top pages, then replayed through
// the offload simulator.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <set>

#include "engine/engine_fixture.hpp"
#include "engine/prefetch.hpp"
#include "prefetch_workload.hpp"

using namespace kvp_engine;

namespace {

constexpr int kSteps = 6;

const PrefillState& prompt_prefill() {
  static const PrefillState p = [] {
    const auto& s = engine_test::eval_samples()[engine_test::samples_of("passkey", 1).at(0)];
    PrefillOptions o;
    o.query_window = static_cast<std::int64_t>(s.prompt.size());  // InfiniGen's prepare reads every prompt query
    return prefill(engine_test::model(), s.prompt, o);
  }();
  return p;
}

PrefetchLoopOptions options(PrefetchKind k, ActualSelection a) {
  PrefetchLoopOptions o;
  o.kind = k;
  o.actual = a;
  return o;
}

}  // namespace

TEST_CASE("prefetch engine: the four policies run in the decode loop with consistent counters", "[prefetch][engine]") {
  const Model& m = engine_test::model();
  const PrefillState& p = prompt_prefill();
  const int L = m.config().n_layers;
  for (ActualSelection a : {ActualSelection::kQuest, ActualSelection::kExactTopK}) {
    std::vector<PrefetchTrace> traces;
    for (PrefetchKind k : kAllPrefetchKinds) {
      INFO(prefetch_kind_name(k) << " vs " << actual_selection_name(a));
      PrefetchTrace t = run_prefetch_loop(m, p, options(k, a), kSteps);
      REQUIRE(t.events.size() == static_cast<std::size_t>(kSteps * L));
      CHECK(t.generated.size() == static_cast<std::size_t>(kSteps + 1));
      CHECK(t.predict_calls > 0);
      std::int64_t needed = 0;
      for (const auto& e : t.events) {
        CHECK(!e.needed.empty());
        CHECK(std::set<std::int32_t>(e.needed.begin(), e.needed.end()).size() == e.needed.size());
        for (auto pg : e.needed) CHECK((pg >= 0 && pg < t.pool_pages));
        CHECK(e.needed.size() <= static_cast<std::size_t>(m.config().n_heads * 8));  // rows x page budget
        needed += static_cast<std::int64_t>(e.needed.size());
        if (k == PrefetchKind::kInfiniGen) CHECK(e.next_layer == (e.layer > 0 && !e.request.empty()));
        if (k == PrefetchKind::kInfiniGen && e.layer == 0) CHECK(e.request.empty());  // nothing before layer 0
      }
      const kvpolicy::PrefetchCounters c = t.total();
      CHECK(c.steps == kSteps * L);
      CHECK(c.needed == needed);
      CHECK(c.hits + c.misses <= c.needed);
      CHECK(c.late <= c.needed);
      CHECK(c.predicted_steps > 0);
      CHECK(c.hits > 0);  // every policy predicts something the step then reads
      CHECK(c.reuse_total == needed - static_cast<std::int64_t>([&] {
                               std::size_t first = 0;
                               for (const auto& e : t.events) first += e.step == 0 ? e.needed.size() : 0;
                               return first;
                             }()));
      traces.push_back(std::move(t));
    }
    // The prefetchers only observe: every policy saw the same selections and decoded the same tokens.
    for (std::size_t i = 1; i < traces.size(); ++i) {
      CHECK(traces[i].generated == traces[0].generated);
      for (std::size_t e = 0; e < traces[0].events.size(); ++e) CHECK(traces[i].events[e].needed == traces[0].events[e].needed);
    }
    // InfiniGen's layers 0 and 1 are loaded whole (reference default): layer 1 predicts every page.
    // (predicted before the step's token entered layer 1: the pages of T + step tokens).
    for (const auto& e : traces[1].events)
      if (e.layer == 1) CHECK(e.request.size() == static_cast<std::size_t>((p.length + e.step + 15) / 16));
  }
}

TEST_CASE("prefetch engine: a selection of every page decodes exactly like the plain engine", "[prefetch][engine]") {
  const Model& m = engine_test::model();
  const PrefillState& p = prompt_prefill();
  PrefetchLoopOptions o = options(PrefetchKind::kQuestLookahead, ActualSelection::kExactTopK);
  o.page_budget = 1 << 20;  // every page
  const PrefetchTrace t = run_prefetch_loop(m, p, o, kSteps);
  const CacheShape shape{m.config().n_layers, m.config().n_heads, m.config().n_kv_heads, m.config().head_dim, p.length + kSteps + 1};
  Session<PagedKVCache<float>> plain(m, PagedKVCache<float>(shape, 16));
  plain.load(p);
  CHECK(plain.greedy(kSteps + 1) == t.generated);
  // Every page every step: after the first step everything read was read before, except new pages.
  const auto c = t.total();
  CHECK(c.buffer_hit_rate() > 0.9);
}

TEST_CASE("prefetch engine: the trace replays through the offload simulator", "[prefetch][engine]") {
  const Model& m = engine_test::model();
  const PrefillState& p = prompt_prefill();
  const PrefetchTrace t = run_prefetch_loop(m, p, options(PrefetchKind::kShadowKV, ActualSelection::kQuest), kSteps);
  std::size_t most = 0;
  for (const auto& e : t.events) most = std::max(most, e.needed.size());
  kvpolicy::OffloadSimParams sp{.bandwidth_gb_s = 16.0, .latency_us = 5.0, .device_pages = static_cast<std::int64_t>(most) + 8};
  kvpolicy::OffloadTotals pre, miss, all;
  REQUIRE(simulate_trace(t, sp, kvpolicy::OffloadMode::kPrefetch, 20.0, &pre).is_ok());
  REQUIRE(simulate_trace(t, sp, kvpolicy::OffloadMode::kFetchOnMiss, 20.0, &miss).is_ok());
  REQUIRE(simulate_trace(t, sp, kvpolicy::OffloadMode::kAllResident, 20.0, &all).is_ok());
  CHECK(pre.sum.needed == t.total().needed);
  CHECK(miss.sum.needed == pre.sum.needed);
  CHECK(all.sum.stall_us == 0.0);
  CHECK(all.sum.bytes == 0.0);
  CHECK(miss.prediction_recall() == 0.0);
  CHECK(pre.prediction_recall() > 0.0);
  CHECK(miss.sum.stall_us > 0.0);
  CHECK(pre.sum.bytes == t.page_bytes * static_cast<double>(pre.sum.prefetched + pre.sum.demand));
  CHECK(miss.sum.bytes == t.page_bytes * static_cast<double>(miss.sum.demand));
  // A device budget below a step's pages is rejected, and so is a non-positive layer time.
  sp.device_pages = static_cast<std::int64_t>(most) - 1;
  CHECK_FALSE(simulate_trace(t, sp, kvpolicy::OffloadMode::kPrefetch, 20.0, &pre).is_ok());
  sp.device_pages = 100;
  CHECK_FALSE(simulate_trace(t, sp, kvpolicy::OffloadMode::kPrefetch, 0.0, &pre).is_ok());
  sp.bandwidth_gb_s = 0;
  CHECK_FALSE(simulate_trace(t, sp, kvpolicy::OffloadMode::kPrefetch, 20.0, &pre).is_ok());
}

TEST_CASE("prefetch engine: the comparison's prefetch workload writes its rows", "[prefetch][engine]") {
  kvp_compare::PrefetchWorkloadOptions o;
  o.model_dir = engine_test::model_dir();
  o.task_set = engine_test::fixture_dir() + "/eval_set.json";
  o.samples = 1;
  o.steps = 3;
  o.device_pages = {1, 200};
  o.progress = false;
  std::vector<kvp_compare::ResultRow> rows;
  const auto notes = kvp_compare::run_prefetch_workload(o, &rows);
  REQUIRE(notes.size() == 2);  // 1 page is below a step's pages, for both real selections
  CHECK(notes[0].find("device budget 1 pages") != std::string::npos);
  std::set<std::string> workloads, policies;
  for (const auto& r : rows) {
    workloads.insert(r.workload);
    policies.insert(r.policy);
    CHECK(r.budget_kind == "device_pages");
    CHECK(r.budget_value == 200.0);
    CHECK(std::isfinite(r.value));
    if (r.metric.find("recall") != std::string::npos || r.metric.find("hit") != std::string::npos ||
        r.metric.find("late") != std::string::npos)
      CHECK((r.value >= 0.0 && r.value <= 1.0));
    if (r.policy == "all_resident" && (r.metric == "stall_us_per_step" || r.metric == "bytes_per_step")) CHECK(r.value == 0.0);
    CHECK(r.family == (r.policy == "fetch_on_miss" || r.policy == "all_resident" ? "baseline" : "prefetch"));
  }
  CHECK(workloads == std::set<std::string>{"prefetch:quest", "prefetch:exact_topk"});
  CHECK(policies == std::set<std::string>{"QuestLookahead", "InfiniGen", "SpeCache", "ShadowKV", "fetch_on_miss", "all_resident"});
  // 4 policies x 9 metrics + 2 baselines x 5, per workload.
  CHECK(rows.size() == 2 * (4 * 9 + 2 * 5));
}

TEST_CASE("prefetch engine: SpeCache's speculative row decodes the next token like the engine when its guess is right",
          "[prefetch][engine]") {
  // Every page selected: the speculative row reads full-precision keys only, so with a right guess of the
  // next token it computes what the engine computes one step later, and its output is the token after.
  const Model& m = engine_test::model();
  const PrefillState& p = prompt_prefill();
  PrefetchLoopOptions o = options(PrefetchKind::kSpeCache, ActualSelection::kExactTopK);
  o.page_budget = 1 << 20;
  const int steps = 12;
  const PrefetchTrace t = run_prefetch_loop(m, p, o, steps);
  REQUIRE(t.speculated.size() == static_cast<std::size_t>(steps));
  REQUIRE(t.spec_inputs.size() == static_cast<std::size_t>(steps));
  CHECK(t.spec_inputs[0] == t.generated[0]);  // seeded with the first real token
  int right = 0;
  for (int s = 0; s < steps; ++s) {
    if (s >= 1) CHECK(t.spec_inputs[static_cast<std::size_t>(s)] == t.speculated[static_cast<std::size_t>(s - 1)]);
    if (t.spec_inputs[static_cast<std::size_t>(s)] == t.generated[static_cast<std::size_t>(s + 1)] && s + 2 <= steps) {
      ++right;
      CHECK(t.speculated[static_cast<std::size_t>(s)] == t.generated[static_cast<std::size_t>(s + 2)]);
    }
  }
  CHECK(right > 0);
}
