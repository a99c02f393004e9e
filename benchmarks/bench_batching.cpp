// Many sequences per call: 64 sequences x 8192 tokens decided in one call, a
// tensor-parallel rank's shape (8 query / 2 kv heads, head_dim 128), fp16 keys
// and queries, on backend::Cpu with 1 and 2 threads:
//
//   snapkv/batch      SnapKV::evict over the 64 sequences (SnapKVPress r=.5, w=64).
//   pyramidkv/batch   PyramidKV::evict (layer 8 of 32), i.e. Budgeted<SnapKV, LayerAllocation>.
//   quest/batch       Quest::select at one decode step over a paged table of
//                     64 x 512 pages of 16 tokens (fp16 metadata, page ids
//                     scattered; the plan is made once, outside the loop).
//   */loop            the same work as 64 one-sequence calls in a loop (what an
//                     engine without batched entry points does); with 2 kv heads
//                     per rank such a call has 2 items, so the loop is also run
//                     with 1 kv head (hkv1: 4 query heads, a TP-8 rank of a
//                     32/8 model), where it leaves a second thread idle.
//
// Times are wall-clock (the point is the scaling), medians of 3 repetitions;
// the machine may be shared, so the summary also prints the load average.
// Counters: tokens/s (sequences x tokens per second), pct_peak_fma for the
// SnapKV family (window dot products 2 * Hq * w * T * d per sequence, against
// threads x the single-core FMA peak of peak.hpp), pct_peak_bw for Quest (the
// 2 * d metadata values per (page, kv head) it reads, against the single-core
// read bandwidth). The summary prints the 2-thread / 1-thread ratios and
// batch / loop ratios.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "peak.hpp"

using namespace kvpolicy;

namespace {

constexpr std::int64_t kSeqs = 64, kT = 8192, kD = 128, kW = 64, kPage = 16, kPages = kT / kPage;

/// (Hq, Hkv) = (8, 2) or (4, 1); keys (Hkv, T, d) per sequence in one buffer, queries (Hq, w, d).
struct Prefill {
  std::int64_t hq, hkv;
  std::vector<half> keys, q;
  std::vector<ScoreInput<half, half>> batch;
  Prefill(std::int64_t Hq, std::int64_t Hkv) : hq(Hq), hkv(Hkv), keys(kSeqs * Hkv * kT * kD), q(kSeqs * Hq * kW * kD) {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    for (auto& x : keys) x = to_half(nd(rng) * 0.5f);
    for (auto& x : q) x = to_half(nd(rng));
    for (std::int64_t b = 0; b < kSeqs; ++b)
      batch.push_back({TensorView<const half, 3>::contiguous(q.data() + b * Hq * kW * kD, {Hq, kW, kD}),
                       KVSource<half>::from(TensorView<const half, 3>::contiguous(keys.data() + b * Hkv * kT * kD, {Hkv, kT, kD}))});
  }
};

const Prefill& prefill(std::int64_t hkv) {
  static const Prefill p82(8, 2), p41(4, 1);
  return hkv == 2 ? p82 : p41;
}

/// One decode step's Quest inputs: metadata of 64 x 512 pages in a shuffled pool, queries (64, Hq, d).
struct Decode {
  std::vector<half> meta, q;
  std::vector<std::int32_t> indptr, indices, last;
  Decode() : meta(PageMetaView<half>::contiguous_size(kSeqs * kPages, 2, kD)), q(kSeqs * 8 * kD) {
    std::mt19937 rng(11);
    std::normal_distribution<float> nd;
    const std::size_t per = 2 * kD;  // (max, min) rows of one (page, kv head)
    for (std::size_t i = 0; i < meta.size(); i += per)
      for (std::size_t c = 0; c < static_cast<std::size_t>(kD); ++c) {
        const float a = nd(rng), b = nd(rng);
        meta[i + c] = to_half(std::max(a, b));
        meta[i + kD + c] = to_half(std::min(a, b));
      }
    for (auto& x : q) x = to_half(nd(rng));
    indices.resize(kSeqs * kPages);
    std::iota(indices.begin(), indices.end(), 0);
    std::shuffle(indices.begin(), indices.end(), rng);
    for (std::int64_t b = 0; b <= kSeqs; ++b) indptr.push_back(static_cast<std::int32_t>(b * kPages));
    last.assign(kSeqs, static_cast<std::int32_t>(kPage));
  }
  PageMetaView<const half> view() const {
    return PageMetaView<const half>::contiguous(meta.data(), static_cast<std::int32_t>(kSeqs * kPages), 2, static_cast<std::int32_t>(kD));
  }
  /// Sequences [b0, b0 + n) of the table (pointers into the whole table's arrays).
  DecodeInput<half> input(std::int64_t b0, std::int64_t n, std::vector<std::int32_t>& ptr) const {
    ptr.assign(indptr.begin() + b0, indptr.begin() + b0 + n + 1);
    for (auto& p : ptr) p -= indptr[static_cast<std::size_t>(b0)];
    return DecodeInput<half>{
        TensorView<const half, 3>::contiguous(q.data() + b0 * 8 * kD, {n, 8, kD}),
        PageTable{ptr.data(), indices.data() + indptr[static_cast<std::size_t>(b0)], last.data() + b0, static_cast<std::int32_t>(n)},
        static_cast<std::int32_t>(kPage), 4};
  }
};

const Decode& decode() {
  static const Decode d;
  return d;
}

void report(benchmark::State& st, int threads, double flops, double bytes) {
  st.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kSeqs * kT), benchmark::Counter::kIsIterationInvariantRate);
  if (flops > 0)
    st.counters["pct_peak_fma"] = benchmark::Counter(100.0 * flops / (kvp_bench::peak().fma_flops_per_second * threads),
                                                     benchmark::Counter::kIsIterationInvariantRate);
  if (bytes > 0)
    st.counters["pct_peak_bw"] =
        benchmark::Counter(100.0 * bytes / kvp_bench::peak().read_bytes_per_second, benchmark::Counter::kIsIterationInvariantRate);
}

