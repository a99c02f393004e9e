// SPDX-License-Identifier: Apache-2.0
// Apply a `MergePlan` to engine memory, in place.
//
//  * `merge_contiguous`: write the plan's merged K/V rows into a
//    `(kv_heads, capacity, head_dim)` cache (any strides), at the kept tokens'
//    rows before compaction (`MergeSlots::kBeforeCompaction`: slot c of row r
//    is token keep.row(r)[c]) or after it (`kAfterCompaction`: slot c is row c).
//  * `merge_and_compact_contiguous`: merge, then `compact_contiguous`, as one
//    atomic step.
//  * `merge_paged` / `merge_and_compact_paged`: the same for a paged cache
//    (FlashInfer CSR page table), before compaction / then `compact_paged`.
//
// Logical positions are kept: a merged row stays at its kept token's slot, so
// the positions array (the RoPE position of each slot) is not touched by the
// merge; keys are merged post-RoPE (every reference does), so a merged key
// carries the kept token's phase with the evicted keys' phases blended in.
// Rows are converted from fp32 to the cache dtype once (round to nearest even).
//
// Atomic on error: the plan is validated entirely before the first write —
// rows in range, every entry's dst a kept slot and src an evicted token
// (a src that is itself kept would alias a destination row), weights finite
// and >= 0, merged rows present for each half the plan merges, finite, inside
// their buffers, and not overlapping the cache's own storage. On error nothing
// changed; the message names the argument and the constraint.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/policy/decisions.hpp"

KVP_NAMESPACE_BEGIN

/// Where a merged row of kept slot c lands.
enum class MergeSlots : std::uint8_t {
  kBeforeCompaction,  ///< the cache still holds every token: slot c is token keep.row(r)[c]
  kAfterCompaction,   ///< the cache was compacted with the same KeepSet: slot c is row c
};

