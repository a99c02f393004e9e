// SPDX-License-Identifier: Apache-2.0
// TOVA — "Transformers are Multi-State RNNs" (Oren et al., 2024, arXiv 2401.06104),
// Token Omission Via Attention (reference §8).
//
// Algorithm (per sequence and layer, after the call's attention output):
//   s[j] = (1 / Hq) * sum over ALL query heads h of A[h, last, j]   (newest query row)
//   keep the top n_keep slots of s, ascending, the same slots for every kv head.
// Online (schwartz-lab-NLP/TOVA `TOVACache.reduce`): run it after every call with
// `TOVAParams::original(cache_size)`; a cache of n <= cache_size is kept whole,
// and the newest token itself can be evicted. One-shot (kvpress `TOVAPress`):
// `TOVAParams::kvpress(r)` keeps n_keep = int(T * (1 - r)) and always keeps the
// last token (kvpress pads its score with max + 1).
// TOVA has no state: each call decides from that call's attention alone.
// kvpress versions: the presets follow the reference snapshot (0.5.4), whose
// n_keep = int(T * (1 - r)) can be 0; kvpress >= 0.5.5 keeps at least one token:
// `params.budget = params.budget.keep_at_least_one()` (the fixture tests use it).
//
// Inputs (`evict` / `score`, ScoreInput): the engine's probabilities
// (`attention`, (Hq, q, n): the last row is used), or the queries and keys
// (the last query row of each head is used, at position n - 1;
// Backend::window_scores recomputes its attention row).
//
// Choices: the head mean sums heads in ascending order, then divides by Hq, in
// fp32. Ties: higher score kept, equal scores keep the more recent token
// (`score_order_key`; torch.topk's order is unspecified). With protect_last and
// n_keep >= 1 the last token is kept and the other n_keep - 1 are chosen among
// [0, n - 1), exactly what kvpress's max + 1 pad selects (`score` writes +inf,
// the library's protected-token convention; the order is the same). NaN
// probabilities rank lowest and are evicted first; indices stay valid. When
// exactly one token goes (the online steady state) the victim is found by one
// argmin pass instead of a top-k.
//
// Batch split (`evict`): the head mean couples a sequence's heads, so each
// sequence gets a workspace slot (its attention rows, mean, top-k). With at
// least as many sequences as workers, one item per sequence; otherwise the
// sequences of a wave (as many as there are slots) are scored in (sequence,
// kv head) items, then reduced and chosen one item per sequence.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>

#include "kvpolicy/core/gqa.hpp"
#include "kvpolicy/policy/budget.hpp"
#include "kvpolicy/policy/policy.hpp"

KVP_NAMESPACE_BEGIN

struct TOVAParams {
  Budget budget = Budget::tokens(512).clamp_to_length();  ///< the original's cache_size
  bool protect_last = false;                              ///< kvpress: the last token is always kept
  float scale = 0.0f;                                     ///< logit scale when recomputing attention; 0 means 1/sqrt(head_dim)

  static constexpr auto fields() noexcept {
    return std::tuple{budget_field<&TOVAParams::budget>(),
                      param_field<&TOVAParams::protect_last>("protect_last", "always keep the last token (kvpress)"),
                      param_field<&TOVAParams::scale>("scale", "logit scale, 0 = 1/sqrt(head_dim)")};
  }

  /// `TOVACache(cache_size)` applied after every call (README: 512).
  static constexpr TOVAParams original(std::int64_t cache_size) noexcept {
    return TOVAParams{Budget::tokens(cache_size).clamp_to_length(), false, 0.0f};
  }
  /// kvpress `TOVAPress(compression_ratio=r)`.
  static constexpr TOVAParams kvpress(double r) noexcept { return TOVAParams{Budget::compression_ratio(r), true, 0.0f}; }
};

class TOVA {
 public:
  using Params = TOVAParams;
  static constexpr const char* kName = "tova";

