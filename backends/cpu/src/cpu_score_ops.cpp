// SPDX-License-Identifier: Apache-2.0
// Entry points of `backend::CpuScoreOps` (baseline flags): workspace carving,
// ISA dispatch, and the control of top-k (sampling, histogram rank search)
// around its vectorised kernels (collection, key gather, compaction).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
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
  WindowScratch::visit(s, w,
                       [&](auto*& ptr, std::size_t n) { plan.add<std::remove_pointer_t<std::remove_reference_t<decltype(ptr)>>>(n); });
  return plan.total();
}

template <class Tk, class Kernel>
void run_window_scores(const WindowScoreShape& s, const float* q, Rows<Tk> keys, float* out, Workspace ws, Kernel kernel,
                       bool may_narrow = true) noexcept {
  if (ws.data == nullptr || ws.bytes < window_bytes(s)) {
    // Workspace sized for the reference op: compute with the reference, and count it.
    cpu_detail::note_reference_fallback();
    ScalarScoreOps::window_scores(s, q, keys, out, ws);
    return;
  }
  WindowScratch w = window_scratch_layout(s);
  WorkspaceCarver carve(ws);
  WindowScratch::visit(
      s, w, [&](auto*& ptr, std::size_t n) { ptr = carve.take<std::remove_pointer_t<std::remove_reference_t<decltype(ptr)>>>(n); });
  // At most 8 queries (TOVA: the newest query of each of a group's heads) fill half an AVX2 vector but a quarter
  // of an AVX-512 one, and the one-vector tiles cost the same per key at either width: on the AVX-512 level they
  // run the AVX2 level's kernel (TOVA's decision at 32K tokens on an Ice Lake Xeon: about 24 ms through the
  // AVX-512 kernel, 16 ms through the AVX2 one). The scratch layout is the same for every level. The bf16 dot
  // form (may_narrow false) stays on its level.
  const bool narrow = may_narrow && s.group * s.window <= 8 && cpu_detail::active_isa() == CpuIsa::kAvx512;
  ((narrow ? cpu_detail::score_kernels_avx2() : cpu_detail::score_kernels()).*kernel)(s, q, keys, out, w);
}

// ---- top-k ------------------------------------------------------------------
//
// Plan for k << n: (1) a sample of kSample scores (runs of neighbours spread
// over the row) and one histogram give a threshold expected to pass 1.5-2 k
// scores; (2) one SIMD pass collects the indices of the scores at or above it
// (a superset of the answer whenever at least k pass; otherwise step 3 runs
// on all scores); (3) an exact rank search on the candidates' order keys
// finds the k-th largest (key, index) pair; (4) one SIMD compaction writes the
// candidates at or above that pair, in index order. Rows of 256 to 32K scores
// take step 1 from block maxima instead (the k-th largest of 2k block maxima,
// one SIMD pass); where those blocks span whole 64-score words (k <= n/128 on
// AVX2) step 2 reads only the ~k blocks whose maximum reaches the threshold
// (AVX2, k = 63 of 8191 scores: 69 -> 61 us for 32 rows, medians, old and new
// interleaved). Large k (> n/8) and rows below 256 go straight to step 3
// on all scores. The k-th largest of the block maxima (step 1), and of up to
// 4096 candidates (step 3), comes from kth_largest_key: up to 48 keys by
// counting, for every key, the keys at or above it (branch-free, one compare
// per pair); more by a search over the key values whose guesses interpolate
// between the counts at the ends of a bracket (branch-free counting passes,
// 5-9 of them for a few hundred keys where a bit-by-bit bisection took
// 15-18), the block maxima's cut stopping at any key that k to k + k^2/n of
// them reach; more candidates take the histogram rounds. At Quest's 4K-token
// budget (255 of 8191 pages per head) a bit-by-bit bisection in place of
// std::nth_element took the top-k from 5.3 to 2.2 us per head (bench_quest
// topk/cpu/4096, medians), and the interpolating search took 0.85x of that
// bisection's time (AVX2, 32 rows, old and new in one process).

