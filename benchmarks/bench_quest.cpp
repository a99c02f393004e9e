// Quest at one decode step of a 128K-token sequence: 8192 pages of 16 tokens,
// head_dim 128, 32 query / 8 kv heads (GQA 4), fp16 keys, values and page
// metadata, page ids scattered over the pool as in a real engine.
//
//   estimate      page_bounds for every kv head: reads 2 * head_dim metadata
//                 values per (page, kv head), 32 MiB per step; reported as a
//                 fraction of the read bandwidth measured here on a buffer of
//                 the same size (the same cache level).
//   topk          Backend::topk of the 8191 bounds of each query head, against
//                 one read pass over the same scores.
//   select        Quest::select end to end (estimate + top-k + CSR output).
//   attention     decode attention over the selection vs over every page
//                 (eval/page_metrics.hpp `attend_pages`), per-query-head rows.
//
// After the runs a summary prints the medians and the ratios the issue asks
// for, plus the bytes a step reads with the selection vs dense attention.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/eval/page_metrics.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#if KVP_BENCH_QUEST_CPU
#include "kvpolicy/backends/cpu.hpp"
#endif

using namespace kvpolicy;

namespace {

constexpr std::int32_t kPages = 8192, kPage = 16, kDim = 128, kHq = 32, kHkv = 8, kG = kHq / kHkv;
constexpr std::int64_t kTokens = static_cast<std::int64_t>(kPages) * kPage;
constexpr std::int32_t kScored = kPages - 1;  // the last page is never scored

/// One layer of the cache at 128K tokens, built once.
struct Step {
  std::vector<half> k, v, meta;
  std::vector<std::int32_t> indptr{0, kPages}, indices, last{kPage};
  std::vector<float> q, scores;
  PagedKVView<const half> kv{};
  PageMetaView<const half> mv{};

