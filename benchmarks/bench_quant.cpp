// SPDX-License-Identifier: Apache-2.0
// Quantization family: quantize and dequantize throughput per format on one
// layer's cache streamed from memory (8 kv heads x 16384 tokens x 128, fp16
// in / out: 32 MiB of fp16 plus the codes), through the policies on
// backend::Cpu, one thread. Each iteration works on the next of several copies
// of the layer (rows, codes and output alike), enough that together they hold
// more than twice the last-level cache the OS reports (a model's layers do):
// a layer is never still cached when its turn comes round again, whatever the
// machine's cache size (the copies: 'copies' counter).
//
//   quantize/<format>    GgmlQuant / Fp8Quant / Int4Quant / KiviQuant::quantize: fp16 rows -> codes
//                        (the policy: its finiteness check reads the rows once before the codes are written)
//   quantize_op/<format> backend::Cpu::ggml_quantize_row on the same rows, one call per head (no check)
//   dequantize/<format>/streaming  the decoders with backend::Cpu::set_streaming_stores(true) (rows written
//                        by non-temporal stores, no read for ownership): the ggml formats, int4_token, KIVI
//                        values
//   check_finite/fp16    backend::Cpu::first_nonfinite over the same rows (the policies' check alone)
//   dequantize/<format>  ::dequantize: codes -> fp16 rows
//   (<format>_rot: the Hadamard rotation of llama.cpp's rule in front, n = 128 keys / 64 values;
//   kivi_<k|v><bits>: codes plus the separate scale rows)
//   score/snapkv_<format>  SnapKV's scores (window 64, 32 query / 8 kv heads, 4096 tokens, d = 128) on the
//                          fp16 keys and, through QuantizedKeys, on the same keys stored in <format>:
//                          GFLOP/s and pct_peak_fma over the window logits (2 Hq w T d), tokens/s
//                          (kv heads x tokens scored per second), against score/snapkv_fp16
//   paged_attention/<format>_<backend>  quantized_paged_decode_attention: one decode step of a 4-query GQA group
//                          per kv head over a page pool of codes (8 kv heads x 16384 tokens, pages of 16 in
//                          shuffled order, d = 128, K and V in <format>), backend::Scalar (the reference: scalar
//                          codecs and attention) against backend::Cpu (vectorised codecs, the SIMD paged op,
//                          pages merged by log-sum-exp); paged_attention/fp16_cpu: the same step on an fp16
//                          pool through backend::Cpu::paged_decode_attention (no decoding), the speed of light
//                          the codes are compared with. Bytes: the codes (or fp16 rows) read once. The pools
//                          (17-64 MiB) are not rotated: where the last-level cache holds them, their GB/s are
//                          cache figures, the same for the fp16 pool and the codes.
//
// Each run reports GB/s and pct_peak_bw over the bytes a pass cannot avoid
// (fp16 rows read or written once, codes written or read once) against the
// in-process single-core read bandwidth probe (peak.hpp). Goal (issue #11):
// >= 80 % of it. Times are CPU time, medians of 5 repetitions.
//   read_pass/fp16 (the probe's kernel over the same rotation) shows what a pure
//   read of a layer reaches here. Two costs this count leaves out: a policy's
//   quantize reads its rows twice (the finiteness check, before anything is
//   written, then the codes), and every written line is first read for
//   ownership and later written back, so a written byte moves twice.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "bench_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "kvpolicy/policy/quantization/quantized_keys.hpp"
#include "kvpolicy/policy/quantization/quantized_paged.hpp"

using namespace kvpolicy;

