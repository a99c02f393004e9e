// SPDX-License-Identifier: Apache-2.0
// Merging family: each merge step and the full evict -> merge -> quantize
// pipeline on one layer's fp16 cache of 32K tokens (8 kv heads x 32768 x 128:
// 64 MiB of K + 64 MiB of V), backend::Cpu, one thread. CPU time, medians of
// 3 repetitions. 128 MiB exceeds most servers' last-level cache but not every
// one (the machine these figures were last taken on reports 480 MiB): where it
// fits, the bandwidth counters are cache figures and can pass the probe's.
//
//   apply/merge_and_compact     apply::merge_and_compact_contiguous, keep 25 %, every kept row merged
//                               (the cache copy that resets it is not timed)
//   kvpress_cam/prefill         KvpressCAM, keep 25 %, every evicted token a candidate (merge_budget 32)
//   cam/keep25                  CaM streaming form on a keep-25 % set (the pipeline's merge step)
//   cam/decode                  CaM streaming, one token leaves per head (the original's decode step)
//   <cosine>/decode             KvpressMerging, D2O, LOOK-M, NearestKept: 32 evicted tokens per head
//                               against the 32K-32 kept ones (a decode-time eviction)
//   <cosine>/prefill_4k         the same policies at prefill, 4096 tokens, keep 50 % (E x C x d FMAs)
//   minicache/merge             two layers' keys -> SLERP directions + norms + retained rows
//   pipeline/snapkv_cam_q8_0    Compress<SnapKV, CaM (streaming form), GgmlQuant q8_0>, 32 query heads, window 64,
//                               token budget 8192 (the cache copy that resets it is not timed)
//
// Counters: GB/s and pct_peak_bw over the bytes a step cannot avoid reading or
// writing (stated per benchmark below), against the in-process single-core
// read bandwidth probe (peak.hpp); the cosine merges also report GFLOP/s and
// pct_peak_fma (2 flops per (evicted, kept) key pair and channel): they are
// compute-bound (fp32 dot products written as portable loops, no SIMD op).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "bench_util.hpp"
#include "kvpolicy/apply/merge.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/merging/cam.hpp"
#include "kvpolicy/policy/merging/d2o.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"
#include "kvpolicy/policy/merging/minicache.hpp"
#include "kvpolicy/policy/merging/nearest_kept.hpp"
#include "kvpolicy/policy/pipeline.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"

using namespace kvpolicy;

namespace {

constexpr std::int64_t kH = 8, kT = 32768, kD = 128;

struct Layer {
  std::vector<half> k = kvp_bench::normal_values<half>(static_cast<std::size_t>(kH * kT * kD), 1);
  std::vector<half> v = kvp_bench::normal_values<half>(static_cast<std::size_t>(kH * kT * kD), 2);
  std::vector<float> attn = kvp_bench::score_values(static_cast<std::size_t>(kH * kT), 3);
};
Layer& layer() {
  static Layer l;
  return l;
}

struct Plan {
  std::vector<std::int32_t> indptr, dst, src;
  std::vector<float> weight, keys, values;
  MergePlan view;
  Plan(std::int64_t rows, std::int64_t cap, std::int64_t slots, std::int64_t d, bool with_keys)
      : indptr(rows + 1), dst(cap), src(cap), weight(cap), keys(with_keys ? rows * slots * d : 0), values(rows * slots * d) {
    view = MergePlan{indptr.data(), dst.data(), src.data(), weight.data(), rows, cap};
    if (with_keys) view.merged_keys = TensorView<float, 2>::contiguous(keys.data(), {rows * slots, d});
    view.merged_values = TensorView<float, 2>::contiguous(values.data(), {rows * slots, d});
    view.slots_per_row = slots;
  }
};

struct Keep {
  std::vector<std::int32_t> indptr, indices;
  KeepSet view;
  /// Every head keeps the first `sinks` tokens, every `stride`-th token and the last `recent`.
  Keep(std::int64_t H, std::int64_t T, std::int64_t n) : indptr(H + 1) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t j = 0; j < n; ++j) indices.push_back(static_cast<std::int32_t>(j * T / n));
      indptr[h + 1] = static_cast<std::int32_t>(indices.size());
    }
    view = KeepSet{indptr.data(), indices.data(), H, static_cast<std::int64_t>(indices.size())};
  }
  /// Every head evicts `e` evenly spaced tokens (the middle of each of e equal runs).
  static Keep evicting(std::int64_t H, std::int64_t T, std::int64_t e) {
    Keep k(H, T, 0);
    k.indices.clear();
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t j = 0; j < T; ++j)
        if (j % (T / e) != (T / e) / 2) k.indices.push_back(static_cast<std::int32_t>(j));
      k.indptr[h + 1] = static_cast<std::int32_t>(k.indices.size());
    }
    k.view = KeepSet{k.indptr.data(), k.indices.data(), H, static_cast<std::int64_t>(k.indices.size())};
    return k;
  }
};

