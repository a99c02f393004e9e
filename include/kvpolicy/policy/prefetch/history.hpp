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
// plus the observation counter `step` and the prediction counter `serial`
// (host values), and the size of the current prediction with its count of
// pages the previous observation had not read (host fields on a host
// backend; two `pending` slots of the buffer on a device backend, where they
// depend on page ids the host never reads: ops/prefetch_ops.hpp).
//
// On a device backend the buffer is device memory: wrap it with
// `PrefetchHistory::wrap` and clear it with `reset(ctx)` (one op on the
// context's stream); `observe` then reads the selection's page ids on the
// device and adds into a `PrefetchCounters` in device memory, so nothing
// returns to the host (copy the counters back when the rates are wanted).
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
#include "kvpolicy/ops/prefetch_ops.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/decisions.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

KVP_NAMESPACE_BEGIN

/// Caller-owned hit-rate history of one layer (see the header comment).
struct PrefetchHistory {
  std::int64_t* predicted_at = nullptr;  // (num_pages) prediction serial, -1: never
  std::int64_t* used_at = nullptr;       // (num_pages) observation index, -1: never
  std::int32_t num_pages = 0;            ///< pages of the pool
  std::int64_t step = 0;                 ///< observations made so far
  std::int64_t serial = 0;               ///< predictions made so far
  std::int64_t predicted_for = -1;       ///< observation the current prediction targets (-1: none)
  std::int64_t predicted_count = 0;      ///< distinct pages of that prediction (host backends)
  std::int64_t predicted_new = 0;        ///< of those, pages the previous observation had not read (host backends)
  std::int64_t* pending = nullptr;       ///< (2) the two counts above on a device backend (device memory)

  /// int64 elements a history of a pool of `num_pages` pages needs.
  static constexpr std::int64_t buffer_size(std::int32_t num_pages) noexcept { return 2 * static_cast<std::int64_t>(num_pages) + 2; }
  /// A history over `buf` (`buffer_size(num_pages)` elements), not cleared:
  /// the form for device memory, cleared with `reset(ctx)`.
  static PrefetchHistory wrap(std::int64_t* buf, std::int32_t num_pages) noexcept {
    PrefetchHistory h;
    h.predicted_at = buf;
    h.used_at = buf == nullptr ? nullptr : buf + std::max(num_pages, 0);
    h.pending = buf == nullptr ? nullptr : buf + 2 * static_cast<std::int64_t>(std::max(num_pages, 0));
    h.num_pages = num_pages;
    return h;
  }
  /// A fresh history over host memory `buf` (`buffer_size(num_pages)` elements), reset.
  static PrefetchHistory over(std::int64_t* buf, std::int32_t num_pages) noexcept {
    PrefetchHistory h = wrap(buf, num_pages);
    h.reset();
    return h;
  }
  /// Forgets every prediction and observation (a new request); host memory.
  void reset() noexcept {
    if (predicted_at != nullptr) std::fill(predicted_at, predicted_at + std::max(num_pages, 0), std::int64_t{-1});
    if (used_at != nullptr) std::fill(used_at, used_at + std::max(num_pages, 0), std::int64_t{-1});
    if (pending != nullptr) pending[0] = pending[1] = 0;
    reset_counters();
  }
  /// `reset()` on `ctx`'s backend: on a device backend the buffer (device
  /// memory, built with `wrap`) is cleared by one op on the context's stream.
  template <class Backend>
  Status reset(const Context<Backend>& ctx) noexcept {
    KVP_RETURN_IF_ERROR(check("prefetch history"));
    if constexpr (kDeviceBackend<Backend>) {
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      if (num_pages > 0) ops::prefetch_history_reset<Backend>(predicted_at, num_pages);
      reset_counters();
      return call.end();
    } else {
      (void)ctx;
      reset();
      return Status::ok();
    }
  }
  Status check(const char* who) const noexcept {
    KVP_REQUIRE(num_pages >= 0, "%s: history num_pages is %d, must be >= 0", who, num_pages);
    KVP_REQUIRE(num_pages == 0 || (predicted_at != nullptr && used_at != nullptr), "%s: history buffers are null with %d pages", who,
                num_pages);
    KVP_REQUIRE(step >= 0, "%s: history step is %lld, must be >= 0", who, static_cast<long long>(step));
    return Status::ok();
  }
  /// `check` plus what a device backend reads: the `pending` slots after the stamps.
  Status check_device(const char* who) const noexcept {
    KVP_RETURN_IF_ERROR(check(who));
    KVP_REQUIRE(num_pages == 0 || pending != nullptr,
                "%s: history pending slots are null (a device history is one buffer of buffer_size(num_pages) elements: "
                "PrefetchHistory::wrap)",
                who);
    return Status::ok();
  }

