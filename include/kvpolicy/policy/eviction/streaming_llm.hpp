// SPDX-License-Identifier: Apache-2.0
// StreamingLLM — "Efficient Streaming Language Models with Attention Sinks"
// (Xiao et al., ICLR 2024, arXiv 2309.17453).
//
// Keep the first `sinks` tokens (attention sinks) and the most recent tokens,
// the same positions for every kv head, layer and sequence. No scores: the
// decision costs O(kv heads x budget) and is independent of the sequence length.
//
// Budget semantics (reference §7):
//  * `StreamingLLMParams::original(start, recent)` — mit-han-lab StartRecentKVCache:
//    keep `start + recent` tokens; shorter sequences are kept whole.
//  * `StreamingLLMParams::kvpress(r, n_sink)` — kvpress StreamingLLMPress:
//    n_keep = int(T * (1 - r)) including the sinks.
//  * `num_coming` (the original's `evict_for_space`): make room for tokens about
//    to be appended by shrinking the recent part, so that after appending
//    `num_coming` tokens the cache holds at most the budget.
// Choice: if the budget is smaller than `sinks`, the first n_keep tokens are
// kept (kvpress keeps an arbitrary subset of its tied sinks).
// Positions: kept tokens keep their original (logical) positions; the
// original's in-cache re-rotation ("pos shift") is the engine's choice and is
// supported by the logical-positions array that `apply/` maintains.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

struct StreamingLLMParams {
  std::int32_t sinks = 4;                          ///< attention-sink tokens kept at the start
  Budget budget = Budget::compression_ratio(0.5);  ///< total kept, sinks included by default
  std::int64_t num_coming = 0;                     ///< tokens about to be appended (evict_for_space)

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&StreamingLLMParams::sinks>("sinks", "attention-sink tokens kept at the start"),
                      budget_field<&StreamingLLMParams::budget>(),
                      param_field<&StreamingLLMParams::num_coming>("num_coming", "tokens about to be appended (room made for them)")};
  }

  static constexpr StreamingLLMParams original(std::int32_t start_size = 4, std::int64_t recent_size = 512) noexcept {
    return StreamingLLMParams{start_size, Budget::tokens(start_size + recent_size).clamp_to_length(), 0};
  }
  static constexpr StreamingLLMParams kvpress(double r, std::int32_t n_sink = 4) noexcept {
    return StreamingLLMParams{n_sink, Budget::compression_ratio(r), 0};
  }
};

class StreamingLLM {
 public:
  using Params = StreamingLLMParams;
  static constexpr const char* kName = "streaming_llm";