namespace detail {

/// [begin, end) byte range a strided view may touch (empty views: an empty range).
template <class T, int R>
inline void view_range(const TensorView<T, R>& v, const std::byte** b, const std::byte** e) noexcept {
  *b = *e = nullptr;
  if (v.empty() || v.data() == nullptr) return;
  std::int64_t lo = 0, hi = 0;
  for (int k = 0; k < R; ++k) {
    const std::int64_t span = (v.extent(k) - 1) * v.stride(k);
    (span < 0 ? lo : hi) += span;
  }
  *b = reinterpret_cast<const std::byte*>(v.data() + lo);
  *e = reinterpret_cast<const std::byte*>(v.data() + hi + 1);
}

inline bool ranges_overlap(const std::byte* a0, const std::byte* a1, const std::byte* b0, const std::byte* b1) noexcept {
  return a0 != nullptr && b0 != nullptr && a0 < b1 && b0 < a1;
}

/// Every check of a plan against a keep set (rows row0 .. row0 + H, of
/// sequences whose original lengths are `len(h)`), before any write.
template <class LenFn>
Status check_plan_for_apply(const char* who, const MergePlan& plan, const KeepSet& keep, std::int64_t row0, std::int64_t H, std::int64_t d,
                            LenFn&& len) noexcept {
  KVP_RETURN_IF_ERROR(check_keep_rows(who, keep, row0, H));
  KVP_REQUIRE(plan.indptr != nullptr, "%s: merge plan indptr is null", who);
  std::int64_t end = 0;
  KVP_REQUIRE(checked_add(row0, H, &end) && end <= plan.num_rows, "%s: merge plan has %lld rows, needs rows [%lld, %lld) of the keep set",
              who, static_cast<long long>(plan.num_rows), static_cast<long long>(row0), static_cast<long long>(end));
  const TensorView<float, 2>* views[] = {&plan.merged_keys, &plan.merged_values};
  const char* names[] = {"merged_keys", "merged_values"};
  std::int64_t max_kept = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    KVP_RETURN_IF_ERROR(check_keep_row(who, keep, row0 + h, len(h)));
    max_kept = std::max<std::int64_t>(max_kept, keep.row_size(row0 + h));
  }
  for (int i = 0; i < 2; ++i) {
    const auto& v = *views[i];
    if (v.empty()) continue;
    KVP_RETURN_IF_ERROR(v.check_basic(who, names[i]));
    KVP_REQUIRE(v.device().is_host(), "%s: %s is a device tensor; this entry point reads host memory", who, names[i]);
    KVP_REQUIRE(v.extent(1) == d && (v.stride(1) == 1 || d == 1), "%s: %s has %lld columns (stride %lld), expected head_dim=%lld, stride 1",
                who, names[i], static_cast<long long>(v.extent(1)), static_cast<long long>(v.stride(1)), static_cast<long long>(d));
    std::int64_t need = 0;
    KVP_REQUIRE(plan.slots_per_row >= max_kept, "%s: merge plan slots_per_row is %lld, below the %lld kept tokens of a row", who,
                static_cast<long long>(plan.slots_per_row), static_cast<long long>(max_kept));
    KVP_REQUIRE(checked_mul(end, plan.slots_per_row, &need) && v.extent(0) >= need,
                "%s: %s has %lld rows, needs (row0 + kv_heads) x slots_per_row = %lld x %lld", who, names[i],
                static_cast<long long>(v.extent(0)), static_cast<long long>(end), static_cast<long long>(plan.slots_per_row));
  }
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t r = row0 + h;
    const std::int32_t b = plan.indptr[r], e = plan.indptr[r + 1];
    KVP_REQUIRE(b >= 0 && e >= b && e <= plan.capacity, "%s: merge plan indptr[%lld..%lld] = [%d, %d) is not a valid range of %lld entries",
                who, static_cast<long long>(r), static_cast<long long>(r + 1), b, e, static_cast<long long>(plan.capacity));
    KVP_REQUIRE(e == b || (plan.dst != nullptr && plan.src != nullptr && plan.weight != nullptr),
                "%s: merge plan dst/src/weight is null but row %lld has %d entries", who, static_cast<long long>(r), e - b);
    const auto kept = keep.row(r);
    const auto C = static_cast<std::int64_t>(kept.size());
    const std::int64_t T = len(h);
    for (std::int32_t i = b; i < e; ++i) {
      const std::int64_t dst = plan.dst[i], src = plan.src[i];
      const float w = plan.weight[i];
      KVP_REQUIRE(dst >= 0 && dst < C, "%s: merge plan row %lld entry %d: dst slot %lld is outside the %lld kept tokens", who,
                  static_cast<long long>(r), i - b, static_cast<long long>(dst), static_cast<long long>(C));
      KVP_REQUIRE(src >= 0 && src < T, "%s: merge plan row %lld entry %d: src token %lld is outside the cache [0, %lld)", who,
                  static_cast<long long>(r), i - b, static_cast<long long>(src), static_cast<long long>(T));
      const auto it = std::lower_bound(kept.begin(), kept.end(), static_cast<std::int32_t>(src));
      KVP_REQUIRE(it == kept.end() || *it != src,
                  "%s: merge plan row %lld entry %d: src token %lld is kept (slot %lld), so it aliases a destination row; a merge "
                  "source must be an evicted token",
                  who, static_cast<long long>(r), i - b, static_cast<long long>(src), static_cast<long long>(it - kept.begin()));
      KVP_REQUIRE(std::isfinite(w) && w >= 0.0f, "%s: merge plan row %lld entry %d: weight %g must be finite and >= 0", who,
                  static_cast<long long>(r), i - b, static_cast<double>(w));
      for (int v = 0; v < 2; ++v) {
        if (views[v]->empty()) continue;
        const float* row = &(*views[v])(r * plan.slots_per_row + dst, 0);
        for (std::int64_t c = 0; c < d; ++c)
          KVP_REQUIRE(std::isfinite(row[c]), "%s: %s row of plan row %lld slot %lld is not finite at channel %lld (%g)", who, names[v],
                      static_cast<long long>(r), static_cast<long long>(dst), static_cast<long long>(c), static_cast<double>(row[c]));
      }
    }
  }
  return Status::ok();
}

template <class T>
void store_row(T* dst, const float* src, std::int64_t d, std::int64_t stride) noexcept {
  for (std::int64_t c = 0; c < d; ++c) dst[c * stride] = from_float<T>(src[c]);
}

