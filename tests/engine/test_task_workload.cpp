// SPDX-License-Identifier: Apache-2.0
// The end-to-end workload of kvpolicy-compare (tools/compare/task_workload.hpp)
// on the committed model: its CSV rows are complete, a budget >= the prompt
// gives every policy the full cache's numbers, and two runs agree exactly.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <set>

#include "engine_fixture.hpp"
#include "task_workload.hpp"

using namespace kvp_compare;

namespace {

std::vector<ResultRow> run(int per_task, const std::vector<BudgetSpec>& budgets, const std::vector<std::string>& policies = {}) {
  std::vector<ResultRow> rows;
  TaskWorkloadOptions o;
  o.model_dir = engine_test::model_dir();
  o.task_set = engine_test::fixture_dir() + "/eval_set.json";
  o.per_task = per_task;
  o.progress = false;
  run_task_workload(o, budgets, policies, &rows);
  return rows;
}

double value(const std::vector<ResultRow>& rows, const std::string& wl, const std::string& policy, const std::string& kind, double budget,
             const std::string& metric) {
  for (const auto& r : rows)
    if (r.workload == wl && r.policy == policy && r.metric == metric &&
        (kind == "full" ? r.budget_kind == "full" : r.budget_kind == kind && r.budget_value == budget))
      return r.value;
  FAIL("no row " << wl << " " << policy << " " << kind << " " << budget << " " << metric);
  return 0.0;
}

}  // namespace

