// SPDX-License-Identifier: Apache-2.0
// compare_policies — the policy comparison on the built-in synthetic workload.
//
// For each policy and token budget (per kv head, protected tokens inside) it
// runs the policy's decision on a prefill of fp16 keys, then evaluates the
// decision with decode queries the policy never saw:
//   rel_err      ||attn_out(kept) - attn_out(full)|| / ||attn_out(full)||
//   mass_recall  attention mass (full softmax) that falls on kept tokens
//   needle_hit   fraction of planted needle tokens that were kept
//   time_ms      median wall time of the decision (all heads, all threads)
// averaged over query heads, decode queries and workload seeds.
//
//   compare_policies [--seeds N] [--len T] [--threads N] [--budgets 64,128,...] [--csv out.csv]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/streaming_llm.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "synthetic_workload.hpp"

using namespace kvpolicy;
using kvp_examples::Workload;

namespace {

struct Keep {
  std::vector<std::int32_t> indptr, indices;
};

/// A policy under comparison: given a workload and a budget, fill `keep`.
struct Entry {
  std::string name;
  std::function<Status(const Workload&, std::int64_t budget, const ExecContext&, Keep&)> run;
};

template <class Policy>
Status run_policy(const Policy& policy, const Workload& w, const ExecContext& ctx, Keep& keep) {
  const auto& s = w.s;
  PrefillInput<float, half> in{
      TensorView<const float, 3>::contiguous(w.window_q.data(), {s.num_q_heads, s.window, s.head_dim}),
      KVSource<half>::from(TensorView<const half, 3>::contiguous(w.keys.data(), {s.num_kv_heads, s.kv_len, s.head_dim}))};
  const std::int64_t n = policy.kept_count(s.kv_len);
  keep.indptr.assign(s.num_kv_heads + 1, 0);
  keep.indices.assign(static_cast<std::size_t>(std::max<std::int64_t>(n, 1) * s.num_kv_heads), 0);
  static std::vector<std::byte> ws;
  ws.resize(policy.template workspace_bytes<backend::Cpu>({s.num_q_heads, s.num_kv_heads, s.head_dim, s.kv_len, s.window}, ctx));
  KeepSet out{keep.indptr.data(), keep.indices.data(), s.num_kv_heads, static_cast<std::int64_t>(keep.indices.size())};
  return policy.template select<backend::Cpu>(in, out, Workspace{ws.data(), ws.size()}, ctx);
}

std::vector<Entry> registry() {
  std::vector<Entry> e;
  e.push_back({"StreamingLLM", [](const Workload& w, std::int64_t b, const ExecContext& ctx, Keep& k) {
                 return run_policy(StreamingLLM(StreamingLLMParams{w.s.sinks, Budget::tokens(b), 0}), w, ctx, k);
               }});
  e.push_back({"SnapKV(kvpress)", [](const Workload& w, std::int64_t b, const ExecContext& ctx, Keep& k) {
                 SnapKVParams p = SnapKVParams::kvpress(0.0, w.s.window, 5);
                 p.budget = Budget::tokens(b);
                 return run_policy(SnapKV(p), w, ctx, k);
               }});
  e.push_back({"SnapKV(original)", [](const Workload& w, std::int64_t b, const ExecContext& ctx, Keep& k) {
                 return run_policy(SnapKV(SnapKVParams::original(b, w.s.window, 7, Pooling::kMax)), w, ctx, k);
               }});
  return e;
}

/// Full-cache reference for the decode queries: logits and outputs.
struct Reference {
  std::vector<double> logits;  // (Hq, F, T)
  std::vector<double> out;     // (Hq, F, d)
  std::vector<double> lse_max; // (Hq, F): max logit
  std::vector<double> denom;   // (Hq, F)
};

Reference reference(const Workload& w) {
  const auto& s = w.s;
  const int G = s.num_q_heads / s.num_kv_heads, T = s.kv_len, d = s.head_dim, F = s.num_future;
  Reference r;
  r.logits.resize(static_cast<std::size_t>(s.num_q_heads) * F * T);
  r.out.assign(static_cast<std::size_t>(s.num_q_heads) * F * d, 0.0);
  r.lse_max.resize(static_cast<std::size_t>(s.num_q_heads) * F);
  r.denom.resize(r.lse_max.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int qh = 0; qh < s.num_q_heads; ++qh) {
    const int h = qh / G;
    for (int i = 0; i < F; ++i) {
      const float* q = &w.future_q[(static_cast<std::size_t>(qh) * F + i) * d];
      double* l = &r.logits[(static_cast<std::size_t>(qh) * F + i) * T];
      double mx = -1e300;
      for (int j = 0; j < T; ++j) {
        const float* k = &w.keys_f[(static_cast<std::size_t>(h) * T + j) * d];
        float acc = 0;
        for (int c = 0; c < d; ++c) acc += q[c] * k[c];
        l[j] = acc * scale;
        mx = std::max(mx, l[j]);
      }
      double den = 0;
      double* o = &r.out[(static_cast<std::size_t>(qh) * F + i) * d];
      for (int j = 0; j < T; ++j) {
        const double p = std::exp(l[j] - mx);
        den += p;
        const float* v = &w.values[(static_cast<std::size_t>(h) * T + j) * d];
        for (int c = 0; c < d; ++c) o[c] += p * v[c];
      }
      for (int c = 0; c < d; ++c) o[c] /= den;
      r.lse_max[static_cast<std::size_t>(qh) * F + i] = mx;
      r.denom[static_cast<std::size_t>(qh) * F + i] = den;
    }
  }
  return r;
}

struct Metrics {
  double rel_err = 0, mass_recall = 0, needle_hit = 0;
};

Metrics evaluate(const Workload& w, const Reference& ref, const Keep& keep) {
  const auto& s = w.s;
  const int G = s.num_q_heads / s.num_kv_heads, T = s.kv_len, d = s.head_dim, F = s.num_future;
  Metrics m;
  std::vector<double> o(d);
  for (int qh = 0; qh < s.num_q_heads; ++qh) {
    const int h = qh / G;
    const std::int32_t* ids = keep.indices.data() + keep.indptr[h];
    const std::int32_t n = keep.indptr[h + 1] - keep.indptr[h];
    for (int i = 0; i < F; ++i) {
      const std::size_t row = static_cast<std::size_t>(qh) * F + i;
      const double* l = &ref.logits[row * T];
      const double mx = ref.lse_max[row];
      double den = 0, mass = 0;
      std::fill(o.begin(), o.end(), 0.0);
      for (std::int32_t r = 0; r < n; ++r) {
        const double p = std::exp(l[ids[r]] - mx);
        den += p;
        const float* v = &w.values[(static_cast<std::size_t>(h) * T + ids[r]) * d];
        for (int c = 0; c < d; ++c) o[c] += p * v[c];
      }
      mass = den / ref.denom[row];
      double num = 0, nrm = 0;
      const double* full = &ref.out[row * d];
      for (int c = 0; c < d; ++c) {
        const double oc = den > 0 ? o[c] / den : 0.0;
        num += (oc - full[c]) * (oc - full[c]);
        nrm += full[c] * full[c];
      }
      m.rel_err += std::sqrt(num / nrm);
      m.mass_recall += mass;
    }
  }
  const double nq = static_cast<double>(s.num_q_heads) * F;
  m.rel_err /= nq;
  m.mass_recall /= nq;
  int hits = 0;
  for (int h = 0; h < s.num_kv_heads; ++h) {
    const std::int32_t* b = keep.indices.data() + keep.indptr[h];
    const std::int32_t* e = keep.indices.data() + keep.indptr[h + 1];
    for (int n = 0; n < s.needles; ++n) hits += std::binary_search(b, e, w.needle_pos[static_cast<std::size_t>(h) * s.needles + n]);
  }
  m.needle_hit = static_cast<double>(hits) / (s.num_kv_heads * s.needles);
  return m;
}

std::vector<std::int64_t> parse_list(const char* s) {
  std::vector<std::int64_t> v;
  for (const char* p = s; *p;) {
    v.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int seeds = 3, threads = 2;
  kvp_examples::WorkloadShape shape;
  std::vector<std::int64_t> budgets{64, 128, 256, 512, 1024};
  const char* csv_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--seeds")) seeds = std::atoi(next());
    else if (!std::strcmp(argv[i], "--len")) shape.kv_len = std::atoi(next());
    else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(next());
    else if (!std::strcmp(argv[i], "--budgets")) budgets = parse_list(next());
    else if (!std::strcmp(argv[i], "--csv")) csv_path = next();
    else {
      std::fprintf(stderr, "usage: %s [--seeds N] [--len T] [--threads N] [--budgets a,b,...] [--csv file]\n", argv[0]);
      return 2;
    }
  }
  ThreadPool pool(threads);
  const ExecContext ctx = pool.context();
  const auto entries = registry();
  struct Row {
    std::string policy;
    std::int64_t budget;
    Metrics m;
    std::vector<double> times;
  };
  std::vector<Row> rows;
  for (const auto& e : entries)
    for (auto b : budgets) rows.push_back({e.name, b, {}, {}});

  std::printf("kvpolicy compare_policies: %d q heads / %d kv heads, head_dim %d, %d prompt tokens (fp16 keys), window %d,\n"
              "%d decode queries per head, %d needles per kv head, %d seeds, %d threads, CPU ISA %s\n\n",
              shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.kv_len, shape.window, shape.num_future, shape.needles, seeds,
              threads, backend::Cpu::isa_name());
  for (int seed = 0; seed < seeds; ++seed) {
    std::fprintf(stderr, "\r[seed %d/%d] building workload...          ", seed + 1, seeds);
    const Workload w = kvp_examples::make_workload(shape, 1000 + seed);
    const Reference ref = reference(w);
    std::size_t r = 0;
    for (const auto& e : entries) {
      for (auto b : budgets) {
        std::fprintf(stderr, "\r[seed %d/%d] %-18s budget %5lld   ", seed + 1, seeds, e.name.c_str(), static_cast<long long>(b));
        Keep keep;
        for (int rep = 0; rep < 3; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          const Status s = e.run(w, std::min<std::int64_t>(b, shape.kv_len), ctx, keep);
          const auto t1 = std::chrono::steady_clock::now();
          if (!s.is_ok()) {
            std::fprintf(stderr, "\n%s failed: %s\n", e.name.c_str(), s.message());
            return 1;
          }
          rows[r].times.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
        const Metrics m = evaluate(w, ref, keep);
        rows[r].m.rel_err += m.rel_err / seeds;
        rows[r].m.mass_recall += m.mass_recall / seeds;
        rows[r].m.needle_hit += m.needle_hit / seeds;
        ++r;
      }
    }
  }
  std::fprintf(stderr, "\r%60s\r", "");
  std::printf("%-18s %7s %10s %12s %11s %10s\n", "policy", "budget", "rel_err", "mass_recall", "needle_hit", "time_ms");
  FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  if (csv) std::fprintf(csv, "policy,budget,workload,metric,value\n");
  for (auto& row : rows) {
    std::sort(row.times.begin(), row.times.end());
    const double t = row.times[row.times.size() / 2];
    std::printf("%-18s %7lld %10.4f %12.4f %11.3f %10.3f\n", row.policy.c_str(), static_cast<long long>(row.budget), row.m.rel_err,
                row.m.mass_recall, row.m.needle_hit, t);
    if (csv) {
      const char* wl = "synthetic";
      std::fprintf(csv, "%s,%lld,%s,rel_err,%.6g\n", row.policy.c_str(), static_cast<long long>(row.budget), wl, row.m.rel_err);
      std::fprintf(csv, "%s,%lld,%s,mass_recall,%.6g\n", row.policy.c_str(), static_cast<long long>(row.budget), wl, row.m.mass_recall);
      std::fprintf(csv, "%s,%lld,%s,needle_hit,%.6g\n", row.policy.c_str(), static_cast<long long>(row.budget), wl, row.m.needle_hit);
      std::fprintf(csv, "%s,%lld,%s,time_ms,%.6g\n", row.policy.c_str(), static_cast<long long>(row.budget), wl, t);
    }
  }
  if (csv) {
    std::fclose(csv);
    std::printf("\nwrote %s\n", csv_path);
  }
  return 0;
}
