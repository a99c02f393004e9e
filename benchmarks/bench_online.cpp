// Online eviction at one decode step with 32K cached tokens, 32 query / 8 kv
// heads (GQA 4), engine-provided fp32 probabilities of the step's query.
//
//   h2o/update    H2O::update: a streaming add of the (32, 1, 32768) probability
//                 rows into the (8, 32768) state (reads 4 MiB + 1 MiB, writes 1 MiB).
//   h2o/evict     H2O::evict of the one slot the step added: one min pass over
//                 the candidates, a memmove of the state tail, the KeepSet rows
//                 (8 x 32767 int32, written, 1 MiB) for apply/.
//   h2o/step      update + evict, the per-step cost an engine pays.
//   tova/step     TOVA::select_from_attention at cache_size 32767 (head mean of
//                 the 32 rows + one argmin + KeepSet rows).
//   read/<bytes>  a plain read pass (8 accumulators, summed) over a buffer as
//                 large as what the step touches: the read bandwidth at the same
//                 cache level, measured in this process.
//
// Times are CPU time (the default of Google Benchmark): on a shared machine
// wall time also counts the time the thread waits for a core. Each run reports
// bytes_per_second counting the traffic a step cannot avoid
// (inputs read once, state read and written once, KeepSet written once; the
// evict memmove is not counted), and the summary prints the medians as a
// fraction of the measured read bandwidth.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"

#if __has_include("peak.hpp")
#include "peak.hpp"
#define KVP_BENCH_HAVE_PEAK 1
#endif

using namespace kvpolicy;

namespace {

constexpr std::int64_t kN = 32768, kHq = 32, kHkv = 8, kRecent = 1024;

struct Step {
  std::vector<float> probs, state, state0;
  std::vector<std::int32_t> indptr, indices;
  std::vector<std::byte> ws;
  H2O h2o{H2OParams::original(kN - 1 - kRecent, kRecent)};  // cache of kN - 1: every step evicts one slot
  TOVA tova{TOVAParams::original(kN - 1)};

  Step() : probs(kHq * kN), state(kHkv * kN), state0(kHkv * kN), indptr(kHkv + 1), indices(kHkv * kN) {
    std::mt19937 rng(7);
    std::exponential_distribution<float> ex(1.0f);
    for (auto& p : probs) p = ex(rng) / static_cast<float>(kN);  // positive, rows sum to ~1
    for (auto& s : state0) s = ex(rng) * 3.0f;
    state = state0;
    ws.resize(std::max(h2o.evict_workspace_bytes<backend::Scalar>(kHkv, kN), tova.attention_workspace_bytes<backend::Scalar>(kN)));
  }
  H2OState view(std::int64_t len) { return H2OState{TensorView<float, 2>::contiguous(state.data(), {kHkv, kN}), len}; }
  KeepSet keep() { return KeepSet{indptr.data(), indices.data(), kHkv, static_cast<std::int64_t>(indices.size())}; }
  Workspace work() { return Workspace{ws.data(), ws.size()}; }
  TensorView<const float, 3> p() const { return TensorView<const float, 3>::contiguous(probs.data(), {kHq, 1, kN}); }
};

Step& step() {
  static Step s;
  return s;
}

constexpr double kProbBytes = kHq * kN * 4.0, kStateBytes = kHkv * kN * 4.0, kKeepBytes = kHkv * (kN - 1) * 4.0;

void require_ok(benchmark::State& st, const Status& s) {
  if (!s.is_ok()) st.SkipWithError(s.message());
}

void BM_H2OUpdate(benchmark::State& st) {
  Step& s = step();
  for (auto _ : st) {
    H2OState h = s.view(kN - 1);
    require_ok(st, s.h2o.update(h, s.p()));
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * (kProbBytes + 2 * kStateBytes)));
}

void BM_H2OEvict(benchmark::State& st) {
  Step& s = step();
  for (auto _ : st) {
    H2OState h = s.view(kN);
    require_ok(st, s.h2o.evict<backend::Scalar>(h, s.keep(), s.work()));
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * (kStateBytes + kKeepBytes)));
}

