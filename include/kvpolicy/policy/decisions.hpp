// SPDX-License-Identifier: Apache-2.0
// Decision types of the merging, quantization and prefetch families (the
// eviction and selection decisions, `KeepSet` and `PageSelection`, live in
// core). Like those, each is a plain view over caller memory with a
// `validate()` that names the field and the constraint; nothing allocates.
//
//   MergePlan        which evicted token folds into which kept token, with
//                    what weight, plus the merged K/V rows written into
//                    caller buffers (`apply/` or the engine copies them in).
//   QuantLayout      the byte layout of one quantized K/V row format (block
//                    size, bits, where scales / zeros live): enough for an
//                    engine to allocate the cache and for `bytes_per_token`.
//   QuantizedKV      a quantized cache region: codes + scales (+ zeros) views.
//   PrefetchRequest  ordered page ids with priorities for the next step.
//   PrefetchCounters the three hit-rate counters of a prefetcher.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN

// ---- merging --------------------------------------------------------------

/// A merge decision for one call: `num_rows` rows (one per (sequence, kv
/// head), as `KeepSet`), row r holding the triples
/// `(dst[e], src[e], weight[e])` for e in `[indptr[r], indptr[r+1])`:
/// evicted token `src` folds into kept token `dst` with `weight`. `dst` are
/// positions in the *kept* row (0 .. kept-1, so they survive compaction),
/// `src` original token ids. `weight` is the coefficient of the source row in
/// the merged row (each policy states its formula); the merged rows
/// themselves are authoritative (CaM's cascades and D2O's self weights are
/// not recoverable from the triples alone).
///
/// Merged rows go to `merged_keys` / `merged_values`: the merged row of kept
/// slot c of row r is row `r * slots_per_row + c` (so the buffers hold
/// `num_rows * slots_per_row` rows of head_dim, `slots_per_row` >= the kept
/// count of every row). Only slots that some entry targets are written. An
/// empty view means that half is not merged (CaM and kvpress's presses merge
/// values only) or that the caller wants the plan alone.
struct MergePlan {
  std::int32_t* indptr = nullptr;  // (num_rows + 1)
  std::int32_t* dst = nullptr;     // (capacity)
  std::int32_t* src = nullptr;     // (capacity)
  float* weight = nullptr;         // (capacity)
  std::int64_t num_rows = 0;
  std::int64_t capacity = 0;
  TensorView<float, 2> merged_keys{};    ///< optional (num_rows * slots_per_row, head_dim)
  TensorView<float, 2> merged_values{};  ///< optional (num_rows * slots_per_row, head_dim)
  std::int64_t slots_per_row = 0;        ///< row stride of the merged buffers, in rows

  std::int64_t row_size(std::int64_t r) const noexcept { return indptr[r + 1] - indptr[r]; }

  Status check_output(const char* who, std::int64_t rows_needed, std::int64_t total_needed) const noexcept {
    KVP_REQUIRE(indptr != nullptr, "%s: merge plan indptr is null", who);
    KVP_REQUIRE(num_rows == rows_needed, "%s: merge plan has %lld rows, expected %lld (sequences x kv heads)", who,
                static_cast<long long>(num_rows), static_cast<long long>(rows_needed));
    KVP_REQUIRE(total_needed == 0 || (dst != nullptr && src != nullptr && weight != nullptr),
                "%s: merge plan dst/src/weight is null with %lld entries needed", who, static_cast<long long>(total_needed));
    if (capacity < total_needed)
      return Status::error(StatusCode::kOutputTooSmall, "%s: merge plan capacity is %lld, needs %lld", who,
                           static_cast<long long>(capacity), static_cast<long long>(total_needed));
    return Status::ok();
  }
};

// ---- quantization ---------------------------------------------------------