namespace {

constexpr std::int64_t kH = 8, kT = 16384, kD = 128;

constexpr std::size_t kLayer = static_cast<std::size_t>(kH * kT * kD);  // fp16 values in one layer

/// How many copies of a layer the timed loops rotate through: each pass touches at least one layer of fp16
/// rows, so this many passes stream more than twice the last-level cache (64 MiB assumed when the OS does not
/// say) before a copy comes round again.
std::size_t copies() {
  static const std::size_t n = [] {
    const std::size_t llc = kvp_bench::peak().llc_bytes != 0 ? kvp_bench::peak().llc_bytes : std::size_t{64} << 20;
    return std::clamp<std::size_t>(2 * llc / (kLayer * sizeof(half)) + 1, 2, 64);
  }();
  return n;
}

struct Cache {
  std::vector<half> rows = kvp_bench::normal_values<half>(kLayer, 5);  // copy 0, also the setup of the other groups
  std::vector<half> all_rows;                                          // copies() copies of rows, made on first use
  std::vector<half> all_out;                                           // copies() output layers, made on first use
  const half* rows_copy(std::size_t i) {
    if (all_rows.empty()) {
      all_rows.resize(kLayer * copies());
      for (std::size_t c = 0; c < copies(); ++c)
        std::copy(rows.begin(), rows.end(), all_rows.begin() + static_cast<std::ptrdiff_t>(c * kLayer));
    }
    return all_rows.data() + (i % copies()) * kLayer;
  }
  half* out_copy(std::size_t i) {
    if (all_out.empty()) all_out.assign(kLayer * copies(), half{});
    return all_out.data() + (i % copies()) * kLayer;
  }
};
Cache& cache() {
  static Cache c;
  return c;
}

void report_layer_bytes(benchmark::State& st, double bytes_per_iteration) {
  kvp_bench::report_bytes(st, bytes_per_iteration);
  st.counters["copies"] = static_cast<double>(copies());
}

template <class P>
void run(benchmark::State& st, const P& policy, bool quantize) {
  Cache& c = cache();
  const std::size_t n = copies();
  const std::int64_t rb = policy.row_bytes(kD);
  const std::size_t layer_codes = static_cast<std::size_t>(kH * kT * rb);
  std::vector<std::uint8_t> codes(layer_codes * n);
  std::vector<QuantizedKV> q(n);
  std::vector<typename P::State> state(n);
  const Context<backend::Cpu> cx{};
  auto in = [&](std::size_t i) { return TensorView<const half, 3>::contiguous(c.rows_copy(i), {kH, kT, kD}); };
  for (std::size_t i = 0; i < n; ++i) {
    q[i].layout = policy.layout();
    q[i].codes = TensorView<std::uint8_t, 3>::contiguous(codes.data() + i * layer_codes, {kH, kT, rb});
    q[i].tokens = kT;
    if (!policy.quantize(cx, in(i), state[i], q[i]).is_ok()) return st.SkipWithError("quantize failed");
  }
  std::size_t i = 0;
  for (auto _ : st) {
    const std::size_t j = i++ % n;
    const Status s = quantize ? policy.quantize(cx, in(j), state[j], q[j])
                              : policy.dequantize(cx, q[j], TensorView<half, 3>::contiguous(c.out_copy(j), {kH, kT, kD}));
    if (!s.is_ok()) st.SkipWithError(s.message());
    benchmark::DoNotOptimize(codes.data());
    benchmark::ClobberMemory();
  }
  report_layer_bytes(st, static_cast<double>(kLayer * sizeof(half) + layer_codes));
}

void run_kivi(benchmark::State& st, const KiviQuant& policy, bool quantize, int threads = 1) {
  Cache& c = cache();
  const std::size_t n = copies();
  const std::int64_t rows = policy.code_rows(kT);
  const std::size_t layer_codes = static_cast<std::size_t>(kH * rows * policy.codes_row_bytes(kD));
  const std::size_t layer_scales = static_cast<std::size_t>(kH * rows * policy.scales_row_bytes(kD));
  std::vector<std::uint8_t> codes(layer_codes * n), scales(layer_scales * n);
  std::vector<QuantizedKV> q(n);
  std::vector<KiviState> state(n);
  ThreadPool pool(threads);
  const Context<backend::Cpu> cx{{}, threads > 1 ? pool.context() : ExecContext{}};
  auto in = [&](std::size_t i) { return TensorView<const half, 3>::contiguous(c.rows_copy(i), {kH, kT, kD}); };
  for (std::size_t i = 0; i < n; ++i) {
    q[i].layout = policy.layout();
    q[i].codes = TensorView<std::uint8_t, 3>::contiguous(codes.data() + i * layer_codes, {kH, rows, policy.codes_row_bytes(kD)});
    q[i].scales = TensorView<std::uint8_t, 3>::contiguous(scales.data() + i * layer_scales, {kH, rows, policy.scales_row_bytes(kD)});
    q[i].tokens = kT;
    if (!policy.quantize(cx, in(i), state[i], q[i]).is_ok()) return st.SkipWithError("quantize failed");
  }
  std::size_t i = 0;
  for (auto _ : st) {
    const std::size_t j = i++ % n;
    const Status s = quantize ? policy.quantize(cx, in(j), state[j], q[j])
                              : policy.dequantize(cx, q[j], TensorView<half, 3>::contiguous(c.out_copy(j), {kH, kT, kD}));
    if (!s.is_ok()) st.SkipWithError(s.message());
    benchmark::DoNotOptimize(codes.data());
    benchmark::ClobberMemory();
  }
  report_layer_bytes(st, static_cast<double>(kLayer * sizeof(half) + layer_codes + layer_scales));
}

/// The backend op alone on the same layer (backend::Cpu::ggml_quantize_row, one call per head): what an
/// engine that has checked its rows calls; the policy's quantize adds the finiteness check, a read of the
/// rows of its own, before anything is written.
void quantize_op(benchmark::State& st, GgmlType t) {
  Cache& c = cache();
  const std::size_t n = copies();
  const std::int64_t rb = kD / kGgmlBlock * ggml_block_bytes(t);
  const std::size_t layer_codes = static_cast<std::size_t>(kH * kT * rb);
  std::vector<std::uint8_t> codes(layer_codes * n);
  for (std::size_t i = 0; i < n; ++i) c.rows_copy(i);
  std::size_t i = 0;
  for (auto _ : st) {
    const std::size_t j = i++ % n;
    for (std::int64_t h = 0; h < kH; ++h)
      backend::Cpu::ggml_quantize_row(t, c.rows_copy(j) + h * kT * kD, kT * kD,
                                      codes.data() + j * layer_codes + static_cast<std::size_t>(h * kT * rb));
    benchmark::DoNotOptimize(codes.data());
    benchmark::ClobberMemory();
  }
  report_layer_bytes(st, static_cast<double>(kLayer * sizeof(half) + layer_codes));
}
/// The policies' finiteness check alone (backend::Cpu::first_nonfinite over each head's rows): one read.
void check_finite(benchmark::State& st) {
  Cache& c = cache();
  std::size_t i = 0;
  for (auto _ : st) {
    const half* rows = c.rows_copy(i++);
    std::int64_t bad = 0;
    for (std::int64_t h = 0; h < kH; ++h) bad += backend::Cpu::first_nonfinite(rows + h * kT * kD, kT * kD);
    benchmark::DoNotOptimize(bad);
  }
  report_layer_bytes(st, static_cast<double>(kLayer * sizeof(half)));
}

/// The peak probe's read kernel (peak.hpp read_pass) over the same rotation of copies: what a pure read of
/// a layer achieves under this program's conditions, next to the probe's best-of figure.
void read_layer(benchmark::State& st) {
  Cache& c = cache();
  std::size_t i = 0;
  for (auto _ : st) benchmark::DoNotOptimize(kvp_bench::read_pass(reinterpret_cast<const float*>(c.rows_copy(i++)), kLayer / 2));
  report_layer_bytes(st, static_cast<double>(kLayer * sizeof(half)));
}

// ---- fused quantized scoring -----------------------------------------------------------------------

constexpr std::int64_t kSq = 32, kSkv = 8, kST = 4096, kSW = 64;

struct ScoreData {
  std::vector<half> k = kvp_bench::normal_values<half>(static_cast<std::size_t>(kSkv * kST * kD), 7);
  std::vector<float> q = kvp_bench::normal_values<float>(static_cast<std::size_t>(kSq * kSW * kD), 8);
};
ScoreData& score_data() {
  static ScoreData d;
  return d;
}

template <class S, class In>
void run_score(benchmark::State& st, const S& s, const In& in) {
  const Context<backend::Cpu> probe{};
  const Requirements r = s.requirements(probe, ProblemShape{kSq, kSkv, kD, kST, kSW});
  if (!r.status.is_ok()) return st.SkipWithError(r.status.message());
  std::vector<std::byte> ws(r.workspace_bytes);
  std::vector<float> out(static_cast<std::size_t>(kSkv * kST));
  const Context<backend::Cpu> cx{Workspace{ws.data(), ws.size()}};
  for (auto _ : st) {
    const Status e = s.score(cx, in, TensorView<float, 2>::contiguous(out.data(), {kSkv, kST}));
    if (!e.is_ok()) return st.SkipWithError(e.message());
    benchmark::DoNotOptimize(out.data());
  }
  kvp_bench::report_flops(st, 2.0 * kSq * kSW * kST * kD);
  st.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kSkv * kST), benchmark::Counter::kIsIterationInvariantRate);
}