/// state.range(0): threads; range(1): 1 = one batched call, 0 = per-sequence calls in a loop; range(2): kv heads.
template <class Policy>
void run_evict(benchmark::State& st, const Policy& policy) {
  const int threads = static_cast<int>(st.range(0));
  const bool batched = st.range(1) == 1;
  const Prefill& in = prefill(st.range(2));
  ThreadPool pool(threads);
  const std::int64_t n = batched ? kSeqs : 1;
  const ProblemShape shape{.num_q_heads = in.hq, .num_kv_heads = in.hkv, .head_dim = kD, .max_kv_len = kT, .q_len = kW, .batch = n};
  const Requirements req = policy.requirements(Context<backend::Cpu>{{}, pool.context()}, shape);
  if (!req) {
    st.SkipWithError(req.status.message());
    return;
  }
  std::vector<std::byte> ws(req.workspace_bytes);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(req.output.rows + 1)), indices(static_cast<std::size_t>(req.output.capacity));
  const KeepSet keep{indptr.data(), indices.data(), req.output.rows, req.output.capacity};
  const Context<backend::Cpu> cx{Workspace{ws.data(), ws.size()}, pool.context()};
  for (auto _ : st) {
    for (std::int64_t b = 0; b < kSeqs; b += n) {
      const Status s = policy.evict(cx, std::span<const ScoreInput<half, half>>(in.batch.data() + b, static_cast<std::size_t>(n)), keep);
      if (!s.is_ok()) {
        st.SkipWithError(s.message());
        return;
      }
      benchmark::DoNotOptimize(indices.data());
    }
    benchmark::ClobberMemory();
  }
  report(st, threads, 2.0 * static_cast<double>(in.hq * kW * kT * kD) * kSeqs, 0);
}

void BM_SnapKV(benchmark::State& st) { run_evict(st, SnapKV(SnapKVParams::kvpress(0.5, kW, 5))); }
void BM_PyramidKV(benchmark::State& st) { run_evict(st, PyramidKV(PyramidKVParams::kvpress(0.5, 8, 32, kW, 5))); }