 private:
  void reset_counters() noexcept {
    step = 0;
    serial = 0;
    predicted_for = -1;
    predicted_count = 0;
    predicted_new = 0;
  }
};

namespace prefetch_detail {

/// Rows of `actual` well formed over a pool of `num_pages` pages (CSR, ids in range).
/// On a device (`on_device`) the ids are device memory: the CSR structure
/// (host) is checked, the ids are not (that would need a device read).
inline Status check_actual(const char* who, const PageSelection& actual, std::int32_t num_pages, bool on_device = false) noexcept {
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
  if (on_device) return Status::ok();
  for (std::int32_t i = 0; i < n; ++i)
    KVP_REQUIRE(actual.indices[i] >= 0 && actual.indices[i] < num_pages, "%s: actual selection indices[%d] is %d, out of the pool [0, %d)",
                who, i, actual.indices[i], num_pages);
  return Status::ok();
}

/// The shared `observe`: validates, then counts `actual` into `c` and
/// advances the history by one observation (see the header comment). On a
/// device backend `actual.indices`, the history's buffer and `c` are device
/// memory (`actual.indptr` is a host array), counted by one op.
template <class Backend>
Status observe(const Context<Backend>& ctx, const char* who, PrefetchHistory& h, const PageSelection& actual,
               PrefetchCounters& c) noexcept {
  constexpr bool on_device = kDeviceBackend<Backend>;
  KVP_RETURN_IF_ERROR(on_device ? h.check_device(who) : h.check(who));
  KVP_RETURN_IF_ERROR(check_actual(who, actual, h.num_pages, on_device));
  const std::int64_t s = h.step;
  const bool has_prediction = h.predicted_for == s;
  const std::int32_t n = actual.num_rows == 0 ? 0 : actual.indptr[actual.num_rows];
  if constexpr (on_device) {
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    ops::prefetch_observe<Backend>(actual.indices, n, h.used_at, h.predicted_at, h.pending, s, has_prediction, h.serial, &c);
    KVP_RETURN_IF_ERROR(call.end());
  } else {
    (void)ctx;
    const std::int64_t pending[2] = {h.predicted_count, h.predicted_new};
    ops::prefetch_ref::observe(actual.indices, n, h.used_at, h.predicted_at, pending, s, has_prediction, h.serial, &c);
  }
  h.step = s + 1;
  return Status::ok();
}

/// `observe` of a host history (backend::Scalar's).
inline Status observe(const char* who, PrefetchHistory& h, const PageSelection& actual, PrefetchCounters& c) noexcept {
  return observe(Context<backend::Scalar>{}, who, h, actual, c);
}

/// A prefetcher state's memory against the call: a device backend reads
/// device memory (a state built by `make_state` with its device tag) and the
/// history's pending slots, a host backend host memory.
inline Status check_state_memory(const char* who, Device device, const PrefetchHistory& h, bool on_device) noexcept {
  if (on_device) {
    KVP_REQUIRE(!device.is_host(), "%s: state is host memory; a device backend reads device memory (make_state with the device)", who);
    return h.check_device(who);
  }
  KVP_REQUIRE(device.is_host(), "%s: state is device memory; this entry point reads host memory", who);
  return h.check(who);
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
  const std::int64_t target = h.step, serial = h.serial + 1;
  std::int64_t pending[2] = {0, 0};
  ops::prefetch_ref::write_request(prio, table.indices, n, h.predicted_at, h.used_at, pending, target, serial, out.pages, out.priority,
                                   &out.size, keys);
  h.serial = serial;
  h.predicted_for = target;
  h.predicted_count = pending[0];
  h.predicted_new = pending[1];
}

/// `write_request` on a device backend (inside the caller's backend call):
/// `prio`, `table.indices`, the history's buffer, `out.pages` /
/// `out.priority` and `ws` (`ops::prefetch_request_workspace`) are device
/// memory. The size goes to `h.pending[0]` and `out.device_size` (when set);
/// `out.size` is set to -1 (unknown to the host), the pages past the size to -1.
template <class Backend>
void write_request_on_device(PrefetchHistory& h, const PageTable& table, const float* prio, PrefetchRequest& out, Workspace ws) noexcept {
  const std::int64_t target = h.step, serial = h.serial + 1;
  ops::prefetch_write_request<Backend>(prio, table.indices, table_entries(table), h.predicted_at, h.used_at, h.pending, target, serial,
                                       out.pages, out.priority, out.device_size, ws);
  out.size = -1;
  h.serial = serial;
  h.predicted_for = target;
}

/// Marks every entry of `table` predicted with priority 1 (a dense layer).
inline void predict_all(const PageTable& table, float* prio) noexcept {
  const std::int64_t n = table_entries(table);
  for (std::int64_t i = 0; i < n; ++i) prio[i] = 1.0f;
}

/// Entries of pages the previous observation read and the prediction does
/// not name get `reuse_priority` (ShadowKV-style reuse of the previous selection).
inline void add_reuse(const PrefetchHistory& h, const PageTable& table, float reuse_priority, float* prio) noexcept {
  if (h.step >= 1) ops::prefetch_ref::add_reuse(prio, table.indices, table_entries(table), h.used_at, h.step - 1, reuse_priority);
}

/// Common checks of a predict call: history against the pool, the table,
/// queries shape against the heads, output capacity for the whole table
/// (`on_device`: the page ids are not read, the queries must be device memory).
template <class Tq>
Status check_predict(const char* who, const PrefetchHistory& h, const TensorView<const Tq, 3>& queries, const PageTable& table,
                     std::int32_t page_size, std::int32_t num_kv_heads, std::int32_t head_dim, const PrefetchRequest& out,
                     std::int32_t* group, bool on_device = false) noexcept {
  KVP_RETURN_IF_ERROR(on_device ? h.check_device(who) : h.check(who));
  KVP_RETURN_IF_ERROR(table.validate(who, h.num_pages, page_size, /*check_ids=*/!on_device));
  KVP_RETURN_IF_ERROR(queries.check_basic(who, "queries"));
  if (on_device) {
    KVP_REQUIRE(!queries.device().is_host(), "%s: queries is host memory; a device backend reads device memory (tag the view kCUDA)", who);
  } else {
    KVP_REQUIRE(queries.device().is_host(), "%s: queries is a device tensor; this entry point reads host memory", who);
  }
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

/// In-place softmax of x[0..n), the prefetchers' form: the max as a std::max
/// fold, exp(x - max) summed in double, every entry times the fp32 reciprocal
/// of that sum; `masked(i)` entries become 0 and stay out of the sum.
template <class Masked>
void softmax(float* x, std::int64_t n, Masked masked) noexcept {
  float mx = -std::numeric_limits<float>::infinity();
  for (std::int64_t t = 0; t < n; ++t) mx = std::max(mx, x[t]);
  double sum = 0.0;
  for (std::int64_t t = 0; t < n; ++t) sum += (x[t] = masked(t) ? 0.0f : std::exp(x[t] - mx));
  const float inv = static_cast<float>(1.0 / sum);
  for (std::int64_t t = 0; t < n; ++t) x[t] *= inv;
}
inline void softmax(float* x, std::int64_t n) noexcept {
  softmax(x, n, [](std::int64_t) { return false; });
}

/// prio[e] = max(prio[e], v) treating kNotPredicted as absent.
inline void raise(float* prio, std::int64_t e, float v) noexcept {
  if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();  // NaN scores rank last but still predict
  if (std::isnan(prio[e]) || v > prio[e]) prio[e] = v;
}

}  // namespace prefetch_detail

KVP_NAMESPACE_END
