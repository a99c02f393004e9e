// SPDX-License-Identifier: Apache-2.0
// ShadowKV-style landmarks — after "ShadowKV: KV Cache in Shadows for
// High-Throughput Long-Context LLM Inference" (Sun et al., arXiv 2410.21465;
// reference code bytedance/ShadowKV): chunk landmarks, outlier chunks kept
// resident, a local tail, and reuse of the previous step's selection.
// reference/algorithms-other.md §3.3 and §6.4 (`ChunkReusePolicy`).
//
// Algorithm (per layer):
//   on append:  every complete chunk of C tokens (`chunk_size`) gets a
//               landmark L_c = mean of its keys (per kv head) and an outlier
//               score o_c = min over its keys of cos(L_c, k).
//   predict:    per sequence and kv head g, over the complete chunks that are
//               not in the local tail:
//                 outliers = the `outlier_chunks` chunks of lowest o_c, always kept;
//                 p_h[c]   = softmax_c(q_h . L_c / sqrt(d))   (h in g's group, outliers masked)
//                 score[c] = max_h p_h[c]
//                 selected = top_{chunk_budget}(score)
//               plus the local tail (the last `local_chunks` complete chunks
//               and the partial one). The request is the pages of all of
//               those, plus (`reuse_previous`) the previous step's pages.
//
// ShadowKV scores the current query for the same step; as a prefetcher the
// engine runs it on step t's query for step t + 1 (like Quest lookahead),
// and the pages it keeps from step t are exactly ShadowKV's buffer hits.
//
// Choices, where the references differ or leave it open:
//  * Landmarks from post-RoPE keys (the cache's), as ShadowKV's code computes
//    them (`get_svd` keeps pre-RoPE keys only for its low-rank key
//    reconstruction, which is not modelled here: every page moves whole).
//    The issue text says pre-RoPE; the decode query is post-RoPE, and
//    landmarks in the same basis are what the reference scores against.
//  * Chunks live inside pages: `page_size % chunk_size == 0`, a chunk's
//    tokens share one page, so chunk scores map to page requests.
//  * Outliers are recomputed each call from every complete non-local chunk
//    (ShadowKV fixes them at prefill; decode-time chunks may become outliers
//    here). Ties: `Backend::topk` on -o_c (the more recent chunk). A chunk
//    whose keys or landmark have zero norm has o_c = 1.
//  * Priorities: local tail and outliers +inf (they are resident by
//    construction), selected chunks their score (max over the chunk's kv
//    heads and chunks of the page), reused-only pages -1.
//  * GQA: max over the group's query heads (the reference).
//
// State: caller-owned (`ShadowKVState`), one per layer: landmarks
// (num_pages, page_size / C, Hkv, d), outlier scores (num_pages, page_size / C,
// Hkv), the history. Thread-safety: const; the state is the caller's.
//
// On a device backend (`on_append` / `predict` / `observe` with e.g.
// backend::Cuda) the state (built by `make_state` with a device tag; its
// history cleared with `history.reset(ctx)`), the keys' pool, the queries,
// `table.indices`, the request, the counters of `observe` and the workspace
// are device memory; `table.indptr` / `last_page_len`, `app.append_len` and
// the observed selection's `indptr` are host arrays. The loops are the ops of
// ops/shadowkv_ops.hpp, a few launches per sequence: landmarks on append;
// outlier keys, a top-k over the kv-head rows, the chunk scores, a second
// top-k and the entries' priorities on predict; then the reuse and the
// request of the prefetch ops. Nothing returns to the host: the request's
// size is device data (`PrefetchRequest::device_size`, `size` = -1), its pages
// past the size -1. The landmarks and outlier scores are the host's bits; the
// scores use the device's exp, so a chunk whose score sits within a few ulp of
// its head's k-th may be chosen on one side only, and the priorities of the
// selected chunks agree with the host's to within 1e-5 relative.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/ops/shadowkv_ops.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/prefetch/history.hpp"

