// Scoring policies at one 32K-token prefill, 32 query / 8 kv heads (GQA 4),
// head_dim 128, fp16 keys and queries, window 64, on backend::Cpu, 1 thread:
//
//   snapkv              SnapKVPress(r=.5): window attention + pooling + top-k per kv head.
//   adakv/kvpress       AdaKVPress(SnapKVPress(r=.5), alpha .2): + safeguard and the layer-wide prune.
//   adakv/original_gqa  Ada-KV gqa_support (w=32, maxpool 7, C = T/2): + the blended allocation.
//   pyramidkv/l0, l31   PyramidKVPress(r=.5), first and last of 32 layers.
//   expected_attention  ExpectedAttentionPress(r=.5) at 4K tokens (the d^2 covariance
//                       terms dominate; at 32K one call takes seconds).
//   observed_attention  ObservedAttentionPress(r=.5) from the prompt's queries at 2,560 tokens
//                       (the one-shot H2O scores: every query's causal attention, summed
//                       per key; flops = the causal logits, 2 * Hq * d * T (T + 1) / 2).
//   allocation          select_per_head on precomputed (8, 32768) scores: the
//                       selection alone, with ragged budgets.
//
// Each run reports flop/s counting the window attention's dot products
// (2 * Hq * w * T * d; Expected Attention: 2 * Hq * T * d^2 for the quadratic
// form) and bytes/s counting the keys read once (fp16). The summary prints each
// run's rate, as a fraction of the FMA rate of benchmarks/peak.hpp
// when that header is present.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/budget/allocation.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"

#if __has_include("peak.hpp")
#include "peak.hpp"
#define KVP_BENCH_HAVE_PEAK 1
#endif

using namespace kvpolicy;

