// Quest at one decode step of a 128K-token sequence: 8192 pages of 16 tokens,
// head_dim 128, 32 query / 8 kv heads (GQA 4), fp16 keys, values and page
// metadata, an HND page pool with page ids scattered as in a real engine.
//
//   estimate      page_bounds for every kv head: reads 2 * head_dim metadata
//                 values per (page, kv head), 32 MiB per step; reported as a
//                 fraction of the peak probe's single-core read bandwidth
//                 (peak.hpp, DRAM) and of a read pass over a buffer of the
//                 metadata's size (the same cache level).
//   topk          Backend::topk of the 8191 bounds of each query head, against
//                 one read pass over the same scores (peak.hpp `read_pass`).
//   select        Quest::select end to end (estimate + top-k + CSR output; the
//                 step's Quest::plan is made once, outside the timed loop).
//   attention     decode attention over the selection vs over every page
//                 (eval/page_metrics.hpp `attend_pages`), per-query-head rows.
//
// Times are thread CPU time (the machine may be shared; the peak probe uses
// the same clock). After the runs a summary prints the medians and the
// ratios the issue asks for, plus the bytes a step reads with the selection
// vs dense attention.
#include <benchmark/benchmark.h>

#include <time.h>

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
#if KVP_BENCH_HAVE_PEAK
#include "peak.hpp"
#endif
#if KVP_BENCH_QUEST_CPU
#include "kvpolicy/backends/cpu.hpp"
#endif

using namespace kvpolicy;

#if !KVP_BENCH_HAVE_PEAK
// Without the shared peak probe (benchmarks/peak.hpp): the same two measures,
// locally and more simply (8 float accumulators, best of 3 over 1 GiB).
namespace kvp_bench {
struct Peak {
  double read_bytes_per_second = 0;
  std::size_t read_buffer_bytes = 0;
  double fma_flops_per_second = 0;
  const char* fma_isa = "not measured";
};
inline float read_pass(const float* p, std::size_t n) noexcept {
  float a[8] = {};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  for (; i < n; ++i) a[0] += p[i];
  return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}
inline const Peak& peak() {
  static const Peak p = [] {
    Peak r;
    r.read_buffer_bytes = std::size_t{1} << 30;
    std::vector<float> buf(r.read_buffer_bytes / 4, 1.0f);
    double best = 1e30;
    for (int i = 0; i < 3; ++i) {
      timespec t0, t1;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
      benchmark::DoNotOptimize(read_pass(buf.data(), buf.size()));
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
      best = std::min(best, static_cast<double>(t1.tv_sec - t0.tv_sec) + 1e-9 * static_cast<double>(t1.tv_nsec - t0.tv_nsec));
    }
    r.read_bytes_per_second = static_cast<double>(r.read_buffer_bytes) / best;
    return r;
  }();
  return p;
}
}  // namespace kvp_bench
#endif

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
    // HND: each (page, kv head) block of 16 rows is contiguous, which is what a
    // per-kv-head kernel streams (with NHD it would read 1/8 of every line run).
    const PageStrides st = PageStrides::contiguous(PageLayout::kHND, kHkv, kPage, kDim);
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
    throw_if_error(Quest{}.on_append(Context<backend::Scalar>{}, AppendInput<half>{kv, nullptr}, mview));  // every page
    mv = mview;
    scores.resize(static_cast<std::size_t>(kHq) * kScored);
  }
  PageTable table() const { return PageTable{indptr.data(), indices.data(), last.data(), 1}; }
  TensorView<const float, 3> queries() const { return TensorView<const float, 3>::contiguous(q.data(), {1, kHq, kDim}); }
  /// The decode step Quest selects for: layer 2 (sparse with Quest's 2 dense layers).
  DecodeInput<float> decode_input() const { return DecodeInput<float>{queries(), table(), kPage, 2}; }
  template <class Backend>
  static Quest::Plan plan(const Quest& quest, const DecodeInput<float>& in) {
    Quest::Plan p;
    throw_if_error(quest.plan(Context<Backend>{}, in, ProblemShape{.num_q_heads = kHq, .num_kv_heads = kHkv, .head_dim = kDim}, p));
    return p;
  }
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
  // One vectorised read pass (peak.hpp) over a buffer the size of the metadata.
  static std::vector<float> buf(static_cast<std::size_t>(step().meta_bytes() / 4), 1.0f);
  for (auto _ : state) benchmark::DoNotOptimize(kvp_bench::read_pass(buf.data(), buf.size()));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(buf.size() * 4));
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
  state.counters["pct_peak_bw"] =
      benchmark::Counter(100.0 * s.meta_bytes() * static_cast<double>(state.iterations()) / kvp_bench::peak().read_bytes_per_second,
                         benchmark::Counter::kIsRate);
}

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

