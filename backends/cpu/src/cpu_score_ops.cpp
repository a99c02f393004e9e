// SPDX-License-Identifier: Apache-2.0
// Entry points of `backend::CpuScoreOps` (baseline flags): workspace carving,
// ISA dispatch, and the scalar parts of top-k (threshold estimation, exact
// resolution of the boundary) around the vectorised collection pass.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>

#include "kvpolicy/backends/cpu_score_ops.hpp"
#include "score_kernels.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {
namespace {

using cpu_detail::WindowLayout;
using cpu_detail::WindowScratch;

WindowScratch window_scratch_layout(const WindowScoreShape& s) noexcept {
  WindowScratch w;
  w.layout = WindowLayout::of(s);
  return w;
}

std::size_t window_bytes(const WindowScoreShape& s) noexcept {
  WindowScratch w = window_scratch_layout(s);
  WorkspacePlan plan;
  WindowScratch::visit(s, w, [&](auto*& ptr, std::size_t n) { plan.add<std::remove_pointer_t<std::remove_reference_t<decltype(ptr)>>>(n); });
  return plan.total();
}

template <class Tk, class Kernel>
void run_window_scores(const WindowScoreShape& s, const float* q, KeyRows<Tk> keys, float* out, Workspace ws, Kernel kernel) noexcept {
  if (ws.data == nullptr || ws.bytes < window_bytes(s)) {
    // Workspace sized for the reference op: compute with the reference.
    ScalarScoreOps::window_scores(s, q, keys, out, ws);
    return;
  }
  WindowScratch w = window_scratch_layout(s);
  WorkspaceCarver carve(ws);
  WindowScratch::visit(s, w, [&](auto*& ptr, std::size_t n) { ptr = carve.take<std::remove_pointer_t<std::remove_reference_t<decltype(ptr)>>>(n); });
  (cpu_detail::score_kernels().*kernel)(s, q, keys, out, w);
}

// ---- top-k ------------------------------------------------------------------

constexpr std::int64_t kSample = 2048;  // strided sample that estimates the threshold
constexpr std::int64_t kBins = 2048;    // histogram bins of one rank search
constexpr std::int64_t kDirect = 4096;  // below this length every score is a candidate

// Signed form of `score_order_key` (same order; NaN is INT32_MIN, the only
// key no number maps to).
inline std::int64_t signed_key(float f) noexcept {
  return static_cast<std::int32_t>(score_order_key(f) ^ 0x80000000u);
}
// The float whose signed key is t (t >= the key of -inf).
inline float key_float(std::int64_t t) noexcept {
  const auto u = static_cast<std::uint32_t>(static_cast<std::int32_t>(t));
  return std::bit_cast<float>(t >= 0 ? u : u ^ 0x7fffffffu);
}
inline std::uint64_t packed_key(std::int64_t key, std::int32_t idx) noexcept {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(key) ^ 0x80000000u) << 32) | static_cast<std::uint32_t>(idx);
}

// Histogram search for the element of rank `rank` (1 = largest) among
// `count` keys: keys are binned by (key - lo) >> shift into at most kBins
// bins; `bin` holds the rank-th key, `above` keys lie in higher bins.
struct RankBin {
  std::int64_t lo = 0;
  int shift = 0;
  std::int64_t bin = 0;
  std::int64_t above = 0;
  std::int64_t in_bin = 0;
  std::int64_t bin_of(std::int64_t key) const noexcept { return (key - lo) >> shift; }
  std::int64_t bin_floor() const noexcept { return lo + (bin << shift); }  ///< smallest key of `bin`
};

