// SPDX-License-Identifier: Apache-2.0
// Ops of the contract, backend::Scalar vs backend::Cpu on every ISA level:
//
//  * window_scores — SnapKV's hot op on one kv head: G=4 query heads, w=32
//    window queries, d=128, T=32768 keys (fp16, bf16, fp32); and the whole
//    8-kv-head layer through ExecContext on 1 and 2 threads. Flops counted:
//    2*G*w*T*d (the logits); reported as GFLOP/s and pct_peak_fma (the rows
//    at the AVX2 level also as pct_peak_fma_avx2, against the AVX2 kernel);
//    bf16 keys also through the bf16 dot form (window_scores/cpu/avx512/bf16_dot).
//  * topk — keep 1% of 131072 scores, for one row (cache resident) and for 32
//    rows (one per query head, 16 MiB: streamed), next to a read pass over the
//    same rows (the lower bound of any top-k); GB/s and pct_peak_bw.
//  * pool1d — avg (k=5) and max (k=7) over 32768 scores.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;
using kvp_bench::report_bytes;
using kvp_bench::report_flops;
using kvp_bench::report_flops_at;

namespace {

constexpr std::int64_t kG = 4, kW = 32, kD = 128, kT = 32768, kKvHeads = 8;

template <class Tk>
struct WindowData {
  std::vector<float> q = kvp_bench::normal_values<float>(static_cast<std::size_t>(kKvHeads * kG * kW * kD), 1);  // (Hq, w, d)
  std::vector<Tk> k = kvp_bench::normal_values<Tk>(static_cast<std::size_t>(kKvHeads * kT * kD), 2);             // (Hkv, T, d)
  static const WindowData& get() {
    static const WindowData d;
    return d;
  }
};

WindowScoreShape window_shape() {
  return WindowScoreShape{kG, kW, kD, kT, kT - kW, kT - kW, 1.0f / std::sqrt(static_cast<float>(kD)), WindowReduce::kMean};
}

template <class Backend, class Tk>
void bm_window_scores(benchmark::State& st, CpuIsa isa) {
  if (std::is_same_v<Backend, backend::Cpu> && !kvp_bench::use_isa(st, isa)) return;
  const auto& data = WindowData<Tk>::get();
  const WindowScoreShape s = window_shape();
  std::vector<std::byte> ws(Backend::window_scores_workspace(s));
  std::vector<float> out(static_cast<std::size_t>(kG * s.num_cols));
  for (auto _ : st) {
    Backend::window_scores(s, data.q.data(), Rows<Tk>{data.k.data(), kD}, out.data(), Workspace{ws.data(), ws.size()});
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report_flops_at(st, 2.0 * kG * kW * kT * kD, isa);
}

// bf16 keys through the bf16 dot form (Cpu::set_bf16_dot; AVX-512 with AVX512_BF16), same shape and flops.
void bm_window_scores_bf16_dot(benchmark::State& st) {
  if (!kvp_bench::use_isa(st, CpuIsa::kAvx512)) return;
  if (!backend::Cpu::set_bf16_dot(true)) {
    st.SkipWithError("no AVX512_BF16 on this machine");
    return;
  }
  bm_window_scores<backend::Cpu, bfloat16>(st, CpuIsa::kAvx512);
  backend::Cpu::set_bf16_dot(false);
}

// The whole layer: 8 kv heads (32 query heads), one window_scores per kv head.
template <class Tk>
void bm_window_scores_layer(benchmark::State& st, CpuIsa isa, int threads, bool wall) {
  if (!kvp_bench::use_isa(st, isa)) return;
  const auto& data = WindowData<Tk>::get();
  const WindowScoreShape s = window_shape();
  ThreadPool pool(threads);
  const ExecContext ctx = pool.context();
  const std::size_t per_worker = align_up(backend::Cpu::window_scores_workspace(s));
  std::vector<std::byte> ws(per_worker * static_cast<std::size_t>(ctx.workers()) + kWorkspaceAlign);
  std::vector<float> out(static_cast<std::size_t>(kKvHeads * kG * s.num_cols));
  for (auto _ : st) {
    ctx.parallel_for(kKvHeads, [&](std::int64_t h, int worker) {
      backend::Cpu::window_scores(s, data.q.data() + h * kG * kW * kD, Rows<Tk>{data.k.data() + h * kT * kD, kD},
                                  out.data() + h * kG * s.num_cols,
                                  Workspace{ws.data() + static_cast<std::size_t>(worker) * per_worker, per_worker});
    });
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report_flops(st, 2.0 * kKvHeads * kG * kW * kT * kD, wall ? threads : 1);
}

// ---- top-k -----------------------------------------------------------------------

constexpr std::int64_t kTopkN = 131072, kTopkK = kTopkN / 100;

const std::vector<float>& topk_scores(std::int64_t rows) {
  static const std::vector<float> one = kvp_bench::score_values(static_cast<std::size_t>(kTopkN), 7);
  static const std::vector<float> many = kvp_bench::score_values(static_cast<std::size_t>(32 * kTopkN), 8);
  return rows == 1 ? one : many;
}

template <class Backend>
void bm_topk(benchmark::State& st, CpuIsa isa, std::int64_t rows) {
  if (std::is_same_v<Backend, backend::Cpu> && !kvp_bench::use_isa(st, isa)) return;
  const auto& s = topk_scores(rows);
  std::vector<std::byte> ws(Backend::topk_workspace(kTopkN));
  std::vector<std::int32_t> out(static_cast<std::size_t>(kTopkK));
  for (auto _ : st) {
    for (std::int64_t r = 0; r < rows; ++r) {
      Backend::topk(s.data() + r * kTopkN, kTopkN, kTopkK, out.data(), Workspace{ws.data(), ws.size()});
      benchmark::DoNotOptimize(out.data());
    }
    benchmark::ClobberMemory();
  }
  report_bytes(st, static_cast<double>(rows * kTopkN) * sizeof(float));
}

// One read pass over the same rows: what any top-k has to pay at least.
void bm_read_pass(benchmark::State& st, std::int64_t rows) {
  const auto& s = topk_scores(rows);
  for (auto _ : st) {
    float acc = 0;
    for (std::int64_t r = 0; r < rows; ++r) acc += kvp_bench::read_pass(s.data() + r * kTopkN, static_cast<std::size_t>(kTopkN));
    benchmark::DoNotOptimize(acc);
  }
  report_bytes(st, static_cast<double>(rows * kTopkN) * sizeof(float));
}

// Small rows (Quest's page scores, short sequences): n from 1K to 16K, cache resident, next to a read pass
// over the same n scores. k = 1% of n (at least 8) and k = 64.
const std::vector<float>& small_scores() {
  static const std::vector<float> s = kvp_bench::score_values(16384, 21);
  return s;
}
void bm_topk_small(benchmark::State& st, std::int64_t n, std::int64_t k) {
  if (!kvp_bench::use_isa(st, backend::Cpu::best_isa())) return;  // the rows before may have left a lower level set
  const auto& s = small_scores();
  std::vector<std::byte> ws(backend::Cpu::topk_workspace(n));
  std::vector<std::int32_t> out(static_cast<std::size_t>(k));
  for (auto _ : st) {
    backend::Cpu::topk(s.data(), n, k, out.data(), Workspace{ws.data(), ws.size()});
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report_bytes(st, static_cast<double>(n) * sizeof(float));
}
void bm_read_pass_small(benchmark::State& st, std::int64_t n) {
  const auto& s = small_scores();
  for (auto _ : st) {
    benchmark::DoNotOptimize(kvp_bench::read_pass(s.data(), static_cast<std::size_t>(n)));
    benchmark::ClobberMemory();
  }
  report_bytes(st, static_cast<double>(n) * sizeof(float));
}

// ---- pool1d ----------------------------------------------------------------------

constexpr std::int64_t kPoolN = 32768;

template <class Backend>
void bm_pool1d(benchmark::State& st, CpuIsa isa, Pooling kind, int kernel) {
  if (std::is_same_v<Backend, backend::Cpu> && !kvp_bench::use_isa(st, isa)) return;
  static const std::vector<float> in = kvp_bench::score_values(static_cast<std::size_t>(kPoolN), 9);
  std::vector<float> out(in.size());
  for (auto _ : st) {
    Backend::pool1d(in.data(), kPoolN, kernel, kind, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report_bytes(st, 2.0 * kPoolN * sizeof(float));  // read + write
}

template <class Tk>
void register_window(const char* dtype) {
  for (CpuIsa isa : kvp_bench::isas()) {
    benchmark::RegisterBenchmark((std::string("window_scores/cpu/") + cpu_isa_name(isa) + "/" + dtype).c_str(),
                                 bm_window_scores<backend::Cpu, Tk>, isa)
        ->Unit(benchmark::kMillisecond);
  }
}

void register_all() {
  register_window<half>("f16");
  register_window<bfloat16>("bf16");
  register_window<float>("f32");
  benchmark::RegisterBenchmark("window_scores/cpu/avx512/bf16_dot", bm_window_scores_bf16_dot)->Unit(benchmark::kMillisecond);
  // The reference takes about a second per call: one iteration per repetition.
  benchmark::RegisterBenchmark("window_scores/scalar/f16", bm_window_scores<backend::Scalar, half>, CpuIsa::kSse2)
      ->Iterations(1)
      ->Unit(benchmark::kMillisecond);
  for (int threads : {1, 2}) {
    for (bool wall : {false, true}) {
      if (threads == 1 && wall) continue;
      auto* b = benchmark::RegisterBenchmark(("window_scores_layer/cpu/" + std::string(cpu_isa_name(backend::Cpu::best_isa())) +
                                              "/f16/threads:" + std::to_string(threads))
                                                 .c_str(),
                                             bm_window_scores_layer<half>, backend::Cpu::best_isa(), threads, wall)
                    ->MeasureProcessCPUTime()
                    ->Unit(benchmark::kMillisecond);
      if (wall) b->UseRealTime();
    }
  }

  for (std::int64_t rows : {1, 32}) {
    const std::string shape = "/n:" + std::to_string(kTopkN) + "/k:" + std::to_string(kTopkK) + "/rows:" + std::to_string(rows);
    benchmark::RegisterBenchmark(("read_pass" + shape).c_str(), bm_read_pass, rows)->Unit(benchmark::kMicrosecond);
    for (CpuIsa isa : kvp_bench::isas()) {
      benchmark::RegisterBenchmark(("topk/cpu/" + std::string(cpu_isa_name(isa)) + shape).c_str(), bm_topk<backend::Cpu>, isa, rows)
          ->Unit(benchmark::kMicrosecond);
    }
    benchmark::RegisterBenchmark(("topk/scalar" + shape).c_str(), bm_topk<backend::Scalar>, CpuIsa::kSse2, rows)
        ->Unit(benchmark::kMicrosecond);
  }

  for (std::int64_t n : {1024, 4096, 8192, 16384}) {
    benchmark::RegisterBenchmark(("read_pass/n:" + std::to_string(n)).c_str(), bm_read_pass_small, n)->Unit(benchmark::kMicrosecond);
    for (std::int64_t k : {std::max<std::int64_t>(8, n / 100), std::int64_t{64}}) {
      benchmark::RegisterBenchmark(
          ("topk/cpu/" + std::string(cpu_isa_name(backend::Cpu::best_isa())) + "/n:" + std::to_string(n) + "/k:" + std::to_string(k))
              .c_str(),
          bm_topk_small, n, k)
          ->Unit(benchmark::kMicrosecond);
    }
  }

  for (auto [kind, kernel, name] : {std::tuple{Pooling::kAvg, 5, "avg/k:5"}, std::tuple{Pooling::kMax, 7, "max/k:7"}}) {
    const std::string shape = std::string("/") + name + "/n:" + std::to_string(kPoolN);
    for (CpuIsa isa : kvp_bench::isas()) {
      benchmark::RegisterBenchmark(("pool1d/cpu/" + std::string(cpu_isa_name(isa)) + shape).c_str(), bm_pool1d<backend::Cpu>, isa, kind,
                                   kernel)
          ->Unit(benchmark::kMicrosecond);
    }
    benchmark::RegisterBenchmark(("pool1d/scalar" + shape).c_str(), bm_pool1d<backend::Scalar>, CpuIsa::kSse2, kind, kernel)
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvp_bench::add_peak_context();  // measures the peaks before any benchmark runs
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