template <class In>
In input(std::int64_t H, std::int64_t T) {
  Layer& l = layer();
  In in;
  in.keys = KVSource<half>::from(TensorView<const half, 3>(l.k.data(), {H, T, kD}, {kT * kD, kD, 1}));
  in.values = KVSource<half>::from(TensorView<const half, 3>(l.v.data(), {H, T, kD}, {kT * kD, kD, 1}));
  in.attention_sums = TensorView<const float, 2>(l.attn.data(), {H, T}, {kT, 1});
  in.seed = 7;
  return in;
}

template <class P, class In>
void run_merge(benchmark::State& st, const P& policy, In in, const Keep& keep, std::int64_t H, std::int64_t T, std::int64_t per_token,
               bool with_keys, double bytes, double flops) {
  const Context<backend::Cpu> probe{};
  const Requirements r = policy.requirements(probe, ProblemShape{H, H, kD, T, 1});
  if (!r.status.is_ok()) {
    st.SkipWithError(r.status.message());
    return;
  }
  std::vector<std::byte> ws(r.workspace_bytes);
  std::int64_t max_kept = 0;
  for (std::int64_t h = 0; h < H; ++h) max_kept = std::max<std::int64_t>(max_kept, keep.view.row_size(h));
  Plan plan(H, H * T * per_token, max_kept, kD, with_keys);
  const Context<backend::Cpu> cx{Workspace{ws.data(), ws.size()}};
  for (auto _ : st) {
    const Status s = policy.merge(cx, in, keep.view, plan.view);
    if (!s.is_ok()) st.SkipWithError(s.message());
    benchmark::DoNotOptimize(plan.values.data());
    benchmark::ClobberMemory();
  }
  st.counters["entries"] = static_cast<double>(plan.indptr[static_cast<std::size_t>(H)]);
  if (bytes > 0) kvp_bench::report_bytes(st, bytes);
  if (flops > 0) kvp_bench::report_flops(st, flops);
}

void bench_apply(benchmark::State& st) {
  // Keep 25 %; every kept slot gets a merged K and V row. Bytes: kept K/V rows read + written (fp16), merged rows read (fp32).
  Layer& l = layer();
  std::vector<half> k = l.k, v = l.v;
  std::vector<std::int32_t> pos(static_cast<std::size_t>(kH * kT));
  const std::int64_t n = kT / 4;
  const Keep keep(kH, kT, n);
  Plan plan(kH, kH * n, n, kD, true);
  plan.indptr[0] = 0;
  for (std::int64_t h = 0; h < kH; ++h) {
    for (std::int64_t c = 0; c < n; ++c) {
      plan.dst[h * n + c] = static_cast<std::int32_t>(c);
      plan.src[h * n + c] = static_cast<std::int32_t>(keep.view.row(h)[c] + 1);
      plan.weight[h * n + c] = 0.5f;
    }
    plan.indptr[h + 1] = static_cast<std::int32_t>((h + 1) * n);
  }
  std::fill(plan.keys.begin(), plan.keys.end(), 0.25f);
  std::fill(plan.values.begin(), plan.values.end(), -0.25f);
  std::vector<std::int64_t> lens(kH);
  for (auto _ : st) {
    st.PauseTiming();
    std::copy(l.k.begin(), l.k.end(), k.begin());
    std::copy(l.v.begin(), l.v.end(), v.begin());
    std::iota(pos.begin(), pos.end(), 0);
    st.ResumeTiming();
    const Status s = merge_and_compact_contiguous(
        TensorView<half, 3>::contiguous(k.data(), {kH, kT, kD}), TensorView<half, 3>::contiguous(v.data(), {kH, kT, kD}),
        TensorView<std::int32_t, 2>::contiguous(pos.data(), {kH, kT}), kT, keep.view, 0, plan.view, lens);
    if (!s.is_ok()) st.SkipWithError(s.message());
    benchmark::ClobberMemory();
  }
  // Validation reads the merged rows once, compaction moves K/V, the write pass reads merged rows and writes K/V.
  kvp_bench::report_bytes(st, static_cast<double>(kH * n * kD) * (2 * 2 * 2 + 2 * 4 * 2 + 2 * 2));
}