/// Copies of the metadata filling as much memory as the peak probe's read
/// buffer: cycling through them, every estimate reads cold data (at 128K
/// tokens a model's 32 layers hold ~1 GiB of metadata, so a real step does
/// stream it from memory).
struct ColdMeta {
  std::vector<std::vector<half>> copies;
  ColdMeta() {
    const std::size_t bytes = step().meta.size() * sizeof(half);
    const std::size_t n = std::clamp<std::size_t>(kvp_bench::peak().read_buffer_bytes / bytes, 4, 128);
    copies.assign(n, step().meta);
  }
  PageMetaView<const half> view(std::size_t i) const {
    return PageMetaView<half>::contiguous(const_cast<half*>(copies[i % copies.size()].data()), kPages, kHkv, kDim);
  }
};
ColdMeta& cold_meta() {
  static ColdMeta c;
  return c;
}

/// One read of the metadata blocks of `pages` (page_bytes each, page_stride
/// apart) in the given order, each block front to back, with the same block of
/// the page 4 ahead prefetched line by line alongside: what memory delivers for
/// the estimate's access pattern (best of the variants tried: hints T0 / T1,
/// 1 to 16 pages ahead, 1 to 32 blocks interleaved).
float read_pages(const char* base, const std::int32_t* pages, std::int64_t n, std::size_t page_bytes, std::size_t page_stride) {
  float a[16] = {};
  for (std::int64_t i = 0; i < n; ++i) {
    const auto* p = reinterpret_cast<const float*>(base + static_cast<std::size_t>(pages[i]) * page_stride);
    const char* f = i + 4 < n ? base + static_cast<std::size_t>(pages[i + 4]) * page_stride : nullptr;
    for (std::size_t o = 0; o < page_bytes / 4; o += 16) {
      if (f != nullptr) asm volatile("prefetcht0 %0" : : "m"(f[o * 4]));
      for (int j = 0; j < 16; ++j) a[j] += p[o + static_cast<std::size_t>(j)];
    }
  }
  float t = 0.0f;
  for (float x : a) t += x;
  return t;
}

/// Paired measurement on cold data: each iteration times, each on another copy
/// of the metadata, the estimate, a read pass (peak.hpp) and `read_pages` over
/// the estimate's pages in its order, all thread CPU time; the best of each is
/// kept, so their ratios are what the estimate achieves of the read bandwidth
/// and of what memory gives for its access pattern under the same conditions.
/// Arg 0: the step's scattered page ids (as an engine's page table has them);
/// 1: the same pages in id order (metadata stored in sequence order).
template <class Backend>
void BM_EstimateVsRead(benchmark::State& state) {
  Step& s = step();
  ColdMeta& cm = cold_meta();
  auto ws = estimate_ws<Backend>();
  std::vector<std::int32_t> in_order(static_cast<std::size_t>(kScored));
  std::iota(in_order.begin(), in_order.end(), 0);
  const std::int32_t* pages = state.range(0) == 0 ? s.indices.data() : in_order.data();
  const std::size_t page_bytes = static_cast<std::size_t>(2 * kHkv * kDim) * sizeof(half);
  double best_est = 1e30, best_read = 1e30, best_pages = 1e30;
  std::size_t i = 0;
  const std::size_t nc = cm.copies.size();
  for (auto _ : state) {
    const double t0 = thread_seconds();
    Backend::page_bounds(s.q.data(), kG, kDim, cm.view(i), pages, kScored, s.scores.data(), kScored, Workspace{ws.data(), ws.size()});
    const double t1 = thread_seconds();
    const auto& other = cm.copies[(i + nc / 3) % nc];
    benchmark::DoNotOptimize(kvp_bench::read_pass(reinterpret_cast<const float*>(other.data()), other.size() / 2));
    const double t2 = thread_seconds();
    const auto& third = cm.copies[(i + 2 * nc / 3) % nc];
    benchmark::DoNotOptimize(read_pages(reinterpret_cast<const char*>(third.data()), pages, kScored, page_bytes, page_bytes));
    const double t3 = thread_seconds();
    best_est = std::min(best_est, t1 - t0);
    best_read = std::min(best_read, t2 - t1);
    best_pages = std::min(best_pages, t3 - t2);
    ++i;
  }
  state.counters["est_GBps"] = s.meta_bytes() / best_est / 1e9;
  state.counters["read_GBps"] = s.meta_bytes() / best_read / 1e9;
  state.counters["pages_GBps"] = s.meta_bytes() / best_pages / 1e9;
  state.counters["pct_read_bw"] = 100.0 * best_read / best_est;
  state.counters["pct_pattern_bw"] = 100.0 * best_pages / best_est;
}