KVP_NAMESPACE_BEGIN

struct ShadowKVParams {
  std::int32_t chunk_size = 8;       ///< tokens per chunk (reference 8)
  std::int32_t chunk_budget = 256;   ///< chunks selected per kv head (reference sparse budget 2048 / 8)
  std::int32_t outlier_chunks = 48;  ///< chunks kept resident per kv head (reference accuracy class 48)
  std::int32_t local_chunks = 4;     ///< complete chunks of the tail always kept (reference 4)
  bool reuse_previous = true;        ///< keep the previous step's pages requested (priority -1)
  std::int32_t dense_layers = 0;     ///< layers predicted whole

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&ShadowKVParams::chunk_size>("chunk_size", "tokens per landmark chunk"),
                      param_field<&ShadowKVParams::chunk_budget>("chunk_budget", "chunks selected per kv head"),
                      param_field<&ShadowKVParams::outlier_chunks>("outlier_chunks", "lowest-cosine chunks kept resident"),
                      param_field<&ShadowKVParams::local_chunks>("local_chunks", "tail chunks always kept"),
                      param_field<&ShadowKVParams::reuse_previous>("reuse_previous", "keep the previous step's pages"),
                      param_field<&ShadowKVParams::dense_layers>("dense_layers", "layers predicted whole")};
  }
};

/// Caller-owned state of one layer (see the header comment). Build with `ShadowKV::make_state`.
struct ShadowKVState {
  float* landmarks = nullptr;  // (num_pages, chunks_per_page, num_kv_heads, head_dim)
  float* outlier = nullptr;    // (num_pages, chunks_per_page, num_kv_heads) min cosine
  std::int32_t num_pages = 0, page_size = 0, chunk_size = 0, num_kv_heads = 0, head_dim = 0;
  PrefetchHistory history{};
  Device device{};  ///< where the buffers live (a device backend needs device memory)

  std::int32_t chunks_per_page() const noexcept { return chunk_size > 0 ? page_size / chunk_size : 0; }
  std::int64_t slot(std::int32_t page, std::int32_t chunk_in_page, std::int32_t g) const noexcept {
    return (static_cast<std::int64_t>(page) * chunks_per_page() + chunk_in_page) * num_kv_heads + g;
  }
};

class ShadowKV {
 public:
  using Params = ShadowKVParams;
  using State = ShadowKVState;
  static constexpr const char* kName = "shadowkv";

