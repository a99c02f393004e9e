// Policies on backend::Cuda (Google Benchmark, manual time from CUDA events).
//
// Every figure is reported against this device's limits measured in the same
// process (`Cuda::measure_peaks`: streaming read bandwidth, fp32 FMA rate,
// fp16 mma.sync rate), printed in the benchmark context and as counters:
//
//   CudaSnapKV/T        one layer's SnapKV decision (kvpress defaults: window
//                       64, avg pool 5, ratio 0.5), 32 query heads, 8 kv heads,
//                       head_dim 128, fp16 keys: the whole policy call as an
//                       engine makes it (launches enqueued one by one).
//   CudaSnapKVGraph/T   the same call captured once in a CUDA graph and replayed.
//   CudaAdaKVGraph/T    Ada-KV (kvpress, ratio 0.5) over Ada-KV's SnapKV scoring
//                       on the same shape, graph-replayed (offsets on the device).
//   CudaAdaKVKeep/T     `Cuda::adakv_keep` alone: the allocation and kept rows
//                       of 8 rows of T scores; hbm_frac counts one read of them.
//   CudaExpectedAttention/T  Expected Attention's decision from the whole
//                       prompt's queries (kvpress defaults), one layer.
//   CudaTopk/n/k_pct    exact top-k of 8 rows of n fp32 scores (radix select).
//   CudaH2OStep/C       one H2O decode step of a layer (32 query heads, 8 kv
//                       heads, cache of C slots): fold the step's attention
//                       probabilities into the state, evict one slot per head;
//                       captured once in a CUDA graph and replayed.
//   CudaQuant/T/f/dir   quantize (dir 0) or dequantize (dir 1) one layer's K
//                       rows, 8 kv heads x T tokens x head_dim 128, fp16, in
//                       format f: 0 q8_0, 1 q4_0 with llama.cpp's rotation,
//                       2 INT4 (Int4Quant defaults: rotated), 3 fp8 e4m3 with
//                       per-(token, head) scales; one launch per kv head;
//                       hbm_frac counts the fp16 rows plus the codes once.
//   CudaQuantizedPaged/T/f  decode attention of one layer (32 query heads, 8
//                       kv heads, head_dim 128) over a paged quantized pool of
//                       T tokens (page 16, NHD), format f: 0 q8_0, 1 q4_0;
//                       one quantized_paged_decode_attention call per kv head
//                       (per 1024-row chunk: gather the code rows, decode,
//                       attend, merge by lse); hbm_frac counts the key and
//                       value codes once (the decoded fp32 rows it also
//                       writes and reads are not counted: the gap is the cost
//                       of not fusing the decode into the attention).
//   CudaKivi/T/role     KIVI-2 (group 32) one-shot quantize of one layer's
//                       rows (role 0 keys, 1 values), 8 kv heads x T tokens
//                       x 128, fp16; hbm_frac counts rows, codes and scales.
//   CudaMerge/T         kvpress MergingPress (threshold 0, every evicted token
//                       a candidate) folding the evicted half of one layer's
//                       8 kv heads x T tokens x 128 fp16 (every other token
//                       kept) into the kept values: the whole merge call,
//                       five launches per head; fp32_frac counts the cosine
//                       search's 2 E C d flops per head.
//   CudaQuestSelect/B   one Quest decode step of a layer for B sequences of
//                       32K tokens (page 16, fp16 metadata, budget 2048
//                       tokens, kPerQueryHead), graph-replayed; hbm_frac counts
//                       the metadata bytes the bounds must read.
//   CudaQuestLookahead/B  one Quest-lookahead prediction for the same batch
//                       (lookahead budget 256 pages, kPerQueryHead): the
//                       selection per sequence, votes, priorities and the
//                       ordered request over every page; enqueued per
//                       iteration; hbm_frac as CudaQuestSelect.
//   CudaShadowKV/B      one ShadowKV prediction for the same batch (default
//                       parameters): outlier and chunk top-k, chunk scores,
//                       priorities, request; hbm_frac counts landmark bytes.
//   CudaSpeCache/B      one SpeCache prediction for the same batch (q4_0 copy,
//                       top 64 tokens per kv head): logits from the copy,
//                       softmax, group mean, top-k, priorities, request;
//                       hbm_frac counts the copy's bytes.
//   CudaInfiniGen/B     one InfiniGen speculation for the same batch (r = 25
//                       of 128 channels): skewed queries, partial logits,
//                       counts, radix-select thresholds, request; hbm_frac
//                       counts the partial keys' bytes.
//
// Counters: `fp32_frac` = logit flops (2*Hq*w*T*d) per second / fp32 peak
// (kept against the fp32 peak although fp16 keys now take the tensor-core
// logits kernel by default); `hbm_frac` = bytes the op must read (keys, or scores) per
// second / read bandwidth; `tokens_per_s` = prompt tokens decided per second.
// tools/gpu/torch_reference.py times kvpress's SnapKV formula and torch.topk
// on the same shapes for the ratio.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench_util.hpp"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/merging/cam.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/minicache.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/policy/quantization/quantized_paged.hpp"
#include "kvpolicy/policy/prefetch/quest_lookahead.hpp"
#include "kvpolicy/policy/prefetch/infinigen.hpp"
#include "kvpolicy/policy/prefetch/shadowkv.hpp"
#include "kvpolicy/policy/prefetch/specache.hpp"
#include "kvpolicy/policy/selection/quest.hpp"

namespace kvp = kvpolicy;
using kvp::backend::Cuda;

namespace {

kvp::backend::Cuda::Peaks g_peaks;
bool g_have_device = false;

using kvp_cuda_bench::DeviceBuffer;

/// `count` samples of N(0, 1) rounded to fp16 from seed `seed`, drawn once and
/// kept for the process. Google Benchmark calls a benchmark function once per
/// repetition and again while it sizes the iteration count; drawing the
/// 33M-134M samples of the largest shapes on every call took longer than the
/// timed work, and cut the device check's run short on an H100 (its time limit
/// stopped the program in CudaQuant).
const std::vector<kvp::half>& normal_halves(std::size_t count, std::uint32_t seed) {
  static std::map<std::pair<std::size_t, std::uint32_t>, std::vector<kvp::half>> cache;
  auto [it, fresh] = cache.try_emplace({count, seed});
  if (fresh) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    it->second.resize(count);
    for (auto& x : it->second) x = kvp::to_half(nd(rng));
  }
  return it->second;
}