/// Merged buffers must not overlap [c0, c1) (the cache's storage of `what`).
inline Status check_no_alias(const char* who, const MergePlan& plan, const std::byte* c0, const std::byte* c1, const char* what) noexcept {
  const TensorView<float, 2>* views[] = {&plan.merged_keys, &plan.merged_values};
  const char* names[] = {"merged_keys", "merged_values"};
  for (int i = 0; i < 2; ++i) {
    const std::byte *b0 = nullptr, *b1 = nullptr;
    view_range(*views[i], &b0, &b1);
    KVP_REQUIRE(!ranges_overlap(b0, b1, c0, c1), "%s: %s overlaps the cache's %s storage; merged rows must live in separate buffers", who,
                names[i], what);
  }
  return Status::ok();
}

/// Storage range of a page pool half: pages x heads x slots x dims as strided.
inline void pool_range(const void* base, std::size_t elem, const PageStrides& s, std::int64_t pages, std::int64_t H, std::int64_t ps,
                       std::int64_t d, const std::byte** b, const std::byte** e) noexcept {
  *b = *e = nullptr;
  if (base == nullptr || pages <= 0) return;
  const std::int64_t spans[] = {(pages - 1) * s.page, (H - 1) * s.head, (ps - 1) * s.slot, (d - 1) * s.dim};
  std::int64_t lo = 0, hi = 0;
  for (auto x : spans) (x < 0 ? lo : hi) += x;
  *b = static_cast<const std::byte*>(base) + lo * static_cast<std::int64_t>(elem);
  *e = static_cast<const std::byte*>(base) + (hi + 1) * static_cast<std::int64_t>(elem);
}

template <class T>
Status check_contiguous_cache(const char* who, const TensorView<T, 3>& keys, const TensorView<T, 3>& values, std::int64_t kv_len,
                              const MergePlan& plan, MergeSlots slots, std::int64_t* H, std::int64_t* d) noexcept {
  KVP_RETURN_IF_ERROR(keys.check_writable(who, "keys"));
  KVP_RETURN_IF_ERROR(values.check_writable(who, "values"));
  KVP_RETURN_IF_ERROR(check_disjoint(who, keys, "keys", values, "values"));
  KVP_REQUIRE(keys.device().is_host() && values.device().is_host(), "%s: keys/values must be host memory", who);
  KVP_REQUIRE(!keys.empty() || !values.empty(), "%s: keys and values are both empty", who);
  const TensorView<T, 3>& any = keys.empty() ? values : keys;
  *H = any.extent(0);
  *d = any.extent(2);
  KVP_REQUIRE(keys.empty() || values.empty() || (values.extent(0) == *H && values.extent(1) == keys.extent(1) && values.extent(2) == *d),
              "%s: values has shape (%lld, %lld, %lld), keys (%lld, %lld, %lld)", who, static_cast<long long>(values.extent(0)),
              static_cast<long long>(values.extent(1)), static_cast<long long>(values.extent(2)), static_cast<long long>(keys.extent(0)),
              static_cast<long long>(keys.extent(1)), static_cast<long long>(keys.extent(2)));
  KVP_REQUIRE(plan.merged_keys.empty() || !keys.empty(), "%s: the plan merges keys but keys is empty", who);
  KVP_REQUIRE(plan.merged_values.empty() || !values.empty(), "%s: the plan merges values but values is empty", who);
  KVP_REQUIRE(kv_len >= 0 && (slots == MergeSlots::kAfterCompaction || kv_len <= any.extent(1)),
              "%s: kv_len %lld out of range [0, capacity=%lld]", who, static_cast<long long>(kv_len),
              static_cast<long long>(any.extent(1)));
  const std::byte *b = nullptr, *e = nullptr;
  view_range(keys, &b, &e);
  KVP_RETURN_IF_ERROR(check_no_alias(who, plan, b, e, "key"));
  view_range(values, &b, &e);
  return check_no_alias(who, plan, b, e, "value");
}

template <class T>
void write_contiguous(const TensorView<T, 3>& keys, const TensorView<T, 3>& values, const KeepSet& keep, std::int64_t row0, std::int64_t H,
                      std::int64_t d, const MergePlan& plan, MergeSlots slots) noexcept {
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t r = row0 + h;
    for (std::int32_t i = plan.indptr[r]; i < plan.indptr[r + 1]; ++i) {
      const std::int64_t c = plan.dst[i];
      const std::int64_t slot = slots == MergeSlots::kAfterCompaction ? c : keep.row(r)[static_cast<std::size_t>(c)];
      const std::int64_t m = r * plan.slots_per_row + c;
      if (!plan.merged_keys.empty()) store_row(&keys(h, slot, 0), &plan.merged_keys(m, 0), d, keys.stride(2));
      if (!plan.merged_values.empty()) store_row(&values(h, slot, 0), &plan.merged_values(m, 0), d, values.stride(2));
    }
  }
}

}  // namespace detail

