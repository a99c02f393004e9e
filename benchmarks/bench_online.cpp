// Online eviction at one decode step with 32K cached tokens, 32 query / 8 kv
// heads (GQA 4), engine-provided fp32 probabilities of the step's query.
//
//   h2o/update    H2O::update (ScoreInput::attention): a streaming add of the (32, 1, 32768) probability
//                 rows into the (8, 32768) state (reads 4 MiB + 1 MiB, writes 1 MiB).
//   h2o/evict     H2O::evict of the one slot the step added: one min pass over
//                 the candidates, a memmove of the state tail, the KeepSet rows
//                 (8 x 32767 int32, written, 1 MiB) for apply/.
//   h2o/step      update + evict, the per-step cost an engine pays.
//   h2o/step_cold the same step over a rotation of independent (probabilities,
//                 state) sets twice the last-level cache: inputs stream from memory.
//   tova/step     TOVA::evict on ScoreInput::attention at cache_size 32767 (head mean of
//                 the 32 rows + one argmin + KeepSet rows).
//   read/<bytes>  kvp_bench::read_pass over a buffer as large as what the step
//                 touches (cache-resident, like the warm steps); read_cold the
//                 same pass over the cold rotation: read bandwidths at the same
//                 level of the memory hierarchy, measured in this process.
//
// Times are CPU time (Google Benchmark's default; see bench_util.hpp): on a
// shared machine wall time also counts the time the thread waits for a core.
// Each run reports GB/s and pct_peak_bw (kvp_bench::report_bytes) counting the
// traffic a step cannot avoid: inputs read once, state read and written once,
// KeepSet written once (the evict memmove is not counted). The summary prints
// the medians against the same-level read pass and the peak probe (peak.hpp:
// one core streaming from memory).
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
#include "bench_util.hpp"  // report_bytes (GB/s, pct_peak_bw), peak.hpp

using namespace kvpolicy;

namespace {

constexpr std::int64_t kN = 32768, kHq = 32, kHkv = 8, kRecent = 1024;
using Ctx = Context<backend::Scalar>;  // where the calls run: the scalar reference, the calling thread

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
    // Engine probabilities: head_dim 0 sizes the probabilities paths (H2O's covers evict too).
    const ProblemShape shape{kHq, kHkv, 0, kN, 1};
    const Requirements rh = h2o.requirements(Ctx{}, shape), rt = tova.requirements(Ctx{}, shape);
    if (!rh || !rt) throw Error(rh ? rt.status : rh.status);
    ws.resize(std::max(rh.workspace_bytes, rt.workspace_bytes));
  }
  H2OState view(std::int64_t len) { return H2OState{TensorView<float, 2>::contiguous(state.data(), {kHkv, kN}), len}; }
  KeepSet keep() { return KeepSet{indptr.data(), indices.data(), kHkv, static_cast<std::int64_t>(indices.size())}; }
  Ctx work() { return Ctx{Workspace{ws.data(), ws.size()}}; }
  /// The step's probabilities (kHq, 1, kN) as the engine hands them; keys give the shape only.
  static ScoreInput<float, float> attention(const float* probs) {
    ScoreInput<float, float> in;
    in.keys = KVSource<float>::shape_only(kHkv, kN);
    in.attention = TensorView<const float, 3>::contiguous(probs, {kHq, 1, kN});
    return in;
  }
  ScoreInput<float, float> p() const { return attention(probs.data()); }
};

Step& step() {
  static Step s;
  return s;
}

/// Last-level cache size as the peak probe reports it (64 MiB if unknown).
std::size_t llc_bytes() {
  const std::size_t llc = kvp_bench::peak().llc_bytes;
  return llc > 0 ? llc : std::size_t{64} << 20;
}

constexpr double kProbBytes = kHq * kN * 4.0, kStateBytes = kHkv * kN * 4.0, kKeepBytes = kHkv * (kN - 1) * 4.0;

void require_ok(benchmark::State& st, const Status& s) {
  if (!s.is_ok()) st.SkipWithError(s.message());
}

void BM_H2OUpdate(benchmark::State& st) {
  Step& s = step();
  const auto in = s.p();
  for (auto _ : st) {
    H2OState h = s.view(kN - 1);
    require_ok(st, s.h2o.update(Ctx{}, h, in));
    benchmark::ClobberMemory();
  }
  kvp_bench::report_bytes(st, kProbBytes + 2 * kStateBytes);
}

void BM_H2OEvict(benchmark::State& st) {
  Step& s = step();
  const Ctx cx = s.work();
  for (auto _ : st) {
    H2OState h = s.view(kN);
    require_ok(st, s.h2o.evict(cx, h, s.keep()));
    benchmark::ClobberMemory();
  }
  kvp_bench::report_bytes(st, kStateBytes + kKeepBytes);
}

void BM_H2OStep(benchmark::State& st) {
  Step& s = step();
  const Ctx cx = s.work();
  const auto in = s.p();
  for (auto _ : st) {
    H2OState h = s.view(kN - 1);
    require_ok(st, s.h2o.update(cx, h, in));
    require_ok(st, s.h2o.evict(cx, h, s.keep()));
    benchmark::ClobberMemory();
  }
  kvp_bench::report_bytes(st, kProbBytes + 2 * kStateBytes + kKeepBytes);
}