const SnapKV& score_snapkv() {
  static const SnapKV s(SnapKVParams::kvpress(0.5, static_cast<std::int32_t>(kSW), 5));
  return s;
}

void score_fp16(benchmark::State& st) {
  ScoreData& d = score_data();
  const ScoreInput<float, half> in{TensorView<const float, 3>::contiguous(d.q.data(), {kSq, kSW, kD}),
                                   KVSource<half>::from(TensorView<const half, 3>::contiguous(d.k.data(), {kSkv, kST, kD}))};
  run_score(st, score_snapkv(), in);
}

template <class P>
void score_quantized(benchmark::State& st, const P& p) {
  ScoreData& d = score_data();
  const auto rows = TensorView<const half, 3>::contiguous(d.k.data(), {kSkv, kST, kD});
  std::vector<std::uint8_t> codes, scales;
  std::vector<half> res;
  QuantKeys keys;
  keys.dim = kD;
  const Context<backend::Cpu> cx{};
  if constexpr (std::is_same_v<P, KiviQuant>) {
    const std::int64_t n = p.code_rows(kST), R = p.params().residual;
    codes.resize(static_cast<std::size_t>(kSkv * n * p.codes_row_bytes(kD)));
    scales.resize(static_cast<std::size_t>(kSkv * n * p.scales_row_bytes(kD)));
    res.resize(static_cast<std::size_t>(kSkv * R * kD));
    KiviState state{TensorView<half, 3>::contiguous(res.data(), {kSkv, R, kD}), 0};
    keys.region = QuantizedKV{p.layout(), TensorView<std::uint8_t, 3>::contiguous(codes.data(), {kSkv, n, p.codes_row_bytes(kD)}),
                              TensorView<std::uint8_t, 3>::contiguous(scales.data(), {kSkv, n, p.scales_row_bytes(kD)}), 0};
    if (!p.append(cx, rows, state, keys.region).is_ok()) return st.SkipWithError("kivi append failed");
    keys.residual = TensorView<const half, 3>::contiguous(res.data(), {kSkv, R, kD});
    keys.residual_len = state.residual_len;
  } else {
    codes.resize(static_cast<std::size_t>(kSkv * kST * p.row_bytes(kD)));
    keys.region = QuantizedKV{p.layout(), TensorView<std::uint8_t, 3>::contiguous(codes.data(), {kSkv, kST, p.row_bytes(kD)}), {}, kST};
    typename P::State state{};
    if (!p.quantize(cx, rows, state, keys.region).is_ok()) return st.SkipWithError("quantize failed");
  }
  const QuantScoreInput<float> in{TensorView<const float, 3>::contiguous(d.q.data(), {kSq, kSW, kD}), keys};
  run_score(st, QuantizedKeys<SnapKV, P>(score_snapkv(), p), in);
}

