// SPDX-License-Identifier: Apache-2.0
// Policies end to end on backend::Cpu (best ISA) against backend::Scalar:
//
//  * SnapKV select (kvpress defaults: compression 0.5, window 32, avg pool 5)
//    on one sequence of 32768 fp16 tokens, 32 query heads / 8 kv heads,
//    head_dim 128, on 1 and 2 threads. Flops counted: those of the window
//    logits, 2 * Hq * w * T * d. Rates are per CPU-second (per core) except
//    in the /real_time runs, where pct_peak_fma is relative to threads x the
//    single-core peak (see bench_util.hpp).
//  * StreamingLLM plan (4 sinks + 1020 recent tokens) at lengths from 4K to 2M
//    tokens: the plan writes the kept ids only, so its cost must not grow
//    with the length.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/streaming_llm.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;

namespace {

constexpr std::int64_t kHq = 32, kHkv = 8, kD = 128, kW = 32, kT = 32768;

struct SnapInputs {
  std::vector<float> q = kvp_bench::normal_values<float>(static_cast<std::size_t>(kHq * kW * kD), 11);  // (Hq, w, d)
  std::vector<half> k = kvp_bench::normal_values<half>(static_cast<std::size_t>(kHkv * kT * kD), 12);   // (Hkv, T, d)
  ScoreInput<float, half> input() const {
    return ScoreInput<float, half>{TensorView<const float, 3>::contiguous(q.data(), {kHq, kW, kD}),
                                   KVSource<half>::from(TensorView<const half, 3>::contiguous(k.data(), {kHkv, kT, kD}))};
  }
  static const SnapInputs& get() {
    static const SnapInputs s;
    return s;
  }
};

template <class Backend>
void bm_snapkv_select(benchmark::State& st, int threads, bool wall) {
  if (std::is_same_v<Backend, backend::Cpu> && !kvp_bench::use_isa(st, backend::Cpu::best_isa())) return;
  const SnapKV policy(SnapKVParams::kvpress(0.5, static_cast<std::int32_t>(kW), 5));
  const auto in = SnapInputs::get().input();
  ThreadPool pool(threads);
  const ExecContext ctx = pool.context();
  const ProblemShape shape{kHq, kHkv, kD, kT, kW};
  const Requirements req = policy.requirements(Context<Backend>{{}, ctx}, shape);
  if (!req) {
    st.SkipWithError(req.status.message());
    return;
  }
  std::vector<std::byte> ws(req.workspace_bytes);
  const std::int64_t kept = policy.kept_count(kT);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(req.output.rows + 1)), indices(static_cast<std::size_t>(req.output.capacity));
  const KeepSet keep{indptr.data(), indices.data(), req.output.rows, req.output.capacity};
  const Context<Backend> cx{Workspace{ws.data(), ws.size()}, ctx};
  for (auto _ : st) {
    const Status s = policy.evict(cx, std::span<const ScoreInput<float, half>>(&in, 1), keep);
    if (!s.is_ok()) {
      st.SkipWithError(s.message());
      return;
    }
    benchmark::DoNotOptimize(indices.data());
    benchmark::ClobberMemory();
  }
  kvp_bench::report_flops(st, 2.0 * kHq * kW * kT * kD, wall ? threads : 1);
  st.SetLabel("kept " + std::to_string(kept) + " of " + std::to_string(kT) + " per kv head");
}

void bm_streaming_llm_plan(benchmark::State& st, std::int64_t kv_len) {
  const StreamingLLM policy(StreamingLLMParams::original(4, 1020));
  const std::int64_t kept = policy.kept_count(kv_len);
  std::vector<std::int32_t> out(static_cast<std::size_t>(kept));
  for (auto _ : st) {
    const Status s = policy.evict_row(kv_len, std::span<std::int32_t>(out.data(), out.size()));
    if (!s.is_ok()) {
      st.SkipWithError(s.message());
      return;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  st.counters["kept"] = static_cast<double>(kept);
  kvp_bench::report_bytes(st, static_cast<double>(kept) * sizeof(std::int32_t));  // ids written
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvp_bench::add_peak_context();
  const std::string isa = cpu_isa_name(backend::Cpu::best_isa());
  for (int threads : {1, 2}) {
    for (bool wall : {false, true}) {
      if (threads == 1 && wall) continue;
      auto* b = benchmark::RegisterBenchmark(("snapkv_select/cpu/" + isa + "/f16/threads:" + std::to_string(threads)).c_str(),
                                             bm_snapkv_select<backend::Cpu>, threads, wall)
                    ->MeasureProcessCPUTime()
                    ->Unit(benchmark::kMillisecond);
      if (wall) b->UseRealTime();
    }
  }
  // The reference needs several seconds per call: one iteration per repetition.
  benchmark::RegisterBenchmark("snapkv_select/scalar/f16/threads:1", bm_snapkv_select<backend::Scalar>, 1, false)
      ->Iterations(1)
      ->Unit(benchmark::kMillisecond);
  for (std::int64_t len : {4096, 32768, 262144, 2097152}) {
    benchmark::RegisterBenchmark(("streaming_llm_plan/len:" + std::to_string(len)).c_str(), bm_streaming_llm_plan, len)
        ->Unit(benchmark::kNanosecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
