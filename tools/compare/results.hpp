// SPDX-License-Identifier: Apache-2.0
// Results of a comparison as tidy long-format rows (one row per workload x
// layer x policy x budget x metric), their CSV form, and the console table,
// which is a pivot of the same rows (so the printed table, the CSV and the
// plots drawn from it by plot.py always agree).
//
// CSV columns (header line first, comma-separated, no quoting needed: names
// never contain commas):
//   workload      "synthetic", "trace:<file stem>", "tasks:<task>"
//   model         model name of a trace / the engine model, "" for synthetic data
//   layer         "all" (mean over layers and instances) or a layer index (--per-layer)
//   policy        policy name (see policies.hpp); "Full" is the full-cache baseline
//   family        eviction | selection | oracle | baseline | prefetch
//   query_aware   1 when the policy reads the prompt's last queries or the decode query
//   budget_kind   tokens | ratio_removed | full | device_pages (prefetch: the simulated device buffer per layer)
//   budget_value  tokens per kv head, kvpress compression ratio, or the prompt length (full)
//   kept_tokens   mean prompt tokens a head reads under the decision
//   metric        rel_err | mass_recall | topk_overlap | needle_hit | kv_bytes | time_ms |
//                 accuracy | logit_kl (end-to-end) | pred_recall | buffer_hit | late_miss | sim_pred_recall |
//                 sim_buffer_hit | sim_late_miss | bytes_per_step | stall_us_per_step (prefetch_workload.hpp)
//   value         the metric's value (mean over cases; time_ms: median decision time per layer)
//   n             cases (layer x instance) aggregated
//   commit        source revision given with --commit ("unknown" otherwise)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace kvp_compare {

struct ResultRow {
  std::string workload, model, layer, policy, family;
  bool query_aware = false;
  std::string budget_kind;
  double budget_value = 0;
  double kept_tokens = 0;
  std::string metric;
  double value = 0;
  long long n = 0;
};

inline const char* kCsvHeader = "workload,model,layer,policy,family,query_aware,budget_kind,budget_value,kept_tokens,metric,value,n,commit";

inline std::string csv_number(double v) {
  if (std::isnan(v)) return "nan";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

/// Replaces characters that would break the CSV (commas, quotes, newlines).
inline std::string csv_field(std::string s) {
  for (char& ch : s)
    if (ch == ',' || ch == '"' || ch == '\n' || ch == '\r') ch = ' ';
  return s;
}

inline bool write_csv(const std::string& path, const std::vector<ResultRow>& rows, const std::string& commit) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  std::fprintf(f, "%s\n", kCsvHeader);
  for (const auto& r : rows)
    std::fprintf(f, "%s,%s,%s,%s,%s,%d,%s,%s,%s,%s,%s,%lld,%s\n", csv_field(r.workload).c_str(), csv_field(r.model).c_str(),
                 csv_field(r.layer).c_str(), csv_field(r.policy).c_str(), r.family.c_str(), r.query_aware ? 1 : 0, r.budget_kind.c_str(),
                 csv_number(r.budget_value).c_str(), csv_number(r.kept_tokens).c_str(), r.metric.c_str(), csv_number(r.value).c_str(), r.n,
                 csv_field(commit).c_str());
  return std::fclose(f) == 0;
}

/// Console table: for each workload, one line per (policy, budget), one column
/// per metric, from the rows with layer == "all".
inline void print_table(FILE* out, const std::vector<ResultRow>& rows) {
  struct Line {
    std::string policy, kind;
    double budget = 0, kept = 0;
    std::map<std::string, double> m;
  };
  std::vector<std::string> workloads;
  std::map<std::string, std::vector<Line>> by_wl;
  for (const auto& r : rows) {
    if (r.layer != "all") continue;
    if (r.budget_kind == "device_pages") continue;  // prefetch rows: print_prefetch_table (prefetch_workload.hpp)
    if (std::find(workloads.begin(), workloads.end(), r.workload) == workloads.end()) workloads.push_back(r.workload);
    auto& lines = by_wl[r.workload];
    auto it = std::find_if(lines.begin(), lines.end(),
                           [&](const Line& l) { return l.policy == r.policy && l.kind == r.budget_kind && l.budget == r.budget_value; });
    if (it == lines.end()) {
      lines.push_back({r.policy, r.budget_kind, r.budget_value, r.kept_tokens, {}});
      it = lines.end() - 1;
    }
    it->m[r.metric] = r.value;
  }
  const char* cols[] = {"rel_err", "mass_recall", "topk_overlap", "needle_hit", "time_ms", "kv_bytes", "accuracy", "logit_kl"};
  for (const auto& wl : workloads) {
    const auto& lines = by_wl[wl];
    bool present[8] = {};
    for (const auto& l : lines)
      for (int c = 0; c < 8; ++c) present[c] |= l.m.count(cols[c]) > 0;
    std::fprintf(out, "\n== %s ==\n%-27s %9s %7s", wl.c_str(), "policy", "budget", "kept");
    const char* heads[] = {"rel_err", "mass_rec", "topk_ovl", "needle", "time_ms", "KiB/layer", "accuracy", "logit_KL"};
    for (int c = 0; c < 8; ++c)
      if (present[c]) std::fprintf(out, " %9s", heads[c]);
    std::fprintf(out, "\n");
    for (const auto& l : lines) {
      char b[32];
      if (l.kind == "tokens")
        std::snprintf(b, sizeof b, "%.0f", l.budget);
      else if (l.kind == "ratio_removed")
        std::snprintf(b, sizeof b, "r=%.3g", l.budget);
      else
        std::snprintf(b, sizeof b, "full");
      std::fprintf(out, "%-27s %9s %7.0f", l.policy.c_str(), b, l.kept);
      for (int c = 0; c < 8; ++c) {
        if (!present[c]) continue;
        auto it = l.m.find(cols[c]);
        if (it == l.m.end() || std::isnan(it->second))
          std::fprintf(out, " %9s", "-");
        else if (c == 5)
          std::fprintf(out, " %9.1f", it->second / 1024.0);
        else if (c == 4)
          std::fprintf(out, " %9.3f", it->second);
        else
          std::fprintf(out, " %9.4f", it->second);
      }
      std::fprintf(out, "\n");
    }
  }
}

}  // namespace kvp_compare