  Step() {
    const std::size_t pool = static_cast<std::size_t>(kPages) * kHkv * kPage * kDim;
    k.resize(pool);
    v.resize(pool);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (auto& x : k) x = to_half(nd(rng) * 0.7f);
    for (auto& x : v) x = to_half(nd(rng));
    indices.resize(kPages);
    std::iota(indices.begin(), indices.end(), 0);
    std::shuffle(indices.begin(), indices.end(), rng);
    q.resize(static_cast<std::size_t>(kHq) * kDim);
    for (auto& x : q) x = nd(rng);
    const PageStrides st = PageStrides::contiguous(PageLayout::kNHD, kHkv, kPage, kDim);
    kv = PagedKVView<const half>{k.data(), v.data(), st, st, kPages, kHkv, kPage, kDim, table(), kHost};
    // Planted structure: 64 clusters of 8 keys per kv head aligned with the group's mean query.
    std::uniform_int_distribution<std::int64_t> pick(0, kTokens / 8 - 1);
    for (std::int32_t g = 0; g < kHkv; ++g)
      for (int c = 0; c < 64; ++c)
        for (std::int64_t t = pick(rng) * 8, e = t + 8; t < e; ++t) {
          half* row = const_cast<half*>(kv.key(0, g, t));
          for (std::int32_t i = 0; i < kDim; ++i) {
            float m = 0.0f;
            for (std::int32_t j = 0; j < kG; ++j) m += q[static_cast<std::size_t>((g * kG + j) * kDim + i)];
            row[i] = to_half(to_float(row[i]) + 2.5f * m / kG);
          }
        }
    meta.resize(static_cast<std::size_t>(PageMetaView<half>::contiguous_size(kPages, kHkv, kDim)));
    auto mview = PageMetaView<half>::contiguous(meta.data(), kPages, kHkv, kDim);
    throw_if_error(Quest::rebuild_metadata(kv, mview));
    mv = mview;
    scores.resize(static_cast<std::size_t>(kHq) * kScored);
  }
  PageTable table() const { return PageTable{indptr.data(), indices.data(), last.data(), 1}; }
  TensorView<const float, 3> queries() const { return TensorView<const float, 3>::contiguous(q.data(), {1, kHq, kDim}); }
  double meta_bytes() const { return 2.0 * kDim * sizeof(half) * static_cast<double>(kScored) * kHkv; }
};

Step& step() {
  static Step s;
  return s;
}

template <class Backend>
void estimate(Step& s, Workspace ws) {
  Backend::page_bounds(s.q.data(), kG, kDim, s.mv, s.indices.data(), kScored, s.scores.data(), kScored, ws);
}

template <class Backend>
std::vector<std::byte> estimate_ws() {
  return std::vector<std::byte>(Backend::page_bounds_workspace(kHq, kDim));
}

// ---- read-bandwidth baseline (same working-set size as the metadata) -------------

void BM_ReadBandwidth(benchmark::State& state) {
  // Sum of 64-bit words, 4 accumulators: vectorises at the baseline ISA and
  // is limited by the loads alone.
  static std::vector<std::uint64_t> buf(static_cast<std::size_t>(step().meta_bytes() / 8), 0x0102030405060708ull);
  for (auto _ : state) {
    std::uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (std::size_t i = 0; i < buf.size(); i += 4) {
      a0 += buf[i];
      a1 += buf[i + 1];
      a2 += buf[i + 2];
      a3 += buf[i + 3];
    }
    benchmark::DoNotOptimize(a0 + a1 + a2 + a3);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(buf.size() * 8));
}

// ---- estimate / top-k / select --------------------------------------------------

template <class Backend>
void BM_Estimate(benchmark::State& state) {
  Step& s = step();
  auto ws = estimate_ws<Backend>();
  for (auto _ : state) {
    estimate<Backend>(s, Workspace{ws.data(), ws.size()});
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(static_cast<double>(state.iterations()) * s.meta_bytes()));
}

template <class Backend>
void BM_TopK(benchmark::State& state) {
  Step& s = step();
  auto ews = estimate_ws<Backend>();
  estimate<Backend>(s, Workspace{ews.data(), ews.size()});
  const std::int64_t k = state.range(0) / kPage - 1;
  std::vector<std::byte> ws(Backend::topk_workspace(kScored));
  std::vector<std::int32_t> out(static_cast<std::size_t>(k));
  for (auto _ : state) {
    for (std::int32_t h = 0; h < kHq; ++h)
      Backend::topk(s.scores.data() + static_cast<std::size_t>(h) * kScored, kScored, k, out.data(), Workspace{ws.data(), ws.size()});
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * kHq * kScored * 4);
}

/// One read pass over the same 32 x 8191 scores: count those above a threshold.
void BM_ScoresReadPass(benchmark::State& state) {
  Step& s = step();
  const float t = 1e9f;
  for (auto _ : state) {
    std::int32_t n = 0;
    for (const float x : s.scores) n += x >= t ? 1 : 0;
    benchmark::DoNotOptimize(n);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * kHq * kScored * 4);
}

template <class Backend>
void BM_Select(benchmark::State& state) {
  Step& s = step();
  const Quest quest(QuestParams{.token_budget = static_cast<std::int32_t>(state.range(0))});
  const GqaMap gqa{kHq, kHkv};
  std::vector<std::int32_t> indptr(kHq + 1), last(kHq), idx(static_cast<std::size_t>(quest.output_capacity(2, s.table(), kPage, gqa)));
  const PageSelection sel{indptr.data(), idx.data(), last.data(), nullptr, kHq, static_cast<std::int64_t>(idx.size())};
  std::vector<std::byte> ws(quest.workspace_bytes<Backend>(s.table(), kPage, gqa, kDim));
  for (auto _ : state) {
    throw_if_error(quest.select<Backend>(2, s.queries(), s.table(), kPage, s.mv, sel, Workspace{ws.data(), ws.size()}));
    benchmark::ClobberMemory();
  }
}

// ---- attention ---------------------------------------------------------------------

struct Selection {
  std::vector<std::int32_t> indptr, last, idx;
  PageSelection view() {
    return PageSelection{indptr.data(), idx.data(), last.data(), nullptr, static_cast<std::int64_t>(last.size()),
                         static_cast<std::int64_t>(idx.size())};
  }
};

template <class Backend>
Selection make_selection(std::int32_t token_budget, QuestGqa mode) {
  Step& s = step();
  const Quest quest(QuestParams{.token_budget = token_budget, .gqa = mode});
  const GqaMap gqa{kHq, kHkv};
  Selection out;
  out.indptr.resize(static_cast<std::size_t>(quest.heads_per_seq(gqa) + 1));
  out.last.resize(static_cast<std::size_t>(quest.heads_per_seq(gqa)));
  out.idx.resize(static_cast<std::size_t>(quest.output_capacity(2, s.table(), kPage, gqa)));
  std::vector<std::byte> ws(quest.workspace_bytes<Backend>(s.table(), kPage, gqa, kDim));
  throw_if_error(quest.select<Backend>(2, s.queries(), s.table(), kPage, s.mv, out.view(), Workspace{ws.data(), ws.size()}));
  return out;
}

template <class Backend>
void BM_DenseAttention(benchmark::State& state) {
  Step& s = step();
  std::vector<float> o(static_cast<std::size_t>(kHq) * kDim), l(kHq);
  std::vector<std::byte> ws(attend_pages_workspace<Backend>(kG, kPage, kDim));
  for (auto _ : state) {
    throw_if_error(dense_attention<Backend>(s.kv, s.queries(), 0.088f, TensorView<float, 3>::contiguous(o.data(), {1, kHq, kDim}),
                                            TensorView<float, 2>::contiguous(l.data(), {1, kHq}), Workspace{ws.data(), ws.size()}));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * kTokens * kHkv * kDim * 2 * 2);
}

template <class Backend>
void BM_SparseAttention(benchmark::State& state) {
  Step& s = step();
  Selection sel = make_selection<Backend>(static_cast<std::int32_t>(state.range(0)), static_cast<QuestGqa>(state.range(1)));
  std::vector<float> o(static_cast<std::size_t>(kHq) * kDim), l(kHq);
  std::vector<std::byte> ws(attend_pages_workspace<Backend>(kG, kPage, kDim));
  for (auto _ : state) {
    throw_if_error(selection_attention<Backend>(s.kv, s.queries(), sel.view(), 0.088f,
                                                TensorView<float, 3>::contiguous(o.data(), {1, kHq, kDim}),
                                                TensorView<float, 2>::contiguous(l.data(), {1, kHq}), Workspace{ws.data(), ws.size()}));
    benchmark::ClobberMemory();
  }
}

constexpr int kPerHead = static_cast<int>(QuestGqa::kPerQueryHead), kGroupSum = static_cast<int>(QuestGqa::kGroupSum);

#define KVP_QUEST_BENCHES(B, NAME)                                                                                            \
  BENCHMARK_TEMPLATE(BM_Estimate, B)->Name("estimate/" NAME)->Unit(benchmark::kMicrosecond);                                   \
  BENCHMARK_TEMPLATE(BM_TopK, B)->Name("topk/" NAME)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);                     \
  BENCHMARK_TEMPLATE(BM_Select, B)->Name("select/" NAME)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);                 \
  BENCHMARK_TEMPLATE(BM_DenseAttention, B)->Name("dense_attention/" NAME)->Unit(benchmark::kMillisecond);                       \
  BENCHMARK_TEMPLATE(BM_SparseAttention, B)                                                                                    \
      ->Name("sparse_attention/" NAME)                                                                                         \
      ->Args({1024, kPerHead})                                                                                                 \
      ->Args({4096, kPerHead})                                                                                                 \
      ->Args({4096, kGroupSum})                                                                                                \
      ->Unit(benchmark::kMillisecond)

