// SPDX-License-Identifier: Apache-2.0
// Sanity of the policy comparison (tools/compare): a budget covering the
// prompt reproduces the full cache exactly for every policy; StreamingLLM
// without room for the needles misses them; results are deterministic and
// independent of the thread count; the CSV has the documented columns; trace
// files become layer cases with correctly un-rotated queries; --list-policies
// lists the registry and every entry.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <string_view>

#include "kvpolicy/registry.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "sweep.hpp"
#include "synthetic_workload.hpp"
#include "trace_cases.hpp"

using namespace kvp_compare;

namespace {

/// A small synthetic case (fast enough for the sanitizer build).
LayerCase small_synthetic(unsigned seed = 7) {
  WorkloadShape s;
  s.num_q_heads = 8;
  s.num_kv_heads = 2;
  s.head_dim = 32;
  s.kv_len = 256;
  s.window = 16;
  s.num_future = 6;
  s.needles = 3;
  return to_layer_case(make_workload(s, seed), 0);
}

std::vector<LayerCase> trace_cases() {
  std::vector<LayerCase> cases;
  const kvpolicy::Status s = load_trace_cases(std::string(KVP_TEST_DATA_DIR) + "/traces/tiny_llama_random.safetensors", &cases);
  REQUIRE(s.is_ok());
  return cases;
}

Metrics run_one(const PolicySpec& p, const LayerCase& c, const Reference& ref, const BudgetSpec& b, const kvpolicy::ExecContext& ctx,
                Decision* dec) {
  Timer t;
  t.reps = 1;
  const kvpolicy::Status s = p.run(c, ref, b, ctx, t, dec);
  INFO(p.name << ": " << s.message());
  REQUIRE(s.is_ok());
  REQUIRE(dec->well_formed(c));
  return evaluate(c, ref, *dec, ctx);
}

}  // namespace

TEST_CASE("compare: with a budget >= the prompt length every policy reproduces the full cache exactly") {
  kvpolicy::ThreadPool pool(2);
  const auto ctx = pool.context();
  std::vector<LayerCase> cases = trace_cases();
  cases.push_back(small_synthetic());
  for (const auto& c : cases) {
    const Reference ref = make_reference(c, ctx);
    for (const auto& p : all_policies()) {
      // !run: engine-only entries; quantization is lossy whatever the budget (its own test below)
      if ((p.multi_layer && c.num_layers < 2) || !p.run || p.family == "quantization") continue;
      for (std::int64_t budget : {c.kv_len, c.kv_len + 100}) {
        Decision dec;
        const Metrics m = run_one(p, c, ref, BudgetSpec::tokens(budget), ctx, &dec);
        INFO(p.name << " on " << c.workload << " layer " << c.layer << " budget " << budget);
        CHECK(m.rel_err == 0.0);
        CHECK(m.mass_recall == 1.0);
        CHECK(m.topk_overlap == 1.0);
        CHECK(m.kept_tokens == static_cast<double>(c.kv_len));
        if (!c.needles.empty()) CHECK(m.needle_hit == 1.0);
      }
    }
  }
}