// ---- paged decode attention over codes --------------------------------------------------------------

constexpr std::int32_t kPP = 16, kPG = 4;  // page size, queries per kv head

/// One sequence of kT tokens over kT / 16 pages in shuffled order.
struct PagedTable {
  std::vector<std::int32_t> indptr{0, static_cast<std::int32_t>(kT / kPP)}, indices, last{kPP};
  PagedTable() : indices(static_cast<std::size_t>(kT / kPP)) {
    for (std::size_t i = 0; i < indices.size(); ++i) indices[i] = static_cast<std::int32_t>(i);
    std::shuffle(indices.begin(), indices.end(), std::mt19937(3));
  }
  PageTable view() const { return PageTable{indptr.data(), indices.data(), last.data(), 1}; }
};
const PagedTable& paged_table() {
  static const PagedTable t;
  return t;
}

template <class Backend, class P>
void paged_attention(benchmark::State& st, const P& p) {
  Cache& c = cache();
  const PagedTable& tab = paged_table();
  const std::int64_t rb = p.row_bytes(kD);
  const auto np = static_cast<std::int32_t>(kT / kPP);
  std::vector<std::uint8_t> kc(static_cast<std::size_t>(kH * kT * rb)), vc(kc.size());
  const PageStrides ps = PageStrides::contiguous(PageLayout::kHND, static_cast<std::int32_t>(kH), kPP, rb);
  const PagedKVView<std::uint8_t> pool{kc.data(),  vc.data(), ps, ps, np, static_cast<std::int32_t>(kH), kPP, static_cast<std::int32_t>(rb),
                                       tab.view(), {}};
  const auto rows = TensorView<const half, 3>::contiguous(c.rows.data(), {kH, kT, kD});
  if (!quantize_paged_append(Context<backend::Cpu>{}, p, pool, 0, rows, false).is_ok() ||
      !quantize_paged_append(Context<backend::Cpu>{}, p, pool, 0, rows, true).is_ok())
    return st.SkipWithError("quantize failed");
  const std::vector<float> q = kvp_bench::normal_values<float>(static_cast<std::size_t>(kH * kPG * kD), 9);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(kH * kPG));
  std::vector<std::byte> ws(quantized_paged_attention_workspace<Backend>(kPP, kD, kPG));
  const Context<Backend> cx{Workspace{ws.data(), ws.size()}};
  const PagedKVView<const std::uint8_t> cpool = pool;
  for (auto _ : st) {
    for (std::int32_t h = 0; h < kH; ++h) {
      const Status e = quantized_paged_decode_attention(cx, p, p, cpool, h, tab.indices.data(), kT, q.data() + h * kPG * kD, kPG, kD,
                                                        0.088f, out.data() + h * kPG * kD, lse.data() + h * kPG);
      if (!e.is_ok()) return st.SkipWithError(e.message());
    }
    benchmark::DoNotOptimize(out.data());
  }
  kvp_bench::report_bytes(st, static_cast<double>(kc.size() + vc.size()));
  st.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kH * kT), benchmark::Counter::kIsIterationInvariantRate);
}