constexpr std::int64_t kSampleRun = 8;                      // neighbouring scores per sample run (one cache line)
constexpr std::int64_t kSampleRuns = 256;                   // runs spread over the row
constexpr std::int64_t kSample = kSampleRun * kSampleRuns;  // sample size
constexpr std::int64_t kBins = 2048;                        // histogram bins of one rank-search round
constexpr std::int64_t kDirect = 4096;                      // below this length every score is a candidate
constexpr std::int64_t kSmallSet = 48;                      // a boundary set this small is resolved by nth_element
constexpr std::int64_t kKeySearchMax = 4096;                // key sets up to this many: kth_largest_key
constexpr std::int64_t kBlockRowMin = 256;                  // rows of this length ...
constexpr std::int64_t kBlockRowMax = 32768;                // ... up to this one take the block-maximum threshold

// Signed form of `score_order_key` (same order; NaN is INT32_MIN, the only
// key no number maps to).
inline std::int32_t signed_key(float f) noexcept {
  const auto i = std::bit_cast<std::int32_t>(f);
  const std::int32_t k = i ^ ((i >> 31) & 0x7fffffff);
  return f != f ? std::numeric_limits<std::int32_t>::min() : k;
}
// The float whose signed key is t (t >= the key of -inf).
inline float key_float(std::int32_t t) noexcept { return std::bit_cast<float>(t ^ ((t >> 31) & 0x7fffffff)); }
inline std::uint64_t packed_key(std::int32_t key, std::int32_t idx) noexcept {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(key) ^ 0x80000000u) << 32) | static_cast<std::uint32_t>(idx);
}

// Histogram of `count` keys over at most kBins bins of width 2^shift above
// lo; `bin` holds the element of rank `rank` (1 = largest), `above` counts
// the elements in higher bins.
struct RankBin {
  std::int64_t lo = 0;
  int shift = 0;
  std::int64_t bin = 0, above = 0;
  std::int64_t bin_of(std::int32_t key) const noexcept { return (static_cast<std::int64_t>(key) - lo) >> shift; }
  std::int64_t floor_key() const noexcept { return lo + (bin << shift); }      ///< smallest key of `bin`
  std::int64_t end_key() const noexcept { return lo + ((bin + 1) << shift); }  ///< one past its largest
};

RankBin rank_bin(const std::int32_t* keys, std::int64_t count, std::int32_t lo, std::int32_t hi, std::int64_t rank,
                 std::uint32_t* hist) noexcept {
  RankBin rb;
  rb.lo = lo;
  const std::int64_t range = static_cast<std::int64_t>(hi) - lo;
  // About one bin per key (at least 64, at most kBins): a short candidate list clears and walks a short table.
  const std::int64_t bins =
      std::clamp<std::int64_t>(static_cast<std::int64_t>(std::bit_ceil(static_cast<std::uint64_t>(count))), 64, kBins);
  while ((range >> rb.shift) >= bins) ++rb.shift;
  const std::int64_t nb = (range >> rb.shift) + 1;
  // Four interleaved sub-histograms: neighbouring keys often share a bin, and
  // one table would serialise those increments through store forwarding.
  std::fill(hist, hist + 4 * nb, 0u);
  const std::int64_t quads = count / 4;
  for (std::int64_t q = 0; q < quads; ++q) {
    const std::int32_t* k4 = keys + 4 * q;
    ++hist[rb.bin_of(k4[0])];
    ++hist[nb + rb.bin_of(k4[1])];
    ++hist[2 * nb + rb.bin_of(k4[2])];
    ++hist[3 * nb + rb.bin_of(k4[3])];
  }
  for (std::int64_t i = 4 * quads; i < count; ++i) ++hist[rb.bin_of(keys[i])];
  for (std::int64_t b = nb - 1; b >= 0; --b) {
    hist[b] += hist[nb + b] + hist[2 * nb + b] + hist[3 * nb + b];
    if (rb.above + hist[b] >= rank) {
      rb.bin = b;
      return rb;
    }
    rb.above += hist[b];
  }
  return rb;  // not reached for 1 <= rank <= count
}