TEST_CASE("compare: quantization on a layer - attention-output error of the decoded cache, bytes of the format") {
  kvpolicy::ThreadPool pool(2);
  const auto ctx = pool.context();
  const LayerCase c = small_synthetic();  // head_dim 32, fp16 source
  const Reference ref = make_reference(c, ctx);
  std::map<std::string, Metrics> m;
  std::map<std::string, double> scale;
  for (const auto& p : all_policies()) {
    if (p.family != "quantization") continue;
    INFO(p.name);
    REQUIRE(p.run);
    Decision dec;
    Timer t;
    t.reps = 1;
    REQUIRE(p.run(c, ref, BudgetSpec::tokens(64), ctx, t, &dec).is_ok());
    REQUIRE(dec.quantized);
    REQUIRE(dec.well_formed(c));
    const Reference qref = make_reference(*dec.quantized, ctx);
    m[p.name] = evaluate(*dec.quantized, qref, dec, ctx, &ref);
    scale[p.name] = dec.bytes_scale;
    CHECK(m[p.name].rel_err > 0.0);
    CHECK(m[p.name].rel_err < (p.name.rfind("KIVI-2", 0) == 0 ? 1.0 : 0.5));  // 2 bits, one value group per 32-wide head
    CHECK(m[p.name].kept_tokens == static_cast<double>(c.kv_len));
    CHECK(m[p.name].mass_recall == 1.0);
  }
  REQUIRE(m.size() == 11);
  // Bytes per value over fp16 at head_dim 32: q8_0 34 / 64, q4_0 18 / 64, int4 (16 + 8) / 64, fp8 (32 + 16) / 64.
  CHECK(scale["q8_0"] == Approx(34.0 / 64));
  CHECK(scale["q4_0"] == Approx(18.0 / 64));
  CHECK(scale["int4"] == Approx(24.0 / 64));
  CHECK(scale["fp8_e4m3"] == Approx(48.0 / 64));
  CHECK(scale["KIVI-2"] < scale["KIVI-4"]);
  CHECK(scale["KIVI-4"] < 1.0);
  // R = 128 on 256 tokens: keys all in groups (256 is a multiple of R), values 128 quantized, 128 in fp16.
  const double kivi2 = (12.0 * 256 + 12.0 * 128 + 64.0 * 128) / (2 * 256 * 64),
               kivi4 = (20.0 * 256 + 20.0 * 128 + 64.0 * 128) / (2 * 256 * 64);
  CHECK(scale["KIVI-2(R=128)"] == Approx(kivi2));
  CHECK(scale["KIVI-4(R=128)"] == Approx(kivi4));
  CHECK(scale["KIVI-2(R=128)"] > scale["KIVI-2"]);  // more of the cache in fp16
  CHECK(m["KIVI-4(R=128)"].rel_err < m["KIVI-2(R=128)"].rel_err);
  // More bits, less error.
  CHECK(m["q8_0"].rel_err < m["q4_0"].rel_err);
  CHECK(m["KIVI-4"].rel_err < m["KIVI-2"].rel_err);
  CHECK(m["q8_0"].rel_err < m["int4"].rel_err);
  std::ostringstream table;
  for (const auto& [name, x] : m) table << name << " " << x.rel_err << " (bytes x" << scale[name] << ")  ";
  WARN("attention-output relative error on the synthetic layer: " << table.str());
}

TEST_CASE("compare: StreamingLLM without room for the needles fails the needle metric") {
  kvpolicy::ThreadPool pool(2);
  const auto ctx = pool.context();
  const LayerCase c = small_synthetic();
  REQUIRE(!c.needles.empty());
  // Needles sit in [T/16, T - 2*window]; 4 sinks + 28 recent tokens cannot reach them.
  for (auto n : c.needles) REQUIRE((n >= 4 && n < c.kv_len - 28));
  const Reference ref = make_reference(c, ctx);
  const auto policies = all_policies();
  auto find = [&](const std::string& name) {
    return *std::find_if(policies.begin(), policies.end(), [&](auto& p) { return p.name == name; });
  };
  Decision dec;
  const Metrics streaming = run_one(find("StreamingLLM"), c, ref, BudgetSpec::tokens(32), ctx, &dec);
  CHECK(streaming.needle_hit == 0.0);
  CHECK(streaming.rel_err > 0.0);
  // The oracle at the same budget finds them: the metric is not vacuous.
  const Metrics oracle = run_one(find("Oracle"), c, ref, BudgetSpec::tokens(32), ctx, &dec);
  CHECK(oracle.needle_hit > 0.5);
  CHECK(oracle.mass_recall > streaming.mass_recall);
  CHECK(oracle.topk_overlap == 1.0);
}

TEST_CASE("compare: metrics follow their definitions on a hand-checkable decision") {
  kvpolicy::ThreadPool pool(1);
  const auto ctx = pool.context();
  const LayerCase c = small_synthetic(3);
  const Reference ref = make_reference(c, ctx);
  // Keep only token 0 for every kv head: mass recall is that token's mean weight.
  Decision dec;
  dec.rows = Decision::Rows::kKvHead;
  dec.indptr = {0, 1, 2};
  dec.indices = {0, 0};
  const Metrics m = evaluate(c, ref, dec, ctx);
  double mass = 0;
  for (std::int32_t qh = 0; qh < c.num_q_heads; ++qh)
    for (std::int64_t f = 0; f < c.num_eval; ++f) {
      const std::int64_t row = qh * c.num_eval + f;
      mass += std::exp(ref.logit[static_cast<std::size_t>(row * c.kv_len)] - ref.row_max[static_cast<std::size_t>(row)]) /
              ref.full_den[static_cast<std::size_t>(row)];
    }
  CHECK(m.mass_recall == Approx(mass / static_cast<double>(c.num_q_heads * c.num_eval)).epsilon(1e-12));
  CHECK(m.kept_tokens == 1.0);
  CHECK(m.kv_bytes == 2.0 * 2 * c.head_dim * 2);  // 2 kv heads x 1 token x (K + V) x d x fp16
  // With one token kept, the output is that token's value: rel_err = ||v0 - o|| / ||o||.
  CHECK(m.rel_err > 0.1);
}