void paged_attention_fp16(benchmark::State& st) {
  Cache& c = cache();
  const PagedTable& tab = paged_table();
  const auto np = static_cast<std::int32_t>(kT / kPP);
  std::vector<half> kp(static_cast<std::size_t>(kH * kT * kD)), vp(kp.size());
  const PageStrides ps = PageStrides::contiguous(PageLayout::kHND, static_cast<std::int32_t>(kH), kPP, kD);
  const PagedKVView<half> wpool{kp.data(),  vp.data(), ps, ps, np, static_cast<std::int32_t>(kH), kPP, static_cast<std::int32_t>(kD),
                                tab.view(), {}};
  const PagedKVView<const half> pool = wpool;
  for (std::int64_t h = 0; h < kH; ++h)
    for (std::int64_t t = 0; t < kT; ++t) {
      const half* src = c.rows.data() + (h * kT + t) * kD;
      std::copy(src, src + kD, wpool.key(0, static_cast<std::int32_t>(h), t));
      std::copy(src, src + kD, wpool.value(0, static_cast<std::int32_t>(h), t));
    }
  const std::vector<float> q = kvp_bench::normal_values<float>(static_cast<std::size_t>(kH * kPG * kD), 9);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(kH * kPG));
  const auto keys0 = Rows<half>::paged_keys(pool, 0, 0);
  std::vector<std::byte> ws(backend::Cpu::paged_attention_workspace(kPG, backend::Cpu::attention_block(keys0), kD));
  for (auto _ : st) {
    for (std::int32_t h = 0; h < kH; ++h)
      backend::Cpu::paged_decode_attention(q.data() + h * kPG * kD, kPG, kD, Rows<half>::paged_keys(pool, 0, h),
                                           Rows<half>::paged_values(pool, 0, h), kT, 0.088f, out.data() + h * kPG * kD,
                                           lse.data() + h * kPG, Workspace{ws.data(), ws.size()});
    benchmark::DoNotOptimize(out.data());
  }
  kvp_bench::report_bytes(st, static_cast<double>((kp.size() + vp.size()) * sizeof(half)));
  st.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kH * kT), benchmark::Counter::kIsIterationInvariantRate);
}

