// SPDX-License-Identifier: Apache-2.0
// The sweep: every policy x budget on every LayerCase, accumulated into
// tidy result rows (results.hpp).
//
// Per case: the full-cache reference is computed once; the "Full" baseline
// (every token kept) is evaluated through the same code path as the policies;
// then each applicable (policy, budget) pair decides and is evaluated.
// Budgets that resolve to >= the prompt length equal the full cache and are
// skipped (the Full row stands for them), as are multi-layer policies on
// single-layer cases. A policy that rejects a (case, budget) (e.g. a budget
// below its protected tokens) is reported once as a warning and left out.
// Aggregation: metrics are means over cases (layers x instances); time_ms is
// the median of every timed call. Results do not depend on the thread count.
#pragma once

#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "evaluate.hpp"
#include "policies.hpp"
#include "results.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace kvp_compare {

struct SweepOptions {
  std::vector<BudgetSpec> budgets;
  std::vector<std::string> policies;  ///< names to run; empty: all
  int reps = 3;                       ///< timed repetitions per decision (fewer once a decision takes > 0.5 s)
  bool per_layer = false;             ///< also emit per-layer rows
  bool progress = true;               ///< progress line on stderr (only when it is a terminal)
};

class Sweep {
 public:
  Sweep(SweepOptions opt, const kvpolicy::ExecContext& ctx) : opt_(std::move(opt)), ctx_(ctx) {
    for (auto& p : all_policies())
      if (p.run && (opt_.policies.empty() || std::find(opt_.policies.begin(), opt_.policies.end(), p.name) != opt_.policies.end()))
        policies_.push_back(p);
#if defined(__unix__) || defined(__APPLE__)
    tty_ = opt_.progress && isatty(2);
#endif
  }

  const std::vector<PolicySpec>& policies() const noexcept { return policies_; }
  const std::vector<std::string>& warnings() const noexcept { return warnings_; }

  /// Decisions the sweep will make on `c` (for progress accounting).
  std::int64_t units(const LayerCase& c) const {
    std::int64_t n = 0;
    for (const auto& p : policies_)
      if (!p.multi_layer || c.num_layers > 1)
        for (const auto& b : opt_.budgets) n += applicable(c, b);
    return n;
  }
  void set_total_units(std::int64_t n) { total_ = n; }

  /// Run every policy and budget on one case and accumulate the results.
  void run(const LayerCase& c) {
    const Reference ref = make_reference(c, ctx_);
    {
      Decision full;
      full.rows = Decision::Rows::kKvHead;
      for (std::int32_t h = 0; h <= c.num_kv_heads; ++h) full.indptr.push_back(static_cast<std::int32_t>(h * c.kv_len));
      for (std::int32_t h = 0; h < c.num_kv_heads; ++h)
        for (std::int64_t j = 0; j < c.kv_len; ++j) full.indices.push_back(static_cast<std::int32_t>(j));
      add(c, kFull, "Full", "baseline", false, -1, evaluate(c, ref, full, ctx_), {});
    }
    std::map<std::size_t, Metrics> quant_memo;
    for (std::size_t pi = 0; pi < policies_.size(); ++pi) {
      const auto& p = policies_[pi];
      if (p.multi_layer && c.num_layers < 2) continue;
      for (std::size_t bi = 0; bi < opt_.budgets.size(); ++bi) {
        const BudgetSpec& b = opt_.budgets[bi];
        if (!applicable(c, b)) continue;
        progress(c, p.name, b);
        Timer t;
        t.reps = opt_.reps;
        Decision dec;
        kvpolicy::Status s = p.run(c, ref, b, ctx_, t, &dec);
        ++done_;
        if (!s) {
          warn(p.name + " on " + c.workload + " (" + b.kind_name() + " " + csv_number(b.value) + "): " + s.message());
          continue;
        }
        if (!dec.well_formed(c)) {
          warn(p.name + " on " + c.workload + ": malformed decision (ids out of range or not ascending)");
          continue;
        }
        if (dec.quantized) {  // the format ignores the budget: one evaluation per case, every budget's row
          auto it = quant_memo.find(pi);
          if (it == quant_memo.end()) {
            const Reference qref = make_reference(*dec.quantized, ctx_);
            it = quant_memo.emplace(pi, evaluate(*dec.quantized, qref, dec, ctx_, &ref)).first;
          }
          add(c, static_cast<int>(pi), p.name, p.family, p.query_aware, static_cast<int>(bi), it->second, t.ms);
          continue;
        }
        add(c, static_cast<int>(pi), p.name, p.family, p.query_aware, static_cast<int>(bi), evaluate(c, ref, dec, ctx_), t.ms);
      }
    }
    clear_progress();
  }