/// Many independent (probabilities, state) sets, together twice the last-level
/// cache: each step streams its inputs from memory, as when an engine walks
/// many layers and sequences between two visits of the same state.
struct ColdSets {
  std::int64_t sets = 0;
  std::vector<float> probs, state;
  ColdSets() {
    const std::size_t llc = llc_bytes();
    const double per_set = kProbBytes + kStateBytes;
    sets = std::max<std::int64_t>(4, static_cast<std::int64_t>(2.0 * static_cast<double>(llc) / per_set) + 1);
    probs.resize(static_cast<std::size_t>(sets * kHq * kN));
    state.resize(static_cast<std::size_t>(sets * kHkv * kN));
    std::mt19937 rng(11);
    std::exponential_distribution<float> ex(1.0f);
    for (auto& p : probs) p = ex(rng) / static_cast<float>(kN);
    for (auto& v : state) v = ex(rng) * 3.0f;
  }
};

ColdSets& cold_sets() {
  static ColdSets c;
  return c;
}

void BM_H2OStepCold(benchmark::State& st) {
  ColdSets& cold = cold_sets();
  Step& s = step();
  const Ctx cx = s.work();
  std::int64_t i = 0;
  for (auto _ : st) {
    const std::int64_t k = i++ % cold.sets;
    H2OState h{TensorView<float, 2>::contiguous(cold.state.data() + k * kHkv * kN, {kHkv, kN}), kN - 1};
    require_ok(st, s.h2o.update(cx, h, Step::attention(cold.probs.data() + k * kHq * kN)));
    require_ok(st, s.h2o.evict(cx, h, s.keep()));
    benchmark::ClobberMemory();
  }
  kvp_bench::report_bytes(st, kProbBytes + 2 * kStateBytes + kKeepBytes);
  st.counters["sets"] = static_cast<double>(cold.sets);
}

/// The read pass over the same rotation of cold sets: the memory read bandwidth
/// under the same conditions as h2o/step_cold.
void BM_ReadCold(benchmark::State& st) {
  ColdSets& cold = cold_sets();
  std::int64_t i = 0;
  for (auto _ : st) {
    const std::int64_t k = i++ % cold.sets;
    benchmark::DoNotOptimize(kvp_bench::read_pass(cold.probs.data() + k * kHq * kN, static_cast<std::size_t>(kHq * kN)) +
                             kvp_bench::read_pass(cold.state.data() + k * kHkv * kN, static_cast<std::size_t>(kHkv * kN)));
  }
  kvp_bench::report_bytes(st, kProbBytes + kStateBytes);
}

void BM_TOVAStep(benchmark::State& st) {
  Step& s = step();
  const Ctx cx = s.work();
  const auto in = s.p();
  for (auto _ : st) {
    require_ok(st, s.tova.evict(cx, in, s.keep()));
    benchmark::ClobberMemory();
  }
  kvp_bench::report_bytes(st, kProbBytes + kKeepBytes);
}

/// Read bandwidth on a buffer of `bytes`, the working-set size of a step.
void BM_Read(benchmark::State& st) {
  static std::map<std::int64_t, std::vector<float>> bufs;
  auto& buf = bufs[st.range(0)];
  if (buf.empty()) buf.assign(static_cast<std::size_t>(st.range(0)) / sizeof(float), 1.0f);
  for (auto _ : st) benchmark::DoNotOptimize(kvp_bench::read_pass(buf.data(), buf.size()));
  kvp_bench::report_bytes(st, static_cast<double>(st.range(0)));
}

constexpr std::int64_t kStepBytes = static_cast<std::int64_t>(kProbBytes + 2 * kStateBytes + kKeepBytes);

BENCHMARK(BM_H2OUpdate)->Name("h2o/update")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_H2OEvict)->Name("h2o/evict")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_H2OStep)->Name("h2o/step")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_H2OStepCold)->Name("h2o/step_cold")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_ReadCold)->Name("read_cold")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_TOVAStep)->Name("tova/step")->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();
BENCHMARK(BM_Read)->Name("read")->Arg(kStepBytes)->Unit(benchmark::kMicrosecond)->Repetitions(9)->ReportAggregatesOnly();

/// Collects the medians for the summary.
class Summary : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> bps;  // median bytes/s by benchmark name
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      if (r.aggregate_name != "median") continue;
      const auto it = r.counters.find("GB/s");
      if (it != r.counters.end()) bps[r.run_name.function_name] = it->second * 1e9;
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
  kvp_bench::add_peak_context();
  Summary rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  auto bw = [&](const char* n) { return rep.bps.count(n) ? rep.bps[n] : 0.0; };
  std::printf("\nOnline eviction at %lld cached tokens, %lld q / %lld kv heads (medians of CPU time)\n", static_cast<long long>(kN),
              static_cast<long long>(kHq), static_cast<long long>(kHkv));
  std::printf("  read pass, %.1f MiB buffer (cache-resident, as the warm steps):   %6.2f GB/s\n", kStepBytes / 1048576.0,
              bw("read") * 1e-9);
  std::printf("  read pass over the cold rotation (memory, as h2o/step_cold):  %6.2f GB/s\n", bw("read_cold") * 1e-9);
  const double peak_bw = kvp_bench::peak().read_bytes_per_second;
  std::printf("  peak read bandwidth, benchmarks/peak.hpp (memory, 1 core):    %6.2f GB/s\n", peak_bw * 1e-9);
  for (const char* name : {"h2o/update", "h2o/evict", "h2o/step", "h2o/step_cold", "tova/step"}) {
    if (!rep.bps.count(name)) continue;
    const double base = bw(std::string(name) == "h2o/step_cold" ? "read_cold" : "read");
    std::printf("  %-13s %8.1f us  %6.2f GB/s  %6.1f%% of the same-level read pass", name, rep.times[name], rep.bps[name] * 1e-9,
                base > 0 ? 100.0 * rep.bps[name] / base : 0.0);
    std::printf("  %6.1f%% of peak", 100.0 * rep.bps[name] / peak_bw);
    std::printf("\n");
  }
  benchmark::Shutdown();
  return 0;
}