TEST_CASE("compare: sweeps are deterministic and independent of the thread count") {
  SweepOptions opt;
  opt.budgets = {BudgetSpec::tokens(32), BudgetSpec::tokens(64), BudgetSpec::ratio(0.75)};
  opt.reps = 1;
  opt.per_layer = true;
  opt.progress = false;
  auto run = [&](int threads) {
    kvpolicy::ThreadPool pool(threads);
    Sweep s(opt, pool.context());
    s.run(small_synthetic());
    for (const auto& c : trace_cases()) s.run(c);
    return s.rows();
  };
  const auto a = run(1), b = run(2), c = run(2);
  REQUIRE(a.size() == b.size());
  REQUIRE(b.size() == c.size());
  std::set<std::string> policies;
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].workload << " " << a[i].policy << " " << a[i].budget_value << " " << a[i].metric);
    CHECK(a[i].policy == b[i].policy);
    CHECK(a[i].metric == b[i].metric);
    CHECK(a[i].layer == b[i].layer);
    CHECK(a[i].kept_tokens == b[i].kept_tokens);
    if (a[i].metric != "time_ms") {
      CHECK(a[i].value == b[i].value);
      CHECK(b[i].value == c[i].value);
    }
    policies.insert(a[i].policy);
  }
  // Every policy with a per-layer adapter produced rows (PyramidKV on the 2-layer trace), plus the Full baseline;
  // the evict+quantize, lookahead (LAQ) and merging entries run on the engine's task workloads only.
  std::size_t per_layer = 0;
  for (const auto& p : all_policies()) per_layer += p.run ? 1 : 0;
  // + twelve engine-only entries (six eviction variants and LAQ, six evict+quantize ones with SnapKV+KIVI-2 / -4)
  // + the twelve merging entries
  CHECK(per_layer + 12 + 12 == all_policies().size());
  CHECK(policies.size() == per_layer + 1);
}

TEST_CASE("compare: the CSV has the documented columns") {
  SweepOptions opt;
  opt.budgets = {BudgetSpec::tokens(64), BudgetSpec::ratio(0.5)};
  opt.policies = {"StreamingLLM", "SnapKV", "Quest"};
  opt.reps = 1;
  opt.progress = false;
  kvpolicy::ThreadPool pool(2);
  Sweep s(opt, pool.context());
  s.run(small_synthetic());
  const auto rows = s.rows();
  const std::string path = "test_compare_results.csv";
  REQUIRE(write_csv(path, rows, "abc123"));
  std::ifstream f(path);
  std::string line;
  REQUIRE(std::getline(f, line));
  CHECK(line == "workload,model,layer,policy,family,query_aware,budget_kind,budget_value,kept_tokens,metric,value,n,commit");
  const std::set<std::string> metrics{"rel_err", "mass_recall", "topk_overlap", "needle_hit", "kv_bytes", "time_ms"};
  const std::set<std::string> kinds{"tokens", "ratio_removed", "full"};
  std::size_t count = 0;
  std::set<std::string> seen_policies;
  while (std::getline(f, line)) {
    std::vector<std::string> col;
    std::stringstream ss(line);
    for (std::string x; std::getline(ss, x, ',');) col.push_back(x);
    if (!line.empty() && line.back() == ',') col.push_back("");
    REQUIRE(col.size() == 13);
    CHECK(col[0] == "synthetic");
    CHECK(col[2] == "all");
    CHECK(kinds.count(col[6]) == 1);
    CHECK(metrics.count(col[9]) == 1);
    CHECK(std::isfinite(std::stod(col[10])));
    CHECK(col[12] == "abc123");
    seen_policies.insert(col[3]);
    ++count;
  }
  CHECK(count == rows.size());
  CHECK(seen_policies == std::set<std::string>{"Full", "StreamingLLM", "SnapKV", "Quest"});
  std::remove(path.c_str());
}