void BM_Quest(benchmark::State& st) {
  const int threads = static_cast<int>(st.range(0));
  const bool batched = st.range(1) == 1;
  const Decode& dec = decode();
  ThreadPool pool(threads);
  QuestParams qp;
  qp.budget = Budget::tokens(1024);
  const Quest quest(qp);
  const std::int64_t n = batched ? kSeqs : 1;
  // One plan per call shape (the batch, or each sequence alone), made outside the timed loop.
  std::vector<std::vector<std::int32_t>> ptrs(static_cast<std::size_t>(kSeqs / n));
  std::vector<DecodeInput<half>> steps;
  std::vector<Quest::Plan> plans;
  std::size_t ws_bytes = 0;
  std::int64_t rows = 0, cap = 0;
  for (std::int64_t b = 0; b < kSeqs; b += n) {
    steps.push_back(dec.input(b, n, ptrs[static_cast<std::size_t>(b / n)]));
    plans.emplace_back();
    const Status s = quest.plan(Context<backend::Cpu>{{}, pool.context()}, steps.back(),
                                ProblemShape{.num_q_heads = 8, .num_kv_heads = 2, .head_dim = kD}, plans.back());
    if (!s.is_ok()) {
      st.SkipWithError(s.message());
      return;
    }
    ws_bytes = std::max(ws_bytes, plans.back().requirements.workspace_bytes);
    rows = std::max(rows, plans.back().requirements.output.rows);
    cap = std::max(cap, plans.back().requirements.output.capacity);
  }
  std::vector<std::byte> ws(ws_bytes);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(rows + 1)), indices(static_cast<std::size_t>(cap)),
      lastp(static_cast<std::size_t>(rows));
  const PageSelection out{indptr.data(), indices.data(), lastp.data(), nullptr, rows, cap};
  const Context<backend::Cpu> cx{Workspace{ws.data(), ws.size()}, pool.context()};
  for (auto _ : st) {
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Status s = quest.select(cx, plans[i], steps[i], dec.view(), out);
      if (!s.is_ok()) {
        st.SkipWithError(s.message());
        return;
      }
      benchmark::DoNotOptimize(indices.data());
    }
    benchmark::ClobberMemory();
  }
  report(st, threads, 0, static_cast<double>(kSeqs * (kPages - 1) * 2 * 2 * kD * sizeof(half)));
}

void evict_args(benchmark::internal::Benchmark* b) {
  for (int batched : {1, 0})
    for (int threads : {1, 2}) b->Args({threads, batched, 2});
  for (int batched : {1, 0}) b->Args({2, batched, 1});  // hkv1: where per-sequence calls leave a thread idle
  b->ArgNames({"threads", "batched", "hkv"});
}

