// SPDX-License-Identifier: Apache-2.0
// The prefetch family's predict at one decode step of a 16K-token sequence:
// 1024 pages of 16 tokens, head_dim 128, 32 query / 8 kv heads (GQA 4), fp32
// keys in an NHD pool with scattered page ids, on backend::Cpu.
//
//   quest_lookahead  Quest bounds over the page metadata (2 * d floats per page and kv head)
//                    + top-k + the request sort; page_budget 64
//   infinigen        speculative logits over the partial keys (r = 25 of 128 channels, read once
//                    per kv head for its 4 query heads), threshold count, top-k; max_num_kv 400
//   specache         dequantize the q4_0 key copy (18 bytes per 32 values) and score G = 4
//                    query heads per kv head, softmax, GQA mean, top-64
//   shadowkv         scores over chunk landmarks (chunks of 8 tokens), top-256 chunks
//
// Each reports the bytes of policy state it reads (GB/s and % of the peak
// probe's single-core read bandwidth, benchmarks/peak.hpp) and the flops of
// its dot products (GFLOP/s and % of the single-core FMA peak). Thread CPU time.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "bench_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/prefetch/infinigen.hpp"
#include "kvpolicy/policy/prefetch/quest_lookahead.hpp"
#include "kvpolicy/policy/prefetch/shadowkv.hpp"
#include "kvpolicy/policy/prefetch/specache.hpp"

using namespace kvpolicy;
using Cpu = backend::Cpu;