  constexpr TOVA() noexcept = default;
  explicit constexpr TOVA(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(std::isfinite(params_.scale) && params_.scale >= 0.0f, "tova: scale is %g, must be finite and >= 0",
                static_cast<double>(params_.scale));
    return params_.budget.validate(kName);
  }

  /// Tokens kept per kv head for a cache of kv_len tokens (-1 if invalid).
  std::int64_t kept_count(std::int64_t kv_len) const noexcept {
    std::int64_t n = 0;
    if (!validate_params().is_ok() || !params_.budget.resolve(kName, kv_len, params_.protect_last ? 1 : 0, &n).is_ok()) return -1;
    return n;
  }

  /// Tokens scored +inf by rule: the last one with protect_last (kvpress).
  std::int64_t protected_tokens(std::int64_t kv_len) const noexcept { return params_.protect_last ? std::min<std::int64_t>(1, kv_len) : 0; }

  /// The size query: workspace for `score` / `evict` (head_dim = 0 sizes the
  /// engine-probabilities path alone), KeepSet rows (batch x num_kv_heads),
  /// query window 1 (the newest query; 0 with probabilities).
  template <class Backend>
  Requirements requirements(const Context<Backend>& ctx, const ProblemShape& s) const noexcept {
    return detail::budget_requirements(
        kName, validate_params(), s, params_.budget, [this](std::int64_t n) { return protected_tokens(n); },
        workspace_bytes<Backend>(s, ctx.exec), s.num_kv_heads, s.head_dim > 0 ? 1 : 0);
  }

