// SPDX-License-Identifier: Apache-2.0
// `Compress<E, M, Q>`: evict -> merge -> quantize on one budget, as one
// composed policy an engine calls at one hook (after_prefill).
//
//   1. n = the budget in tokens per kv head: `PipelineBudget::tokens(n)`, or
//      `bytes(b)`: the most tokens whose quantized K + V fit b bytes per kv
//      head, n = floor(b / (2 * Q::bytes_per_token(head_dim))); at most kv_len.
//   2. E (any eviction policy whose Params has a `budget`) evicts with
//      Budget::tokens(n) -> KeepSet.
//   3. M merges what E dropped into what it kept -> MergePlan + merged rows.
//   4. apply::merge_and_compact_contiguous writes the merged rows and compacts
//      the cache in place (logical positions kept).
//   5. Q quantizes the n kept rows of K and of V into the caller's codes.
//   6. `MemoryAccount`: bytes per (token, kv head) before (cache dtype) and
//      after (quantized), and the whole sequence's bytes before / after.
//
// One workspace serves every stage in turn (its size is the largest stage's).
// Atomic on error: every stage's inputs and outputs are checked before the
// cache is touched (eviction and merge write only caller-owned decision
// buffers; the quantizer's shape and the kept rows' finiteness are checked
// before compaction), so on error the cache is unchanged.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "kvpolicy/apply/merge.hpp"
#include "kvpolicy/policy/merging/merge_common.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

/// The one budget of a pipeline, per kv head of a sequence.
struct PipelineBudget {
  enum class Kind : std::uint8_t { kTokens, kBytes };
  Kind kind = Kind::kTokens;
  double value = 0.0;
  static constexpr PipelineBudget tokens(std::int64_t n) noexcept { return {Kind::kTokens, static_cast<double>(n)}; }
  static constexpr PipelineBudget bytes(double b) noexcept { return {Kind::kBytes, b}; }
};

/// Memory before and after a pipeline run, one sequence.
struct MemoryAccount {
  std::int64_t kv_heads = 0;
  std::int64_t tokens_before = 0;       ///< per kv head
  std::int64_t tokens_after = 0;        ///< per kv head
  double bytes_per_token_before = 0.0;  ///< K + V bytes per (token, kv head), cache dtype
  double bytes_per_token_after = 0.0;   ///< K + V bytes per stored (token, kv head), quantized
  double bytes_before = 0.0;            ///< whole sequence, every kv head
  double bytes_after = 0.0;
  /// Bytes after per original (token, kv head): the effective cost of a prompt token.
  double bytes_per_prompt_token_after() const noexcept {
    return tokens_before == 0 ? 0.0 : bytes_after / static_cast<double>(tokens_before * kv_heads);
  }
};

/// The contiguous cache of one sequence the pipeline compresses in place.
template <class Tk>
struct CompressCache {
  TensorView<Tk, 3> keys{};                 ///< (kv_heads, capacity, head_dim)
  TensorView<Tk, 3> values{};               ///< (kv_heads, capacity, head_dim)
  TensorView<std::int32_t, 2> positions{};  ///< optional (kv_heads, capacity) logical positions
  std::int64_t kv_len = 0;
};

/// Caller-owned outputs: the decisions, the codes, the accounting.
struct CompressOutput {
  KeepSet keep{};                      ///< rows = kv heads, capacity >= kv heads x n
  MergePlan plan{};                    ///< the merge's plan and merged rows
  QuantizedKV keys{};                  ///< codes of the kept keys
  QuantizedKV values{};                ///< codes of the kept values
  std::span<std::int64_t> new_lens{};  ///< (kv_heads)
  MemoryAccount* account = nullptr;    ///< optional
};

template <class E, class M, class Q>
class Compress {
 public:
  static constexpr const char* kName = "compress";

  Compress(const E& evict, const M& merge, const Q& quant, PipelineBudget budget) noexcept
      : evict_(evict), merge_(merge), quant_(quant), budget_(budget) {}
  const E& eviction() const noexcept { return evict_; }
  const M& merging() const noexcept { return merge_; }
  const Q& quantization() const noexcept { return quant_; }
  PipelineBudget budget() const noexcept { return budget_; }

  Status validate_params() const noexcept {
    KVP_REQUIRE(std::isfinite(budget_.value) && budget_.value >= 0.0, "compress: budget is %g, must be finite and >= 0", budget_.value);
    KVP_REQUIRE(budget_.kind == PipelineBudget::Kind::kBytes || budget_.value == std::floor(budget_.value),
                "compress: token budget %g is not an integer", budget_.value);
    KVP_RETURN_IF_ERROR(evict_.validate_params());
    KVP_RETURN_IF_ERROR(merge_.validate_params());
    return quant_.validate_params();
  }

  /// Tokens kept per kv head for a sequence of kv_len tokens of head_dim channels.
  std::int64_t kept_tokens(std::int64_t kv_len, std::int64_t head_dim) const noexcept {
    double n = budget_.value;
    if (budget_.kind == PipelineBudget::Kind::kBytes) {
      const double per = 2.0 * quant_.bytes_per_token(head_dim);
      n = per > 0.0 ? std::floor(budget_.value / per) : 0.0;
    }
    return std::min<std::int64_t>(kv_len, static_cast<std::int64_t>(std::min(n, 9.0e15)));
  }