BENCHMARK(BM_ReadBandwidth)->Name("read_bandwidth/32MiB")->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ScoresReadPass)->Name("scores_read_pass")->Unit(benchmark::kMicrosecond);
KVP_QUEST_BENCHES(backend::Scalar, "scalar");
#if KVP_BENCH_QUEST_CPU
KVP_QUEST_BENCHES(backend::Cpu, "cpu");
#endif

// ---- summary -------------------------------------------------------------------------

/// Console output plus the medians, kept for the summary.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> seconds;  // run name -> median (or only) time per iteration

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name != "median") continue;
      const double mult = benchmark::GetTimeUnitMultiplier(r.time_unit);
      seconds[r.run_name.str()] = r.GetAdjustedRealTime() / mult;
    }
  }
};

double get(const SummaryReporter& rep, const std::string& name) {
  const auto it = rep.seconds.find(name);
  return it == rep.seconds.end() ? NAN : it->second;
}

void summary(const SummaryReporter& rep) {
  Step& s = step();
  const double bw = s.meta_bytes() / get(rep, "read_bandwidth/32MiB");
  std::printf("\n== Quest decode step, 128K tokens (8192 pages x 16), head_dim 128, 32 q / 8 kv heads, fp16 ==\n");
  std::printf("read bandwidth (32 MiB, same size as the metadata): %.2f GB/s\n", bw / 1e9);
  for (const char* b : {"scalar", "cpu"}) {
    const std::string B = b;
    const double est = get(rep, "estimate/" + B);
    if (std::isnan(est)) continue;
    std::printf("[%s] estimate: %.1f us, %.2f GB/s = %.0f%% of read bandwidth\n", b, est * 1e6, s.meta_bytes() / est / 1e9,
                100.0 * s.meta_bytes() / est / bw);
    const double pass = get(rep, "scores_read_pass");
    for (int budget : {1024, 4096}) {
      const double tk = get(rep, "topk/" + B + "/" + std::to_string(budget));
      std::printf("[%s] top-%d of 8191 x 32 heads: %.1f us = %.2fx one read pass over the scores (%.1f us)\n", b, budget / kPage - 1,
                  tk * 1e6, tk / pass, pass * 1e6);
      std::printf("[%s] select (estimate + top-k + CSR), budget %d: %.1f us\n", b, budget,
                  get(rep, "select/" + B + "/" + std::to_string(budget)) * 1e6);
    }
    const double dense = get(rep, "dense_attention/" + B);
    for (auto [budget, mode, label] : {std::tuple{1024, kPerHead, "per-query-head"}, std::tuple{4096, kPerHead, "per-query-head"},
                                       std::tuple{4096, kGroupSum, "group-sum"}}) {
      const double sp = get(rep, "sparse_attention/" + B + "/" + std::to_string(budget) + "/" + std::to_string(mode));
      const double sel = get(rep, "select/" + B + "/" + std::to_string(budget));
      std::printf("[%s] sparse attention, budget %d (%s): %.2f ms vs dense %.2f ms: ratio %.3f (%.3f with select)\n", b, budget, label,
                  sp * 1e3, dense * 1e3, sp / dense, (sp + (mode == kPerHead ? sel : sel)) / dense);
    }
  }
  // Bytes read per step, from the selections themselves.
  for (auto [budget, mode, label] : {std::tuple{1024, QuestGqa::kPerQueryHead, "per-query-head"},
                                     std::tuple{4096, QuestGqa::kPerQueryHead, "per-query-head"},
                                     std::tuple{4096, QuestGqa::kGroupSum, "group-sum"}}) {
    Selection sel = make_selection<backend::Scalar>(budget, mode);
    StepBytes sb;
    throw_if_error(selection_bytes(s.table(), kPage, sel.view(), kHq, kHkv, kDim, sizeof(half), sizeof(half), budget / kPage, &sb));
    std::printf("bytes per step, budget %d (%s): metadata %.1f MiB + KV %.1f MiB vs dense %.1f MiB = %.4f "
                "(model 1/page_size + budget/length = %.4f)\n",
                budget, label, sb.metadata / 1048576.0, sb.kv / 1048576.0, sb.dense_kv / 1048576.0, sb.fraction(),
                quest_traffic_fraction(kTokens, kPage, budget));
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  step();  // build the cache outside the timed runs
  SummaryReporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  summary(rep);
  benchmark::Shutdown();
  return 0;
}
