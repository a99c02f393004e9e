// SPDX-License-Identifier: Apache-2.0
// What every prefetch policy shares: the caller-owned per-layer history that
// turns a prediction and the step's real selection into the three hit-rate
// counters (`PrefetchCounters`, decisions.hpp; reference/algorithms-other.md
// §6.3), and the writer of an ordered `PrefetchRequest`.
//
// The unit is the physical page of the pool: a page holds every kv head's
// K/V rows of `page_size` tokens (paged engines move whole pages, vLLM /
// FlashInfer layout), so a per-head selection needs the union of its rows.
// One `PrefetchHistory` serves one layer of one batch; it holds two stamps
// per pool page:
//
//   predicted_at[p]  the serial number of the last prediction that named page p
//   used_at[p]       the last observation that read page p
//
// plus the observation counter `step` and the prediction counter `serial`.
// `predict` targets observation `step` (the next `observe`): a next-layer predictor (InfiniGen) predicts layer
// l + 1 of the current step before that layer runs; a next-step predictor
// (Quest lookahead, SpeCache, ShadowKV) predicts after the current step's
// observe, i.e. for the next step. `observe(actual)` then counts, for each
// distinct page p of `actual` (every row, every sequence):
//
//   needed      += 1
//   def 1       (only when a prediction targets this observation; the
//               latest one counts when several did)
//               named by it ? hits : misses
//   def 2       (only when step >= 1)  reuse_total += 1; used_at[p] == step-1 ? reused
//   def 3       neither reused nor predicted -> late
//   wasted      += predicted pages - hits; transferred += predicted pages the
//               previous step had not read (counted at predict) + late
//
// Def 3 assumes a device buffer that still holds the previous step's
// selection of the layer (ShadowKV's buffer) plus every predicted page, and
// prefetches that arrive in time; `eval/offload_sim.hpp` replays the same
// requests with a finite buffer and a link model for the timed version.
// The page that receives new tokens is counted like any other page (it is
// read every step, so it is a buffer hit from the second step on, except when
// a new page starts).
//
// Definition choices (reference/algorithms-other.md §7 item 11): pooled, not
// per head (a page counts once per layer step, whichever heads or sequences
// read it; rates are ratios of sums over layers and steps); def 2 skips the
// first step of a layer (no previous step) and def 1 skips observations no
// prediction targeted (InfiniGen's layer 0, the first step of a next-step
// predictor), while def 3 counts every observation; CSR rows have no padding
// slots, so none are counted (SparDA counts its -1 padding).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvpolicy/core/page_selection.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/decisions.hpp"

KVP_NAMESPACE_BEGIN

/// Caller-owned hit-rate history of one layer (see the header comment).
struct PrefetchHistory {
  std::int64_t* predicted_at = nullptr;  // (num_pages) prediction serial, -1: never
  std::int64_t* used_at = nullptr;       // (num_pages) observation index, -1: never
  std::int32_t num_pages = 0;            ///< pages of the pool
  std::int64_t step = 0;                 ///< observations made so far
  std::int64_t serial = 0;               ///< predictions made so far
  std::int64_t predicted_for = -1;       ///< observation the current prediction targets (-1: none)
  std::int64_t predicted_count = 0;      ///< distinct pages of that prediction
  std::int64_t predicted_new = 0;        ///< of those, pages the previous observation had not read

  /// int64 elements `over` needs for a pool of `num_pages` pages.
  static constexpr std::int64_t buffer_size(std::int32_t num_pages) noexcept { return 2 * static_cast<std::int64_t>(num_pages); }
  /// A fresh history over `buf` (`buffer_size(num_pages)` elements), reset.
  static PrefetchHistory over(std::int64_t* buf, std::int32_t num_pages) noexcept {
    PrefetchHistory h;
    h.predicted_at = buf;
    h.used_at = buf == nullptr ? nullptr : buf + num_pages;
    h.num_pages = num_pages;
    h.reset();
    return h;
  }
  /// Forgets every prediction and observation (a new request).
  void reset() noexcept {
    if (predicted_at != nullptr) std::fill(predicted_at, predicted_at + std::max(num_pages, 0), std::int64_t{-1});
    if (used_at != nullptr) std::fill(used_at, used_at + std::max(num_pages, 0), std::int64_t{-1});
    step = 0;
    serial = 0;
    predicted_for = -1;
    predicted_count = 0;
    predicted_new = 0;
  }
  Status check(const char* who) const noexcept {
    KVP_REQUIRE(num_pages >= 0, "%s: history num_pages is %d, must be >= 0", who, num_pages);
    KVP_REQUIRE(num_pages == 0 || (predicted_at != nullptr && used_at != nullptr), "%s: history buffers are null with %d pages", who,
                num_pages);
    KVP_REQUIRE(step >= 0, "%s: history step is %lld, must be >= 0", who, static_cast<long long>(step));
    return Status::ok();
  }
};