/// Where a format keeps its per-group parameters.
enum class QuantScaleLayout : std::uint8_t {
  kInBlock,   ///< ggml blocks: scale (and min) stored at the head of each block, codes after
  kSeparate,  ///< codes and scales in separate arrays (KIVI, fp8 with per-head scale)
};

/// Along which axis a group of values shares one scale.
enum class QuantAxis : std::uint8_t {
  kToken,    ///< groups run along head_dim within a token (q8_0, q4_*, KIVI values, INT4)
  kChannel,  ///< groups run along tokens within a channel (KIVI keys)
};

/// The byte layout of one quantized format, enough to size a cache.
struct QuantLayout {
  const char* name = "";         ///< e.g. "q8_0", "kivi2"
  std::int32_t bits = 0;         ///< code bits per value
  std::int32_t group = 0;        ///< values sharing one scale (block size)
  std::int32_t block_bytes = 0;  ///< bytes per group including in-block scales (kInBlock), codes only otherwise
  std::int32_t scale_bytes = 0;  ///< bytes of scale (+ zero) per group in the separate array (kSeparate)
  QuantScaleLayout scales = QuantScaleLayout::kInBlock;
  QuantAxis axis = QuantAxis::kToken;

  Status validate(const char* who) const noexcept {
    KVP_REQUIRE(bits >= 1 && bits <= 16, "%s: quant layout '%s' has %d bits per value, must be in [1, 16]", who, name, bits);
    KVP_REQUIRE(group >= 1, "%s: quant layout '%s' has group %d, must be >= 1", who, name, group);
    KVP_REQUIRE(block_bytes >= 1, "%s: quant layout '%s' has %d bytes per block, must be >= 1", who, name, block_bytes);
    KVP_REQUIRE(scale_bytes >= 0, "%s: quant layout '%s' has %d scale bytes, must be >= 0", who, name, scale_bytes);
    return Status::ok();
  }
  /// Bytes one token of `head_dim` channels costs in this format (scales included;
  /// for kChannel groups, the scale cost is spread over the group's tokens).
  double bytes_per_token(std::int64_t head_dim) const noexcept {
    if (group <= 0) return 0.0;
    const double groups = axis == QuantAxis::kToken ? static_cast<double>((head_dim + group - 1) / group)
                                                    : static_cast<double>(head_dim) / static_cast<double>(group);
    const double code = axis == QuantAxis::kToken ? groups * block_bytes : static_cast<double>(head_dim) * bits / 8.0;
    return code + groups * scale_bytes;
  }
};

/// A quantized K or V region: `tokens` rows of `head_dim` channels per kv head.
struct QuantizedKV {
  QuantLayout layout{};
  TensorView<std::uint8_t, 3> codes{};   ///< (kv_heads, tokens or groups, row bytes)
  TensorView<std::uint8_t, 3> scales{};  ///< (kv_heads, groups, scale_bytes) when layout.scales == kSeparate
  std::int64_t tokens = 0;               ///< quantized tokens held
};

// ---- prefetch -------------------------------------------------------------

/// Pages to bring on-device before the next step, most urgent first. A
/// policy's `predict` takes it by reference: it fills `pages[0, size)` (and
/// `priority` when not null) and sets `size`.
struct PrefetchRequest {
  std::int32_t* pages = nullptr;  // (capacity) physical page ids
  float* priority = nullptr;      // (capacity) optional, higher = sooner
  std::int64_t capacity = 0;
  std::int64_t size = 0;  ///< written by the policy (-1 on a device backend: the size is device data)
  /// Device backends: optional device memory the policy writes the size to
  /// (`pages` / `priority` are device memory there too). On every backend
  /// the entries past the size, up to the table's entry count, are -1
  /// (priority NaN), so a consumer kernel can stop at the first -1 without a
  /// host read.
  std::int64_t* device_size = nullptr;