  /// The largest stage's workspace; output: keep set rows / capacity (the plan's
  /// size comes from `merging().requirements`).
  template <class B>
  Requirements requirements(const Context<B>& ctx, const ProblemShape& s) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (!r.status.is_ok()) return r;
    const E e = evictor(kept_tokens(s.max_kv_len, s.head_dim));
    const Requirements re = e.requirements(ctx, s), rm = merge_.requirements(ctx, s), rq = quant_.requirements(ctx, s);
    for (const Requirements* x : {&re, &rm, &rq})
      if (!x->status.is_ok()) {
        r.status = x->status;
        return r;
      }
    r.workspace_bytes = std::max({re.workspace_bytes, rm.workspace_bytes, rq.workspace_bytes});
    r.output = re.output;
    r.query_window = re.query_window;
    return r;
  }

  /// One sequence: `in` scores the cache (its keys view the cache), `merge_in`
  /// is the merge's input over the same cache (with its state, if any).
  template <class B, class Tq, class Tk, class MIn>
  Status run(const Context<B>& ctx, const ScoreInput<Tq, Tk>& in, const MIn& merge_in, CompressCache<Tk> cache,
             CompressOutput out) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    const std::int64_t T = cache.kv_len, H = cache.keys.extent(0), d = cache.keys.extent(2);
    KVP_REQUIRE(in.keys.kv_len() == T && merge_in.values.kv_len() == T, "compress: the inputs cover %lld / %lld tokens, the cache %lld",
                static_cast<long long>(in.keys.kv_len()), static_cast<long long>(merge_in.values.kv_len()), static_cast<long long>(T));
    KVP_REQUIRE(cache.values.extent(0) == H && cache.values.extent(2) == d && cache.keys.extent(1) >= T && cache.values.extent(1) >= T,
                "compress: keys and values must both be (kv_heads, >= kv_len, head_dim)");
    const std::int64_t n = kept_tokens(T, d);
    // Quantizer checks before anything is written (head_dim, code buffers).
    const Requirements rq = quant_.requirements(ctx, ProblemShape{H, H, d, n, 1});
    KVP_RETURN_IF_ERROR(rq.status);
    KVP_REQUIRE(out.new_lens.size() >= static_cast<std::size_t>(H), "compress: new_lens has %zu entries, needs %lld", out.new_lens.size(),
                static_cast<long long>(H));
    for (const QuantizedKV* q : {&out.keys, &out.values}) {
      KVP_RETURN_IF_ERROR(q->codes.check_basic(kName, "codes"));
      KVP_REQUIRE(q->codes.extent(0) == H && q->codes.extent(1) >= n,
                  "compress: codes hold (%lld heads, %lld tokens), need (%lld, >= %lld)", static_cast<long long>(q->codes.extent(0)),
                  static_cast<long long>(q->codes.extent(1)), static_cast<long long>(H), static_cast<long long>(n));
    }
    typename Q::State st{};
    {  // a dry run over zero tokens checks the code buffers' layout without writing
      const auto none = TensorView<const Tk, 3>(cache.keys.narrow(1, 0, 0));
      KVP_RETURN_IF_ERROR(quant_.quantize(ctx, none, st, out.keys));
      KVP_RETURN_IF_ERROR(quant_.quantize(ctx, none, st, out.values));
    }
    // 1-2: evict.
    const E e = evictor(n);
    KVP_RETURN_IF_ERROR(e.evict(ctx, std::span<const ScoreInput<Tq, Tk>>(&in, 1), out.keep));
    // 3: merge (writes only the plan and its merged buffers).
    KVP_RETURN_IF_ERROR(merge_.merge(ctx, merge_in, out.keep, out.plan));
    // Kept rows must quantize: finite (merged rows were checked finite by apply's validation).
    for (std::int64_t h = 0; h < H; ++h)
      for (const std::int32_t j : out.keep.row(h)) {
        KVP_REQUIRE(B::first_nonfinite(&cache.keys(h, j, 0), d) < 0 && B::first_nonfinite(&cache.values(h, j, 0), d) < 0,
                    "compress: kept token %d of kv head %lld has a non-finite key or value; nothing was written", j,
                    static_cast<long long>(h));
      }
    // 4: merge + compact.
    KVP_RETURN_IF_ERROR(merge_and_compact_contiguous(cache.keys, cache.values, cache.positions, T, out.keep, 0, out.plan, out.new_lens));
    // 5: quantize the kept rows.
    const auto kk = TensorView<const Tk, 3>(cache.keys.narrow(1, 0, n)), vv = TensorView<const Tk, 3>(cache.values.narrow(1, 0, n));
    out.keys.tokens = out.values.tokens = n;
    KVP_RETURN_IF_ERROR(quant_.quantize(ctx, kk, st, out.keys));
    KVP_RETURN_IF_ERROR(quant_.quantize(ctx, vv, st, out.values));
    // 6: accounting.
    if (out.account != nullptr) {
      MemoryAccount& a = *out.account;
      a.kv_heads = H;
      a.tokens_before = T;
      a.tokens_after = n;
      a.bytes_per_token_before = 2.0 * static_cast<double>(d) * static_cast<double>(sizeof(Tk));
      a.bytes_per_token_after = 2.0 * quant_.bytes_per_token(d);
      a.bytes_before = a.bytes_per_token_before * static_cast<double>(T * H);
      a.bytes_after = a.bytes_per_token_after * static_cast<double>(n * H);
    }
    return Status::ok();
  }

 private:
  E evictor(std::int64_t n) const noexcept {
    auto p = evict_.params();
    p.budget = Budget::tokens(n).clamp_to_length();
    return E(p);
  }

  E evict_;
  M merge_;
  Q quant_;
  PipelineBudget budget_;
};

KVP_NAMESPACE_END