/// Write the merged rows of one sequence into a contiguous cache.
///
/// keys, values: (kv_heads, capacity, head_dim), any strides; either may be
///               empty when the plan does not merge that half.
/// kv_len:       the sequence's length *before* eviction (src ids are checked against it).
/// keep, plan:   rows `row0 .. row0 + kv_heads` (the sequence's rows of a batch).
/// slots:        whether the cache is still uncompacted or already compacted with `keep`.
/// Complexity: O(entries x head_dim) writes after an O(entries x (log kept + head_dim)) check.
template <class T>
Status merge_contiguous(TensorView<T, 3> keys, TensorView<T, 3> values, std::int64_t kv_len, const KeepSet& keep, std::int64_t row0,
                        const MergePlan& plan, MergeSlots slots = MergeSlots::kBeforeCompaction) noexcept {
  const char* who = "merge_contiguous";
  std::int64_t H = 0, d = 0;
  KVP_RETURN_IF_ERROR(detail::check_contiguous_cache(who, keys, values, kv_len, plan, slots, &H, &d));
  KVP_RETURN_IF_ERROR(detail::check_plan_for_apply(who, plan, keep, row0, H, d, [&](std::int64_t) { return kv_len; }));
  if (slots == MergeSlots::kAfterCompaction) {
    const std::int64_t cap = keys.empty() ? values.extent(1) : keys.extent(1);
    for (std::int64_t h = 0; h < H; ++h)
      KVP_REQUIRE(keep.row_size(row0 + h) <= cap, "%s: row %lld keeps %lld tokens, more than the cache capacity %lld", who,
                  static_cast<long long>(row0 + h), static_cast<long long>(keep.row_size(row0 + h)), static_cast<long long>(cap));
  }
  detail::write_contiguous(keys, values, keep, row0, H, d, plan, slots);
  return Status::ok();
}

/// `compact_contiguous` with the plan's merged rows written into the kept
/// slots, atomically: the plan is validated, then the cache compacted (which
/// validates its own arguments before moving anything), then the rows written.
template <class T>
Status merge_and_compact_contiguous(TensorView<T, 3> keys, TensorView<T, 3> values, TensorView<std::int32_t, 2> positions,
                                    std::int64_t kv_len, const KeepSet& keep, std::int64_t row0, const MergePlan& plan,
                                    std::span<std::int64_t> new_lens) noexcept {
  const char* who = "merge_and_compact_contiguous";
  std::int64_t H = 0, d = 0;
  KVP_RETURN_IF_ERROR(detail::check_contiguous_cache(who, keys, values, kv_len, plan, MergeSlots::kBeforeCompaction, &H, &d));
  KVP_RETURN_IF_ERROR(detail::check_plan_for_apply(who, plan, keep, row0, H, d, [&](std::int64_t) { return kv_len; }));
  KVP_REQUIRE(!keys.empty(), "%s: keys is empty (compaction moves keys and values)", who);
  KVP_RETURN_IF_ERROR(compact_contiguous(keys, values, positions, kv_len, keep, row0, new_lens));
  detail::write_contiguous(keys, values, keep, row0, H, d, plan, MergeSlots::kAfterCompaction);
  return Status::ok();
}