  constexpr ShadowKV() noexcept = default;
  explicit constexpr ShadowKV(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.chunk_size >= 1, "shadowkv: chunk_size is %d, must be >= 1", params_.chunk_size);
    KVP_REQUIRE(params_.chunk_budget >= 0, "shadowkv: chunk_budget is %d, must be >= 0", params_.chunk_budget);
    KVP_REQUIRE(params_.outlier_chunks >= 0, "shadowkv: outlier_chunks is %d, must be >= 0", params_.outlier_chunks);
    KVP_REQUIRE(params_.local_chunks >= 0, "shadowkv: local_chunks is %d, must be >= 0", params_.local_chunks);
    KVP_REQUIRE(params_.dense_layers >= 0, "shadowkv: dense_layers is %d, must be >= 0", params_.dense_layers);
    return Status::ok();
  }

  struct StateSize {
    std::int64_t floats = 0, history = 0;
  };
  StateSize state_size(std::int32_t num_pages, std::int32_t page_size, std::int32_t num_kv_heads, std::int32_t head_dim) const noexcept {
    const std::int64_t slots =
        params_.chunk_size > 0 ? static_cast<std::int64_t>(num_pages) * (page_size / params_.chunk_size) * num_kv_heads : 0;
    return StateSize{slots * (head_dim + 1), PrefetchHistory::buffer_size(num_pages)};
  }
  /// A state over `floats` (`state_size(...).floats`) and `history`
  /// (`.history` int64). Host memory (the default `device`): the history is
  /// cleared here. Device memory (`device` not host): nothing is written here;
  /// clear the history with `out->history.reset(ctx)` on the device's backend.
  Status make_state(float* floats, std::int64_t* history, std::int32_t num_pages, std::int32_t page_size, std::int32_t num_kv_heads,
                    std::int32_t head_dim, State* out, Device device = {}) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(num_pages >= 0 && page_size >= 1 && num_kv_heads >= 1 && head_dim >= 1,
                "shadowkv: state (num_pages %d, page_size %d, kv heads %d, head_dim %d) must be >= 0, >= 1, >= 1, >= 1", num_pages,
                page_size, num_kv_heads, head_dim);
    KVP_REQUIRE(page_size % params_.chunk_size == 0,
                "shadowkv: page_size %d is not a multiple of chunk_size %d (a chunk must sit in one page)", page_size, params_.chunk_size);
    KVP_REQUIRE((floats != nullptr && history != nullptr) || num_pages == 0, "shadowkv: state buffers are null");
    State s;
    s.num_pages = num_pages;
    s.page_size = page_size;
    s.chunk_size = params_.chunk_size;
    s.num_kv_heads = num_kv_heads;
    s.head_dim = head_dim;
    s.landmarks = floats;
    s.outlier = floats == nullptr ? nullptr : floats + static_cast<std::int64_t>(num_pages) * s.chunks_per_page() * num_kv_heads * head_dim;
    s.history = device.is_host() ? PrefetchHistory::over(history, num_pages) : PrefetchHistory::wrap(history, num_pages);
    s.device = device;
    *out = s;
    return Status::ok();
  }

  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& shape, std::int32_t page_size) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (r.status.is_ok() && (page_size < 1 || shape.max_kv_len < 0 || shape.batch < 1 || shape.num_q_heads < 1 || shape.num_kv_heads < 1 ||
                             shape.num_q_heads % shape.num_kv_heads != 0))
      r.status = KVP_INVALID("shadowkv: shape (batch %lld, heads %lld/%lld, max_kv_len %lld) or page_size %d out of range",
                             static_cast<long long>(shape.batch), static_cast<long long>(shape.num_q_heads),
                             static_cast<long long>(shape.num_kv_heads), static_cast<long long>(shape.max_kv_len), page_size);
    if (!r.status.is_ok()) return r;
    const std::int64_t entries = shape.batch * ((shape.max_kv_len + page_size - 1) / page_size);
    const std::int64_t M = shape.max_kv_len / params_.chunk_size, G = shape.num_q_heads / shape.num_kv_heads;
    if constexpr (kDeviceBackend<Backend>)
      r.workspace_bytes = device_layout<Backend>(M, entries, G, shape.num_kv_heads).total();
    else
      r.workspace_bytes = layout<Backend>(M, entries, G, shape.head_dim).total();
    r.output = OutputSize{1, entries};
    r.query_window = 1;
    return r;
  }

  /// Landmarks and outlier scores of the chunks the append completed
  /// (`app.append_len[b]` per sequence; nullptr: every complete chunk of the table).
  template <class Backend, class Tk>
  Status on_append(const Context<Backend>& ctx, const AppendInput<Tk>& app, State& st) const noexcept {
    constexpr bool on_device = kDeviceBackend<Backend>;
    KVP_RETURN_IF_ERROR(check_state(st, on_device));
    const PagedKVView<const Tk>& keys = app.kv;
    KVP_RETURN_IF_ERROR(keys.validate(kName, /*need_values=*/false, /*check_ids=*/!on_device));
    if constexpr (on_device) {
      KVP_REQUIRE(!keys.device.is_host(), "shadowkv: keys are host memory; a device backend reads device memory (tag the view kCUDA)");
    } else {
      KVP_REQUIRE(keys.device.is_host(), "shadowkv: keys are on a device; this entry point reads host memory");
    }
    KVP_REQUIRE(keys.k_strides.dim == 1, "shadowkv: keys' dim stride is %lld, must be 1", static_cast<long long>(keys.k_strides.dim));
    KVP_REQUIRE(keys.num_pages == st.num_pages && keys.page_size == st.page_size && keys.num_kv_heads == st.num_kv_heads &&
                    keys.head_dim == st.head_dim,
                "shadowkv: keys (pages %d, page_size %d, kv heads %d, head_dim %d) do not match the state (%d, %d, %d, %d)", keys.num_pages,
                keys.page_size, keys.num_kv_heads, keys.head_dim, st.num_pages, st.page_size, st.num_kv_heads, st.head_dim);
    if (app.append_len != nullptr)
      for (std::int32_t b = 0; b < keys.table.batch; ++b)
        KVP_REQUIRE(app.append_len[b] >= 0 && app.append_len[b] <= keys.seq_len(b),
                    "shadowkv: append_len[%d] is %d, must be in [0, sequence length %lld]", b, app.append_len[b],
                    static_cast<long long>(keys.seq_len(b)));
    // The same op on every backend: on the host its reference (ops/shadowkv_ops.hpp), on a device its kernel.
    const std::int32_t C = st.chunk_size;
    const ops::ChunkGeometry geo = geometry(st);
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    for (std::int32_t b = 0; b < keys.table.batch; ++b) {
      const std::int64_t len = keys.seq_len(b), from = app.append_len ? len - app.append_len[b] : 0;
      const std::int64_t first = from / C, count = len / C - first;  // chunks completed by tokens [from, len)
      if (count > 0)
        ops::shadowkv_landmarks<Backend>(keys.k_data, keys.k_strides, keys.table.indices + keys.table.indptr[b], geo, first, count,
                                         st.landmarks, st.outlier);
    }
    return call.end();
  }

  /// Predicts the pages the next observation of `next.layer` reads from the
  /// queries `next.queries` (batch, Hq, d) post-RoPE (the current step's).
  template <class Backend, class Tq>
  Status predict(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, PrefetchRequest& out) const noexcept {
    std::int32_t G = 0;
    KVP_RETURN_IF_ERROR(check_predict_call(st, next, out, kDeviceBackend<Backend>, &G));
    if constexpr (kDeviceBackend<Backend>)
      return predict_on_device(ctx, st, next, G, out);
    else
      return predict_on_host(ctx, st, next, G, out);
  }

  template <class Backend>
  Status observe(const Context<Backend>& ctx, State& st, const PageSelection& actual, PrefetchCounters& counters) const noexcept {
    KVP_RETURN_IF_ERROR(check_state(st, kDeviceBackend<Backend>));
    return prefetch_detail::observe(ctx, kName, st.history, actual, counters);
  }

 private:
  /// Everything `predict` checks before it writes: the parameters and state (its memory against the
  /// backend), the history, queries, table and request, the page size and layer.
  /// `*G` receives the query heads per kv head.
  template <class Tq>
  Status check_predict_call(const State& st, const DecodeInput<Tq>& next, const PrefetchRequest& out, bool on_device,
                            std::int32_t* G) const noexcept {
    KVP_RETURN_IF_ERROR(check_state(st, on_device));
    KVP_RETURN_IF_ERROR(prefetch_detail::check_predict(kName, st.history, next.queries, next.table, next.page_size, st.num_kv_heads,
                                                       st.head_dim, out, G, on_device));
    KVP_REQUIRE(next.page_size == st.page_size, "shadowkv: page_size is %d, the state has %d", next.page_size, st.page_size);
    KVP_REQUIRE(next.layer >= 0, "shadowkv: layer is %d, must be >= 0", next.layer);
    return Status::ok();
  }

  template <class Backend, class Tq>
  Status predict_on_host(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, std::int32_t G,
                         PrefetchRequest& out) const noexcept {
    const PageTable& table = next.table;
    const std::int32_t C = st.chunk_size;
    std::int64_t M = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) M = std::max(M, table.seq_len(b, st.page_size) / C);
    const std::int64_t entries = prefetch_detail::table_entries(table), d = st.head_dim;
    const auto L = layout<Backend>(M, entries, G, d);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, L.total()));
    WorkspaceCarver c(ctx.workspace);
    const auto m1 = static_cast<std::size_t>(std::max<std::int64_t>(M, 1));
    float* logits = c.take<float>(static_cast<std::size_t>(G) * m1);
    float* score = c.take<float>(m1);
    std::int32_t* idx = c.take<std::int32_t>(m1);
    std::uint8_t* is_outlier = c.take<std::uint8_t>(m1);
    float* qf = c.take<float>(static_cast<std::size_t>(G * d));
    const Workspace topk_ws{c.take<std::byte>(Backend::topk_workspace(M)), Backend::topk_workspace(M)};
    float* prio = c.take<float>(static_cast<std::size_t>(entries));
    std::uint64_t* keys = c.take<std::uint64_t>(static_cast<std::size_t>(entries));

    constexpr float kInf = std::numeric_limits<float>::infinity();
    std::fill(prio, prio + entries, prefetch_detail::kNotPredicted);
    if (next.layer < params_.dense_layers) {
      prefetch_detail::predict_all(table, prio);
    } else {
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      auto entry_of_chunk = [&](std::int32_t b, std::int64_t chunk) {
        return prefetch_detail::entry_of(table, b, chunk * C, st.page_size);
      };
      auto slot_of = [&](std::int32_t b, std::int64_t chunk, std::int32_t g) {
        const std::int64_t t0 = chunk * C;
        return st.slot(table.page_of(b, t0, st.page_size), static_cast<std::int32_t>((t0 % st.page_size) / C), g);
      };
      for (std::int32_t b = 0; b < table.batch; ++b) {
        const std::int64_t n = table.seq_len(b, st.page_size), m = n / C;
        if (n == 0) continue;
        const std::int64_t cand = m - std::min<std::int64_t>(params_.local_chunks, m);  // chunks [0, cand) are scored
        for (std::int64_t t = cand * C; t < n; t += C)
          prefetch_detail::raise(prio, prefetch_detail::entry_of(table, b, t, st.page_size), kInf);
        prefetch_detail::raise(prio, prefetch_detail::entry_of(table, b, n - 1, st.page_size), kInf);  // the partial chunk
        if (cand == 0) continue;
        for (std::int32_t g = 0; g < st.num_kv_heads; ++g) {
          std::fill(is_outlier, is_outlier + cand, std::uint8_t{0});
          const std::int64_t no = std::min<std::int64_t>(params_.outlier_chunks, cand);
          if (no > 0) {
            for (std::int64_t ch = 0; ch < cand; ++ch) score[ch] = -st.outlier[slot_of(b, ch, g)];
            Backend::topk(score, cand, no, idx, topk_ws);
            for (std::int64_t i = 0; i < no; ++i) {
              is_outlier[idx[i]] = 1;
              prefetch_detail::raise(prio, entry_of_chunk(b, idx[i]), kInf);
            }
          }
          const std::int64_t k = std::min<std::int64_t>(params_.chunk_budget, cand - no);
          if (k <= 0) continue;
          for (std::int32_t j = 0; j < G; ++j)  // the group's queries, fp32, scaled
            for (std::int64_t i = 0; i < d; ++i) qf[j * d + i] = to_float(next.queries(b, g * G + j, i)) * scale;
          for (std::int64_t ch = 0; ch < cand; ++ch) {  // each landmark read once for the group
            const float* Lm = st.landmarks + slot_of(b, ch, g) * d;
            for (std::int32_t j = 0; j < G; ++j) logits[j * cand + ch] = is_outlier[ch] ? -kInf : prefetch_detail::dot(qf + j * d, Lm, d);
          }
          for (std::int32_t j = 0; j < G; ++j)
            prefetch_detail::softmax(logits + j * cand, cand, [&](std::int64_t ch) { return is_outlier[ch] != 0; });
          Backend::group_reduce(logits, G, cand, cand, GroupReduce::kMax, score);
          for (std::int64_t ch = 0; ch < cand; ++ch)
            if (is_outlier[ch]) score[ch] = -kInf;  // already kept; never re-selected
          Backend::topk(score, cand, k, idx, topk_ws);
          for (std::int64_t i = 0; i < k; ++i) prefetch_detail::raise(prio, entry_of_chunk(b, idx[i]), score[idx[i]]);
        }
      }
    }
    if (params_.reuse_previous) prefetch_detail::add_reuse(st.history, table, -1.0f, prio);
    prefetch_detail::write_request(st.history, table, prio, keys, out);
    return Status::ok();
  }

  /// `predict` on a device backend (header comment, "On a device backend").
  template <class Backend, class Tq>
  Status predict_on_device(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, std::int32_t G,
                           PrefetchRequest& out) const noexcept {
    const PageTable& table = next.table;
    const std::int32_t C = st.chunk_size;
    std::int64_t M = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) M = std::max(M, table.seq_len(b, st.page_size) / C);
    const std::int64_t entries = prefetch_detail::table_entries(table);
    const DeviceLayout L = device_layout<Backend>(M, entries, G, st.num_kv_heads);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, L.total()));
    WorkspaceCarver c(ctx.workspace);
    float* prio = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(entries, 1)));
    float* keys_or_scores = c.take<float>(static_cast<std::size_t>(L.rows_floats));
    float* logits = c.take<float>(static_cast<std::size_t>(L.logits_floats));
    std::int32_t* oidx = c.take<std::int32_t>(static_cast<std::size_t>(L.rows_floats));
    std::int32_t* sidx = c.take<std::int32_t>(static_cast<std::size_t>(L.rows_floats));
    const Workspace topk_ws{c.take<std::byte>(L.topk_bytes), L.topk_bytes};
    const Workspace request_ws{c.take<std::byte>(L.request_bytes), L.request_bytes};

    const ops::ChunkGeometry geo = geometry(st);
    const std::int32_t Hkv = st.num_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(st.head_dim));
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    const bool dense = next.layer < params_.dense_layers;
    if (entries > 0) Backend::fill(prio, entries, 1, dense ? 1.0f : prefetch_detail::kNotPredicted);
    for (std::int32_t b = 0; b < table.batch && !dense; ++b) {
      const std::int64_t n = table.seq_len(b, st.page_size), m = n / C;
      if (n == 0) continue;
      const std::int64_t cand = m - std::min<std::int64_t>(params_.local_chunks, m);
      const std::int32_t* seq_pages = table.indices + table.indptr[b];
      const std::int64_t no = std::min<std::int64_t>(params_.outlier_chunks, cand);
      const std::int64_t k = std::max<std::int64_t>(std::min<std::int64_t>(params_.chunk_budget, cand - no), 0);
      if (no > 0) {
        ops::shadowkv_outlier_keys<Backend>(st.outlier, seq_pages, geo, cand, keys_or_scores);
        Backend::topk_rows_strided(keys_or_scores, cand, Hkv, cand, no, oidx, no, topk_ws);
      }
      if (k > 0) {
        const Tq* q = next.queries.data() + b * next.queries.stride(0);
        ops::shadowkv_chunk_scores<Backend>(q, next.queries.stride(1), next.queries.stride(2), G, scale, st.landmarks, seq_pages, geo, cand,
                                            oidx, no, logits, keys_or_scores);
        Backend::topk_rows_strided(keys_or_scores, cand, Hkv, cand, k, sidx, k, topk_ws);
      }
      ops::shadowkv_priorities<Backend>(geo, n, cand, oidx, no, sidx, k, keys_or_scores, prio + table.indptr[b]);
    }
    if (params_.reuse_previous && st.history.step >= 1 && entries > 0)
      ops::prefetch_add_reuse<Backend>(prio, table.indices, entries, st.history.used_at, st.history.step - 1, -1.0f);
    prefetch_detail::write_request_on_device<Backend>(st.history, table, prio, out, request_ws);
    return call.end();
  }

  static ops::ChunkGeometry geometry(const State& st) noexcept {
    return ops::ChunkGeometry{st.page_size, st.chunk_size, st.num_kv_heads, st.head_dim};
  }

  Status check_state(const State& st, bool on_device) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(st.chunk_size == params_.chunk_size, "shadowkv: state chunk_size is %d, the policy's %d; build it with make_state",
                st.chunk_size, params_.chunk_size);
    KVP_REQUIRE(st.page_size >= 1 && st.page_size % st.chunk_size == 0 && st.num_kv_heads >= 1 && st.head_dim >= 1,
                "shadowkv: state dims (page_size %d, chunk_size %d, kv heads %d, head_dim %d) are invalid", st.page_size, st.chunk_size,
                st.num_kv_heads, st.head_dim);
    KVP_REQUIRE((st.landmarks != nullptr && st.outlier != nullptr) || st.num_pages == 0, "shadowkv: state buffers are null");
    KVP_REQUIRE(st.history.num_pages == st.num_pages, "shadowkv: history has %d pages, the state %d", st.history.num_pages, st.num_pages);
    return prefetch_detail::check_state_memory(kName, st.device, st.history, on_device);
  }

  /// Device workspace: priorities, one (Hkv, M) score map (the outlier keys,
  /// then the chunk scores), the logits (Hkv * G * M), two index maps, the
  /// top-k's and the request's scratch.
  struct DeviceLayout {
    std::int64_t entries = 0, rows_floats = 0, logits_floats = 0;
    std::size_t topk_bytes = 0, request_bytes = 0;
    std::size_t total() const noexcept {
      WorkspacePlan p;
      p.add<float>(static_cast<std::size_t>(std::max<std::int64_t>(entries, 1))).add<float>(static_cast<std::size_t>(rows_floats));
      p.add<float>(static_cast<std::size_t>(logits_floats));
      p.add<std::int32_t>(static_cast<std::size_t>(rows_floats)).add<std::int32_t>(static_cast<std::size_t>(rows_floats));
      p.add_bytes(topk_bytes).add_bytes(request_bytes);
      return p.total();
    }
  };
  template <class Backend>
  static DeviceLayout device_layout(std::int64_t M, std::int64_t entries, std::int64_t G, std::int64_t Hkv) noexcept {
    const std::int64_t m = std::max<std::int64_t>(M, 1);
    return DeviceLayout{entries, Hkv * m, Hkv * G * m, Backend::topk_workspace(m), ops::prefetch_request_workspace<Backend>(entries)};
  }
  template <class Backend>
  static WorkspacePlan layout(std::int64_t M, std::int64_t entries, std::int64_t G, std::int64_t d) noexcept {
    const auto m = static_cast<std::size_t>(std::max<std::int64_t>(M, 1));
    WorkspacePlan p;
    p.add<float>(static_cast<std::size_t>(G) * m).add<float>(m).add<std::int32_t>(m).add<std::uint8_t>(m);
    p.add<float>(static_cast<std::size_t>(G * d));
    p.add_bytes(Backend::topk_workspace(M));
    p.add<float>(static_cast<std::size_t>(entries)).add<std::uint64_t>(static_cast<std::size_t>(entries));
    return p;
  }

  Params params_{};
};

static_assert(PrefetchPolicy<ShadowKV, float> && PrefetchPolicy<ShadowKV, half>);

KVP_NAMESPACE_END