  /// The accumulated results as tidy rows, ordered by workload (first seen),
  /// layer ("all" first), policy (Full, then the registry order), budget.
  std::vector<ResultRow> rows() const {
    std::vector<ResultRow> out;
    for (const auto& [key, a] : acc_) {
      const auto& [wl_order, layer, pol, bud] = key;
      (void)wl_order;
      const double n = static_cast<double>(a.n);
      ResultRow base;
      base.workload = a.workload;
      base.model = a.model;
      base.layer = layer < 0 ? "all" : std::to_string(layer);
      base.policy = a.policy;
      base.family = a.family;
      base.query_aware = a.query_aware;
      if (bud < 0) {
        base.budget_kind = "full";
        base.budget_value = a.kv_len_sum / n;
      } else {
        base.budget_kind = opt_.budgets[static_cast<std::size_t>(bud)].kind_name();
        base.budget_value = opt_.budgets[static_cast<std::size_t>(bud)].value;
      }
      (void)pol;
      base.kept_tokens = a.m.kept_tokens / n;
      base.n = a.n;
      auto emit = [&](const char* metric, double v) {
        ResultRow r = base;
        r.metric = metric;
        r.value = v;
        out.push_back(r);
      };
      emit("rel_err", a.m.rel_err / n);
      emit("mass_recall", a.m.mass_recall / n);
      emit("topk_overlap", a.m.topk_overlap / n);
      if (a.needle_n > 0) emit("needle_hit", a.m.needle_hit / static_cast<double>(a.needle_n));
      emit("kv_bytes", a.m.kv_bytes / n);
      if (!a.times.empty()) {
        std::vector<double> t = a.times;
        std::sort(t.begin(), t.end());
        emit("time_ms", t[t.size() / 2]);
      }
    }
    return out;
  }

 private:
  static constexpr int kFull = -1;

  struct Acc {
    std::string workload, model, policy, family;
    bool query_aware = false;
    long long n = 0, needle_n = 0;
    double kv_len_sum = 0;
    Metrics m{0, 0, 0, 0, 0, 0};
    std::vector<double> times;
  };
  using Key = std::tuple<int, int, int, int>;  // (workload order, layer or -1, policy index or -1, budget index or -1)

  static bool applicable(const LayerCase& c, const BudgetSpec& b) noexcept {
    const std::int64_t n = b.tokens_for(c.kv_len);
    return n >= 1 && n < c.kv_len;
  }

  int workload_order(const std::string& wl) {
    auto it = std::find(workloads_.begin(), workloads_.end(), wl);
    if (it != workloads_.end()) return static_cast<int>(it - workloads_.begin());
    workloads_.push_back(wl);
    return static_cast<int>(workloads_.size() - 1);
  }

  void add(const LayerCase& c, int pol, const std::string& name, const std::string& family, bool qa, int bud, const Metrics& m,
           const std::vector<double>& times) {
    const int wo = workload_order(c.workload);
    for (int layer : {-1, static_cast<int>(c.layer)}) {
      if (layer >= 0 && !opt_.per_layer) continue;
      Acc& a = acc_[Key{wo, layer, pol, bud}];
      a.workload = c.workload;
      a.model = c.model;
      a.policy = name;
      a.family = family;
      a.query_aware = qa;
      a.n += 1;
      a.kv_len_sum += static_cast<double>(c.kv_len);
      a.m.rel_err += m.rel_err;
      a.m.mass_recall += m.mass_recall;
      a.m.topk_overlap += m.topk_overlap;
      a.m.kept_tokens += m.kept_tokens;
      a.m.kv_bytes += m.kv_bytes;
      if (!std::isnan(m.needle_hit)) {
        a.m.needle_hit += m.needle_hit;
        a.needle_n += 1;
      }
      a.times.insert(a.times.end(), times.begin(), times.end());
    }
  }

  void warn(const std::string& w) {
    const std::string key = w.substr(0, w.find(" ("));
    if (!warned_.insert(key).second) return;
    warnings_.push_back(w);
  }

  void progress(const LayerCase& c, const std::string& policy, const BudgetSpec& b) {
    if (!tty_) return;
    const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    char eta[32] = "";
    if (done_ > 0 && total_ > done_)
      std::snprintf(eta, sizeof eta, ", ~%.0f s left", el / static_cast<double>(done_) * static_cast<double>(total_ - done_));
    char bud[32];
    if (b.kind == BudgetSpec::Kind::kTokens)
      std::snprintf(bud, sizeof bud, "%.0f tokens", b.value);
    else
      std::snprintf(bud, sizeof bud, "ratio %.3g", b.value);
    std::fprintf(stderr, "\r\033[K[%3.0f%%] %s layer %d #%d: %s @ %s (%.0f s%s)",
                 total_ ? 100.0 * static_cast<double>(done_) / static_cast<double>(total_) : 0.0, c.workload.c_str(), c.layer, c.instance,
                 policy.c_str(), bud, el, eta);
    std::fflush(stderr);
  }
  void clear_progress() {
    if (tty_) std::fprintf(stderr, "\r\033[K");
  }

  SweepOptions opt_;
  kvpolicy::ExecContext ctx_;
  std::vector<PolicySpec> policies_;
  std::vector<std::string> workloads_;
  std::map<Key, Acc> acc_;
  std::vector<std::string> warnings_;
  std::set<std::string> warned_;
  bool tty_ = false;
  std::int64_t total_ = 0, done_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace kvp_compare