namespace prefetch_detail {

/// Rows of `actual` well formed over a pool of `num_pages` pages (CSR, ids in range).
inline Status check_actual(const char* who, const PageSelection& actual, std::int32_t num_pages) noexcept {
  KVP_REQUIRE(actual.num_rows >= 0, "%s: actual selection has %lld rows, must be >= 0", who, static_cast<long long>(actual.num_rows));
  if (actual.num_rows == 0) return Status::ok();
  KVP_REQUIRE(actual.indptr != nullptr, "%s: actual selection indptr is null", who);
  KVP_REQUIRE(actual.indptr[0] == 0, "%s: actual selection indptr[0] is %d, must be 0", who, actual.indptr[0]);
  for (std::int64_t r = 0; r < actual.num_rows; ++r)
    KVP_REQUIRE(actual.indptr[r + 1] >= actual.indptr[r], "%s: actual selection indptr decreases at row %lld", who,
                static_cast<long long>(r));
  const std::int32_t n = actual.indptr[actual.num_rows];
  KVP_REQUIRE(n <= actual.capacity, "%s: actual selection holds %d entries, beyond its capacity %lld", who, n,
              static_cast<long long>(actual.capacity));
  KVP_REQUIRE(n == 0 || actual.indices != nullptr, "%s: actual selection indices is null with %d entries", who, n);
  for (std::int32_t i = 0; i < n; ++i)
    KVP_REQUIRE(actual.indices[i] >= 0 && actual.indices[i] < num_pages, "%s: actual selection indices[%d] is %d, out of the pool [0, %d)",
                who, i, actual.indices[i], num_pages);
  return Status::ok();
}

/// The shared `observe`: validates, then counts `actual` into `c` and
/// advances the history by one observation (see the header comment).
inline Status observe(const char* who, PrefetchHistory& h, const PageSelection& actual, PrefetchCounters& c) noexcept {
  KVP_RETURN_IF_ERROR(h.check(who));
  KVP_RETURN_IF_ERROR(check_actual(who, actual, h.num_pages));
  const std::int64_t s = h.step;
  const bool has_prediction = h.predicted_for == s;
  PrefetchCounters d;
  const std::int32_t n = actual.num_rows == 0 ? 0 : actual.indptr[actual.num_rows];
  for (std::int32_t i = 0; i < n; ++i) {
    const std::int32_t p = actual.indices[i];
    if (h.used_at[p] == s) continue;  // another row (head, sequence) already read it
    const bool prev = s >= 1 && h.used_at[p] == s - 1;
    const bool pred = has_prediction && h.predicted_at[p] == h.serial;
    ++d.needed;
    if (has_prediction) ++(pred ? d.hits : d.misses);
    if (s >= 1) {
      ++d.reuse_total;
      if (prev) ++d.reused;
    }
    if (!prev && !pred) ++d.late;
    h.used_at[p] = s;
  }
  if (has_prediction) {
    d.predicted = h.predicted_count;
    d.wasted = h.predicted_count - d.hits;
    d.predicted_steps = 1;
  }
  d.transferred = (has_prediction ? h.predicted_new : 0) + d.late;
  d.steps = 1;
  c += d;
  h.step = s + 1;
  return Status::ok();
}

/// Priority of a table entry the prediction does not name.
inline constexpr float kNotPredicted = std::numeric_limits<float>::quiet_NaN();

/// Entries `table` holds in all (the request's worst case).
inline std::int64_t table_entries(const PageTable& table) noexcept { return table.batch <= 0 ? 0 : table.indptr[table.batch]; }

/// Writes the prediction `prio` (one priority per table entry, kNotPredicted
/// for the entries it does not name) into `out`, most urgent first: higher
/// priority first, equal priorities -> the later table entry first (the more
/// recent page of a sequence, then the later sequence), the library's
/// `score_order_key` order. A page shared by several entries is listed once,
/// at its most urgent entry. Marks the history (target = `h.step`; a later
/// prediction for the same target replaces this one). `keys`:
/// workspace of `table_entries(table)` uint64. Inputs were validated and
/// `out` checked for `table_entries(table)` pages by the caller.
inline void write_request(PrefetchHistory& h, const PageTable& table, const float* prio, std::uint64_t* keys,
                          PrefetchRequest& out) noexcept {
  const std::int64_t n = table_entries(table);
  std::int64_t m = 0;
  for (std::int64_t i = 0; i < n; ++i)
    if (!std::isnan(prio[i])) keys[m++] = (static_cast<std::uint64_t>(score_order_key(prio[i])) << 32) | static_cast<std::uint64_t>(i);
  std::sort(keys, keys + m, [](std::uint64_t a, std::uint64_t b) { return a > b; });
  const std::int64_t target = h.step, serial = h.serial + 1;
  std::int64_t size = 0, fresh = 0;
  for (std::int64_t j = 0; j < m; ++j) {
    const auto i = static_cast<std::int64_t>(keys[j] & 0xffffffffu);
    const std::int32_t p = table.indices[i];
    if (h.predicted_at[p] == serial) continue;
    h.predicted_at[p] = serial;
    if (!(target >= 1 && h.used_at[p] == target - 1)) ++fresh;
    out.pages[size] = p;
    if (out.priority != nullptr) out.priority[size] = prio[i];
    ++size;
  }
  out.size = size;
  h.serial = serial;
  h.predicted_for = target;
  h.predicted_count = size;
  h.predicted_new = fresh;
}

/// Marks every entry of `table` predicted with priority 1 (a dense layer).
inline void predict_all(const PageTable& table, float* prio) noexcept {
  const std::int64_t n = table_entries(table);
  for (std::int64_t i = 0; i < n; ++i) prio[i] = 1.0f;
}

/// Entries of pages the previous observation read and the prediction does
/// not name get `reuse_priority` (ShadowKV-style reuse of the previous selection).
inline void add_reuse(const PrefetchHistory& h, const PageTable& table, float reuse_priority, float* prio) noexcept {
  if (h.step < 1) return;
  const std::int64_t n = table_entries(table);
  for (std::int64_t i = 0; i < n; ++i)
    if (std::isnan(prio[i]) && h.used_at[table.indices[i]] == h.step - 1) prio[i] = reuse_priority;
}

/// Common checks of a predict call: history against the pool, the table,
/// queries shape against the heads, output capacity for the whole table.
template <class Tq>
Status check_predict(const char* who, const PrefetchHistory& h, const TensorView<const Tq, 3>& queries, const PageTable& table,
                     std::int32_t page_size, std::int32_t num_kv_heads, std::int32_t head_dim, const PrefetchRequest& out,
                     std::int32_t* group) noexcept {
  KVP_RETURN_IF_ERROR(h.check(who));
  KVP_RETURN_IF_ERROR(table.validate(who, h.num_pages, page_size));
  KVP_RETURN_IF_ERROR(queries.check_basic(who, "queries"));
  KVP_REQUIRE(queries.device().is_host(), "%s: queries is a device tensor; this entry point reads host memory", who);
  KVP_REQUIRE(queries.extent(0) == table.batch, "%s: queries has %lld sequences, the page table has batch %d", who,
              static_cast<long long>(queries.extent(0)), table.batch);
  KVP_REQUIRE(queries.extent(2) == head_dim, "%s: queries head_dim is %lld, the state has %d", who,
              static_cast<long long>(queries.extent(2)), head_dim);
  KVP_REQUIRE(num_kv_heads > 0 && queries.extent(1) > 0 && queries.extent(1) % num_kv_heads == 0,
              "%s: queries has %lld heads, not a positive multiple of the %d kv heads", who, static_cast<long long>(queries.extent(1)),
              num_kv_heads);
  KVP_RETURN_IF_ERROR(out.check_output(who, table_entries(table)));
  *group = static_cast<std::int32_t>(queries.extent(1) / num_kv_heads);
  return Status::ok();
}

/// Table entry index of token t of sequence b.
inline std::int64_t entry_of(const PageTable& table, std::int32_t b, std::int64_t t, std::int32_t page_size) noexcept {
  return table.indptr[b] + t / page_size;
}

/// sum_i a[i] * b[i] in fp32 over 8 interleaved partial sums (lane l takes
/// i = l mod 8, the lanes added pairwise at the end, then the tail in order):
/// a fixed order, so every backend and thread count gets the same bits, and
/// one the compiler can vectorise without reassociating.
inline float dot(const float* a, const float* b, std::int64_t n) noexcept {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

/// prio[e] = max(prio[e], v) treating kNotPredicted as absent.
inline void raise(float* prio, std::int64_t e, float v) noexcept {
  if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();  // NaN scores rank last but still predict
  if (std::isnan(prio[e]) || v > prio[e]) prio[e] = v;
}

}  // namespace prefetch_detail

KVP_NAMESPACE_END