void bench_pipeline(benchmark::State& st) {
  Layer& l = layer();
  const std::int64_t Hq = 32, w = 64, n = 8192;
  std::vector<half> k = l.k, v = l.v;
  std::vector<std::int32_t> pos(static_cast<std::size_t>(kH * kT));
  std::vector<float> q = kvp_bench::normal_values<float>(static_cast<std::size_t>(Hq * w * kD), 9);
  const GgmlQuant q8(GgmlQuantParams{GgmlType::kQ8_0});
  const Compress<SnapKV, CaM, GgmlQuant> pipe(SnapKV(SnapKVParams::kvpress(0.5, static_cast<std::int32_t>(w), 5)), CaM{}, q8,
                                              PipelineBudget::tokens(n));
  const Context<backend::Cpu> probe{};
  const Requirements r = pipe.requirements(probe, ProblemShape{Hq, kH, kD, kT, w});
  if (!r.status.is_ok()) {
    st.SkipWithError(r.status.message());
    return;
  }
  std::vector<std::byte> ws(r.workspace_bytes);
  const Context<backend::Cpu> cx{Workspace{ws.data(), ws.size()}};
  std::vector<std::int32_t> kip(kH + 1), kid(kH * n);
  Plan plan(kH, kH * kT * 32, n, kD, false);
  std::vector<std::uint8_t> kb(static_cast<std::size_t>(kH * n * q8.row_bytes(kD))), vb(kb.size());
  QuantizedKV qk, qv;
  qk.layout = qv.layout = q8.layout();
  qk.codes = TensorView<std::uint8_t, 3>::contiguous(kb.data(), {kH, n, q8.row_bytes(kD)});
  qv.codes = TensorView<std::uint8_t, 3>::contiguous(vb.data(), {kH, n, q8.row_bytes(kD)});
  std::vector<std::int64_t> lens(kH);
  MemoryAccount acc;
  const auto kview = TensorView<half, 3>::contiguous(k.data(), {kH, kT, kD}),
             vview = TensorView<half, 3>::contiguous(v.data(), {kH, kT, kD});
  ScoreInput<float, half> sin{TensorView<const float, 3>::contiguous(q.data(), {Hq, w, kD}),
                              KVSource<half>::from(TensorView<const half, 3>(kview))};
  MergeInput<half> min;
  min.keys = KVSource<half>::from(TensorView<const half, 3>(kview));
  min.values = KVSource<half>::from(TensorView<const half, 3>(vview));
  min.attention_sums = TensorView<const float, 2>::contiguous(l.attn.data(), {kH, kT});
  for (auto _ : st) {
    st.PauseTiming();
    std::copy(l.k.begin(), l.k.end(), k.begin());
    std::copy(l.v.begin(), l.v.end(), v.begin());
    std::iota(pos.begin(), pos.end(), 0);
    st.ResumeTiming();
    const Status s =
        pipe.run(cx, sin, min, CompressCache<half>{kview, vview, TensorView<std::int32_t, 2>::contiguous(pos.data(), {kH, kT}), kT},
                 CompressOutput{KeepSet{kip.data(), kid.data(), kH, kH * n}, plan.view, qk, qv, lens, &acc});
    if (!s.is_ok()) st.SkipWithError(s.message());
    benchmark::ClobberMemory();
  }
  st.counters["bytes_per_token_before"] = acc.bytes_per_token_before;
  st.counters["bytes_per_token_after"] = acc.bytes_per_token_after;
  st.counters["bytes_per_prompt_token_after"] = acc.bytes_per_prompt_token_after();
  // Unavoidable: K read (scoring), V read (merge), kept K/V moved, codes written.
  kvp_bench::report_bytes(st, static_cast<double>(kH * kT * kD * 2 * 2 + kH * n * kD * 2 * 2 * 2) + static_cast<double>(kb.size() * 2));
}

void bench_minicache(benchmark::State& st) {
  Layer& l = layer();
  const std::int64_t H = kH, T = kT;
  std::vector<float> dir(static_cast<std::size_t>(H * T * kD)), np(H * T), nc(H * T), rp(static_cast<std::size_t>(H * T * kD)),
      rc(static_cast<std::size_t>(H * T * kD));
  std::vector<std::int32_t> ip(H + 1), idx(H * T);
  MiniCacheMerged m{TensorView<float, 3>::contiguous(dir.data(), {H, T, kD}), TensorView<float, 2>::contiguous(np.data(), {H, T}),
                    TensorView<float, 2>::contiguous(nc.data(), {H, T}),      KeepSet{ip.data(), idx.data(), H, H * T},
                    TensorView<float, 2>::contiguous(rp.data(), {H * T, kD}), TensorView<float, 2>::contiguous(rc.data(), {H * T, kD})};
  // The "two layers": this layer's keys and values stand in for layers l-1 and l.
  const MiniCacheInput<half> in{KVSource<half>::from(TensorView<const half, 3>::contiguous(l.k.data(), {H, T, kD})),
                                KVSource<half>::from(TensorView<const half, 3>::contiguous(l.v.data(), {H, T, kD}))};
  const MiniCache mc;
  std::vector<std::byte> ws(mc.requirements(Context<backend::Cpu>{}, ProblemShape{H, H, kD, T, 1}).workspace_bytes);
  for (auto _ : st) {
    const Status s = mc.merge(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, in, m);
    if (!s.is_ok()) st.SkipWithError(s.message());
    benchmark::ClobberMemory();
  }
  st.counters["retained"] = static_cast<double>(ip[H]);
  // Two passes read both layers (fp16), one writes the fp32 directions.
  kvp_bench::report_bytes(st, static_cast<double>(H * T * kD) * (2 * 2 * 2 + 4));
}