  Status check_output(const char* who, std::int64_t needed) const noexcept {
    KVP_REQUIRE(needed == 0 || pages != nullptr, "%s: prefetch request pages is null with %lld needed", who,
                static_cast<long long>(needed));
    if (capacity < needed)
      return Status::error(StatusCode::kOutputTooSmall, "%s: prefetch request capacity is %lld, needs %lld", who,
                           static_cast<long long>(capacity), static_cast<long long>(needed));
    return Status::ok();
  }
};

/// Hit-rate accounting of a prefetcher, the three definitions of
/// reference/algorithms-other.md §6.3 (policy/prefetch/history.hpp counts them):
///
///   1. prediction recall  hits / (hits + misses): of the pages a step read,
///                         the fraction its prediction named (steps without a
///                         prediction are not counted here);
///   2. buffer hit         reused / reuse_total: of the pages a step read, the
///                         fraction the previous step of the same layer also
///                         read (resident in a ShadowKV-style buffer; the first
///                         step of a layer has no previous step and is skipped);
///   3. late-miss rate     late / needed: of the pages a step read, the fraction
///                         neither read by the previous step nor predicted, i.e.
///                         fetched on demand while attention waits.
///
/// Counts are pooled: a page counts once per (layer, step) however many heads
/// or sequences read it, and rates are ratios of sums over steps and layers
/// (not means of per-step ratios). There is no padding (rows are CSR).
/// `transferred` pages crossed the link (predicted pages not already read by
/// the previous step, plus the late misses): bytes moved = transferred *
/// page bytes. `hits`, `misses`, `wasted`, `recall()` and `precision()` keep
/// their earlier meaning.
struct PrefetchCounters {
  std::int64_t hits = 0;             ///< read pages that were predicted (steps with a prediction)
  std::int64_t misses = 0;           ///< read pages that were not predicted (steps with a prediction)
  std::int64_t wasted = 0;           ///< predicted pages the step did not read
  std::int64_t predicted = 0;        ///< predicted pages (distinct per step)
  std::int64_t needed = 0;           ///< read pages (distinct per step), every step
  std::int64_t reused = 0;           ///< read pages the previous step of the layer also read
  std::int64_t reuse_total = 0;      ///< read pages of steps that have a previous step
  std::int64_t late = 0;             ///< read pages neither reused nor predicted (demand fetches)
  std::int64_t transferred = 0;      ///< pages moved host -> device (prefetched and not resident, plus late)
  std::int64_t steps = 0;            ///< observations (layer steps)
  std::int64_t predicted_steps = 0;  ///< observations that had a prediction

  double recall() const noexcept { return hits + misses == 0 ? 1.0 : static_cast<double>(hits) / static_cast<double>(hits + misses); }
  double precision() const noexcept { return hits + wasted == 0 ? 1.0 : static_cast<double>(hits) / static_cast<double>(hits + wasted); }
  /// Definition 1.
  double prediction_recall() const noexcept { return recall(); }
  /// Definition 2 (1 when no step had a previous step).
  double buffer_hit_rate() const noexcept {
    return reuse_total == 0 ? 1.0 : static_cast<double>(reused) / static_cast<double>(reuse_total);
  }
  /// Definition 3 (0 when nothing was read).
  double late_miss_rate() const noexcept { return needed == 0 ? 0.0 : static_cast<double>(late) / static_cast<double>(needed); }
  /// Host -> device bytes for pages of `page_bytes` bytes.
  double bytes_moved(double page_bytes) const noexcept { return static_cast<double>(transferred) * page_bytes; }

  PrefetchCounters& operator+=(const PrefetchCounters& o) noexcept {
    hits += o.hits;
    misses += o.misses;
    wasted += o.wasted;
    predicted += o.predicted;
    needed += o.needed;
    reused += o.reused;
    reuse_total += o.reuse_total;
    late += o.late;
    transferred += o.transferred;
    steps += o.steps;
    predicted_steps += o.predicted_steps;
    return *this;
  }
};

KVP_NAMESPACE_END