void min_max(const std::int32_t* keys, std::int64_t count, std::int32_t* lo, std::int32_t* hi) noexcept {
  std::int32_t a = std::numeric_limits<std::int32_t>::max(), b = std::numeric_limits<std::int32_t>::min();
  for (std::int64_t i = 0; i < count; ++i) {
    a = std::min(a, keys[i]);
    b = std::max(b, keys[i]);
  }
  *lo = a;
  *hi = b;
}

struct TopkScratch {
  std::int32_t* candidates;  // (n + slack): candidate indices, ascending
  std::int32_t* keys;        // (n + slack): their order keys
  std::int32_t* set_idx;     // (n + slack): boundary set of the rank search, then the answer
  std::int32_t* set_key;     // (n + slack)
  std::int32_t* sample_idx;  // (kSample + slack)
  std::int32_t* sample_key;  // (kSample + slack)
  std::uint32_t* hist;       // (4 kBins)

  template <class Fn>
  static void visit(std::int64_t n, TopkScratch& t, Fn&& fn) noexcept {
    const auto un = static_cast<std::size_t>(n + cpu_detail::kCollectSlack);
    const auto us = static_cast<std::size_t>(kSample + cpu_detail::kCollectSlack);
    fn(t.candidates, un);
    fn(t.keys, un);
    fn(t.set_idx, un);
    fn(t.set_key, un);
    fn(t.sample_idx, us);
    fn(t.sample_key, us);
    fn(t.hist, static_cast<std::size_t>(4 * kBins));
  }
};

// The rank-th largest (key, index) pair of the m candidates (idx ascending):
// rounds of histograms narrow the set to the bin that holds the rank (kept in
// index order in set_idx / set_key) until it is small or all tied.
std::uint64_t kth_pair(const cpu_detail::ScoreKernels& kern, const std::int32_t* idx, const std::int32_t* key, std::int64_t m,
                       std::int64_t rank, std::int32_t lo, std::int32_t hi, const TopkScratch& t) noexcept {
  for (bool first = true;; first = false) {
    if (m <= kSmallSet) {
      std::uint64_t packed[kSmallSet];
      for (std::int64_t i = 0; i < m; ++i) packed[i] = packed_key(key[i], idx[i]);
      std::nth_element(packed, packed + (rank - 1), packed + m, std::greater<std::uint64_t>());
      return packed[rank - 1];
    }
    if (!first) min_max(key, m, &lo, &hi);
    if (lo == hi) return packed_key(lo, idx[m - rank]);  // all tied: the rank-th highest index
    const RankBin rb = rank_bin(key, m, lo, hi, rank, t.hist);
    m = kern.keep_in_key_range(idx, key, m, static_cast<std::int32_t>(rb.floor_key()), rb.end_key(), t.set_idx, t.set_key);
    idx = t.set_idx;
    key = t.set_key;
    rank -= rb.above;
  }
}

// The k-th largest (key, index) pair of the m candidates by kth_largest_key's search over the keys, then
// the ties at that key that the pair order keeps: the highest indices (the candidates are in ascending index
// order, so the last ones). Out of line: the small sets' path through select_exact stays as compact as before.
[[gnu::noinline]] void cut_by_search(const cpu_detail::ScoreKernels& kern, std::int64_t m, std::int64_t k, const TopkScratch& t,
                                     std::int32_t* cut_key, std::int32_t* cut_idx) noexcept {
  std::int64_t at_least = 0;
  const std::int32_t c = kern.kth_largest_key(t.keys, m, k, 0, &at_least);
  *cut_key = c;
  *cut_idx = std::numeric_limits<std::int32_t>::min();
  // Exactly k keys >= c, so every key equal to c is kept (the usual case: distinct keys): no index cut, and
  // no counting pass or scalar walk for it.
  if (at_least == k) return;
  std::int64_t need = k - (c == std::numeric_limits<std::int32_t>::max() ? 0 : kern.count_keys_at_least(t.keys, m, c + 1));
  *cut_idx = 0;
  for (std::int64_t i = m - 1; i >= 0; --i) {
    if (t.keys[i] == c && --need == 0) {
      *cut_idx = t.candidates[i];
      return;
    }
  }
}