namespace {

constexpr std::int64_t kT = 32768, kHq = 32, kHkv = 8, kD = 128, kW = 64, kEaT = 4096;

struct Inputs {
  std::vector<half> q, keys, values, prompt;  // prompt: (Hq, kEaT, d) pre-RoPE queries for Expected Attention
  std::vector<float> scores;
  Inputs() : q(kHq * kW * kD), keys(kHkv * kT * kD), values(kHkv * kEaT * kD), prompt(kHq * kEaT * kD), scores(kHkv * kT) {
    std::mt19937 rng(5);
    std::normal_distribution<float> nd;
    for (auto* v : {&q, &keys, &values, &prompt})
      for (auto& x : *v) x = to_half(nd(rng));
    std::exponential_distribution<float> ex(1.0f);
    for (auto& s : scores) s = ex(rng);
  }
  ScoreInput<half, half> prefill(std::int64_t w) const {
    return {TensorView<const half, 3>(q.data() + (kW - w) * kD, {kHq, w, kD}, {kW * kD, kD, 1}),
            KVSource<half>::from(TensorView<const half, 3>::contiguous(keys.data(), {kHkv, kT, kD}))};
  }
  ExpectedAttentionInput<half, half> ea() const {
    ExpectedAttentionInput<half, half> in;
    in.queries = TensorView<const half, 3>::contiguous(prompt.data(), {kHq, kEaT, kD});
    in.keys = KVSource<half>::from(TensorView<const half, 3>(keys.data(), {kHkv, kEaT, kD}, {kT * kD, kD, 1}));
    in.values = KVSource<half>::from(TensorView<const half, 3>::contiguous(values.data(), {kHkv, kEaT, kD}));
    return in;
  }
};

const Inputs& inputs() {
  static const Inputs in;
  return in;
}

std::map<std::string, double>& flops_by_run() {
  static std::map<std::string, double> m;
  return m;
}

template <class Policy, class In>
void run_policy(benchmark::State& state, const Policy& policy, const In& in, const ProblemShape& shape, double flops, double bytes) {
  const Requirements req = policy.requirements(Context<backend::Cpu>{}, shape);  // workspace, KeepSet rows and capacity
  if (!req) {
    state.SkipWithError(req.status.message());
    return;
  }
  std::vector<std::byte> ws(req.workspace_bytes);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(req.output.rows + 1)), indices(static_cast<std::size_t>(req.output.capacity));
  const KeepSet keep{indptr.data(), indices.data(), req.output.rows, req.output.capacity};
  const Context<backend::Cpu> cx{Workspace{ws.data(), ws.size()}};
  for (auto _ : state) {
    const Status s = policy.evict(cx, in, keep);
    if (!s.is_ok()) {
      state.SkipWithError(s.message());
      return;
    }
    benchmark::DoNotOptimize(indices.data());
    benchmark::ClobberMemory();
  }
  state.counters["flop/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}

const double kKeyBytes = static_cast<double>(kHkv * kT * kD * 2);
double window_flops(std::int64_t w) { return 2.0 * kHq * static_cast<double>(w) * kT * kD; }

void BM_SnapKV(benchmark::State& state) {
  const SnapKV p(SnapKVParams::kvpress(0.5, kW, 5));
  run_policy(state, p, inputs().prefill(kW), {kHq, kHkv, kD, kT, kW}, window_flops(kW), kKeyBytes);
}

void BM_AdaKV_kvpress(benchmark::State& state) {
  const AdaKV<SnapKV> p(AdaKVParams::kvpress(0.5, 0.2), SnapKV(SnapKVParams::kvpress(0.5, kW, 5)));
  run_policy(state, p, inputs().prefill(kW), {kHq, kHkv, kD, kT, kW}, window_flops(kW), kKeyBytes);
}

void BM_AdaKV_original_gqa(benchmark::State& state) {
  const AdaKV<SnapKV> p(AdaKVParams::original_gqa(kT / 2, 0.2), SnapKV(adakv_scoring(32, 7)));
  run_policy(state, p, inputs().prefill(32), {kHq, kHkv, kD, kT, 32}, window_flops(32), kKeyBytes);
}

void BM_PyramidKV(benchmark::State& state) {
  const PyramidKV p(PyramidKVParams::kvpress(0.5, static_cast<std::int32_t>(state.range(0)), 32, kW, 5));
  run_policy(state, p, inputs().prefill(kW), {kHq, kHkv, kD, kT, kW}, window_flops(kW), kKeyBytes);
}

void BM_ExpectedAttention(benchmark::State& state) {
  const ExpectedAttention p(ExpectedAttentionParams::kvpress(0.5));
  const double flops = 2.0 * kHq * kEaT * kD * kD * 1.5;  // quadratic form + half the covariance
  run_policy(state, p, inputs().ea(), {kHq, kHkv, kD, kEaT, kEaT}, flops,
             static_cast<double>(kHkv * kEaT * kD * 2 * 2 + kHq * kEaT * kD * 2));
}

constexpr std::int64_t kOaT = 2560;
void BM_ObservedAttention(benchmark::State& state) {
  ObservedAttentionParams params = ObservedAttentionParams::kvpress(0.5);
  params.query_block = static_cast<std::int32_t>(state.range(0));
  const ObservedAttention p(params);
  ScoreInput<half, half> in{TensorView<const half, 3>(inputs().prompt.data(), {kHq, kOaT, kD}, {kEaT * kD, kD, 1}),
                            KVSource<half>::from(TensorView<const half, 3>(inputs().keys.data(), {kHkv, kOaT, kD}, {kT * kD, kD, 1}))};
  const double flops = 2.0 * kHq * kD * static_cast<double>(kOaT) * (kOaT + 1) / 2.0;
  run_policy(state, p, in, {kHq, kHkv, kD, kOaT, kOaT}, flops, static_cast<double>(kHkv * kOaT * kD * 2));
}

void BM_Allocation(benchmark::State& state) {
  std::vector<std::int32_t> counts(kHkv);
  for (std::int64_t h = 0; h < kHkv; ++h) counts[h] = static_cast<std::int32_t>(kT / 2 + (h - kHkv / 2) * 512);
  const HeadAllocation alloc{counts.data(), kHkv, kHkv * kT / 2 - 2048, true};
  const auto scores = TensorView<const float, 2>::contiguous(inputs().scores.data(), {kHkv, kT});
  std::vector<std::byte> ws(select_per_head_workspace<backend::Cpu>(kT));
  std::vector<std::int32_t> indptr(kHkv + 1), indices(kHkv * kT);
  const KeepSet keep{indptr.data(), indices.data(), kHkv, kHkv * kT};
  for (auto _ : state) {
    const Status s = select_per_head<backend::Cpu>(scores, alloc, keep, Workspace{ws.data(), ws.size()});
    if (!s.is_ok()) {
      state.SkipWithError(s.message());
      return;
    }
    benchmark::DoNotOptimize(indices.data());
  }
  state.counters["bytes/s"] = benchmark::Counter(static_cast<double>(kHkv * kT * 4), benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_SnapKV)->Name("snapkv")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdaKV_kvpress)->Name("adakv/kvpress")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdaKV_original_gqa)->Name("adakv/original_gqa")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_PyramidKV)->Name("pyramidkv")->Arg(0)->Arg(31)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ExpectedAttention)->Name("expected_attention/T4096")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ObservedAttention)->Name("observed_attention/T2560/query_block")->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Allocation)->Name("allocation/select_per_head")->Unit(benchmark::kMillisecond)->UseRealTime();

/// Collects each run's flop/s for the summary.
class Summary : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      auto it = r.counters.find("flop/s");
      if (it != r.counters.end() && !r.error_occurred) flops_by_run()[r.benchmark_name()] = it->second.value;
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("backend::Cpu ISA: %s\n", backend::Cpu::isa_name());
  Summary rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  benchmark::Shutdown();
  std::printf("\nsummary (GFLOP/s of the scoring dot products):\n");
#if KVP_BENCH_HAVE_PEAK
  const double peak_flops = kvp_bench::peak().fma_flops_per_second;
  std::printf("  peak FMA rate (benchmarks/peak.hpp): %.1f GFLOP/s\n", peak_flops * 1e-9);
#endif
  for (const auto& [name, f] : flops_by_run()) {
    std::printf("  %-34s %8.1f GFLOP/s", name.c_str(), f * 1e-9);
#if KVP_BENCH_HAVE_PEAK
    std::printf("  %5.1f%% of peak", 100.0 * f / peak_flops);
#endif
    std::printf("\n");
  }
  return 0;
}