BENCHMARK(BM_SnapKV)->Name("snapkv")->Apply(evict_args)->Unit(benchmark::kMillisecond)->UseRealTime()->Repetitions(3);
BENCHMARK(BM_PyramidKV)->Name("pyramidkv")->Apply(evict_args)->Unit(benchmark::kMillisecond)->UseRealTime()->Repetitions(3);
BENCHMARK(BM_Quest)
    ->Name("quest")
    ->Args({1, 1})
    ->Args({2, 1})
    ->Args({1, 0})
    ->Args({2, 0})
    ->ArgNames({"threads", "batched"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Repetitions(3);

/// Keeps every repetition's time and counters for the summary's medians.
class Summary : public benchmark::ConsoleReporter {
 public:
  struct Sample {
    std::vector<double> ms, tokens, pct;
  };
  std::map<std::string, Sample> runs;
  void ReportRuns(const std::vector<Run>& rs) override {
    for (const auto& r : rs) {
      if (r.error_occurred || r.run_type != Run::RT_Iteration) continue;
      std::string name = r.run_name.str();  // without "/repeats:N", so that names are those of the summary
      if (const auto at = name.find("/repeats:"); at != std::string::npos) name.erase(at, name.find('/', at + 1) - at);
      Sample& s = runs[name];
      s.ms.push_back(r.GetAdjustedRealTime());
      if (auto it = r.counters.find("tokens/s"); it != r.counters.end()) s.tokens.push_back(it->second.value);
      for (const char* k : {"pct_peak_fma", "pct_peak_bw"})
        if (auto it = r.counters.find(k); it != r.counters.end()) s.pct.push_back(it->second.value);
    }
    ConsoleReporter::ReportRuns(rs);
  }
};

/// Read bandwidth of one core and of two cores at once (each thread a read pass over its own 256 MiB buffer,
/// wall time, best of 3): the ceiling of the 2-thread speed-up of a decision that streams memory, as Quest's
/// page-bounds estimate does.
std::pair<double, double> read_bandwidth_1_2() {
  const std::size_t n = (std::size_t{256} << 20) / sizeof(float);
  std::vector<float> a(n, 1.0f), b(n, 1.0f);
  double one = 0, two = 0;
  for (int r = 0; r < 3; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(kvp_bench::read_pass(a.data(), n));
    auto t1 = std::chrono::steady_clock::now();
    std::thread other([&] { benchmark::DoNotOptimize(kvp_bench::read_pass(b.data(), n)); });
    benchmark::DoNotOptimize(kvp_bench::read_pass(a.data(), n));
    other.join();
    auto t2 = std::chrono::steady_clock::now();
    one = std::max(one, static_cast<double>(n * sizeof(float)) / std::chrono::duration<double>(t1 - t0).count());
    two = std::max(two, 2.0 * static_cast<double>(n * sizeof(float)) / std::chrono::duration<double>(t2 - t1).count());
  }
  return {one, two};
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("backend::Cpu ISA: %s; peak FMA %.1f GFLOP/s, read %.1f GB/s (one core)\n", backend::Cpu::isa_name(),
              kvp_bench::peak().fma_flops_per_second * 1e-9, kvp_bench::peak().read_bytes_per_second * 1e-9);
  Summary rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  benchmark::Shutdown();
  double load[3] = {0, 0, 0};
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = load[1] = load[2] = 0;
    std::fclose(f);
  }
  std::printf("\nsummary: medians of %lld sequences x %lld tokens per call (load average %.2f %.2f %.2f)\n", static_cast<long long>(kSeqs),
              static_cast<long long>(kT), load[0], load[1], load[2]);
  for (const auto& [name, s] : rep.runs)
    std::printf("  %-44s %9.2f ms  %8.2f Mtok/s  %6.1f %% of peak\n", name.c_str(), median(s.ms), median(s.tokens) * 1e-6, median(s.pct));
  auto ms = [&](const std::string& n) { return rep.runs.count(n) ? median(rep.runs[n].ms) : 0.0; };
  std::printf("ratios (speed-up, time of the first / time of the second):\n");
  for (const char* p : {"snapkv", "pyramidkv"}) {
    const std::string b = p;
    const double t1 = ms(b + "/threads:1/batched:1/hkv:2/real_time"), t2 = ms(b + "/threads:2/batched:1/hkv:2/real_time");
    const double l2 = ms(b + "/threads:2/batched:0/hkv:2/real_time"), l1 = ms(b + "/threads:1/batched:0/hkv:2/real_time");
    const double h1b = ms(b + "/threads:2/batched:1/hkv:1/real_time"), h1l = ms(b + "/threads:2/batched:0/hkv:1/real_time");
    if (t1 > 0 && t2 > 0) std::printf("  %-10s batch, 1 thread / 2 threads: %.2f\n", p, t1 / t2);
    if (l1 > 0 && l2 > 0) std::printf("  %-10s loop,  1 thread / 2 threads: %.2f\n", p, l1 / l2);
    if (l2 > 0 && t2 > 0) std::printf("  %-10s 2 threads, loop / batch (hkv 2): %.2f\n", p, l2 / t2);
    if (h1l > 0 && h1b > 0) std::printf("  %-10s 2 threads, loop / batch (hkv 1): %.2f\n", p, h1l / h1b);
  }
  const double q1 = ms("quest/threads:1/batched:1/real_time"), q2 = ms("quest/threads:2/batched:1/real_time");
  const double ql = ms("quest/threads:2/batched:0/real_time");
  if (q1 > 0 && q2 > 0) std::printf("  quest      batch, 1 thread / 2 threads: %.2f\n", q1 / q2);
  if (ql > 0 && q2 > 0) std::printf("  quest      2 threads, loop / batch: %.2f\n", ql / q2);
  const auto [bw1, bw2] = read_bandwidth_1_2();
  std::printf(
      "read bandwidth, one core %.1f GB/s, two cores at once %.1f GB/s: %.2fx (the ceiling of a memory-bound decision's "
      "2-thread speed-up on this machine)\n",
      bw1 * 1e-9, bw2 * 1e-9, bw2 / bw1);
  return 0;
}