/// Times `enqueue` on `stream` with events, one sample per iteration.
template <class F>
void timed_loop(benchmark::State& state, cudaStream_t stream, F&& enqueue) {
  cudaEvent_t a = nullptr, b = nullptr;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (auto _ : state) {
    cudaEventRecord(a, stream);
    const kvp::Status st = enqueue();
    cudaEventRecord(b, stream);
    if (cudaEventSynchronize(b) != cudaSuccess || !st.is_ok()) {
      state.SkipWithError(st.is_ok() ? cudaGetErrorString(cudaGetLastError()) : st.message());
      break;
    }
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, a, b);
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

struct SnapKVCase {
  static constexpr std::int64_t Hq = 32, Hkv = 8, d = 128, w = 64;
  std::int64_t T;
  kvp::SnapKV policy{kvp::SnapKVParams::kvpress(0.5, 64, 5)};
  kvp::Requirements req;
  DeviceBuffer dq, dk, dws, dind;
  std::vector<std::int32_t> indptr;
  explicit SnapKVCase(std::int64_t t)
      : T(t),
        req(policy.requirements(kvp::Context<Cuda>{}, kvp::ProblemShape{Hq, Hkv, d, t, w})),
        dq(static_cast<std::size_t>(Hq * w * d) * sizeof(float)),
        dk(static_cast<std::size_t>(Hkv * t * d) * sizeof(kvp::half)),
        dws(req.workspace_bytes),
        dind(static_cast<std::size_t>(req.output.capacity) * sizeof(std::int32_t)),
        indptr(static_cast<std::size_t>(req.output.rows + 1), 0) {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    std::vector<float> q(static_cast<std::size_t>(Hq * w * d));
    const std::vector<kvp::half>& k = normal_halves(static_cast<std::size_t>(Hkv * T * d), 2);
    for (auto& x : q) x = nd(rng);
    if (dq.ok && dk.ok) {
      cudaMemcpy(dq.ptr, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice);
      cudaMemcpy(dk.ptr, k.data(), k.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
    }
  }
  bool ok() const { return req.status.is_ok() && dq.ok && dk.ok && dws.ok && dind.ok; }
  kvp::ScoreInput<float, kvp::half> input() const {
    constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
    return {kvp::TensorView<const float, 3>::contiguous(static_cast<const float*>(dq.ptr), {Hq, w, d}, gpu),
            kvp::KVSource<kvp::half>::from(
                kvp::TensorView<const kvp::half, 3>::contiguous(static_cast<const kvp::half*>(dk.ptr), {Hkv, T, d}, gpu))};
  }
  kvp::Status evict(cudaStream_t s) {
    const kvp::Context<Cuda> cx{kvp::Workspace{dws.ptr, req.workspace_bytes}, {}, s};
    return policy.evict(cx, input(),
                        kvp::KeepSet{indptr.data(), static_cast<std::int32_t*>(dind.ptr), req.output.rows, req.output.capacity});
  }
  void counters(benchmark::State& state) const {
    const double flops = 2.0 * Hq * w * static_cast<double>(T) * d;
    const double bytes = static_cast<double>(Hkv * T * d) * sizeof(kvp::half);
    state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
    if (g_peaks.fp32_flops_per_s > 0)
      state.counters["fp32_frac"] = benchmark::Counter(flops / g_peaks.fp32_flops_per_s, benchmark::Counter::kIsIterationInvariantRate);
    if (g_peaks.read_bytes_per_s > 0)
      state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
  }
};

void CudaSnapKV(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  SnapKVCase c(state.range(0));
  if (!c.ok()) return state.SkipWithError(c.req.status.is_ok() ? "cudaMalloc failed" : c.req.status.message());
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (const kvp::Status st = c.evict(s); !st.is_ok()) {
    state.SkipWithError(st.message());
  } else {
    cudaStreamSynchronize(s);
    timed_loop(state, s, [&] { return c.evict(s); });
    c.counters(state);
  }
  cudaStreamDestroy(s);
}

/// Captures `enqueue` on `s` once in a CUDA graph, then times its replays; `graph_nodes` is a counter.
template <class F>
void timed_graph(benchmark::State& state, cudaStream_t s, F&& enqueue) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  const kvp::Status st = enqueue();
  const cudaError_t e = cudaStreamEndCapture(s, &graph);
  if (!st.is_ok() || e != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    state.SkipWithError(st.is_ok() ? "graph capture failed" : st.message());
  } else {
    cudaGraphLaunch(exec, s);
    cudaStreamSynchronize(s);
    timed_loop(state, s, [&] {
      return cudaGraphLaunch(exec, s) == cudaSuccess ? kvp::Status::ok()
                                                     : kvp::Status::error(kvp::StatusCode::kDeviceError, "cudaGraphLaunch failed");
    });
    std::size_t nodes = 0;
    cudaGraphGetNodes(graph, nullptr, &nodes);
    state.counters["graph_nodes"] = static_cast<double>(nodes);
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
}

void CudaSnapKVGraph(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  SnapKVCase c(state.range(0));
  if (!c.ok()) return state.SkipWithError(c.req.status.is_ok() ? "cudaMalloc failed" : c.req.status.message());
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  timed_graph(state, s, [&] { return c.evict(s); });
  c.counters(state);
  cudaStreamDestroy(s);
}

/// Ada-KV (kvpress, ratio 0.5, safeguard 0.2) over Ada-KV's SnapKV scoring (window 32, max pool 7) on the
/// SnapKV shape: the keys of SnapKVCase, the row offsets on the device.
struct AdaKVCase {
  SnapKVCase in;
  kvp::AdaKV<kvp::SnapKV> policy{kvp::AdaKVParams::kvpress(0.5), kvp::SnapKV(kvp::adakv_scoring())};
  kvp::Requirements req;
  DeviceBuffer dws, dindptr, dind;
  explicit AdaKVCase(std::int64_t t)
      : in(t),
        req(policy.requirements(kvp::Context<Cuda>{}, kvp::ProblemShape{SnapKVCase::Hq, SnapKVCase::Hkv, SnapKVCase::d, t, 32})),
        dws(req.workspace_bytes),
        dindptr(static_cast<std::size_t>(req.output.rows + 1) * sizeof(std::int32_t)),
        dind(static_cast<std::size_t>(req.output.capacity) * sizeof(std::int32_t)) {}
  bool ok() const { return in.ok() && req.status.is_ok() && dws.ok && dindptr.ok && dind.ok; }
  kvp::Status evict(cudaStream_t s) {
    constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
    const auto full = in.input();  // the first 32 of the 64 window queries of every head
    const kvp::ScoreInput<float, kvp::half> window{
        kvp::TensorView<const float, 3>(full.queries.data() + (SnapKVCase::w - 32) * SnapKVCase::d, {SnapKVCase::Hq, 32, SnapKVCase::d},
                                        {SnapKVCase::w * SnapKVCase::d, SnapKVCase::d, 1}, gpu),
        full.keys};
    return policy.evict(
        kvp::Context<Cuda>{kvp::Workspace{dws.ptr, req.workspace_bytes}, {}, s}, window,
        kvp::KeepSet{static_cast<std::int32_t*>(dindptr.ptr), static_cast<std::int32_t*>(dind.ptr), req.output.rows, req.output.capacity});
  }
};

void CudaAdaKVGraph(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  AdaKVCase c(state.range(0));
  if (!c.ok()) return state.SkipWithError(c.req.status.is_ok() ? "cudaMalloc failed" : c.req.status.message());
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  timed_graph(state, s, [&] { return c.evict(s); });
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(c.in.T), benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}

/// The allocation alone (`Cuda::adakv_keep`): 8 kv-head rows of T scores, kvpress ratio 0.5, safeguard 0.2;
/// hbm_frac counts one read of the score map.
void CudaAdaKVKeep(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  const std::int64_t rows = 8, T = state.range(0);
  const kvp::AdaKVAllocation alloc{kvp::AdaKVVariant::kKvpress, 0.2, false, kvp::Budget::compression_ratio(0.5), 32};
  const kvp::AdaKVKeepSpec spec = alloc.keep_spec(T, rows);
  std::vector<float> scores(static_cast<std::size_t>(rows * T));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (auto& x : scores) x = nd(rng);
  DeviceBuffer dS(scores.size() * sizeof(float)), dcounts(static_cast<std::size_t>(rows) * sizeof(std::int64_t)),
      dindptr(static_cast<std::size_t>(rows + 1) * sizeof(std::int32_t)), dind(scores.size() * sizeof(std::int32_t)),
      dws(Cuda::adakv_keep_workspace(rows, T));
  if (!(dS.ok && dcounts.ok && dindptr.ok && dind.ok && dws.ok)) return state.SkipWithError("cudaMalloc failed");
  cudaMemcpy(dS.ptr, scores.data(), scores.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemset(dindptr.ptr, 0, sizeof(std::int32_t));
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  timed_loop(state, s, [&] {
    const Cuda::CallScope scope(s, 1);
    Cuda::adakv_keep(static_cast<const float*>(dS.ptr), rows, T, spec, static_cast<std::int64_t*>(dcounts.ptr),
                     static_cast<std::int32_t*>(dindptr.ptr), static_cast<std::int32_t*>(dind.ptr),
                     kvp::Workspace{dws.ptr, Cuda::adakv_keep_workspace(rows, T)});
    return scope.end();
  });
  if (g_peaks.read_bytes_per_s > 0)
    state.counters["hbm_frac"] = benchmark::Counter(static_cast<double>(scores.size() * sizeof(float)) / g_peaks.read_bytes_per_s,
                                                    benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}

/// Expected Attention (kvpress defaults: 512 future positions, 4 sinks, covariance and value norms, ratio 0.5)
/// over the whole prompt's queries, 32 query / 8 kv heads, head_dim 128, fp16 queries, keys and values.
/// fp32_frac counts the covariance products (Hq * T * d^2) and the quadratic forms (2 * Hq * T * d^2).
void CudaExpectedAttention(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  constexpr std::int64_t Hq = 32, Hkv = 8, d = 128;
  const std::int64_t T = state.range(0);
  const kvp::ExpectedAttention policy(kvp::ExpectedAttentionParams::kvpress(0.5));
  const kvp::Requirements req = policy.requirements(kvp::Context<Cuda>{}, kvp::ProblemShape{Hq, Hkv, d, T, T});
  if (!req.status.is_ok()) return state.SkipWithError(req.status.message());
  const std::vector<kvp::half>& host = normal_halves(static_cast<std::size_t>(Hq * T * d), 5);
  DeviceBuffer dq(host.size() * sizeof(kvp::half)), dk(static_cast<std::size_t>(Hkv * T * d) * sizeof(kvp::half)),
      dv(static_cast<std::size_t>(Hkv * T * d) * sizeof(kvp::half)), dws(req.workspace_bytes),
      dind(static_cast<std::size_t>(req.output.capacity) * sizeof(std::int32_t));
  if (!(dq.ok && dk.ok && dv.ok && dws.ok && dind.ok)) return state.SkipWithError("cudaMalloc failed");
  cudaMemcpy(dq.ptr, host.data(), host.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
  cudaMemcpy(dk.ptr, host.data(), static_cast<std::size_t>(Hkv * T * d) * sizeof(kvp::half), cudaMemcpyHostToDevice);
  cudaMemcpy(dv.ptr, host.data() + Hkv * T * d, static_cast<std::size_t>(Hkv * T * d) * sizeof(kvp::half), cudaMemcpyHostToDevice);
  constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
  kvp::ExpectedAttentionInput<kvp::half, kvp::half> in;
  in.queries = kvp::TensorView<const kvp::half, 3>::contiguous(static_cast<const kvp::half*>(dq.ptr), {Hq, T, d}, gpu);
  in.keys = kvp::KVSource<kvp::half>::from(
      kvp::TensorView<const kvp::half, 3>::contiguous(static_cast<const kvp::half*>(dk.ptr), {Hkv, T, d}, gpu));
  in.values = kvp::KVSource<kvp::half>::from(
      kvp::TensorView<const kvp::half, 3>::contiguous(static_cast<const kvp::half*>(dv.ptr), {Hkv, T, d}, gpu));
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(req.output.rows + 1));
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const auto evict = [&] {
    return policy.evict(kvp::Context<Cuda>{kvp::Workspace{dws.ptr, req.workspace_bytes}, {}, s}, in,
                        kvp::KeepSet{indptr.data(), static_cast<std::int32_t*>(dind.ptr), req.output.rows, req.output.capacity});
  };
  timed_loop(state, s, evict);
  const double flops = 3.0 * Hq * static_cast<double>(T) * d * d;
  if (g_peaks.fp32_flops_per_s > 0)
    state.counters["fp32_frac"] = benchmark::Counter(flops / g_peaks.fp32_flops_per_s, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}

void CudaQuant(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  constexpr std::int64_t H = 8, d = 128;
  const std::int64_t T = state.range(0);
  const bool decode = state.range(2) != 0;
  const auto run = [&](const auto& policy, const char* label) {
    state.SetLabel(label);
    typename std::decay_t<decltype(policy)>::State st{};
    const std::int64_t rb = policy.row_bytes(d);
    const std::vector<kvp::half>& host = normal_halves(static_cast<std::size_t>(H * T * d), 9);
    DeviceBuffer drows(host.size() * sizeof(kvp::half)), dcodes(static_cast<std::size_t>(H * T * rb));
    if (!(drows.ok && dcodes.ok)) return state.SkipWithError("cudaMalloc failed");
    cudaMemcpy(drows.ptr, host.data(), host.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
    constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
    kvp::QuantizedKV q{
        policy.layout(), kvp::TensorView<std::uint8_t, 3>::contiguous(static_cast<std::uint8_t*>(dcodes.ptr), {H, T, rb}, gpu), {}, T};
    const auto rows = kvp::TensorView<kvp::half, 3>::contiguous(static_cast<kvp::half*>(drows.ptr), {H, T, d}, gpu);
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    const kvp::Context<Cuda> cx{{}, {}, s};
    const auto quantize = [&] { return policy.quantize(cx, kvp::TensorView<const kvp::half, 3>(rows), st, q); };
    if (decode && !quantize().is_ok()) return state.SkipWithError("quantize failed");
    if (decode)
      timed_loop(state, s, [&] { return policy.dequantize(cx, q, rows); });
    else
      timed_loop(state, s, quantize);
    const double bytes = static_cast<double>(H * T) * (d * sizeof(kvp::half) + static_cast<double>(rb));
    if (g_peaks.read_bytes_per_s > 0)
      state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
    cudaStreamDestroy(s);
  };
  switch (state.range(1)) {
    case 0: return run(kvp::GgmlQuant(kvp::GgmlQuantParams{kvp::GgmlType::kQ8_0}), "q8_0");
    case 1: return run(kvp::GgmlQuant(kvp::GgmlQuantParams{kvp::GgmlType::kQ4_0, kvp::HadamardMode::kLlamaCpp}), "q4_0 rotated");
    case 2: return run(kvp::Int4Quant{}, "int4 rotated");
    default:
      return run(kvp::Fp8Quant(kvp::Fp8QuantParams{kvp::Fp8Format::kE4M3, kvp::Fp8Scale::kPerTokenHead, 1.0f}), "fp8 e4m3 per token");
  }
}

void CudaQuantizedPaged(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  constexpr std::int32_t H = 8, P = 16;
  constexpr std::int64_t G = 4, d = 128;
  const std::int64_t T = state.range(0);
  const kvp::GgmlQuant q(kvp::GgmlQuantParams{state.range(1) == 0 ? kvp::GgmlType::kQ8_0 : kvp::GgmlType::kQ4_0});
  state.SetLabel(state.range(1) == 0 ? "q8_0" : "q4_0");
  const std::int64_t rb = q.row_bytes(d);
  const auto pages = static_cast<std::int32_t>((T + P - 1) / P);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(pages)), indptr{0, pages}, last{static_cast<std::int32_t>(T - (pages - 1) * P)};
  for (std::int32_t i = 0; i < pages; ++i) ids[static_cast<std::size_t>(i)] = i;
  const std::vector<kvp::half>& rows = normal_halves(static_cast<std::size_t>(H * T * d), 11);
  const std::vector<kvp::half>& queries = normal_halves(static_cast<std::size_t>(H * G * d), 12);
  std::vector<float> qf(queries.size());
  for (std::size_t i = 0; i < qf.size(); ++i) qf[i] = kvp::to_float(queries[i]);
  const std::size_t pool_bytes = static_cast<std::size_t>(pages) * H * P * static_cast<std::size_t>(rb);
  const std::size_t ws_bytes =
      std::max(kvp::quantized_paged_attention_workspace<Cuda>(q, P, d, G), kvp::quantize_paged_append_workspace<Cuda>(q, P, d, H));
  DeviceBuffer dk(pool_bytes), dv(pool_bytes), dids(ids.size() * sizeof(std::int32_t)), drows(rows.size() * sizeof(kvp::half)),
      dq(qf.size() * sizeof(float)), dout(qf.size() * sizeof(float)), dlse(static_cast<std::size_t>(H * G) * sizeof(float)), dws(ws_bytes);
  if (!(dk.ok && dv.ok && dids.ok && drows.ok && dq.ok && dout.ok && dlse.ok && dws.ok)) return state.SkipWithError("cudaMalloc failed");
  cudaMemcpy(dids.ptr, ids.data(), ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
  cudaMemcpy(drows.ptr, rows.data(), rows.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
  cudaMemcpy(dq.ptr, qf.data(), qf.size() * sizeof(float), cudaMemcpyHostToDevice);
  constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
  const kvp::PageTable table{indptr.data(), static_cast<const std::int32_t*>(dids.ptr), last.data(), 1};
  const kvp::PageStrides cs = kvp::PageStrides::contiguous(kvp::PageLayout::kNHD, H, P, rb);
  const kvp::PagedKVView<std::uint8_t> pool{static_cast<std::uint8_t*>(dk.ptr),
                                            static_cast<std::uint8_t*>(dv.ptr),
                                            cs,
                                            cs,
                                            pages,
                                            H,
                                            P,
                                            static_cast<std::int32_t>(rb),
                                            table,
                                            gpu};
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const kvp::Context<Cuda> cx{kvp::Workspace{dws.ptr, ws_bytes}, {}, s};
  const auto x = kvp::TensorView<const kvp::half, 3>::contiguous(static_cast<const kvp::half*>(drows.ptr), {H, T, d}, gpu);
  for (const bool values : {false, true})
    if (const kvp::Status st = kvp::quantize_paged_append(cx, q, pool, 0, x, values); !st.is_ok()) {
      cudaStreamDestroy(s);
      return state.SkipWithError(st.message());
    }
  cudaStreamSynchronize(s);
  const kvp::PagedKVView<const std::uint8_t> cpool = pool;
  timed_loop(state, s, [&] {
    for (std::int32_t h = 0; h < H; ++h)
      KVP_RETURN_IF_ERROR(kvp::quantized_paged_decode_attention(
          cx, q, q, cpool, h, static_cast<const std::int32_t*>(dids.ptr), T, static_cast<const float*>(dq.ptr) + h * G * d, G, d, 0.088f,
          static_cast<float*>(dout.ptr) + h * G * d, static_cast<float*>(dlse.ptr) + h * G));
    return kvp::Status::ok();
  });
  const double bytes = 2.0 * static_cast<double>(H * T) * static_cast<double>(rb);
  if (g_peaks.read_bytes_per_s > 0)
    state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}

void CudaKivi(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  constexpr std::int64_t H = 8, d = 128;
  const std::int64_t T = state.range(0);
  const kvp::KiviQuant policy(kvp::KiviQuantParams{state.range(1) == 0 ? kvp::QuantRole::kKeys : kvp::QuantRole::kValues, 2, 32, 128});
  const std::int64_t rows = policy.code_rows(T), cb = policy.codes_row_bytes(d), sb = policy.scales_row_bytes(d);
  const std::vector<kvp::half>& host = normal_halves(static_cast<std::size_t>(H * T * d), 10);
  DeviceBuffer dx(host.size() * sizeof(kvp::half)), dc(static_cast<std::size_t>(H * rows * cb)),
      ds(static_cast<std::size_t>(H * rows * sb));
  if (!(dx.ok && dc.ok && ds.ok)) return state.SkipWithError("cudaMalloc failed");
  cudaMemcpy(dx.ptr, host.data(), host.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
  constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
  kvp::QuantizedKV q{policy.layout(), kvp::TensorView<std::uint8_t, 3>::contiguous(static_cast<std::uint8_t*>(dc.ptr), {H, rows, cb}, gpu),
                     kvp::TensorView<std::uint8_t, 3>::contiguous(static_cast<std::uint8_t*>(ds.ptr), {H, rows, sb}, gpu), 0};
  const auto x = kvp::TensorView<const kvp::half, 3>::contiguous(static_cast<const kvp::half*>(dx.ptr), {H, T, d}, gpu);
  kvp::KiviState none;
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  timed_loop(state, s, [&] { return policy.quantize(kvp::Context<Cuda>{{}, {}, s}, x, none, q); });
  const double bytes = static_cast<double>(H) * (static_cast<double>(T * d) * sizeof(kvp::half) + static_cast<double>(rows * (cb + sb)));
  if (g_peaks.read_bytes_per_s > 0)
    state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}

void CudaTopk(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  const std::int64_t rows = 8, n = state.range(0), k = std::max<std::int64_t>(1, n * state.range(1) / 100);
  std::vector<float> h(static_cast<std::size_t>(rows * n));
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (auto& x : h) x = u(rng);
  DeviceBuffer ds(h.size() * sizeof(float)), dout(static_cast<std::size_t>(rows * k) * sizeof(std::int32_t));
  if (!ds.ok || !dout.ok) return state.SkipWithError("cudaMalloc failed");
  cudaMemcpy(ds.ptr, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  auto call = [&] {
    return Cuda::topk_rows(static_cast<const float*>(ds.ptr), rows, n, n, k, static_cast<std::int32_t*>(dout.ptr), k, kvp::Workspace{}, s);
  };
  if (const kvp::Status st = call(); !st.is_ok()) {
    state.SkipWithError(st.message());
  } else {
    cudaStreamSynchronize(s);
    timed_loop(state, s, call);
    const double bytes = static_cast<double>(rows * n) * sizeof(float);
    if (g_peaks.read_bytes_per_s > 0)
      state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["k"] = static_cast<double>(k);
  }
  cudaStreamDestroy(s);
}

/// Runs `enqueue` once under stream capture and times graph replays.
template <class F>
void graph_loop(benchmark::State& state, cudaStream_t s, F&& enqueue) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  const kvp::Status st = enqueue();
  const cudaError_t e = cudaStreamEndCapture(s, &graph);
  if (!st.is_ok() || e != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    state.SkipWithError(st.is_ok() ? "graph capture failed" : st.message());
  } else {
    timed_loop(state, s, [&] {
      return cudaGraphLaunch(exec, s) == cudaSuccess ? kvp::Status::ok()
                                                     : kvp::Status::error(kvp::StatusCode::kDeviceError, "cudaGraphLaunch failed");
    });
    std::size_t nodes = 0;
    cudaGraphGetNodes(graph, nullptr, &nodes);
    state.counters["graph_nodes"] = static_cast<double>(nodes);
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
}

void CudaH2OStep(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  constexpr std::int64_t Hq = 32, Hkv = 8;
  const std::int64_t C = state.range(0), cap = C + 1;
  const kvp::H2O policy(kvp::H2OParams::original(C / 2, C - C / 2));
  DeviceBuffer dstate(static_cast<std::size_t>(Hkv * cap) * sizeof(float)), dprobs(static_cast<std::size_t>(Hq * cap) * sizeof(float));
  DeviceBuffer dws(std::size_t{16} << 20), dind(static_cast<std::size_t>(Hkv * cap) * sizeof(std::int32_t));
  if (!dstate.ok || !dprobs.ok || !dws.ok || !dind.ok) return state.SkipWithError("cudaMalloc failed");
  std::vector<float> h(static_cast<std::size_t>(Hq * cap));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.0f, 1.0f / static_cast<float>(C));
  for (auto& x : h) x = u(rng);
  cudaMemcpy(dprobs.ptr, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemset(dstate.ptr, 0, static_cast<std::size_t>(Hkv * cap) * sizeof(float));
  constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
  kvp::H2OState st;
  st.scores = kvp::TensorView<float, 2>::contiguous(static_cast<float*>(dstate.ptr), {Hkv, cap}, gpu);
  st.length = C;
  st.prompt_len = C;
  kvp::ScoreInput<float, float, float> in;
  in.attention = kvp::TensorView<const float, 3>::contiguous(static_cast<const float*>(dprobs.ptr), {Hq, 1, cap}, gpu);
  std::vector<std::int32_t> indptr(Hkv + 1);
  const kvp::KeepSet out{indptr.data(), static_cast<std::int32_t*>(dind.ptr), Hkv, Hkv * cap};
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const kvp::Context<Cuda> cx{kvp::Workspace{dws.ptr, std::size_t{16} << 20}, {}, s};
  graph_loop(state, s, [&] {
    KVP_RETURN_IF_ERROR(policy.update(cx, st, in));
    return policy.evict(cx, st, out);
  });
  const double bytes = static_cast<double>(Hq * cap + 2 * Hkv * cap) * sizeof(float);  // probabilities once, state read + written
  if (g_peaks.read_bytes_per_s > 0)
    state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}

/// A Quest decode step's inputs on the device: `batch` sequences of 32K tokens on shuffled pages (page 16),
/// fp16 metadata and fp32 queries drawn from N(0, 1) with `seed`; the table's lengths on the host.
struct QuestDecodeCase {
  static constexpr std::int32_t P = 16, Hq = 32, Hkv = 8, d = 128;
  static constexpr std::int64_t T = 32768;
  static constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
  std::int32_t batch, pages_per_seq, pool;
  std::int64_t meta_elems;
  DeviceBuffer dmeta, dids, dq;
  std::vector<std::int32_t> indptr, last;
  QuestDecodeCase(std::int32_t b, unsigned seed)
      : batch(b),
        pages_per_seq(static_cast<std::int32_t>(T / P)),
        pool(b * pages_per_seq),
        meta_elems(kvp::PageMetaView<kvp::half>::contiguous_size(pool, Hkv, d)),
        dmeta(static_cast<std::size_t>(meta_elems) * sizeof(kvp::half)),
        dids(static_cast<std::size_t>(pool) * sizeof(std::int32_t)),
        dq(static_cast<std::size_t>(batch * Hq * d) * sizeof(float)),
        indptr(static_cast<std::size_t>(batch + 1)),
        last(static_cast<std::size_t>(batch), P) {
    if (!ok()) return;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    {
      std::vector<kvp::half> m(static_cast<std::size_t>(meta_elems));
      for (auto& x : m) x = kvp::to_half(nd(rng));
      cudaMemcpy(dmeta.ptr, m.data(), m.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
      std::vector<std::int32_t> ids(static_cast<std::size_t>(pool));
      for (std::int32_t i = 0; i < pool; ++i) ids[static_cast<std::size_t>(i)] = i;
      std::shuffle(ids.begin(), ids.end(), rng);
      cudaMemcpy(dids.ptr, ids.data(), ids.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
      std::vector<float> q(static_cast<std::size_t>(batch * Hq * d));
      for (auto& x : q) x = nd(rng);
      cudaMemcpy(dq.ptr, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice);
    }
    for (std::int32_t i = 0; i <= batch; ++i) indptr[static_cast<std::size_t>(i)] = i * pages_per_seq;
  }
  bool ok() const { return dmeta.ok && dids.ok && dq.ok; }
  kvp::DecodeInput<float> input() const {
    const kvp::PageTable table{indptr.data(), static_cast<const std::int32_t*>(dids.ptr), last.data(), batch};
    return {kvp::TensorView<const float, 3>::contiguous(static_cast<const float*>(dq.ptr), {batch, Hq, d}, gpu), table, P, 5};
  }
  kvp::PageMetaView<const kvp::half> meta() const {
    return kvp::PageMetaView<const kvp::half>::contiguous(static_cast<const kvp::half*>(dmeta.ptr), pool, Hkv, d, gpu);
  }
};

void CudaQuestSelect(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  constexpr std::int32_t Hq = QuestDecodeCase::Hq, Hkv = QuestDecodeCase::Hkv, d = QuestDecodeCase::d;
  const QuestDecodeCase qc(static_cast<std::int32_t>(state.range(0)), 9);
  if (!qc.ok()) return state.SkipWithError("cudaMalloc failed");
  const kvp::DecodeInput<float> in = qc.input();
  kvp::QuestParams qp;
  qp.budget = kvp::Budget::tokens(2048);
  const kvp::Quest quest(qp);
  kvp::Quest::Plan plan;
  if (const kvp::Status st =
          quest.plan(kvp::Context<Cuda>{}, in, kvp::ProblemShape{.num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = d}, plan);
      !st.is_ok())
    return state.SkipWithError(st.message());
  DeviceBuffer dws(plan.requirements.workspace_bytes),
      dout(static_cast<std::size_t>(plan.requirements.output.capacity) * sizeof(std::int32_t));
  if (!dws.ok || !dout.ok) return state.SkipWithError("cudaMalloc failed");
  std::vector<std::int32_t> oindptr(static_cast<std::size_t>(plan.requirements.output.rows + 1)),
      olast(static_cast<std::size_t>(plan.requirements.output.rows));
  const kvp::PageSelection out{oindptr.data(), static_cast<std::int32_t*>(dout.ptr), olast.data(),
                               nullptr,        plan.requirements.output.rows,        plan.requirements.output.capacity};
  const auto meta = qc.meta();
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const kvp::Context<Cuda> cx{kvp::Workspace{dws.ptr, plan.requirements.workspace_bytes}, {}, s};
  graph_loop(state, s, [&] { return quest.select(cx, plan, in, meta, out); });
  const double bytes = static_cast<double>(qc.meta_elems) * sizeof(kvp::half);
  if (g_peaks.read_bytes_per_s > 0)
    state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}

/// N(0, 1) draws for a large device buffer: a million draws from `seed`, strided over `n` elements
/// (generating every element would dominate the setup of the 16-sequence cases).
template <class T>
std::vector<T> strided_normals(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> table(std::size_t{1} << 20);
  for (auto& v : table) v = nd(rng);
  std::vector<T> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = kvp::from_float<T>(table[(i * 7919) & (table.size() - 1)]);
  return x;
}

/// The timed part of a prefetcher's benchmark over a QuestDecodeCase: the policy's device requirements, the
/// workspace and the request (one entry per page), a stream, `prepare(cx)` (the caller's state set-up on the
/// stream), the history reset, then one prediction per iteration, enqueued (the history's serial advances, so
/// a graph replay would list nothing). hbm_frac counts `bytes` read per prediction.
template <class Pol, class State, class Prepare>
void time_prediction(benchmark::State& state, const QuestDecodeCase& qc, const Pol& pol, State& st, double bytes, Prepare prepare) {
  using C = QuestDecodeCase;
  const std::int32_t pool = qc.pool;
  const kvp::ProblemShape shape{.num_q_heads = C::Hq, .num_kv_heads = C::Hkv, .head_dim = C::d, .max_kv_len = C::T, .batch = qc.batch};
  const kvp::Requirements req = pol.requirements(kvp::Context<Cuda>{}, shape, C::P);
  if (!req.status.is_ok()) return state.SkipWithError(req.status.message());
  DeviceBuffer dws(req.workspace_bytes), dpages(static_cast<std::size_t>(pool) * sizeof(std::int32_t)),
      dprio(static_cast<std::size_t>(pool) * sizeof(float));
  if (!dws.ok || !dpages.ok || !dprio.ok) return state.SkipWithError("cudaMalloc failed");
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const kvp::Context<Cuda> cx{kvp::Workspace{dws.ptr, req.workspace_bytes}, {}, s};
  kvp::Status ps = prepare(cx);
  if (ps.is_ok()) ps = st.history.reset(cx);
  if (!ps.is_ok()) {
    cudaStreamDestroy(s);
    return state.SkipWithError(ps.message());
  }
  const kvp::DecodeInput<float> in = qc.input();
  kvp::PrefetchRequest out{static_cast<std::int32_t*>(dpages.ptr), static_cast<float*>(dprio.ptr), pool, 0};
  timed_loop(state, s, [&] { return pol.predict(cx, st, in, out); });
  if (g_peaks.read_bytes_per_s > 0)
    state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pages_per_s"] = benchmark::Counter(static_cast<double>(pool), benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}

kvp::Status no_preparation(const kvp::Context<Cuda>&) { return kvp::Status::ok(); }

// One Quest-lookahead prediction (policy/prefetch/quest_lookahead.hpp) for B
// sequences of 32K tokens: per sequence Quest's device selection with a
// lookahead budget of 256 pages, the vote counts, then the priorities and the
// ordered request (radix sort + the one-block listing) over every page of the
// batch. hbm_frac counts the metadata bytes the bounds read.
void CudaQuestLookahead(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  const QuestDecodeCase qc(static_cast<std::int32_t>(state.range(0)), 11);
  DeviceBuffer dhist(static_cast<std::size_t>(kvp::PrefetchHistory::buffer_size(qc.pool)) * sizeof(std::int64_t));
  if (!qc.ok() || !dhist.ok) return state.SkipWithError("cudaMalloc failed");
  const kvp::QuestLookahead<kvp::half> pol(kvp::QuestLookaheadParams{.page_budget = 256});
  kvp::QuestLookaheadState<kvp::half> st{qc.meta(), kvp::PrefetchHistory::wrap(static_cast<std::int64_t*>(dhist.ptr), qc.pool)};
  time_prediction(state, qc, pol, st, static_cast<double>(qc.meta_elems) * sizeof(kvp::half), no_preparation);
}

// One ShadowKV prediction (policy/prefetch/shadowkv.hpp, default parameters:
// chunks of 8 tokens, 256 selected and 48 outlier chunks per kv head, 4 local)
// for the same batch: per sequence the outlier top-k, the chunk scores (every
// landmark read once per kv head's group), the second top-k and the entries'
// priorities, then the reuse and the ordered request; landmarks and outlier
// scores drawn from N(0, 1). hbm_frac counts the landmark bytes read.
void CudaShadowKV(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  using C = QuestDecodeCase;
  const QuestDecodeCase qc(static_cast<std::int32_t>(state.range(0)), 13);
  const kvp::ShadowKV pol;
  const auto sz = pol.state_size(qc.pool, C::P, C::Hkv, C::d);
  DeviceBuffer dstate(static_cast<std::size_t>(sz.floats) * sizeof(float)),
      dhist(static_cast<std::size_t>(sz.history) * sizeof(std::int64_t));
  if (!qc.ok() || !dstate.ok || !dhist.ok) return state.SkipWithError("cudaMalloc failed");
  const auto x = strided_normals<float>(static_cast<std::size_t>(sz.floats), 17);
  cudaMemcpy(dstate.ptr, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice);
  kvp::ShadowKVState st;
  if (const kvp::Status ms =
          pol.make_state(static_cast<float*>(dstate.ptr), static_cast<std::int64_t*>(dhist.ptr), qc.pool, C::P, C::Hkv, C::d, &st, C::gpu);
      !ms.is_ok())
    return state.SkipWithError(ms.message());
  time_prediction(state, qc, pol, st, static_cast<double>(qc.batch) * (C::T / 8) * C::Hkv * C::d * sizeof(float), no_preparation);
}

// One SpeCache prediction (policy/prefetch/specache.hpp: q4_0 key copy, top 64
// tokens per kv head) for the same batch: per sequence the logits from the
// copy, the softmax and group mean, the top-k and the priorities, then the
// ordered request; the copy quantized from N(0, 1) fp16 keys by on_append on
// the device first (untimed). hbm_frac counts the copy's bytes read.
void CudaSpeCache(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  using C = QuestDecodeCase;
  const QuestDecodeCase qc(static_cast<std::int32_t>(state.range(0)), 19);
  const kvp::SpeCache pol;
  const std::int64_t code_bytes = pol.codes_bytes(qc.pool, C::P, C::Hkv, C::d);
  const std::size_t key_elems = static_cast<std::size_t>(qc.pool) * C::P * C::Hkv * C::d;
  DeviceBuffer dcodes(static_cast<std::size_t>(code_bytes)), dkeys(key_elems * sizeof(kvp::half));
  DeviceBuffer dhist(static_cast<std::size_t>(kvp::PrefetchHistory::buffer_size(qc.pool)) * sizeof(std::int64_t));
  if (!qc.ok() || !dcodes.ok || !dkeys.ok || !dhist.ok) return state.SkipWithError("cudaMalloc failed");
  const auto k = strided_normals<kvp::half>(key_elems, 23);
  cudaMemcpy(dkeys.ptr, k.data(), k.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
  kvp::SpeCacheState st;
  if (const kvp::Status ms = pol.make_state(static_cast<std::uint8_t*>(dcodes.ptr), static_cast<std::int64_t*>(dhist.ptr), qc.pool, C::P,
                                            C::Hkv, C::d, &st, C::gpu);
      !ms.is_ok())
    return state.SkipWithError(ms.message());
  const kvp::PagedKVView<const kvp::half> keys{static_cast<const kvp::half*>(dkeys.ptr),
                                               nullptr,
                                               kvp::PageStrides::contiguous(kvp::PageLayout::kHND, C::Hkv, C::P, C::d),
                                               {},
                                               qc.pool,
                                               C::Hkv,
                                               C::P,
                                               C::d,
                                               qc.input().table,
                                               C::gpu};
  time_prediction(state, qc, pol, st, static_cast<double>(code_bytes), [&](const kvp::Context<Cuda>& cx) {
    return pol.on_append(cx, kvp::AppendInput<kvp::half>{keys, nullptr}, st);
  });
}

// One InfiniGen speculation (policy/prefetch/infinigen.hpp: alpha 5, r = 25
// partial channels of 128, max_num_kv 400) for the same batch: per sequence
// the skewed queries, the partial logits and the counts, then per sequence the
// radix-select threshold and the entries, then the request; the state (skew,
// channels, partial keys) drawn from N(0, 1). hbm_frac counts the partial
// keys' bytes read.
void CudaInfiniGen(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  using C = QuestDecodeCase;
  const QuestDecodeCase qc(static_cast<std::int32_t>(state.range(0)), 29);
  const kvp::InfiniGen pol(kvp::InfiniGenParams{.dense_layers = 0});
  const auto sz = pol.state_size(qc.pool, C::P, C::Hkv, C::d);
  const std::int32_t r = pol.partial_dim(C::d);
  DeviceBuffer dfl(static_cast<std::size_t>(sz.floats) * sizeof(float)), dints(static_cast<std::size_t>(sz.ints) * sizeof(std::int32_t));
  DeviceBuffer dhist(static_cast<std::size_t>(sz.history) * sizeof(std::int64_t));
  if (!qc.ok() || !dfl.ok || !dints.ok || !dhist.ok) return state.SkipWithError("cudaMalloc failed");
  const auto x = strided_normals<float>(static_cast<std::size_t>(sz.floats), 31);
  cudaMemcpy(dfl.ptr, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice);
  std::vector<std::int32_t> ch(static_cast<std::size_t>(sz.ints));
  for (std::size_t i = 0; i < ch.size(); ++i)
    ch[i] = static_cast<std::int32_t>((i % static_cast<std::size_t>(r)) * 5);  // ascending per head
  cudaMemcpy(dints.ptr, ch.data(), ch.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
  kvp::InfiniGenState st;
  if (const kvp::Status ms = pol.make_state(static_cast<float*>(dfl.ptr), static_cast<std::int32_t*>(dints.ptr),
                                            static_cast<std::int64_t*>(dhist.ptr), qc.pool, C::P, C::Hkv, C::d, &st, C::gpu);
      !ms.is_ok())
    return state.SkipWithError(ms.message());
  st.prepared = true;
  time_prediction(state, qc, pol, st, static_cast<double>(qc.batch) * C::T * C::Hkv * r * sizeof(float), no_preparation);
}

}  // namespace

BENCHMARK(CudaSnapKV)->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaSnapKVGraph)->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaAdaKVGraph)->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaAdaKVKeep)->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaExpectedAttention)->Arg(4096)->Arg(32768)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(CudaTopk)->ArgsProduct({{8192, 32768, 131072}, {1, 50}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaH2OStep)->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaQuant)->ArgsProduct({{32768}, {0, 1, 2, 3}, {0, 1}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaQuantizedPaged)->ArgsProduct({{32768}, {0, 1}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaKivi)->ArgsProduct({{32768}, {0, 1}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaQuestSelect)->Arg(1)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaQuestLookahead)->Arg(1)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaShadowKV)->Arg(1)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaSpeCache)->Arg(1)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(CudaInfiniGen)->Arg(1)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond);

void CudaMerge(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  constexpr std::int64_t H = 8, d = 128;
  const std::int64_t T = state.range(0), C = T / 2, E = T - C;
  const std::vector<kvp::half>& hk = normal_halves(static_cast<std::size_t>(H * T * d), 11);
  const std::vector<kvp::half>& hv = normal_halves(static_cast<std::size_t>(H * T * d), 12);
  std::vector<std::int32_t> indptr(H + 1), kept(static_cast<std::size_t>(H * C));
  for (std::int64_t h = 0; h <= H; ++h) indptr[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * C);
  for (std::int64_t i = 0; i < H * C; ++i) kept[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(2 * (i % C));
  const kvp::KvpressMerging policy;
  const kvp::Requirements req = policy.requirements(kvp::Context<Cuda>{}, kvp::ProblemShape{H, H, d, T, 1});
  if (!req.status.is_ok()) return state.SkipWithError(req.status.message());
  DeviceBuffer dk(hk.size() * sizeof(kvp::half)), dv(hv.size() * sizeof(kvp::half)), dkept(kept.size() * sizeof(std::int32_t)),
      ddst(static_cast<std::size_t>(H * E) * sizeof(std::int32_t)), dsrc(static_cast<std::size_t>(H * E) * sizeof(std::int32_t)),
      dw(static_cast<std::size_t>(H * E) * sizeof(float)), dmv(static_cast<std::size_t>(H * C * d) * sizeof(float)),
      dws(req.workspace_bytes);
  if (!(dk.ok && dv.ok && dkept.ok && ddst.ok && dsrc.ok && dw.ok && dmv.ok && dws.ok)) return state.SkipWithError("cudaMalloc failed");
  cudaMemcpy(dk.ptr, hk.data(), hk.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
  cudaMemcpy(dv.ptr, hv.data(), hv.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
  cudaMemcpy(dkept.ptr, kept.data(), kept.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
  constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
  kvp::MergeInput<kvp::half> in;
  in.keys = kvp::KVSource<kvp::half>::from(
      kvp::TensorView<const kvp::half, 3>::contiguous(static_cast<const kvp::half*>(dk.ptr), {H, T, d}, gpu));
  in.values = kvp::KVSource<kvp::half>::from(
      kvp::TensorView<const kvp::half, 3>::contiguous(static_cast<const kvp::half*>(dv.ptr), {H, T, d}, gpu));
  const kvp::KeepSet keep{indptr.data(), static_cast<std::int32_t*>(dkept.ptr), H, H * C};
  std::vector<std::int32_t> plan_indptr(H + 1);
  kvp::MergePlan plan{plan_indptr.data(),
                      static_cast<std::int32_t*>(ddst.ptr),
                      static_cast<std::int32_t*>(dsrc.ptr),
                      static_cast<float*>(dw.ptr),
                      H,
                      H * E};
  plan.merged_values = kvp::TensorView<float, 2>::contiguous(static_cast<float*>(dmv.ptr), {H * C, d}, gpu);
  plan.slots_per_row = C;
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const kvp::Context<Cuda> cx{kvp::Workspace{dws.ptr, req.workspace_bytes}, {}, s};
  timed_loop(state, s, [&] { return policy.merge(cx, in, keep, plan); });
  if (g_peaks.fp32_flops_per_s > 0)
    state.counters["fp32_frac"] = benchmark::Counter(2.0 * static_cast<double>(H * E * C * d) / g_peaks.fp32_flops_per_s,
                                                     benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}
BENCHMARK(CudaMerge)->Arg(4096)->Arg(16384)->UseManualTime()->Unit(benchmark::kMillisecond);

/// CaM's streaming merge over a half cache: every other token evicted, merge_num 16, attention sums per kv
/// head. Bytes: the values read (evicted and kept rows), the sums, the dense plan and the merged rows written.
void CudaCaM(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  constexpr std::int64_t H = 8, d = 128, M = 16;
  const std::int64_t T = state.range(0), C = T / 2, E = T - C;
  const std::vector<kvp::half>& hv = normal_halves(static_cast<std::size_t>(H * T * d), 13);
  std::vector<float> sums(static_cast<std::size_t>(H * T));
  std::mt19937 rng(14);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  for (auto& x : sums) x = ud(rng);
  std::vector<std::int32_t> indptr(H + 1), kept(static_cast<std::size_t>(H * C));
  for (std::int64_t h = 0; h <= H; ++h) indptr[static_cast<std::size_t>(h)] = static_cast<std::int32_t>(h * C);
  for (std::int64_t i = 0; i < H * C; ++i) kept[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(2 * (i % C) + 1);
  const kvp::CaM policy(kvp::CaMParams::streaming(M));
  const kvp::Requirements req = policy.requirements(kvp::Context<Cuda>{}, kvp::ProblemShape{H, H, d, T, 1});
  if (!req.status.is_ok()) return state.SkipWithError(req.status.message());
  const std::size_t entries = static_cast<std::size_t>(H * E * M);
  DeviceBuffer dv(hv.size() * sizeof(kvp::half)), dsums(sums.size() * sizeof(float)), dkept(kept.size() * sizeof(std::int32_t)),
      ddst(entries * sizeof(std::int32_t)), dsrc(entries * sizeof(std::int32_t)), dw(entries * sizeof(float)),
      dmv(static_cast<std::size_t>(H * C * d) * sizeof(float)), dws(req.workspace_bytes);
  if (!(dv.ok && dsums.ok && dkept.ok && ddst.ok && dsrc.ok && dw.ok && dmv.ok && dws.ok)) return state.SkipWithError("cudaMalloc failed");
  cudaMemcpy(dv.ptr, hv.data(), hv.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
  cudaMemcpy(dsums.ptr, sums.data(), sums.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(dkept.ptr, kept.data(), kept.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice);
  constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
  kvp::MergeInput<kvp::half> in;
  in.values = kvp::KVSource<kvp::half>::from(
      kvp::TensorView<const kvp::half, 3>::contiguous(static_cast<const kvp::half*>(dv.ptr), {H, T, d}, gpu));
  in.attention_sums = kvp::TensorView<const float, 2>::contiguous(static_cast<const float*>(dsums.ptr), {H, T}, gpu);
  in.seed = 7;
  const kvp::KeepSet keep{indptr.data(), static_cast<std::int32_t*>(dkept.ptr), H, H * C};
  std::vector<std::int32_t> plan_indptr(H + 1);
  kvp::MergePlan plan{plan_indptr.data(),
                      static_cast<std::int32_t*>(ddst.ptr),
                      static_cast<std::int32_t*>(dsrc.ptr),
                      static_cast<float*>(dw.ptr),
                      H,
                      static_cast<std::int64_t>(entries)};
  plan.merged_values = kvp::TensorView<float, 2>::contiguous(static_cast<float*>(dmv.ptr), {H * C, d}, gpu);
  plan.slots_per_row = C;
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const kvp::Context<Cuda> cx{kvp::Workspace{dws.ptr, req.workspace_bytes}, {}, s};
  timed_loop(state, s, [&] { return policy.merge(cx, in, keep, plan); });
  const double bytes = static_cast<double>(H * T * d) * sizeof(kvp::half) + static_cast<double>(H * T) * sizeof(float) +
                       static_cast<double>(entries) * 12.0 + static_cast<double>(H * C * d) * sizeof(float);
  if (g_peaks.read_bytes_per_s > 0)
    state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}
BENCHMARK(CudaCaM)->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);

/// MiniCache over a layer pair of half rows (H = 8, d = 128). Bytes: both layers read, norms and fp32
/// directions written (the retained rows are a small fraction and not counted).
void CudaMiniCache(benchmark::State& state) {
  if (!g_have_device) return state.SkipWithError("no CUDA device");
  constexpr std::int64_t H = 8, d = 128;
  const std::int64_t T = state.range(0), rows = H * T;
  const std::vector<kvp::half>& hp = normal_halves(static_cast<std::size_t>(rows * d), 15);
  const std::vector<kvp::half>& hc = normal_halves(static_cast<std::size_t>(rows * d), 16);
  const kvp::MiniCache policy;
  const kvp::Requirements req = policy.requirements(kvp::Context<Cuda>{}, kvp::ProblemShape{H, H, d, T, 1});
  if (!req.status.is_ok()) return state.SkipWithError(req.status.message());
  const auto n = static_cast<std::size_t>(rows);
  DeviceBuffer dp(hp.size() * sizeof(kvp::half)), dc(hc.size() * sizeof(kvp::half)), ddir(n * d * sizeof(float)), dnp(n * sizeof(float)),
      dnc(n * sizeof(float)), drp(n * d * sizeof(float)), drc(n * d * sizeof(float)), dind((H + 1) * sizeof(std::int32_t)),
      didx(n * sizeof(std::int32_t)), dws(req.workspace_bytes);
  if (!(dp.ok && dc.ok && ddir.ok && dnp.ok && dnc.ok && drp.ok && drc.ok && dind.ok && didx.ok && dws.ok))
    return state.SkipWithError("cudaMalloc failed");
  cudaMemcpy(dp.ptr, hp.data(), hp.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
  cudaMemcpy(dc.ptr, hc.data(), hc.size() * sizeof(kvp::half), cudaMemcpyHostToDevice);
  constexpr kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
  const kvp::MiniCacheInput<kvp::half> in{kvp::KVSource<kvp::half>::from(kvp::TensorView<const kvp::half, 3>::contiguous(
                                              static_cast<const kvp::half*>(dp.ptr), {H, T, d}, gpu)),
                                          kvp::KVSource<kvp::half>::from(kvp::TensorView<const kvp::half, 3>::contiguous(
                                              static_cast<const kvp::half*>(dc.ptr), {H, T, d}, gpu))};
  kvp::MiniCacheMerged m;
  m.direction = kvp::TensorView<float, 3>::contiguous(static_cast<float*>(ddir.ptr), {H, T, d}, gpu);
  m.norm_prev = kvp::TensorView<float, 2>::contiguous(static_cast<float*>(dnp.ptr), {H, T}, gpu);
  m.norm_cur = kvp::TensorView<float, 2>::contiguous(static_cast<float*>(dnc.ptr), {H, T}, gpu);
  m.retained = kvp::KeepSet{static_cast<std::int32_t*>(dind.ptr), static_cast<std::int32_t*>(didx.ptr), H, rows};
  m.retained_prev = kvp::TensorView<float, 2>::contiguous(static_cast<float*>(drp.ptr), {rows, d}, gpu);
  m.retained_cur = kvp::TensorView<float, 2>::contiguous(static_cast<float*>(drc.ptr), {rows, d}, gpu);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const kvp::Context<Cuda> cx{kvp::Workspace{dws.ptr, req.workspace_bytes}, {}, s};
  timed_loop(state, s, [&] { return policy.merge(cx, in, m); });
  const double bytes = 2.0 * static_cast<double>(rows * d) * sizeof(kvp::half) + static_cast<double>(rows * d) * sizeof(float) +
                       2.0 * static_cast<double>(rows) * sizeof(float);
  if (g_peaks.read_bytes_per_s > 0)
    state.counters["hbm_frac"] = benchmark::Counter(bytes / g_peaks.read_bytes_per_s, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  cudaStreamDestroy(s);
}
BENCHMARK(CudaMiniCache)->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  int devices = 0;
  g_have_device = Cuda::device_count(&devices).is_ok() && devices > 0;
  if (g_have_device) {
    if (const kvp::Status st = Cuda::measure_peaks(&g_peaks); !st.is_ok()) std::fprintf(stderr, "measure_peaks: %s\n", st.message());
    benchmark::AddCustomContext("device", g_peaks.name);
    benchmark::AddCustomContext("sm_count", std::to_string(g_peaks.sm_count));
    benchmark::AddCustomContext("peak_read_GBps", std::to_string(g_peaks.read_bytes_per_s * 1e-9));
    benchmark::AddCustomContext("peak_fp32_TFLOPs", std::to_string(g_peaks.fp32_flops_per_s * 1e-12));
    benchmark::AddCustomContext("peak_fp16_mma_TFLOPs", std::to_string(g_peaks.fp16_tc_flops_per_s * 1e-12));
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