TEST_CASE("compare: trace files become layer cases with un-rotated queries for Expected Attention") {
  const auto cases = trace_cases();
  REQUIRE(cases.size() == 2);
  for (const auto& c : cases) {
    CHECK(c.workload == "trace:tiny_llama_random");
    CHECK(c.num_layers == 2);
    CHECK(c.num_eval == 8);
    CHECK(c.has_eval_kv());
    CHECK(c.window == 32);
    REQUIRE(c.q_pre.size() == c.q.size());
    REQUIRE(c.inv_freq.size() == static_cast<std::size_t>(c.head_dim / 2));
    // Rotating q_pre forward again (HF's formula) gives back the stored queries.
    const std::int32_t d = c.head_dim, half = d / 2;
    double worst = 0, moved = 0;
    for (std::int32_t h = 0; h < c.num_q_heads; ++h)
      for (std::int64_t t = 0; t < c.kv_len; ++t) {
        const float* x = &c.q_pre[(static_cast<std::size_t>(h) * c.kv_len + t) * d];
        const float* y = &c.q[(static_cast<std::size_t>(h) * c.kv_len + t) * d];
        for (std::int32_t i = 0; i < half; ++i) {
          const float ang = c.inv_freq[static_cast<std::size_t>(i)] * static_cast<float>(t);
          const double y1 = (x[i] * std::cos(ang) - x[i + half] * std::sin(ang)) * c.rope_scaling;
          const double y2 = (x[i + half] * std::cos(ang) + x[i] * std::sin(ang)) * c.rope_scaling;
          worst = std::max({worst, std::abs(y1 - y[i]), std::abs(y2 - y[i + half])});
          moved = std::max(moved, static_cast<double>(std::abs(x[i] - y[i])));
        }
      }
    CHECK(worst < 1e-4);
    CHECK(moved > 1e-2);
  }
  // A bad trace path fails cleanly.
  std::vector<LayerCase> none;
  const kvpolicy::Status s = load_trace_cases("no/such/file.safetensors", &none);
  CHECK_FALSE(s.is_ok());
  CHECK(none.empty());
}

TEST_CASE("compare: --list-policies prints the registry and every comparison entry") {
  const std::string listing = list_policies();  // what kvpolicy-compare --list-policies prints
  // A line that starts with `name` and a space (appended, not `"\n" + name`: GCC 12 -Wrestrict false positive).
  auto line_starting = [&](std::string_view name) {
    std::string l = "\n";
    l.append(name);
    l += ' ';
    return listing.find(l) != std::string::npos;
  };
  CHECK(listing.find(kvpolicy::describe_registry()) != std::string::npos);
  REQUIRE(!kvpolicy::registry().empty());
  for (const auto& p : kvpolicy::registry()) {
    INFO(p.name);
    // A registry line starts with the policy's name, then its family.
    CHECK(line_starting(p.name));
    CHECK(listing.find(std::string(p.family)) != std::string::npos);
  }
  for (const auto& p : all_policies()) {
    INFO(p.name);
    CHECK(line_starting(p.name));
    if (!p.spec.empty()) CHECK(listing.find(p.spec) != std::string::npos);
    // Every entry names a registry policy (the oracle excepted; engine-only entries name a spec, "snapkv+<spec>"
    // for the composed ones, whose registry policies must exist), and every spec string builds.
    if (p.family == "oracle") continue;
    if (p.registry.empty()) {  // an engine policy with no registry counterpart (D2O whole, kvpress CAM, the pipeline)
      CHECK(!p.engine.empty());
      CHECK(listing.find("(engine tasks only: " + p.engine + ")") != std::string::npos);
      continue;
    }
    std::string reg = p.registry;
    if (reg.rfind("snapkv+", 0) == 0) reg = reg.substr(7);
    if (reg.rfind("mixed+", 0) == 0) reg = reg.substr(6);
    reg = reg.substr(0, reg.find(':'));
    CHECK(kvpolicy::registry().end() != std::find_if(kvpolicy::registry().begin(), kvpolicy::registry().end(),
                                                     [&](const kvpolicy::PolicyInfo& i) { return i.name == reg; }));
  }
}

TEST_CASE("compare: the spec strings fill in the case and the budget") {
  LayerCase c = small_synthetic();
  c.window = 16;
  c.sinks = 4;
  CHECK(adapt::spec_for("snapkv:window={window},kernel=5", c, BudgetSpec::tokens(64)) == "snapkv:window=16,kernel=5,tokens=64");
  std::string clamped = "snapkv:window=16,tokens=";  // a token budget above the prompt: n = T
  clamped += std::to_string(c.kv_len);
  CHECK(adapt::spec_for("snapkv:window={window}", c, BudgetSpec::tokens(100000)) == clamped);
  CHECK(adapt::spec_for("streaming_llm:sinks={sinks}", c, BudgetSpec::ratio(0.75)) == "streaming_llm:sinks=4,compression_ratio=0.75");
  CHECK(adapt::spec_for("tova", c, BudgetSpec::ratio(0.1)) == "tova:compression_ratio=0.10000000000000001");
  CHECK(adapt::spec_for("observed_attention:window={factory_window}", c, BudgetSpec::tokens(8)) == "observed_attention:window=8,tokens=8");
  // A bad spec is the registry's error, reported by the entry.
  const auto bad = from_registry("Bad", false, "snapkv:windw=3");
  Timer t;
  Decision d;
  const kvpolicy::Status s = bad.run(c, Reference{}, BudgetSpec::tokens(8), {}, t, &d);
  CHECK_FALSE(s.is_ok());
  CHECK(std::string(s.message()).find("unknown parameter 'windw'") != std::string::npos);
}