/// The page scores of one decode step and the buffers of a top-k keeping `budget` tokens' pages.
template <class Backend>
struct TopKCase {
  Step& s = step();
  std::int64_t k;
  std::vector<std::byte> ws;
  std::vector<std::int32_t> out;
  explicit TopKCase(std::int64_t budget) : k(budget / kPage - 1), ws(Backend::topk_workspace(kScored)), out(static_cast<std::size_t>(k)) {
    auto ews = estimate_ws<Backend>();
    estimate<Backend>(s, Workspace{ews.data(), ews.size()});
  }
  void all_heads() {
    for (std::int32_t h = 0; h < kHq; ++h)
      Backend::topk(s.scores.data() + static_cast<std::size_t>(h) * kScored, kScored, k, out.data(), Workspace{ws.data(), ws.size()});
  }
};

/// Paired: top-k of all 32 heads vs one read pass over the same scores.
template <class Backend>
void BM_TopKVsPass(benchmark::State& state) {
  TopKCase<Backend> c(state.range(0));
  Step& s = c.s;
  double best_topk = 1e30, best_pass = 1e30;
  for (auto _ : state) {
    const double t0 = thread_seconds();
    c.all_heads();
    const double t1 = thread_seconds();
    benchmark::DoNotOptimize(kvp_bench::read_pass(s.scores.data(), s.scores.size()));
    const double t2 = thread_seconds();
    best_topk = std::min(best_topk, t1 - t0);
    best_pass = std::min(best_pass, t2 - t1);
  }
  state.counters["topk_us"] = best_topk * 1e6;
  state.counters["pass_us"] = best_pass * 1e6;
  state.counters["topk_over_pass"] = best_topk / best_pass;
}

template <class Backend>
void BM_TopK(benchmark::State& state) {
  TopKCase<Backend> c(state.range(0));
  for (auto _ : state) {
    c.all_heads();
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * kHq * kScored * 4);
}

/// One read pass over the same 32 x 8191 scores.
void BM_ScoresReadPass(benchmark::State& state) {
  Step& s = step();
  for (auto _ : state) benchmark::DoNotOptimize(kvp_bench::read_pass(s.scores.data(), s.scores.size()));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * kHq * kScored * 4);
}

template <class Backend>
void BM_Select(benchmark::State& state) {
  Step& s = step();
  const Quest quest(QuestParams{.budget = Budget::tokens(static_cast<std::int32_t>(state.range(0)))});
  const DecodeInput<float> in = s.decode_input();
  const Quest::Plan plan = s.plan<Backend>(quest, in);  // host work per batch composition, outside the timed loop
  const std::int64_t rows = plan.requirements.output.rows;
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(rows + 1)), last(static_cast<std::size_t>(rows)),
      idx(static_cast<std::size_t>(plan.requirements.output.capacity));
  const PageSelection sel{indptr.data(), idx.data(), last.data(), nullptr, rows, static_cast<std::int64_t>(idx.size())};
  std::vector<std::byte> ws(plan.requirements.workspace_bytes);
  const Context<Backend> cx{Workspace{ws.data(), ws.size()}};
  for (auto _ : state) {
    throw_if_error(quest.select(cx, plan, in, s.mv, sel));
    benchmark::ClobberMemory();
  }
}