void register_all() {
  auto reg = [](const char* name, auto fn) {
    benchmark::RegisterBenchmark(name, fn)->Unit(benchmark::kMillisecond)->Repetitions(3)->ReportAggregatesOnly()->MinTime(0.05);
  };
  reg("apply/merge_and_compact", bench_apply);
  reg("kvpress_cam/prefill", [](benchmark::State& st) {
    const Keep keep(kH, kT, kT / 4);
    // Bytes: every evicted value row read, 32 kept rows touched per merge (fp32 read+write), attention read.
    run_merge(st, KvpressCAM{}, input<MergeInput<half>>(kH, kT), keep, kH, kT, 32, false, static_cast<double>(kH * kT) * (kD * 2 + 4), 0);
  });
  reg("cam/keep25", [](benchmark::State& st) {
    // The streaming form on a one-shot keep set (the pipeline's merge step): 24K evicted per head, 16 neighbours each.
    const Keep keep(kH, kT, kT / 4);
    run_merge(st, CaM{}, input<MergeInput<half>>(kH, kT), keep, kH, kT, 16, false, static_cast<double>(kH * kT) * (kD * 2 + 4), 0);
  });
  reg("cam/decode", [](benchmark::State& st) {
    const Keep keep = Keep::evicting(kH, kT, 1);
    run_merge(st, CaM{}, input<MergeInput<half>>(kH, kT), keep, kH, kT, 16, false, static_cast<double>(kH * kT) * 4, 0);
  });
  const std::int64_t E = 32;
  auto decode = [E](const char* name, auto policy, auto in, bool keys) {
    benchmark::RegisterBenchmark(name,
                                 [=](benchmark::State& st) {
                                   const Keep keep = Keep::evicting(kH, kT, E);
                                   // Bytes: every key read once (kept keys normalised, evicted keys), K/V of touched slots.
                                   run_merge(st, policy, in, keep, kH, kT, 1, keys, static_cast<double>(kH * kT * kD * 2),
                                             2.0 * kH * E * (kT - E) * kD);
                                 })
        ->Unit(benchmark::kMillisecond)
        ->Repetitions(3)
        ->ReportAggregatesOnly()
        ->MinTime(0.05);
  };
  static D2OState d2o_state;
  D2OInput<half> din;
  static_cast<MergeInput<half>&>(din) = input<MergeInput<half>>(kH, kT);
  din.state = &d2o_state;
  static std::vector<float> weights(static_cast<std::size_t>(kH * kT), 1.0f);
  NearestKeptInput<half> nin;
  static_cast<MergeInput<half>&>(nin) = input<MergeInput<half>>(kH, kT);
  nin.state.weights = TensorView<float, 2>::contiguous(weights.data(), {kH, kT});
  decode("kvpress_merging/decode", KvpressMerging{}, input<MergeInput<half>>(kH, kT), false);
  decode("d2o/decode", D2O{}, din, true);
  decode("lookm_pivot/decode", LookMPivot{}, input<MergeInput<half>>(kH, kT), true);
  decode("nearest_kept/decode", NearestKeptMerge{}, nin, true);
  auto prefill = [](const char* name, auto policy, auto in, bool keys) {
    benchmark::RegisterBenchmark(name,
                                 [=](benchmark::State& st) {
                                   const std::int64_t H = 2, T = 4096;
                                   const Keep keep(H, T, T / 2);
                                   run_merge(st, policy, in, keep, H, T, 1, keys, 0, 2.0 * static_cast<double>(H) * (T / 2) * (T / 2) * kD);
                                 })
        ->Unit(benchmark::kMillisecond)
        ->Repetitions(3)
        ->ReportAggregatesOnly()
        ->MinTime(0.05);
  };
  prefill("kvpress_merging/prefill_4k", KvpressMerging{}, input<MergeInput<half>>(2, 4096), false);
  prefill("lookm_pivot/prefill_4k", LookMPivot{}, input<MergeInput<half>>(2, 4096), true);
  reg("minicache/merge", bench_minicache);
  reg("pipeline/snapkv_cam_q8_0", bench_pipeline);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  kvp_bench::add_peak_context();
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