template <class KeyAt>
RankBin rank_bin(KeyAt key_at, std::int64_t count, std::int64_t rank, std::uint32_t* hist) noexcept {
  std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = std::numeric_limits<std::int64_t>::min();
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t key = key_at(i);
    lo = key < lo ? key : lo;
    hi = key > hi ? key : hi;
  }
  RankBin rb;
  rb.lo = lo;
  while (((hi - lo) >> rb.shift) >= kBins) ++rb.shift;
  const std::int64_t nb = ((hi - lo) >> rb.shift) + 1;
  std::fill(hist, hist + nb, 0u);
  for (std::int64_t i = 0; i < count; ++i) ++hist[rb.bin_of(key_at(i))];
  for (std::int64_t b = nb - 1; b >= 0; --b) {
    if (rb.above + hist[b] >= rank) {
      rb.bin = b;
      rb.in_bin = hist[b];
      return rb;
    }
    rb.above += hist[b];
  }
  return rb;  // not reached for 1 <= rank <= count
}

// Exact top-k of the candidates idx_at(0..m) (ascending indices, a superset
// of the answer): rank search on their keys, the boundary bin resolved by
// (key, index), then one pass writes the survivors in index order.
template <class IdxAt>
void select_exact(const float* scores, IdxAt idx_at, std::int64_t m, std::int64_t k, std::int32_t* out, std::uint64_t* packed,
                  std::uint32_t* hist) noexcept {
  if (m == k) {
    for (std::int64_t i = 0; i < m; ++i) out[i] = idx_at(i);
    return;
  }
  const auto key_of = [&](std::int64_t i) { return signed_key(scores[idx_at(i)]); };
  const RankBin rb = rank_bin(key_of, m, k, hist);
  const std::int64_t need = k - rb.above;
  std::uint64_t cut = 0;  // in the boundary bin, packed keys >= cut survive
  if (need < rb.in_bin) {
    std::int64_t nb = 0;
    for (std::int64_t i = 0; i < m; ++i) {
      const std::int64_t key = key_of(i);
      if (rb.bin_of(key) == rb.bin) packed[nb++] = packed_key(key, idx_at(i));
    }
    std::nth_element(packed, packed + (need - 1), packed + nb, std::greater<std::uint64_t>());
    cut = packed[need - 1];
  }
  std::int64_t o = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    const std::int64_t key = key_of(i), b = rb.bin_of(key);
    if (b > rb.bin || (b == rb.bin && packed_key(key, idx_at(i)) >= cut)) out[o++] = idx_at(i);
  }
}

struct TopkScratch {
  std::int32_t* candidates;
  std::uint64_t* packed;
  std::int64_t* sample;
  std::uint32_t* hist;

  template <class Fn>
  static void visit(std::int64_t n, TopkScratch& t, Fn&& fn) noexcept {
    fn(t.candidates, static_cast<std::size_t>(n + cpu_detail::kCollectSlack));
    fn(t.packed, static_cast<std::size_t>(n));
    fn(t.sample, static_cast<std::size_t>(kSample));
    fn(t.hist, static_cast<std::size_t>(kBins));
  }
};

}  // namespace

std::size_t CpuScoreOps::window_scores_workspace(const WindowScoreShape& s) noexcept { return window_bytes(s); }

template <>
void CpuScoreOps::window_scores<float>(const WindowScoreShape& s, const float* q, KeyRows<float> keys, float* out, Workspace ws) noexcept {
  run_window_scores(s, q, keys, out, ws, &cpu_detail::ScoreKernels::window_scores_f32);
}
template <>
void CpuScoreOps::window_scores<half>(const WindowScoreShape& s, const float* q, KeyRows<half> keys, float* out, Workspace ws) noexcept {
  run_window_scores(s, q, keys, out, ws, &cpu_detail::ScoreKernels::window_scores_f16);
}
template <>
void CpuScoreOps::window_scores<bfloat16>(const WindowScoreShape& s, const float* q, KeyRows<bfloat16> keys, float* out,
                                          Workspace ws) noexcept {
  run_window_scores(s, q, keys, out, ws, &cpu_detail::ScoreKernels::window_scores_bf16);
}