  /// Scores of one sequence, out (num_kv_heads, kv_len): the head-averaged
  /// attention row of the last query (identical for every kv head); with
  /// protect_last the last token scores +inf (kvpress pads it with max + 1:
  /// the same order).
  template <class Backend, class Tq, class Tk, class Tp>
  Status score(const Context<Backend>& cx, const ScoreInput<Tq, Tk, Tp>& in, ScoreMap out) const noexcept {
    const Workspace ws = cx.workspace;
    const ExecContext& ctx = cx.exec;
    KVP_RETURN_IF_ERROR(validate_input(in, 0, kDeviceBackend<Backend>));
    KVP_RETURN_IF_ERROR(out.check_basic(kName, "scores"));
    const std::int64_t H = in.keys.kv_heads(), n = in.keys.kv_len();
    KVP_REQUIRE(out.extent(0) == H && out.extent(1) == n, "tova: scores has shape (%lld, %lld), expected (num_kv_heads=%lld, kv_len=%lld)",
                static_cast<long long>(out.extent(0)), static_cast<long long>(out.extent(1)), static_cast<long long>(H),
                static_cast<long long>(n));
    const ProblemShape shape = shape_of(in);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, workspace_bytes<Backend>(shape, ctx)));
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    const Slots sl = carve<Backend>(ws, shape, ctx.workers(), 1);
    const Blocks blk = sl.block(0);
    wave_rows<Backend>(std::span<const ScoreInput<Tq, Tk, Tp>>(&in, 1), sl, ctx, [](std::int64_t) { return true; });
    head_mean<Backend>(in, blk);
    const std::int64_t last = params_.protect_last ? n - 1 : n;
    for (std::int64_t h = 0; h < H; ++h) {
      float* row = out.data() + h * out.stride(0);
      Backend::copy_strided(blk.mean, last, row, out.stride(1));
      Backend::fill(row + last * out.stride(1), n - last, out.stride(1), kProtectedScore);
    }
    return call.end();
  }

  /// Eviction decision for a batch: rows `b * num_kv_heads + h`, equal per
  /// sequence. Each sequence gives its queries and keys (the last query row
  /// decides; its attention row is recomputed), or the engine's probabilities
  /// `attention` (num_q_heads, q_len, kv_len), whose last row decides (then
  /// `keys` only gives the shape: `KVSource::shape_only`).
  template <class Backend, class Tq, class Tk, class Tp>
  Status evict(const Context<Backend>& cx, std::span<const ScoreInput<Tq, Tk, Tp>> batch, KeepSet out) const noexcept {
    const Workspace ws = cx.workspace;
    const ExecContext& ctx = cx.exec;
    KVP_REQUIRE(!batch.empty(), "tova: batch is empty");
    ProblemShape shape;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      KVP_RETURN_IF_ERROR(validate_input(batch[b], b, kDeviceBackend<Backend>));
      KVP_RETURN_IF_ERROR(detail::check_same_heads(kName, b, shape_of(batch[b]), &shape));
    }
    // One sequence slot at least; as many as the workspace holds, up to min(batch, workers).
    const int W = ctx.workers();
    const auto nb = static_cast<std::int64_t>(batch.size());
    KVP_RETURN_IF_ERROR(check_workspace(kName, ws, workspace_bytes<Backend>(shape, ctx)));
    const detail::BackendCall<Backend> call(cx);
    KVP_RETURN_IF_ERROR(call.begin());
    const Slots sl = carve<Backend>(ws, shape, W, std::min<std::int64_t>(nb, W));
    const std::int64_t H = shape.num_kv_heads;
    KVP_RETURN_IF_ERROR(
        detail::write_uniform_indptr(kName, out, nb, H, [&](std::int64_t b) { return kept_count(batch[b].keys.kv_len()); }));
    if (W > 1 && sl.count == W && nb > W) {  // one item per sequence, its heads on the item's thread
      ctx.parallel_for(nb, [&](std::int64_t b, int worker) {
        const Blocks blk = sl.block(worker);
        const auto& in = batch[static_cast<std::size_t>(b)];
        const std::int64_t n = in.keys.kv_len(), row0 = b * H;
        if (out.row_size(row0) < n) {
          for (std::int64_t h = 0; h < H && !in.has_attention(); ++h) head_rows<Backend>(in, h, blk.rows, sl.workers.slice(worker));
          head_mean<Backend>(in, blk);
        }
        choose<Backend>(blk, n, out, row0, H);
      });
      return call.end();
    }
    for (std::int64_t b0 = 0; b0 < nb; b0 += sl.count) {  // waves of sl.count sequences: (sequence, head) items, then one per sequence
      const std::int64_t m = std::min<std::int64_t>(sl.count, nb - b0);
      const auto part = batch.subspan(static_cast<std::size_t>(b0), static_cast<std::size_t>(m));
      auto scored = [&](std::int64_t i) { return out.row_size((b0 + i) * H) < part[i].keys.kv_len(); };
      wave_rows<Backend>(part, sl, ctx, scored);
      ctx.parallel_for(m, [&](std::int64_t i, int) {
        const Blocks blk = sl.block(static_cast<int>(i));
        if (scored(i)) head_mean<Backend>(part[i], blk);
        choose<Backend>(blk, part[i].keys.kv_len(), out, (b0 + i) * H, H);
      });
    }
    return call.end();
  }

  template <class Backend, class Tq, class Tk, class Tp>
  Status evict(const Context<Backend>& cx, const ScoreInput<Tq, Tk, Tp>& in, KeepSet out) const noexcept {
    return evict(cx, std::span<const ScoreInput<Tq, Tk, Tp>>(&in, 1), out);
  }

 private:
  /// A sequence slot: its (Hq, n) attention rows, the mean row, top-k scratch.
  struct Blocks {
    float* rows = nullptr;
    float* mean = nullptr;
    Workspace topk{};
  };
  /// Per-worker scratch of the attention rows (none for engine probabilities), then `count` sequence slots.
  struct Slots {
    detail::WorkerSlices workers{};
    detail::WorkerSlices seqs{};
    std::int64_t count = 0;
    std::int64_t hq = 0, n = 0;  ///< rows per slot (0: probabilities input) and the longest kv_len sized for
    Blocks block(int i) const noexcept {
      WorkspaceCarver c(seqs.slice(i));
      Blocks b;
      b.rows = c.take<float>(static_cast<std::size_t>(hq * n));
      b.mean = c.take<float>(static_cast<std::size_t>(n));
      b.topk = c.rest();
      return b;
    }
  };

  template <class Backend>
  static std::size_t slot_bytes(std::int64_t hq, std::int64_t n) noexcept {
    WorkspacePlan p;
    p.add<float>(static_cast<std::size_t>(hq * n)).add<float>(static_cast<std::size_t>(n)).add_bytes(Backend::topk_workspace(n));
    return p.bytes;
  }

  /// Carves the per-worker scratch, then up to `want` slots (as many as fit, >= 1 after check_workspace).
  template <class Backend>
  static Slots carve(Workspace ws, const ProblemShape& s, int workers, std::int64_t want) noexcept {
    const std::int64_t G = std::max<std::int64_t>(1, s.num_q_heads / std::max<std::int64_t>(s.num_kv_heads, 1));
    Slots sl;
    sl.n = std::max<std::int64_t>(s.max_kv_len, 1);
    sl.hq = s.head_dim > 0 ? s.num_q_heads : 0;                                             // recomputed rows only
    const std::size_t per = s.head_dim > 0 ? per_worker<Backend>(G, s.head_dim, sl.n) : 0;  // 0: attention input, no recompute
    WorkspaceCarver c(ws);
    if (per > 0) {
      sl.workers.per_worker = align_up(per);
      sl.workers.base = c.take<std::byte>(sl.workers.per_worker * static_cast<std::size_t>(workers < 1 ? 1 : workers));
    }
    sl.seqs.per_worker = slot_bytes<Backend>(sl.hq, sl.n);
    sl.seqs.base = c.take<std::byte>(0);
    sl.count = std::max<std::int64_t>(1, std::min<std::int64_t>(want, static_cast<std::int64_t>(c.rest().bytes / sl.seqs.per_worker)));
    return sl;
  }

  template <class Backend>
  static std::size_t per_worker(std::int64_t G, std::int64_t d, std::int64_t n) noexcept {
    WorkspacePlan per;
    per.add<float>(static_cast<std::size_t>(G * d));
    per.add_bytes(Backend::window_scores_workspace(WindowScoreShape{G, 1, d, n, n, n - 1, 1.0f, WindowReduce::kSum}));
    return per.bytes;
  }

  /// Per-worker scratch plus min(shape.batch, workers) sequence slots (one at
  /// least: a smaller batch of slots runs the call in waves, same result).
  template <class Backend>
  std::size_t workspace_bytes(const ProblemShape& s, const ExecContext& ctx) const noexcept {
    const std::int64_t G = s.num_kv_heads > 0 ? std::max<std::int64_t>(1, s.num_q_heads / s.num_kv_heads) : 1;
    const std::int64_t n = std::max<std::int64_t>(s.max_kv_len, 1);
    const int W = ctx.workers();
    const std::size_t per = s.head_dim > 0 ? align_up(per_worker<Backend>(G, s.head_dim, n)) : 0;
    const std::int64_t slots = std::max<std::int64_t>(1, std::min<std::int64_t>(s.batch, W));
    WorkspacePlan p;
    p.add_bytes(saturating_mul(per, static_cast<std::size_t>(W)));
    p.add_bytes(saturating_mul(slot_bytes<Backend>(s.head_dim > 0 ? std::max<std::int64_t>(s.num_q_heads, 1) : 0, n),
                               static_cast<std::size_t>(slots)));
    return p.total();
  }

  template <class Tq, class Tk, class Tp>
  static ProblemShape shape_of(const ScoreInput<Tq, Tk, Tp>& in) noexcept {
    if (in.has_attention()) return ProblemShape{in.attention.extent(0), in.keys.kv_heads(), 0, in.keys.kv_len(), 1};
    return ProblemShape{in.queries.extent(0), in.keys.kv_heads(), in.keys.head_dim(), in.keys.kv_len(), 1};
  }

  template <class Tq, class Tk, class Tp>
  Status validate_input(const ScoreInput<Tq, Tk, Tp>& in, std::size_t b, bool on_device = false) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(in.lookahead == 0, "tova: lookahead is %lld; TOVA scores with the current query only, it takes no lookahead queries",
                static_cast<long long>(in.lookahead));
    if (in.has_attention()) {
      const auto& p = in.attention;
      KVP_RETURN_IF_ERROR(p.check_basic(kName, "probabilities"));
      if (on_device) {
        KVP_REQUIRE(!p.device().is_host(),
                    "tova: probabilities is a host tensor; a device backend reads device memory (tag the view kCUDA)");
      } else {
        KVP_REQUIRE(p.device().is_host(), "tova: probabilities is a device tensor; this entry point reads host memory");
      }
      if (in.keys.paged != nullptr) {  // lengths come from the page table: validate it before reading them
        KVP_RETURN_IF_ERROR(in.keys.validate(kName, "keys", on_device));
        KVP_RETURN_IF_ERROR(in.keys.paged->table.validate(kName, in.keys.paged->num_pages, in.keys.paged->page_size, !on_device));
      }
      KVP_REQUIRE(p.extent(1) >= 1, "tova: probabilities has %lld query rows, must be >= 1", static_cast<long long>(p.extent(1)));
      GqaMap gqa;
      KVP_RETURN_IF_ERROR(GqaMap::make(p.extent(0), in.keys.kv_heads(), kName, &gqa));
      const std::int64_t n = p.extent(2);
      KVP_REQUIRE(in.keys.kv_len() == n, "tova: probabilities cover %lld tokens, keys has kv_len %lld (sequence %zu)",
                  static_cast<long long>(n), static_cast<long long>(in.keys.kv_len()), b);
      KVP_REQUIRE(n <= INT32_MAX, "tova: kv_len %lld exceeds the int32 token id range (sequence %zu)", static_cast<long long>(n), b);
      std::int64_t k = 0;
      return params_.budget.resolve(kName, n, params_.protect_last ? 1 : 0, &k);
    }
    const PagedKVView<const Tk>** no_paged = nullptr;
    KVP_RETURN_IF_ERROR(detail::check_queries_and_keys(kName, in.queries, in.keys, no_paged, on_device));
    KVP_REQUIRE(in.queries.extent(1) >= 1, "tova: queries has %lld rows per head, must be >= 1 (the last is used)",
                static_cast<long long>(in.queries.extent(1)));
    const std::int64_t n = in.keys.kv_len();
    KVP_REQUIRE(n <= INT32_MAX, "tova: kv_len %lld exceeds the int32 token id range (sequence %zu)", static_cast<long long>(n), b);
    std::int64_t k = 0;
    return params_.budget.resolve(kName, n, params_.protect_last ? 1 : 0, &k);
  }

  /// Kv head h's G attention rows of the last query into rows + h * G * n (n = kv_len).
  template <class Backend, class Tq, class Tk, class Tp>
  void head_rows(const ScoreInput<Tq, Tk, Tp>& in, std::int64_t h, float* rows, Workspace scratch) const noexcept {
    const ProblemShape shape = shape_of(in);
    const std::int64_t H = shape.num_kv_heads, G = shape.num_q_heads / H, d = shape.head_dim, n = shape.max_kv_len;
    const std::int64_t last = in.queries.extent(1) - 1;
    const float scale = params_.scale > 0.0f ? params_.scale : 1.0f / std::sqrt(static_cast<float>(d));
    WorkspaceCarver wc(scratch);
    float* q = wc.take<float>(static_cast<std::size_t>(G * d));
    Backend::widen_queries(in.queries, h * G, G, last, 1, q);
    Backend::window_scores(WindowScoreShape{G, 1, d, n, n, n - 1, scale, WindowReduce::kSum}, q, in.keys.rows(h), rows + h * G * n,
                           wc.rest());
  }

  /// Head-mean attention row of the last query into blk.mean: from the
  /// engine's probabilities, or from the rows `head_rows` wrote.
  template <class Backend, class Tq, class Tk, class Tp>
  void head_mean(const ScoreInput<Tq, Tk, Tp>& in, const Blocks& blk) const noexcept {
    if (in.has_attention()) {  // the engine's probabilities: mean of the last query row over the heads
      const auto& p = in.attention;
      const std::int64_t last = p.extent(1) - 1;
      Backend::mean_rows(
          TensorView<const Tp, 2>(p.data() + last * p.stride(1), {p.extent(0), p.extent(2)}, {p.stride(0), p.stride(2)}, p.device()),
          blk.mean);
      return;
    }
    const ProblemShape shape = shape_of(in);
    Backend::mean_rows(TensorView<const float, 2>::contiguous(blk.rows, {shape.num_q_heads, shape.max_kv_len}), blk.mean);
  }

  /// The attention rows of sequence i of `part` into slot i (part.size() <=
  /// sl.count), over (sequence, kv head) items; sequences kept whole (`keep`
  /// false) and engine probabilities need none.
  template <class Backend, class Tq, class Tk, class Tp, class Keep>
  void wave_rows(std::span<const ScoreInput<Tq, Tk, Tp>> part, const Slots& sl, const ExecContext& ctx, Keep&& scored) const noexcept {
    const std::int64_t m = static_cast<std::int64_t>(part.size()), H = part[0].keys.kv_heads();
    if (part[0].has_attention()) return;
    ctx.parallel_for(m * H, [&](std::int64_t item, int worker) {
      const std::int64_t i = item / H;
      if (scored(i)) head_rows<Backend>(part[i], item % H, sl.block(static_cast<int>(i)).rows, sl.workers.slice(worker));
    });
  }

  /// Row `row0` = the kept ids (all when the budget covers n), copied to the H - 1 next rows.
  template <class Backend>
  void choose(const Blocks& blk, std::int64_t n, KeepSet out, std::int64_t row0, std::int64_t H) const noexcept {
    std::int32_t* dst = out.indices + out.indptr[row0];
    const std::int64_t k = out.row_size(row0);
    if (k >= n) {
      Backend::iota(dst, 0, n);
    } else if (k == n - 1 && (k >= 1 || !params_.protect_last)) {
      // The online steady state evicts one token: an argmin under the same order (NaN lowest, first NaN).
      const std::int64_t cand = params_.protect_last ? n - 1 : n;
      if constexpr (kDeviceBackend<Backend>) {
        Backend::evict_lowest(blk.mean, cand, n, dst);  // same victim; blk.mean is scratch from here on
      } else {
        std::int64_t x = 0;
        if (Backend::argmin_or_nan(blk.mean, cand, &x) >= 0) x = Backend::first_nan(blk.mean, cand);
        for (std::int64_t j = 0; j < x; ++j) dst[j] = static_cast<std::int32_t>(j);
        for (std::int64_t j = x; j < k; ++j) dst[j] = static_cast<std::int32_t>(j + 1);
      }
    } else if (params_.protect_last && k >= 1) {
      Backend::topk(blk.mean, n - 1, k - 1, dst, blk.topk);
      Backend::iota(dst + k - 1, n - 1, 1);
    } else {
      Backend::topk(blk.mean, n, k, dst, blk.topk);
    }
    if (k > 0)  // k == 0: indices may be null (an empty KeepSet)
      for (std::int64_t h = 1; h < H; ++h) Backend::copy_ids(dst, k, out.indices + out.indptr[row0 + h]);
  }

  Params params_{};
};

static_assert(Scorer<TOVA, ScoreInput<float, float>> && EvictionPolicy<TOVA, ScoreInput<float, half>> &&
              EvictionPolicy<TOVA, ScoreInput<float, float, half>>);

KVP_NAMESPACE_END