// Exact top-k of the m candidates in t.candidates (ascending indices) whose
// order keys are in t.keys, between lo and hi.
void select_exact(const cpu_detail::ScoreKernels& kern, std::int64_t m, std::int64_t k, std::int32_t lo, std::int32_t hi, std::int32_t* out,
                  const TopkScratch& t) noexcept {
  if (m == k) {
    std::copy(t.candidates, t.candidates + m, out);
    return;
  }
  std::int32_t cut_key = 0, cut_idx = 0;
  if (m <= kKeySearchMax) {
    cut_by_search(kern, m, k, t, &cut_key, &cut_idx);
  } else {
    const std::uint64_t cut = kth_pair(kern, t.candidates, t.keys, m, k, lo, hi, t);
    cut_key = static_cast<std::int32_t>(static_cast<std::uint32_t>(cut >> 32) ^ 0x80000000u);
    cut_idx = static_cast<std::int32_t>(cut & 0xffffffffu);
  }
  const std::int64_t kept = kern.keep_at_least(t.candidates, t.keys, m, cut_key, cut_idx, t.set_idx);
  std::copy(t.set_idx, t.set_idx + std::min(kept, k), out);  // kept == k: the pairs are distinct
}

}  // namespace

std::size_t CpuScoreOps::window_scores_workspace(const WindowScoreShape& s) noexcept { return window_bytes(s); }

template <>
void CpuScoreOps::window_scores<float>(const WindowScoreShape& s, const float* q, Rows<float> keys, float* out, Workspace ws) noexcept {
  run_window_scores(s, q, keys, out, ws, &cpu_detail::ScoreKernels::window_scores_f32);
}
template <>
void CpuScoreOps::window_scores<half>(const WindowScoreShape& s, const float* q, Rows<half> keys, float* out, Workspace ws) noexcept {
  run_window_scores(s, q, keys, out, ws, &cpu_detail::ScoreKernels::window_scores_f16);
}
template <>
void CpuScoreOps::window_scores<bfloat16>(const WindowScoreShape& s, const float* q, Rows<bfloat16> keys, float* out,
                                          Workspace ws) noexcept {
  const cpu_detail::ScoreKernels& kern = cpu_detail::score_kernels();
  const bool dot = kern.window_scores_bf16_dot != nullptr && s.head_dim % 2 == 0 && cpu_detail::bf16_dot_active();
  run_window_scores(s, q, keys, out, ws,
                    dot ? &cpu_detail::ScoreKernels::window_scores_bf16_dot : &cpu_detail::ScoreKernels::window_scores_bf16, !dot);
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
      out[t] = kvpolicy::detail::ascending_sum(in, lo, hi) / static_cast<float>(kernel);
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
  TopkScratch::visit(n, t,
                     [&](auto*& ptr, std::size_t cnt) { plan.add<std::remove_pointer_t<std::remove_reference_t<decltype(ptr)>>>(cnt); });
  return plan.total();
}