namespace {

constexpr std::int32_t kHq = 32, kHkv = 8, kD = 128, kP = 16, kPages = 1024;
constexpr std::int64_t kT = static_cast<std::int64_t>(kPages) * kP;

struct Setup {
  std::vector<float> k = kvp_bench::normal_values<float>(static_cast<std::size_t>(kT) * kHkv * kD, 3);
  std::vector<float> q = kvp_bench::normal_values<float>(static_cast<std::size_t>(kHq) * kD, 4);
  std::vector<std::int32_t> indptr{0, kPages}, indices, last{kP};
  Setup() {
    indices.resize(kPages);
    std::iota(indices.begin(), indices.end(), 0);
    std::shuffle(indices.begin(), indices.end(), std::mt19937(9));
  }
  PagedKVView<const float> view() const {
    const auto s = PageStrides::contiguous(PageLayout::kNHD, kHkv, kP, kD);
    return PagedKVView<const float>{k.data(), nullptr, s, s, kPages, kHkv, kP, kD, PageTable{indptr.data(), indices.data(), last.data(), 1},
                                    {}};
  }
  DecodeInput<float> input(int layer) const {
    return DecodeInput<float>{TensorView<const float, 3>::contiguous(q.data(), {1, kHq, kD}), view().table, kP, layer};
  }
};
const Setup& setup() {
  static const Setup s;
  return s;
}
const ProblemShape kShape{.num_q_heads = kHq, .num_kv_heads = kHkv, .head_dim = kD, .max_kv_len = kT, .q_len = 1};

template <class P, class St>
void run(benchmark::State& st, const P& pol, St& state, double bytes, double flops) {
  std::vector<std::byte> ws(pol.requirements(Context<Cpu>{}, kShape, kP).workspace_bytes);
  const Context<Cpu> ctx{Workspace{ws.data(), ws.size()}, {}};
  std::vector<std::int32_t> pages(kPages);
  std::vector<float> prio(kPages);
  PrefetchRequest r{pages.data(), prio.data(), kPages, 0};
  const DecodeInput<float> in = setup().input(3);
  for (auto _ : st) {
    const Status s = pol.predict(ctx, state, in, r);
    if (!s.is_ok()) st.SkipWithError(s.message());
    benchmark::DoNotOptimize(pages.data());
    benchmark::ClobberMemory();
  }
  st.counters["pages"] = static_cast<double>(r.size);
  kvp_bench::report_bytes(st, bytes);
  kvp_bench::report_flops(st, flops);
}

void bench_quest_lookahead(benchmark::State& st) {
  std::vector<float> meta(static_cast<std::size_t>(PageMetaView<float>::contiguous_size(kPages, kHkv, kD)));
  const auto mv = PageMetaView<float>::contiguous(meta.data(), kPages, kHkv, kD);
  if (!Quest().on_append(Context<Cpu>{}, AppendInput<float>{setup().view(), nullptr}, mv).is_ok()) st.SkipWithError("metadata");
  std::vector<std::int64_t> hist(static_cast<std::size_t>(PrefetchHistory::buffer_size(kPages)));
  QuestLookaheadState<float> s{mv, PrefetchHistory::over(hist.data(), kPages)};
  const QuestLookahead<float> pol(QuestLookaheadParams{.page_budget = 64, .dense_layers = 0});
  run(st, pol, s, static_cast<double>(meta.size() * sizeof(float)), 2.0 * kHq * kD * (kPages - 1));
}

void bench_infinigen(benchmark::State& st) {
  const InfiniGen pol(InfiniGenParams{.dense_layers = 0});
  const auto n = pol.state_size(kPages, kP, kHkv, kD);
  std::vector<float> f(static_cast<std::size_t>(n.floats));
  std::vector<std::int32_t> ints(static_cast<std::size_t>(n.ints));
  std::vector<std::int64_t> hist(static_cast<std::size_t>(n.history));
  InfiniGenState s;
  if (!pol.make_state(f.data(), ints.data(), hist.data(), kPages, kP, kHkv, kD, &s).is_ok()) st.SkipWithError("state");
  const auto prompt = kvp_bench::normal_values<float>(static_cast<std::size_t>(kHq) * 64 * kD, 5);
  std::vector<std::byte> ws(pol.requirements(Context<Cpu>{}, kShape, kP).workspace_bytes);
  if (!pol.prepare(Context<Cpu>{Workspace{ws.data(), ws.size()}, {}}, TensorView<const float, 3>::contiguous(prompt.data(), {kHq, 64, kD}),
                   setup().view(), s)
           .is_ok())
    st.SkipWithError("prepare");
  const double r = pol.partial_dim(kD);
  // The partial keys read once per kv head; r-dim logits for every query head + q A[:, S] per head.
  run(st, pol, s, static_cast<double>(kHkv) * kT * r * sizeof(float), 2.0 * kHq * kT * r + 2.0 * kHq * r * kD);
}

void bench_specache(benchmark::State& st) {
  const SpeCache pol(SpeCacheParams{.topk = 64});
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(pol.codes_bytes(kPages, kP, kHkv, kD)));
  std::vector<std::int64_t> hist(static_cast<std::size_t>(PrefetchHistory::buffer_size(kPages)));
  SpeCacheState s;
  if (!pol.make_state(codes.data(), hist.data(), kPages, kP, kHkv, kD, &s).is_ok()) st.SkipWithError("state");
  if (!pol.on_append(Context<Cpu>{}, AppendInput<float>{setup().view(), nullptr}, s).is_ok()) st.SkipWithError("append");
  run(st, pol, s, static_cast<double>(codes.size()), 2.0 * kHq * kT * kD);
}

void bench_shadowkv(benchmark::State& st) {
  const ShadowKV pol(ShadowKVParams{});
  const auto n = pol.state_size(kPages, kP, kHkv, kD);
  std::vector<float> f(static_cast<std::size_t>(n.floats));
  std::vector<std::int64_t> hist(static_cast<std::size_t>(n.history));
  ShadowKVState s;
  if (!pol.make_state(f.data(), hist.data(), kPages, kP, kHkv, kD, &s).is_ok()) st.SkipWithError("state");
  if (!pol.on_append(Context<Cpu>{}, AppendInput<float>{setup().view(), nullptr}, s).is_ok()) st.SkipWithError("append");
  const double chunks = static_cast<double>(kT) / 8;
  run(st, pol, s, chunks * kHkv * (kD + 1) * sizeof(float), 2.0 * kHq * chunks * kD);
}

}  // namespace

BENCHMARK(bench_quest_lookahead)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly();
BENCHMARK(bench_infinigen)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly();
BENCHMARK(bench_specache)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly();
BENCHMARK(bench_shadowkv)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly();

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  kvp_bench::add_peak_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