/// fn run with backend::Cpu::set_streaming_stores(true).
template <class Fn>
auto streaming(Fn fn) {
  return [fn](benchmark::State& st) {
    backend::Cpu::set_streaming_stores(true);
    fn(st);
    backend::Cpu::set_streaming_stores(false);
  };
}

void register_all() {
  for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kIQ4_NL}) {
    for (bool quantize : {true, false}) {
      const GgmlQuant p(GgmlQuantParams{t});
      benchmark::RegisterBenchmark((std::string(quantize ? "quantize/" : "dequantize/") + ggml_name(t)).c_str(),
                                   [p, quantize](benchmark::State& st) { run(st, p, quantize); })
          ->Unit(benchmark::kMillisecond)
          ->Repetitions(5)
          ->ReportAggregatesOnly();
    }
  }
  for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1})
    benchmark::RegisterBenchmark((std::string("quantize_op/") + ggml_name(t)).c_str(), [t](benchmark::State& st) { quantize_op(st, t); })
        ->Unit(benchmark::kMillisecond)
        ->Repetitions(5)
        ->ReportAggregatesOnly();
  // The decoders with backend::Cpu::set_streaming_stores(true): decoded rows reach memory without the read
  // for ownership.
  for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kIQ4_NL}) {
    const GgmlQuant p(GgmlQuantParams{t});
    auto reg = [](const std::string& name, auto fn) {
      benchmark::RegisterBenchmark((name + "/streaming").c_str(), fn)
          ->Unit(benchmark::kMillisecond)
          ->Repetitions(5)
          ->ReportAggregatesOnly();
    };
    reg(std::string("dequantize/") + ggml_name(t), streaming([p](benchmark::State& st) { run(st, p, false); }));
  }
  benchmark::RegisterBenchmark("read_pass/fp16", read_layer)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly();
  benchmark::RegisterBenchmark("check_finite/fp16", check_finite)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly();
  for (Fp8Scale s : {Fp8Scale::kPerTensor, Fp8Scale::kPerTokenHead}) {
    for (bool quantize : {true, false}) {
      const Fp8Quant p(Fp8QuantParams{Fp8Format::kE4M3, s, 1.0f});
      benchmark::RegisterBenchmark((std::string(quantize ? "quantize/" : "dequantize/") + "fp8_e4m3_" +
                                    (s == Fp8Scale::kPerTensor ? "per_tensor" : "per_token_head"))
                                       .c_str(),
                                   [p, quantize](benchmark::State& st) { run(st, p, quantize); })
          ->Unit(benchmark::kMillisecond)
          ->Repetitions(5)
          ->ReportAggregatesOnly();
    }
  }
  for (bool quantize : {true, false}) {
    const std::string dir = quantize ? "quantize/" : "dequantize/";
    auto reg = [&](const std::string& name, auto fn) {
      benchmark::RegisterBenchmark((dir + name).c_str(), fn)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly();
    };
    for (HadamardMode m : {HadamardMode::kNone, HadamardMode::kLlamaCpp}) {
      const Int4Quant p(Int4QuantParams{4, m, 128, QuantRole::kKeys});
      reg(m == HadamardMode::kNone ? "int4_token" : "int4_token_rot", [p, quantize](benchmark::State& st) { run(st, p, quantize); });
    }
    const GgmlQuant q4(GgmlQuantParams{GgmlType::kQ4_0, HadamardMode::kLlamaCpp, 64, QuantRole::kKeys});
    reg("q4_0_rot", [q4, quantize](benchmark::State& st) { run(st, q4, quantize); });
    for (QuantRole r : {QuantRole::kKeys, QuantRole::kValues})
      for (int bits : {2, 4}) {
        const KiviQuant p(KiviQuantParams{r, bits, 32, 128});
        reg(std::string("kivi_") + (r == QuantRole::kKeys ? "k" : "v") + std::to_string(bits),
            [p, quantize](benchmark::State& st) { run_kivi(st, p, quantize); });
        if (quantize && bits == 2)  // the finiteness scan runs over the heads in parallel too
          reg(std::string("kivi_") + (r == QuantRole::kKeys ? "k" : "v") + "2/threads:2",
              [p](benchmark::State& st) { run_kivi(st, p, true, 2); });
      }
  }
  // The row decoders with streaming stores (a contiguous head is one call; see cpu.hpp).
  auto reg_stream = [](const std::string& name, auto fn) {
    benchmark::RegisterBenchmark(("dequantize/" + name + "/streaming").c_str(), streaming(fn))
        ->Unit(benchmark::kMillisecond)
        ->Repetitions(5)
        ->ReportAggregatesOnly();
  };
  reg_stream("int4_token", [](benchmark::State& st) {
    run(st, Int4Quant(Int4QuantParams{4, HadamardMode::kNone, 128, QuantRole::kKeys}), false);
  });
  for (int bits : {2, 4}) {
    const KiviQuant p(KiviQuantParams{QuantRole::kValues, bits, 32, 128});
    reg_stream("kivi_v" + std::to_string(bits), [p](benchmark::State& st) { run_kivi(st, p, false); });
  }
  auto reg_score = [](const std::string& name, auto fn) {
    benchmark::RegisterBenchmark(("score/snapkv_" + name).c_str(), fn)
        ->Unit(benchmark::kMillisecond)
        ->Repetitions(5)
        ->ReportAggregatesOnly();
  };
  reg_score("fp16", score_fp16);
  reg_score("q8_0", [](benchmark::State& st) { score_quantized(st, GgmlQuant(GgmlQuantParams{GgmlType::kQ8_0})); });
  reg_score("q4_0", [](benchmark::State& st) { score_quantized(st, GgmlQuant(GgmlQuantParams{GgmlType::kQ4_0})); });
  reg_score("int4_rot", [](benchmark::State& st) { score_quantized(st, Int4Quant{}); });
  reg_score("kivi_k2", [](benchmark::State& st) { score_quantized(st, KiviQuant(KiviQuantParams{QuantRole::kKeys, 2, 32, 128})); });
  auto reg_att = [](const std::string& name, auto fn) {
    benchmark::RegisterBenchmark(("paged_attention/" + name).c_str(), fn)
        ->Unit(benchmark::kMillisecond)
        ->Repetitions(5)
        ->ReportAggregatesOnly();
  };
  reg_att("fp16_cpu", paged_attention_fp16);
  const GgmlQuant q8(GgmlQuantParams{GgmlType::kQ8_0}), q4(GgmlQuantParams{GgmlType::kQ4_0});
  const Fp8Quant f8(Fp8QuantParams{Fp8Format::kE4M3, Fp8Scale::kPerTokenHead, 1.0f});
  reg_att("q8_0_scalar", [q8](benchmark::State& st) { paged_attention<backend::Scalar>(st, q8); });
  reg_att("q8_0_cpu", [q8](benchmark::State& st) { paged_attention<backend::Cpu>(st, q8); });
  reg_att("q4_0_cpu", [q4](benchmark::State& st) { paged_attention<backend::Cpu>(st, q4); });
  reg_att("fp8_e4m3_per_token_head_cpu", [f8](benchmark::State& st) { paged_attention<backend::Cpu>(st, f8); });
  reg_att("int4_rot_cpu", [](benchmark::State& st) { paged_attention<backend::Cpu>(st, Int4Quant{}); });
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