void CpuScoreOps::pool1d(const float* in, std::int64_t n, int kernel, Pooling kind, float* out) noexcept {
  if (kind == Pooling::kNone || kernel <= 1) {
    ScalarScoreOps::pool1d(in, n, kernel, kind, out);
    return;
  }
  const std::int64_t r = kernel / 2;
  // Interior (complete windows) vectorised, the <= r outputs at each edge as the reference computes them.
  const std::int64_t full_lo = std::min(r, n), full_hi = std::max(full_lo, n - r);
  if (full_hi > full_lo) cpu_detail::score_kernels().pool1d_full(in, kernel, kind, out, full_lo, full_hi);
  const auto edge = [&](std::int64_t t) {
    const std::int64_t lo = std::max<std::int64_t>(0, t - r), hi = std::min<std::int64_t>(n - 1, t + r);
    if (kind == Pooling::kAvg) {
      float acc = 0.0f;
      for (std::int64_t u = lo; u <= hi; ++u) acc += in[u];
      out[t] = acc / static_cast<float>(kernel);
    } else {
      float m = in[lo];
      for (std::int64_t u = lo + 1; u <= hi; ++u) m = (in[u] > m || m != m) ? in[u] : m;
      out[t] = m;
    }
  };
  for (std::int64_t t = 0; t < full_lo; ++t) edge(t);
  for (std::int64_t t = full_hi; t < n; ++t) edge(t);
}

std::size_t CpuScoreOps::topk_workspace(std::int64_t n) noexcept {
  TopkScratch t{};
  WorkspacePlan plan;
  TopkScratch::visit(n, t, [&](auto*& ptr, std::size_t cnt) { plan.add<std::remove_pointer_t<std::remove_reference_t<decltype(ptr)>>>(cnt); });
  return plan.total();
}

void CpuScoreOps::topk(const float* scores, std::int64_t n, std::int64_t k, std::int32_t* out, Workspace ws) noexcept {
  if (k <= 0) return;
  if (k >= n) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<std::int32_t>(i);
    return;
  }
  if (ws.data == nullptr || ws.bytes < topk_workspace(n)) {
    ScalarScoreOps::topk(scores, n, k, out, ws);  // workspace sized for the reference op
    return;
  }
  TopkScratch t{};
  WorkspaceCarver carve(ws);
  TopkScratch::visit(n, t, [&](auto*& ptr, std::size_t cnt) { ptr = carve.take<std::remove_pointer_t<std::remove_reference_t<decltype(ptr)>>>(cnt); });
  const auto every = [](std::int64_t i) { return static_cast<std::int32_t>(i); };
  if (n <= kDirect || k > n / 8) {
    select_exact(scores, every, n, k, out, t.packed, t.hist);
    return;
  }
  // Threshold from a strided sample: aim at rank k*S/n plus three standard
  // deviations (and a little), so that about 1.5 k scores pass and fewer than
  // k pass only rarely; then the bin floor of that rank.
  for (std::int64_t i = 0; i < kSample; ++i) t.sample[i] = signed_key(scores[(i * n) / kSample]);
  const double expected = static_cast<double>(k) * static_cast<double>(kSample) / static_cast<double>(n);
  const auto rank = static_cast<std::int64_t>(std::ceil(expected + 3.0 * std::sqrt(expected) + 3.0));
  std::int64_t m = -1;
  if (rank < kSample) {
    const RankBin rb = rank_bin([&](std::int64_t i) { return t.sample[i]; }, kSample, rank, t.hist);
    const std::int64_t neg_inf_key = signed_key(-std::numeric_limits<float>::infinity());
    const std::int64_t floor_key = std::max(rb.bin_floor(), neg_inf_key);  // a NaN-level floor admits every number
    m = cpu_detail::score_kernels().collect_at_least(scores, n, key_float(floor_key), t.candidates);
  }
  if (m < k) {  // the sample did not bound the k-th score: resolve over all scores
    select_exact(scores, every, n, k, out, t.packed, t.hist);
    return;
  }
  const std::int32_t* cand = t.candidates;
  select_exact(scores, [cand](std::int64_t i) { return cand[i]; }, m, k, out, t.packed, t.hist);
}

}  // namespace backend
KVP_NAMESPACE_END