  constexpr StreamingLLM() noexcept = default;
  explicit constexpr StreamingLLM(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.sinks >= 0, "streaming_llm: sinks is %d, must be >= 0", params_.sinks);
    KVP_REQUIRE(params_.num_coming >= 0, "streaming_llm: num_coming is %lld, must be >= 0", static_cast<long long>(params_.num_coming));
    return params_.budget.validate(kName);
  }

  /// Tokens kept per kv head for a sequence of kv_len tokens (-1 if invalid).
  std::int64_t kept_count(std::int64_t kv_len) const noexcept {
    std::int64_t n = 0;
    if (!validate_params().is_ok() || kv_len < 0) return -1;
    const std::int64_t sinks = std::min<std::int64_t>(params_.sinks, kv_len);
    if (!params_.budget.resolve(kName, kv_len, sinks, &n).is_ok()) return -1;
    // Room for `num_coming` tokens comes out of the recent part; sinks survive.
    const std::int64_t budget = params_.budget.total(kv_len, sinks);
    n = std::max(budget - params_.num_coming, std::min(sinks, budget));
    return std::clamp<std::int64_t>(n, 0, kv_len);
  }

  /// Tokens kept by rule: the sinks.
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return std::min<std::int64_t>(params_.sinks, kv_len); }

  /// The size query: no workspace, KeepSet rows (batch x num_kv_heads), no queries.
  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& shape) const noexcept {
    Status st = validate_params();
    if (st.is_ok()) st = detail::check_problem_shape(kName, shape);
    std::int64_t n = 0;
    if (st.is_ok()) st = params_.budget.resolve(kName, shape.max_kv_len, protected_tokens(shape.max_kv_len), &n);
    return detail::uniform_requirements(st, 0, shape, shape.num_kv_heads, kept_count(shape.max_kv_len), 0);
  }

  /// Kept ids of one row (ascending) for a sequence of kv_len tokens into
  /// `out` (at least kept_count(kv_len) entries): the decision without a
  /// KeepSet, for engines that store one row for every head. O(kept).
  Status evict_row(std::int64_t kv_len, std::span<std::int32_t> out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(kv_len >= 0 && kv_len <= INT32_MAX, "streaming_llm: kv_len %lld out of range [0, 2^31)", static_cast<long long>(kv_len));
    std::int64_t n = 0;
    KVP_RETURN_IF_ERROR(params_.budget.resolve(kName, kv_len, std::min<std::int64_t>(params_.sinks, kv_len), &n));
    n = kept_count(kv_len);  // includes the num_coming adjustment
    KVP_REQUIRE(n == 0 || out.data() != nullptr, "streaming_llm: output is null");
    KVP_REQUIRE(static_cast<std::int64_t>(out.size()) >= n, "streaming_llm: output capacity %zu < %lld kept tokens", out.size(),
                static_cast<long long>(n));
    write_row<backend::Scalar>(kv_len, n, out.data());
    return Status::ok();
  }

  /// Eviction decision for a batch: rows `b * num_kv_heads + h`; only the
  /// keys' shape (kv heads, kv_len) is read. A paged source's view is
  /// validated (`KVSource::validate_pool`, keys only: CSR page table, and on
  /// the host the ids in the pool) once per distinct view before its lengths
  /// are read; on error
  /// nothing is written. The rows (one per (sequence, kv head)) are written
  /// in parallel over `cx.exec` once the batch keeps kParallelEntries ids or
  /// more, on the calling thread below; no workspace.
  template <class Backend, class Tq, class Tk, class Tp>
  Status evict(const Context<Backend>& cx, std::span<const ScoreInput<Tq, Tk, Tp>> batch, KeepSet out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(!batch.empty(), "streaming_llm: batch is empty");
    const std::int64_t H = batch[0].keys.kv_heads();
    const PagedKVView<const Tk>* last_paged = nullptr;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      KVP_RETURN_IF_ERROR(batch[b].keys.validate(kName, "keys", kDeviceBackend<Backend>));
      KVP_RETURN_IF_ERROR(batch[b].keys.validate_pool(kName, "keys", kDeviceBackend<Backend>, &last_paged));
      KVP_REQUIRE(batch[b].keys.kv_heads() == H, "streaming_llm: sequence %zu has %lld kv heads, sequence 0 has %lld", b,
                  static_cast<long long>(batch[b].keys.kv_heads()), static_cast<long long>(H));
      const std::int64_t T = batch[b].keys.kv_len();
      KVP_REQUIRE(T <= INT32_MAX, "streaming_llm: kv_len %lld exceeds the int32 token id range", static_cast<long long>(T));
      std::int64_t n = 0;
      KVP_RETURN_IF_ERROR(params_.budget.resolve(kName, T, std::min<std::int64_t>(params_.sinks, T), &n));
    }
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    KVP_RETURN_IF_ERROR(detail::write_uniform_indptr(kName, out, static_cast<std::int64_t>(batch.size()), H,
                                                     [&](std::int64_t b) { return kept_count(batch[b].keys.kv_len()); }));
    const std::int64_t rows = static_cast<std::int64_t>(batch.size()) * H;
    auto one_row = [&](std::int64_t row, int) {
      write_row<Backend>(batch[static_cast<std::size_t>(row / H)].keys.kv_len(), out.row_size(row), out.indices + out.indptr[row]);
    };
    if (out.indptr[rows] >= kParallelEntries) {
      cx.exec.parallel_for(rows, one_row);
    } else {  // a few ids: cheaper than waking the pool
      for (std::int64_t row = 0; row < rows; ++row) one_row(row, 0);
    }
    return call.end();
  }

  /// Single-sequence convenience.
  template <class Backend, class Tq, class Tk, class Tp>
  Status evict(const Context<Backend>& cx, const ScoreInput<Tq, Tk, Tp>& in, KeepSet out) const noexcept {
    return evict(cx, std::span<const ScoreInput<Tq, Tk, Tp>>(&in, 1), out);
  }

 private:
  static constexpr std::int64_t kParallelEntries = std::int64_t{1} << 16;

  template <class Backend>
  void write_row(std::int64_t kv_len, std::int64_t n, std::int32_t* out) const noexcept {
    const std::int64_t s = std::min<std::int64_t>(params_.sinks, n);
    Backend::iota(out, 0, s);
    // Recent part: the last (n - s) tokens, never overlapping the sinks.
    const std::int64_t recent = n - s;
    Backend::iota(out + s, kv_len - recent, recent);
  }

  Params params_{};
};

static_assert(EvictionPolicy<StreamingLLM, ScoreInput<float, float>> && EvictionPolicy<StreamingLLM, ScoreInput<float, half>>);

KVP_NAMESPACE_END