void CpuScoreOps::topk(const float* scores, std::int64_t n, std::int64_t k, std::int32_t* out, Workspace ws) noexcept {
  if (k <= 0) return;
  if (k >= n) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<std::int32_t>(i);
    return;
  }
  if (ws.data == nullptr || ws.bytes < topk_workspace(n)) {
    cpu_detail::note_reference_fallback();  // workspace sized for the reference op
    ScalarScoreOps::topk(scores, n, k, out, ws);
    return;
  }
  TopkScratch t{};
  WorkspaceCarver carve(ws);
  TopkScratch::visit(
      n, t, [&](auto*& ptr, std::size_t cnt) { ptr = carve.take<std::remove_pointer_t<std::remove_reference_t<decltype(ptr)>>>(cnt); });
  const cpu_detail::ScoreKernels& kern = cpu_detail::score_kernels();
  const auto all_candidates = [&] {
    for (std::int64_t i = 0; i < n; ++i) t.candidates[i] = static_cast<std::int32_t>(i);
    std::int32_t lo = 0, hi = 0;
    kern.load_keys(scores, n, t.keys, &lo, &hi);
    select_exact(kern, n, k, lo, hi, out, t);
  };
  if (n >= kBlockRowMin && n <= kBlockRowMax && k <= n / 8) {
    // Short rows: the k-th largest of about 2k block maxima (maxima of disjoint blocks, so at least k scores
    // reach it) is the threshold, found from one SIMD pass instead of a sample and its histogram. A cut at
    // -inf may come from blocks of NaN alone (see block_max_keys): every score is then a candidate.
    const std::int64_t target = std::min<std::int64_t>(2 * k, n);
    const std::int64_t nb = kern.block_max_keys(scores, n, target, t.set_key);
    if (nb < k) return all_candidates();
    // Any cut that at least k block maxima reach will do; up to k^2 / n more than k cost fewer collected scores
    // (about one block each: n / 2k scores) than the counting passes over the 2k maxima that would exclude them.
    const std::int32_t cut = kern.kth_largest_key(t.set_key, nb, k, k * k / n, nullptr);  // reads the keys only: the block order stays
    if (cut <= signed_key(-std::numeric_limits<float>::infinity())) return all_candidates();
    // Blocks of whole words: only those whose maximum reaches the cut (about k of the 2k) hold candidates.
    const std::int64_t m = kern.collect_in_blocks(scores, n, target, t.set_key, nb, cut, t.set_idx, t.candidates);
    std::int32_t lo = 0, hi = 0;
    kern.gather_keys(scores, t.candidates, m, t.keys, &lo, &hi);
    return select_exact(kern, m, k, lo, hi, out, t);
  }
  if (n <= kDirect || k > n / 8) return all_candidates();
  // Threshold from a sample of kSampleRuns runs of kSampleRun neighbours
  // spread evenly over the row (runs share cache lines, so the sample costs
  // few memory accesses): aim at rank k*S/n plus three standard deviations
  // (and a little), and take the floor of that rank's histogram bin.
  // The runs' cache lines are requested up front: a gather waits on its misses one vector at a time, so a row
  // out of cache cost 35-49K cycles in the sample alone (AVX2, 32 rows of 131072 scores: 18-24 % of the top-k).
  for (std::int64_t r = 0; r < kSampleRuns; ++r) {
    const std::int64_t start = (r * (n - kSampleRun)) / (kSampleRuns - 1);
    __builtin_prefetch(scores + start);
    __builtin_prefetch(scores + start + kSampleRun - 1);
    for (std::int64_t j = 0; j < kSampleRun; ++j) t.sample_idx[r * kSampleRun + j] = static_cast<std::int32_t>(start + j);
  }
  std::int32_t lo = 0, hi = 0;
  kern.gather_keys(scores, t.sample_idx, kSample, t.sample_key, &lo, &hi);
  const double expected = static_cast<double>(k) * static_cast<double>(kSample) / static_cast<double>(n);
  const auto rank = static_cast<std::int64_t>(std::ceil(expected + 3.0 * std::sqrt(expected) + 3.0));
  if (rank >= kSample) return all_candidates();
  const RankBin rb = rank_bin(t.sample_key, kSample, lo, hi, rank, t.hist);
  // A NaN-level floor admits every number (-inf and up); NaN never passes.
  const auto floor_key =
      static_cast<std::int32_t>(std::max<std::int64_t>(rb.floor_key(), signed_key(-std::numeric_limits<float>::infinity())));
  const std::int64_t m = kern.collect_at_least(scores, n, key_float(floor_key), rank * n / kSample, t.candidates);
  if (m < k) return all_candidates();  // the sample did not bound the k-th score
  kern.gather_keys(scores, t.candidates, m, t.keys, &lo, &hi);
  select_exact(kern, m, k, lo, hi, out, t);
}

}  // namespace backend
KVP_NAMESPACE_END