// ---- attention ---------------------------------------------------------------------

struct Selection {
  std::vector<std::int32_t> indptr, last, idx;
  PageSelection view() {
    return PageSelection{
        indptr.data(), idx.data(), last.data(), nullptr, static_cast<std::int64_t>(last.size()), static_cast<std::int64_t>(idx.size())};
  }
};

template <class Backend>
Selection make_selection(std::int32_t token_budget, QuestGqa mode) {
  Step& s = step();
  const Quest quest(QuestParams{.budget = Budget::tokens(token_budget), .gqa = mode});
  const DecodeInput<float> in = s.decode_input();
  const Quest::Plan plan = s.plan<Backend>(quest, in);
  Selection out;
  out.indptr.resize(static_cast<std::size_t>(plan.requirements.output.rows + 1));
  out.last.resize(static_cast<std::size_t>(plan.requirements.output.rows));
  out.idx.resize(static_cast<std::size_t>(plan.requirements.output.capacity));
  std::vector<std::byte> ws(plan.requirements.workspace_bytes);
  throw_if_error(quest.select(Context<Backend>{Workspace{ws.data(), ws.size()}}, plan, in, s.mv, out.view()));
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

#define KVP_QUEST_SELECT_BENCHES(B, NAME)                                                                  \
  BENCHMARK_TEMPLATE(BM_Estimate, B)->Name("estimate/" NAME)->Unit(benchmark::kMicrosecond);               \
  BENCHMARK_TEMPLATE(BM_TopK, B)->Name("topk/" NAME)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond); \
  BENCHMARK_TEMPLATE(BM_Select, B)->Name("select/" NAME)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond)

BENCHMARK(BM_ReadBandwidth)->Name("read_bandwidth/32MiB")->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ScoresReadPass)->Name("scores_read_pass")->Unit(benchmark::kMicrosecond);
KVP_QUEST_SELECT_BENCHES(backend::Scalar, "scalar");
#if KVP_BENCH_QUEST_CPU
KVP_QUEST_SELECT_BENCHES(backend::Cpu, "cpu");
BENCHMARK_TEMPLATE(BM_EstimateVsRead, backend::Cpu)
    ->Name("estimate_vs_read_cold/cpu")
    ->ArgName("in_order")
    ->Arg(0)
    ->Arg(1)
    ->Iterations(24)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_TopKVsPass, backend::Cpu)
    ->Name("topk_vs_pass/cpu")
    ->Arg(1024)
    ->Arg(4096)
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);
// Attention at 128K x 32 heads: the CPU backend only (the scalar reference takes seconds).
BENCHMARK_TEMPLATE(BM_DenseAttention, backend::Cpu)->Name("dense_attention/cpu")->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_SparseAttention, backend::Cpu)
    ->Name("sparse_attention/cpu")
    ->Args({1024, kPerHead})
    ->Args({4096, kPerHead})
    ->Args({4096, kGroupSum})
    ->Unit(benchmark::kMillisecond);
#endif

// ---- summary -------------------------------------------------------------------------

/// Console output plus the medians, kept for the summary.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> seconds;  // run name -> median (or only) time per iteration
  std::map<std::string, benchmark::UserCounters> counters;

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name != "median") continue;
      const double mult = benchmark::GetTimeUnitMultiplier(r.time_unit);
      std::string key = r.run_name.function_name;  // without the repetitions / min_time suffixes
      if (!r.run_name.args.empty()) key += "/" + r.run_name.args;
      seconds[key] = r.GetAdjustedCPUTime() / mult;  // thread CPU time, like the peak probe
      counters[key] = r.counters;
    }
  }
};

double counter(const SummaryReporter& rep, const std::string& name, const std::string& c) {
  const auto it = rep.counters.find(name);
  if (it == rep.counters.end()) return NAN;
  const auto jt = it->second.find(c);
  return jt == it->second.end() ? NAN : jt->second.value;
}

double get(const SummaryReporter& rep, const std::string& name) {
  const auto it = rep.seconds.find(name);
  return it == rep.seconds.end() ? NAN : it->second;
}

