// kvpolicy::cuda benchmarks (Google Benchmark, manual time from cudaEvents).
//
// CudaWindowScores_SnapKV<T>/w/exact: one kv head of a SnapKV prefill step,
// G=4 query heads per kv head, observation window w (32 or 64), head_dim 128,
// T=32768 fp16 or bf16 keys. exact=0: the default logits kernel (tensor cores
// on sm_80+), exact=1: the exact CUDA-core kernel (internal switch), for
// comparison. Reported: time per call (GPU time between two events on the
// stream), key bytes read per second, that rate as a fraction of this
// device's measured device-to-device copy bandwidth (read + write, measured
// in-process), and the logits' dot-product rate (2*G*w*T*d flop per call).
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench_util.hpp"
#include "kvpolicy/backends/cuda.hpp"

namespace kvp = kvpolicy;
using kvp::backend::Cuda;

// Internal hook of window_scores.cu (not in the public header): -1 default,
// 0 tensor cores (sm_80+), 1 exact kernel for the fp16 / bf16 logits.
namespace kvpolicy {
inline namespace v0 {
namespace cuda_detail {
void set_window_logits_mode(int mode) noexcept;
}  // namespace cuda_detail
}  // namespace v0
}  // namespace kvpolicy

namespace {

using kvp_cuda_bench::DeviceBuffer;

std::string cuda_message(const char* what, cudaError_t e) { return std::string(what) + ": " + cudaGetErrorString(e); }

/// Device-to-device copy bandwidth in bytes/s (read + write), 0 on failure.
double copy_bandwidth() {
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  DeviceBuffer a(kBytes), b(kBytes);
  cudaEvent_t start, stop;
  if (!a.ok || !b.ok || cudaEventCreate(&start) != cudaSuccess) return 0.0;
  if (cudaEventCreate(&stop) != cudaSuccess) {
    cudaEventDestroy(start);
    return 0.0;
  }
  float best_ms = 0.0f;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(start);
    cudaMemcpyAsync(b.ptr, a.ptr, kBytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    if (rep > 0 && (best_ms == 0.0f || ms < best_ms)) best_ms = ms;  // rep 0 warms up
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best_ms > 0.0f ? 2.0 * static_cast<double>(kBytes) / (best_ms * 1e-3) : 0.0;
}

template <class Tk>
void CudaWindowScores_SnapKV(benchmark::State& state) {
  int devices = 0;
  if (const kvp::Status st = Cuda::device_count(&devices); !st.is_ok() || devices == 0) {
    state.SkipWithError(st.is_ok() ? "no CUDA device" : st.message());
    return;
  }
  kvp::WindowScoreShape s;
  s.group = 4;
  s.window = state.range(0);
  s.head_dim = 128;
  s.kv_len = 32768;
  s.num_cols = s.kv_len - s.window;
  s.q_pos0 = s.kv_len - s.window;
  s.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  s.reduce = kvp::WindowReduce::kMean;

  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<std::size_t>(s.group * s.window * s.head_dim));
  std::vector<Tk> k(static_cast<std::size_t>(s.kv_len * s.head_dim));
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = kvp::from_float<Tk>(nd(rng));

  DeviceBuffer dq(q.size() * sizeof(float)), dk(k.size() * sizeof(Tk));
  DeviceBuffer dout(static_cast<std::size_t>(s.group * s.num_cols) * sizeof(float));
  const std::size_t ws_bytes = Cuda::window_scores_workspace(s);
  DeviceBuffer dws(ws_bytes);
  if (!dq.ok || !dk.ok || !dout.ok || !dws.ok) {
    state.SkipWithError("cudaMalloc failed");
    return;
  }
  cudaMemcpy(dq.ptr, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(dk.ptr, k.data(), k.size() * sizeof(Tk), cudaMemcpyHostToDevice);

  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaError_t e = cudaStreamCreate(&stream); e != cudaSuccess) {
    state.SkipWithError(cuda_message("cudaStreamCreate", e).c_str());
    return;
  }
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const kvp::Rows<Tk> keys{static_cast<const Tk*>(dk.ptr), s.head_dim};
  const kvp::Workspace ws{dws.ptr, ws_bytes};
  auto call = [&] { return Cuda::window_scores(s, static_cast<const float*>(dq.ptr), keys, static_cast<float*>(dout.ptr), ws, stream); };

  kvp::cuda_detail::set_window_logits_mode(state.range(1) != 0 ? 1 : 0);
  if (const kvp::Status st = call(); !st.is_ok()) {  // warm-up, and surfaces argument errors
    state.SkipWithError(st.message());
  } else if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) {
    state.SkipWithError(cuda_message("window_scores", e).c_str());
  } else {
    for (auto _ : state) {
      cudaEventRecord(start, stream);
      const kvp::Status st = call();
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      if (!st.is_ok()) {
        state.SkipWithError(st.message());
        break;
      }
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, start, stop);
      state.SetIterationTime(static_cast<double>(ms) * 1e-3);
    }
    const double key_bytes = static_cast<double>(k.size() * sizeof(Tk));
    state.SetBytesProcessed(static_cast<std::int64_t>(key_bytes) * state.iterations());
    state.counters["ws_MiB"] = static_cast<double>(ws_bytes) / (1 << 20);
    const double logit_flop = 2.0 * static_cast<double>(s.group * s.window) * static_cast<double>(s.kv_len * s.head_dim);
    state.counters["logit_flop/s"] = benchmark::Counter(logit_flop, benchmark::Counter::kIsIterationInvariantRate);
    if (const double peak = copy_bandwidth(); peak > 0.0) {
      state.counters["key_bw_frac_of_copy"] =
          benchmark::Counter(key_bytes / peak, benchmark::Counter::kIsIterationInvariantRate);  // (key bytes/s) / peak
    }
  }
  kvp::cuda_detail::set_window_logits_mode(-1);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
}

}  // namespace

BENCHMARK(CudaWindowScores_SnapKV<kvp::half>)
    ->ArgNames({"w", "exact"})
    ->Args({32, 0})
    ->Args({64, 0})
    ->Args({32, 1})
    ->Args({64, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaWindowScores_SnapKV<kvp::bfloat16>)
    ->ArgNames({"w", "exact"})
    ->Args({64, 0})
    ->Args({64, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