namespace detail {
template <class T>
Status check_paged_for_merge(const char* who, const PagedKVView<T>& cache, const KeepSet& keep, const MergePlan& plan,
                             Workspace ws) noexcept {
  KVP_RETURN_IF_ERROR(cache.validate_writable(who, cache.v_data != nullptr));
  KVP_REQUIRE(cache.device.is_host(), "%s: the page pool must be host memory", who);
  KVP_REQUIRE(plan.merged_values.empty() || cache.v_data != nullptr, "%s: the plan merges values but the cache has no value pool", who);
  const std::int64_t H = cache.num_kv_heads, B = cache.table.batch;
  KVP_REQUIRE(keep.num_rows == B * H, "%s: keep set has %lld rows, expected batch x kv_heads = %lld", who,
              static_cast<long long>(keep.num_rows), static_cast<long long>(B * H));
  KVP_RETURN_IF_ERROR(check_distinct_pages(who, cache.table, cache.num_pages, ws));
  const std::byte *b = nullptr, *e = nullptr;
  pool_range(cache.k_data, sizeof(T), cache.k_strides, cache.num_pages, H, cache.page_size, cache.head_dim, &b, &e);
  KVP_RETURN_IF_ERROR(check_no_alias(who, plan, b, e, "key"));
  pool_range(cache.v_data, sizeof(T), cache.v_strides, cache.num_pages, H, cache.page_size, cache.head_dim, &b, &e);
  KVP_RETURN_IF_ERROR(check_no_alias(who, plan, b, e, "value"));
  for (std::int32_t s = 0; s < cache.table.batch; ++s) {
    const std::int64_t len = cache.seq_len(s);
    KVP_RETURN_IF_ERROR(
        check_plan_for_apply(who, plan, keep, static_cast<std::int64_t>(s) * H, H, cache.head_dim, [&](std::int64_t) { return len; }));
  }
  return Status::ok();
}

/// Writes merged rows; `locate(b, t)` gives the page id holding logical slot t of sequence b.
template <class T, class Locate>
void write_paged(const PagedKVView<T>& cache, const KeepSet& keep, const MergePlan& plan, MergeSlots slots, Locate&& locate) noexcept {
  const std::int64_t H = cache.num_kv_heads, ps = cache.page_size;
  for (std::int32_t s = 0; s < cache.table.batch; ++s)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t r = s * H + h;
      for (std::int32_t i = plan.indptr[r]; i < plan.indptr[r + 1]; ++i) {
        const std::int64_t c = plan.dst[i];
        const std::int64_t t = slots == MergeSlots::kAfterCompaction ? c : keep.row(r)[static_cast<std::size_t>(c)];
        const std::int32_t page = locate(s, t);
        const auto slot = static_cast<std::int32_t>(t % ps), hh = static_cast<std::int32_t>(h);
        const std::int64_t m = r * plan.slots_per_row + c;
        if (!plan.merged_keys.empty()) store_row(cache.k_ptr(page, hh, slot), &plan.merged_keys(m, 0), cache.head_dim, 1);
        if (!plan.merged_values.empty()) store_row(cache.v_ptr(page, hh, slot), &plan.merged_values(m, 0), cache.head_dim, 1);
      }
    }
}
}  // namespace detail

/// Write the merged rows of every sequence of a paged cache into its kept
/// tokens' slots (before compaction). Rows are `b * kv_heads + h` in both the
/// keep set and the plan. The page ids must be distinct (a shared page would
/// be merged for two sequences); ws: compact_paged_workspace(num_pages).
template <class T>
Status merge_paged(const PagedKVView<T>& cache, const KeepSet& keep, const MergePlan& plan, Workspace ws) noexcept {
  KVP_RETURN_IF_ERROR(detail::check_paged_for_merge("merge_paged", cache, keep, plan, ws));
  const PageTable& t = cache.table;
  detail::write_paged(cache, keep, plan, MergeSlots::kBeforeCompaction,
                      [&](std::int32_t b, std::int64_t tok) { return t.page_of(b, tok, cache.page_size); });
  return Status::ok();
}

/// `compact_paged` with the plan's merged rows written into the kept slots,
/// atomically (plan validated, then compaction — itself validated before it
/// moves anything — then the rows written through the compacted table `out`).
template <class T>
Status merge_and_compact_paged(const PagedKVView<T>& cache, const KeepSet& keep, const MergePlan& plan,
                               TensorView<std::int32_t, 3> positions, PagedCompactOutput& out, Workspace ws) noexcept {
  KVP_RETURN_IF_ERROR(detail::check_paged_for_merge("merge_and_compact_paged", cache, keep, plan, ws));
  KVP_RETURN_IF_ERROR(compact_paged(cache, keep, positions, out, ws));
  detail::write_paged(cache, keep, plan, MergeSlots::kAfterCompaction, [&](std::int32_t b, std::int64_t tok) {
    return out.indices[out.indptr[b] + static_cast<std::int32_t>(tok / cache.page_size)];
  });
  return Status::ok();
}

KVP_NAMESPACE_END