TEST_CASE("task workload: every policy x budget x task has its rows - budget >= prompt equals the full cache", "[engine][compare]") {
  const std::vector<BudgetSpec> budgets = {BudgetSpec::tokens(64), BudgetSpec::tokens(4096), BudgetSpec::ratio(0.5)};
#ifdef KVP_SANITIZER_BUILD
  constexpr int kPerTask = 1;
#else
  constexpr int kPerTask = 2;
#endif
  const auto rows = run(kPerTask, budgets);
  std::set<std::string> policies, workloads;
  for (const auto& r : rows) {
    policies.insert(r.policy);
    workloads.insert(r.workload);
    CHECK(r.n == kPerTask);
    CHECK(r.model == "kvp-tiny");
    CHECK(std::isfinite(r.value));
  }
  CHECK(workloads == std::set<std::string>{"tasks:passkey", "tasks:multikey", "tasks:copy"});
  std::set<std::string> others = policies;  // the merging entries, then every other one
  for (const char* merging : {"SnapKV+MergingPress", "SnapKV+LOOK-M", "SnapKV+D2O", "SnapKV+NearestKept", "SnapKV+CaM", "H2O+D2O",
                              "H2O+NearestKept", "H2O+CaM", "kvpress-CAM(Knorm)", "D2O", "D2O(all-layers)", "SnapKV+MergingPress+q4_0"}) {
    INFO(merging);
    CHECK(others.erase(merging) == 1);
  }
  CHECK(others == std::set<std::string>{"Full",
                                        "StreamingLLM",
                                        "H2O",
                                        "TOVA",
                                        "ObservedAttention",
                                        "SnapKV",
                                        "Ada-KV",
                                        "PyramidKV",
                                        "ExpectedAttention",
                                        "Quest",
                                        "q8_0",
                                        "q4_0",
                                        "fp8_e4m3",
                                        "SnapKV+q4_0",
                                        "SnapKV+q8_0",
                                        "SnapKV(LAQ-baseline)",
                                        "LAQ",
                                        "LAQ++",
                                        "LAQ++(corrected-mask)",
                                        "SnapKV(w=16)",
                                        "StreamingLLM(sinks=64)",
                                        "int4",
                                        "int4(no-rotation)",
                                        "int4(BDR16-K-only)",
                                        "q4_0(rotated)",
                                        "KIVI-2",
                                        "KIVI-4",
                                        "SnapKV+int4",
                                        "KIVI-2(R=128)",
                                        "KIVI-4(R=128)",
                                        "SnapKV+KIVI-2",
                                        "SnapKV+KIVI-4",
                                        "SnapKV+mixed(fp32+int4)"});
  // Bytes of each quantized format per byte of kvp-tiny's fp32 cache (head_dim 32): q8_0 34 / 128, q4_0 18 / 128,
  // fp8 with an inline per-(token, head) scale (32 + 16) / 128, token-wise INT4 (16 + 8) / 128 (no rotation at
  // head_dim 32 under llama.cpp's rule, so "int4" and "int4(no-rotation)" coincide there).
  const std::map<std::string, double> scale = {{"q8_0", 34.0 / 128},
                                               {"q4_0", 18.0 / 128},
                                               {"fp8_e4m3", 48.0 / 128},
                                               {"SnapKV+q4_0", 18.0 / 128},
                                               {"SnapKV+q8_0", 34.0 / 128},
                                               {"int4", 24.0 / 128},
                                               {"int4(no-rotation)", 24.0 / 128},
                                               {"int4(BDR16-K-only)", 24.0 / 128},
                                               {"q4_0(rotated)", 18.0 / 128},
                                               {"SnapKV+int4", 24.0 / 128},
                                               {"SnapKV+MergingPress+q4_0", 18.0 / 128}};
  for (const auto& wl : workloads) {
    const double full_acc = value(rows, wl, "Full", "full", 0, "accuracy");
    const double full_bytes = value(rows, wl, "Full", "full", 0, "kv_bytes");
    for (const auto& p : policies) {
      if (p == "Full") continue;
      INFO(wl << " " << p);
      const bool snap_kivi = p.rfind("SnapKV+KIVI-", 0) == 0;
      if (p.rfind("KIVI-", 0) == 0 || snap_kivi) {  // codes + scales ((8 or 16) + 4 bytes of 128 at head_dim 32) plus the fp16 residual
        const bool two = p.find("KIVI-2") != std::string::npos;
        const double codes = (two ? 12.0 : 20.0) / 128;
        const double bytes = value(rows, wl, p, "tokens", 4096, "kv_bytes");
        CHECK(bytes > full_bytes * codes * 1.01);
        CHECK(bytes < full_bytes * 0.5);
        CHECK(value(rows, wl, p, "tokens", 4096, "logit_kl") > 0.0);
        if (!two) CHECK(value(rows, wl, p, "tokens", 4096, "logit_kl") < 0.05);
        if (snap_kivi) {  // 4096 tokens' bytes hold the whole prompt: KIVI alone; 64 tokens' bytes: SnapKV evicts first
          CHECK(bytes == value(rows, wl, two ? "KIVI-2" : "KIVI-4", "tokens", 4096, "kv_bytes"));
          CHECK(value(rows, wl, p, "tokens", 64, "kv_bytes") <= full_bytes / 8);
          CHECK(value(rows, wl, p, "tokens", 64, "kv_bytes") < bytes);
        } else {
          CHECK(value(rows, wl, p, "tokens", 64, "kv_bytes") == bytes);  // every token kept whatever the budget
        }
        continue;
      }
      if (scale.count(p)) {  // quantized: the whole prompt at the format's bytes, close to the full cache
        CHECK(value(rows, wl, p, "tokens", 4096, "kv_bytes") == Approx(full_bytes * scale.at(p)));
        CHECK(value(rows, wl, p, "tokens", 4096, "logit_kl") > 0.0);
        CHECK(value(rows, wl, p, "tokens", 4096, "logit_kl") < 0.05);
        const bool evicts = p.rfind("SnapKV+", 0) == 0;
        CHECK(value(rows, wl, p, "tokens", 64, "kv_bytes") <= (evicts ? full_bytes / 8 : full_bytes * scale.at(p) * 1.0001));
        continue;
      }
      CHECK(value(rows, wl, p, "tokens", 4096, "accuracy") == full_acc);
      CHECK(value(rows, wl, p, "tokens", 4096, "logit_kl") == 0.0);
      CHECK(value(rows, wl, p, "tokens", 4096, "rel_err") == 0.0);  // nothing evicted: the same attention output
      CHECK(value(rows, wl, p, "tokens", 64, "rel_err") > 0.0);
      if (p == "kvpress-CAM(Knorm)") {  // a decoding press: the prompt is whole after prefill, cut at decode
        CHECK(value(rows, wl, p, "tokens", 64, "kv_bytes") == full_bytes);
      } else if (p == "D2O") {  // layers 0, 1 and the last (3 of kvp-tiny's 4) are never compressed
        CHECK(value(rows, wl, p, "tokens", 64, "kv_bytes") < full_bytes);
        CHECK(value(rows, wl, p, "tokens", 64, "kv_bytes") > full_bytes * 0.75);
      } else if (p != "Quest") {  // eviction: fewer bytes at 64 tokens; Quest keeps the cache and reads less
        CHECK(value(rows, wl, p, "tokens", 4096, "kv_bytes") == full_bytes);
        CHECK(value(rows, wl, p, "tokens", 64, "kv_bytes") < full_bytes / 8);
      }
      CHECK(value(rows, wl, p, "tokens", 64, "logit_kl") >= 0.0);
    }
  }
}

TEST_CASE("task workload: deterministic run to run - --policies filters", "[engine][compare]") {
  const std::vector<BudgetSpec> budgets = {BudgetSpec::tokens(128)};
  const auto a = run(1, budgets, {"SnapKV", "H2O"});
  const auto b = run(1, budgets, {"SnapKV", "H2O"});
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].workload << " " << a[i].policy << " " << a[i].metric);
    CHECK(a[i].policy == b[i].policy);
    CHECK(a[i].metric == b[i].metric);
    if (a[i].metric != "time_ms") CHECK(a[i].value == b[i].value);
    CHECK((a[i].policy == "Full" || a[i].policy == "SnapKV" || a[i].policy == "H2O"));
  }
}