void summary(const SummaryReporter& rep) {
  Step& s = step();
  const double bw = s.meta_bytes() / get(rep, "read_bandwidth/32MiB");
  const kvp_bench::Peak& pk = kvp_bench::peak();
  std::printf("\n== Quest decode step, 128K tokens (8192 pages x 16), head_dim 128, 32 q / 8 kv heads, fp16 (CPU time, medians) ==\n");
  std::printf("peak probe: read bandwidth %.2f GB/s (%.0f MiB buffer), FMA %.1f GFLOP/s (%s); read pass over 32 MiB: %.2f GB/s\n",
              pk.read_bytes_per_second / 1e9, static_cast<double>(pk.read_buffer_bytes) / 1048576.0, pk.fma_flops_per_second / 1e9,
              pk.fma_isa, bw / 1e9);
  for (const char* b : {"scalar", "cpu"}) {
    const std::string B = b;
    const double est = get(rep, "estimate/" + B);
    if (std::isnan(est)) continue;
    std::printf("[%s] estimate: %.1f us, %.2f GB/s = %.0f%% of the peak read bandwidth, %.0f%% of a 32 MiB read pass\n", b, est * 1e6,
                s.meta_bytes() / est / 1e9, 100.0 * s.meta_bytes() / est / pk.read_bytes_per_second, 100.0 * s.meta_bytes() / est / bw);
    if (B == "cpu") {
      for (int in_order : {0, 1}) {
        const std::string cold = "estimate_vs_read_cold/cpu/in_order:" + std::to_string(in_order);
        std::printf(
            "[cpu] estimate on cold metadata, page ids %s (paired, best of 24): %.2f GB/s vs read pass %.2f GB/s = %.0f%% of the read "
            "bandwidth; vs %.2f GB/s reading the same pages in the same order = %.0f%% of that pattern's bandwidth\n",
            in_order ? "in order" : "scattered", counter(rep, cold, "est_GBps"), counter(rep, cold, "read_GBps"),
            counter(rep, cold, "pct_read_bw"), counter(rep, cold, "pages_GBps"), counter(rep, cold, "pct_pattern_bw"));
      }
      for (int budget : {1024, 4096}) {
        const std::string n = "topk_vs_pass/cpu/" + std::to_string(budget);
        std::printf("[cpu] top-%d x 32 heads (paired, best of 200): %.1f us vs one read pass over the scores %.1f us = %.2fx\n",
                    budget / kPage - 1, counter(rep, n, "topk_us"), counter(rep, n, "pass_us"), counter(rep, n, "topk_over_pass"));
      }
    }
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
      if (std::isnan(sp)) continue;
      std::printf("[%s] sparse attention, budget %d (%s): %.2f ms vs dense %.2f ms: ratio %.3f (%.3f with select)\n", b, budget, label,
                  sp * 1e3, dense * 1e3, sp / dense, (sp + sel) / dense);
    }
  }
  // Bytes read per step, from the selections themselves.
  for (auto [budget, mode, label] :
       {std::tuple{1024, QuestGqa::kPerQueryHead, "per-query-head"}, std::tuple{4096, QuestGqa::kPerQueryHead, "per-query-head"},
        std::tuple{4096, QuestGqa::kGroupSum, "group-sum"}}) {
    Selection sel = make_selection<backend::Scalar>(budget, mode);
    StepBytes sb;
    throw_if_error(selection_bytes(s.table(), kPage, sel.view(), kHq, kHkv, kDim, sizeof(half), sizeof(half), budget / kPage, &sb));
    std::printf(
        "bytes per step, budget %d (%s): metadata %.1f MiB + KV %.1f MiB vs dense %.1f MiB = %.4f "
        "(model 1/page_size + budget/length = %.4f)\n",
        budget, label, sb.metadata / 1048576.0, sb.kv / 1048576.0, sb.dense_kv / 1048576.0, sb.fraction(),
        quest_traffic_fraction(kTokens, kPage, budget));
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  step();             // build the cache outside the timed runs
  kvp_bench::peak();  // and measure the peaks once
  SummaryReporter rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  summary(rep);
  benchmark::Shutdown();
  return 0;
}