void BM_H2OStep(benchmark::State& st) {
  Step& s = step();
  for (auto _ : st) {
    H2OState h = s.view(kN - 1);
    require_ok(st, s.h2o.update(h, s.p()));
    require_ok(st, s.h2o.evict<backend::Scalar>(h, s.keep(), s.work()));
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * (kProbBytes + 2 * kStateBytes + kKeepBytes)));
}

void BM_TOVAStep(benchmark::State& st) {
  Step& s = step();
  for (auto _ : st) {
    require_ok(st, s.tova.select_from_attention<backend::Scalar>(s.p(), kHkv, s.keep(), s.work()));
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * (kProbBytes + kKeepBytes)));
}

/// Read bandwidth on a buffer of `bytes`, the working-set size of a step.
void BM_Read(benchmark::State& st) {
  static std::map<std::int64_t, std::vector<std::uint64_t>> bufs;
  auto& buf = bufs[st.range(0)];
  if (buf.empty()) buf.assign(static_cast<std::size_t>(st.range(0)) / sizeof(std::uint64_t), 1u);
  for (auto _ : st) {
    std::uint64_t acc[16] = {};  // integer adds: vectorised without reassociation concerns
    const std::size_t body = buf.size() - buf.size() % 16;
    for (std::size_t j = 0; j < body; j += 16)
      for (int l = 0; l < 16; ++l) acc[l] += buf[j + l];
    std::uint64_t total = 0;
    for (auto a : acc) total += a;
    benchmark::DoNotOptimize(total);
  }
  st.SetBytesProcessed(st.iterations() * st.range(0));
}

constexpr std::int64_t kStepBytes = static_cast<std::int64_t>(kProbBytes + 2 * kStateBytes + kKeepBytes);

BENCHMARK(BM_H2OUpdate)->Name("h2o/update")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_H2OEvict)->Name("h2o/evict")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_H2OStep)->Name("h2o/step")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_TOVAStep)->Name("tova/step")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_Read)->Name("read")->Arg(kStepBytes)->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();

/// Collects the medians for the summary.
class Summary : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> bps;  // median bytes/s by benchmark name
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      if (r.aggregate_name != "median") continue;
      const auto it = r.counters.find("bytes_per_second");
      if (it != r.counters.end()) bps[r.run_name.function_name] = it->second;
      times[r.run_name.function_name] = r.GetAdjustedCPUTime();
    }
    ConsoleReporter::ReportRuns(runs);
  }
  std::map<std::string, double> times;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  Summary rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  const double read_bw = rep.bps.count("read") ? rep.bps["read"] : 0.0;
  std::printf("\nOnline eviction at %lld cached tokens, %lld q / %lld kv heads (medians of CPU time)\n", static_cast<long long>(kN),
              static_cast<long long>(kHq), static_cast<long long>(kHkv));
  std::printf("  read bandwidth, %.1f MiB buffer, this process: %.2f GB/s\n", kStepBytes / 1048576.0, read_bw * 1e-9);
#if KVP_BENCH_HAVE_PEAK
  const double peak_bw = kvp_bench::peak().read_bytes_per_second;
  std::printf("  peak read bandwidth (benchmarks/peak.hpp):     %.2f GB/s\n", peak_bw * 1e-9);
#endif
  for (const char* name : {"h2o/update", "h2o/evict", "h2o/step", "tova/step"}) {
    if (!rep.bps.count(name)) continue;
    std::printf("  %-11s %9.1f us  %6.2f GB/s  %5.1f%% of measured read bw", name, rep.times[name], rep.bps[name] * 1e-9,
                read_bw > 0 ? 100.0 * rep.bps[name] / read_bw : 0.0);
#if KVP_BENCH_HAVE_PEAK
    std::printf("  %5.1f%% of peak", 100.0 * rep.bps[name] / peak_bw);
#endif
    std::printf("\n");
  }
  benchmark::Shutdown();
  return 0;
}
