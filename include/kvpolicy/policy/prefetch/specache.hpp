// SPDX-License-Identifier: Apache-2.0
// SpeCache — "SpeCache: Speculative Key-Value Caching for Efficient
// Generation of LLMs" (ICML 2025, arXiv 2503.16163; no official code, the
// community re-implementation intelli-jsong/SpeCache follows the paper).
// Next-token speculative prefetch: reference/algorithms-other.md §3.2, §7 item 4.
//
// Algorithm (per layer):
//   on append:  the keys of every cached token are also stored as a low-bit
//               copy that stays on the fast tier (`SpeCacheState::codes`),
//               while the full-precision K/V live in the offloaded pool.
//   predict:    q^ = the query of the *speculative* next token at this layer
//               (the engine decodes it as a second row next to the real token;
//               examples/engine/prefetch.hpp), then per kv head g
//                 p_h = softmax_t(q^_h . deq(k_t) / sqrt(d))      h in g's group
//                 P_g = mean_h p_h                                 (GQA average)
//                 tokens_g = top_k(P_g),  k = min(`topk`, length)
//               and the request is the pages of those tokens, for the next step.
//
// Choices, where the references differ or leave it open:
//  * Low-bit format. The library's quantization family: ggml q4_0 (default,
//    4.5 bits per value) or any `GgmlType` (q8_0: 8.5 bits), per token and kv
//    head, blocks of 32 channels (head_dim must be a multiple of 32). The
//    paper's KIVI-style 1/2-bit copy (keys per channel, a residual window) is
//    not implemented: q4_0 needs no residual window and reuses the tested ggml
//    quantizers (quant/ggml.hpp).
//  * Only keys are copied: the prediction reads keys alone. (SpeCache also
//    keeps low-bit values to decode the speculative row; the engine's row
//    reads the fp values, see examples/engine/prefetch.hpp.)
//  * The prediction reads the low-bit copy alone; SpeCache patches the
//    previously prefetched rows in at full precision. Not patching keeps the
//    prediction a function of the query and the cache only (not of what the
//    device happens to hold); the engine's speculative row does patch.
//  * The speculative token's own key is not in the cache, so "its column is
//    excluded" holds by construction.
//  * Priority of a page: the summed GQA-mean probability of its selected
//    tokens over the kv heads. Ties in top-k: `Backend::topk` (higher, then
//    the more recent token).
//  * Dense layers (`dense_layers`, default 0): every page predicted.
//
// Validation: quantize-on-append rejects non-finite keys (the ggml entry
// points' rule) naming sequence, token, head and channel, writing nothing.
// Thread-safety: const; the state is the caller's.
//
// On a device backend (`on_append` / `predict` / `observe` with e.g.
// backend::Cuda) the state (`make_state` with a device tag; its history
// cleared with `history.reset(ctx)`), the keys' pool, the queries,
// `table.indices`, the request, the counters of `observe` and the workspace
// are device memory; `table.indptr` / `last_page_len`, `app.append_len` and
// the observed selection's `indptr` are host arrays. on_append is one
// `specache_encode` op per sequence (ops/specache_ops.hpp), bit-identical with
// the host copy; as for GgmlQuant on a device, the keys are not scanned for NaN / Inf
// (that needs a synchronisation): a non-finite key gives unspecified codes in
// its own row only. predict, per sequence: the scores op (logits from the
// copy with the host's rounding, each query head's softmax, the group mean;
// ops/specache_ops.hpp), a top-k over the kv-head rows and one launch adding
// the selected means into the entries in the host's order; then the request
// of the prefetch ops (device size, -1 padding). The softmax uses the device's
// exp, so a token within a few ulp of its head's k-th may be chosen on one side
// only, and priorities agree with the host's to about 1e-5 relative.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/ops/specache_ops.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/prefetch/history.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/quant/ggml.hpp"

KVP_NAMESPACE_BEGIN

struct SpeCacheParams {
  GgmlType type = GgmlType::kQ4_0;  ///< low-bit key copy format
  std::int32_t topk = 64;           ///< tokens per kv head (reference k = 64)
  std::int32_t dense_layers = 0;    ///< layers predicted whole

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&SpeCacheParams::type>("type", "ggml format of the low-bit key copy"),
                      param_field<&SpeCacheParams::topk>("topk", "tokens per kv head"),
                      param_field<&SpeCacheParams::dense_layers>("dense_layers", "layers predicted whole")};
  }
};

/// Caller-owned state of one layer: the low-bit key copy indexed by physical
/// page and slot, `(num_pages, num_kv_heads, page_size, row_bytes)` (a page's
/// rows of one kv head contiguous), and the history.
struct SpeCacheState {
  std::uint8_t* codes = nullptr;
  std::int32_t num_pages = 0, page_size = 0, num_kv_heads = 0, head_dim = 0;
  std::int64_t row_bytes = 0;
  PrefetchHistory history{};
  Device device{};  ///< where the codes and history live (a device backend needs device memory)

  std::uint8_t* row(std::int32_t page, std::int32_t slot, std::int32_t g) const noexcept {
    return codes + ((static_cast<std::int64_t>(page) * num_kv_heads + g) * page_size + slot) * row_bytes;
  }
};

class SpeCache {
 public:
  using Params = SpeCacheParams;
  using State = SpeCacheState;
  static constexpr const char* kName = "specache";

  constexpr SpeCache() noexcept = default;
  explicit constexpr SpeCache(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(ggml_type_valid(params_.type), "specache: type %d is not a ggml block format", static_cast<int>(params_.type));
    KVP_REQUIRE(params_.topk >= 1, "specache: topk is %d, must be >= 1", params_.topk);
    KVP_REQUIRE(params_.dense_layers >= 0, "specache: dense_layers is %d, must be >= 0", params_.dense_layers);
    return Status::ok();
  }
  /// Bytes of one (token, kv head) key row of the low-bit copy.
  constexpr std::int64_t row_bytes(std::int64_t head_dim) const noexcept { return head_dim / kGgmlBlock * ggml_block_bytes(params_.type); }
  /// Bytes of the low-bit copy of a pool of `num_pages` pages.
  constexpr std::int64_t codes_bytes(std::int32_t num_pages, std::int32_t page_size, std::int32_t num_kv_heads,
                                     std::int32_t head_dim) const noexcept {
    return static_cast<std::int64_t>(num_pages) * page_size * num_kv_heads * row_bytes(head_dim);
  }

  /// A state over caller buffers: `codes_bytes(...)` bytes and `PrefetchHistory::buffer_size(num_pages)` int64.
  /// Host memory (the default `device`): the history is cleared here. Device memory: nothing is written
  /// here; clear the history with `out->history.reset(ctx)` on the device's backend.
  Status make_state(std::uint8_t* codes, std::int64_t* history, std::int32_t num_pages, std::int32_t page_size, std::int32_t num_kv_heads,
                    std::int32_t head_dim, State* out, Device device = {}) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(num_pages >= 0 && page_size >= 1 && num_kv_heads >= 1,
                "specache: state (num_pages %d, page_size %d, kv heads %d) must be >= 0, >= 1, >= 1", num_pages, page_size, num_kv_heads);
    KVP_RETURN_IF_ERROR(check_head_dim(head_dim));
    KVP_REQUIRE((codes != nullptr && history != nullptr) || num_pages == 0, "specache: state buffers are null");
    State s;
    s.codes = codes;
    s.num_pages = num_pages;
    s.page_size = page_size;
    s.num_kv_heads = num_kv_heads;
    s.head_dim = head_dim;
    s.row_bytes = row_bytes(head_dim);
    s.history = device.is_host() ? PrefetchHistory::over(history, num_pages) : PrefetchHistory::wrap(history, num_pages);
    s.device = device;
    *out = s;
    return Status::ok();
  }

  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& shape, std::int32_t page_size) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (r.status.is_ok()) r.status = check_head_dim(shape.head_dim);
    if (r.status.is_ok() && (page_size < 1 || shape.max_kv_len < 0 || shape.batch < 1 || shape.num_q_heads < 1 || shape.num_kv_heads < 1 ||
                             shape.num_q_heads % shape.num_kv_heads != 0))
      r.status = KVP_INVALID("specache: shape (batch %lld, heads %lld/%lld, max_kv_len %lld) or page_size %d out of range",
                             static_cast<long long>(shape.batch), static_cast<long long>(shape.num_q_heads),
                             static_cast<long long>(shape.num_kv_heads), static_cast<long long>(shape.max_kv_len), page_size);
    if (!r.status.is_ok()) return r;
    const std::int64_t entries = shape.batch * ((shape.max_kv_len + page_size - 1) / page_size);
    const std::int64_t G = shape.num_q_heads / shape.num_kv_heads;
    if constexpr (kDeviceBackend<Backend>)
      r.workspace_bytes = device_layout<Backend>(shape.max_kv_len, entries, G, shape.num_kv_heads).total();
    else
      r.workspace_bytes = layout<Backend>(shape.max_kv_len, entries, G, shape.head_dim, page_size).total();
    r.output = OutputSize{1, entries};
    r.query_window = 1;
    return r;
  }

  /// Quantizes the keys just appended (`app.append_len[b]` per sequence;
  /// nullptr: every token of the table) into the low-bit copy. Every key is
  /// checked finite before anything is written.
  template <class Backend, class Tk>
  Status on_append(const Context<Backend>& ctx, const AppendInput<Tk>& app, State& st) const noexcept {
    constexpr bool on_device = kDeviceBackend<Backend>;
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_state(st, on_device));
    const PagedKVView<const Tk>& keys = app.kv;
    KVP_RETURN_IF_ERROR(keys.validate(kName, /*need_values=*/false, /*check_ids=*/!on_device));
    if constexpr (on_device) {
      KVP_REQUIRE(!keys.device.is_host(), "specache: keys are host memory; a device backend reads device memory (tag the view kCUDA)");
    } else {
      KVP_REQUIRE(keys.device.is_host(), "specache: keys are on a device; this entry point reads host memory");
    }
    KVP_REQUIRE(keys.num_pages == st.num_pages && keys.page_size == st.page_size && keys.num_kv_heads == st.num_kv_heads &&
                    keys.head_dim == st.head_dim,
                "specache: keys (pages %d, page_size %d, kv heads %d, head_dim %d) do not match the state (%d, %d, %d, %d)", keys.num_pages,
                keys.page_size, keys.num_kv_heads, keys.head_dim, st.num_pages, st.page_size, st.num_kv_heads, st.head_dim);
    KVP_REQUIRE(keys.k_strides.dim == 1, "specache: keys channel stride must be 1");
    if constexpr (on_device) {
      for (std::int32_t b = 0; b < keys.table.batch; ++b) {
        const std::int64_t len = keys.seq_len(b);
        KVP_REQUIRE(app.append_len == nullptr || (app.append_len[b] >= 0 && app.append_len[b] <= len),
                    "specache: append_len[%d] is %d, must be in [0, sequence length %lld]", b, app.append_len ? app.append_len[b] : 0,
                    static_cast<long long>(len));
      }
      const ops::KeyCopyGeometry geo = geometry(st);
      const detail::BackendCall<Backend> call(ctx);
      KVP_RETURN_IF_ERROR(call.begin());
      for (std::int32_t b = 0; b < keys.table.batch; ++b) {
        const std::int64_t len = keys.seq_len(b), from = app.append_len ? len - app.append_len[b] : 0;
        if (len > from)
          ops::specache_encode<Backend>(keys.k_data, keys.k_strides, keys.table.indices + keys.table.indptr[b], geo, from, len - from,
                                        st.codes);
      }
      return call.end();
    } else {
      (void)ctx;
      for (std::int32_t b = 0; b < keys.table.batch; ++b) {
        const std::int64_t len = keys.seq_len(b);
        KVP_REQUIRE(app.append_len == nullptr || (app.append_len[b] >= 0 && app.append_len[b] <= len),
                    "specache: append_len[%d] is %d, must be in [0, sequence length %lld]", b, app.append_len ? app.append_len[b] : 0,
                    static_cast<long long>(len));
        for (std::int64_t t = app.append_len ? len - app.append_len[b] : 0; t < len; ++t)
          for (std::int32_t g = 0; g < st.num_kv_heads; ++g) {
            const Tk* k = keys.key(b, g, t);
            const std::int64_t c = Backend::first_nonfinite(k, st.head_dim);
            KVP_REQUIRE(c < 0, "specache: key of sequence %d token %lld kv head %d channel %lld is not finite; nothing was written", b,
                        static_cast<long long>(t), g, static_cast<long long>(c));
          }
      }
      for (std::int32_t b = 0; b < keys.table.batch; ++b) {
        const std::int64_t len = keys.seq_len(b);
        for (std::int64_t t = app.append_len ? len - app.append_len[b] : 0; t < len; ++t) {
          const std::int32_t page = keys.table.page_of(b, t, st.page_size);
          const auto slot = static_cast<std::int32_t>(t % st.page_size);
          for (std::int32_t g = 0; g < st.num_kv_heads; ++g)
            Backend::ggml_quantize_row(params_.type, keys.k_ptr(page, g, slot), st.head_dim, st.row(page, slot, g));
        }
      }
      return Status::ok();
    }
  }

  /// Key row of (page, slot, kv head) from the low-bit copy, as fp32 (`out`: head_dim floats).
  template <class Backend = backend::Scalar>
  void dequantize_key(const State& st, std::int32_t page, std::int32_t slot, std::int32_t g, float* out) const noexcept {
    Backend::ggml_dequantize_row(params_.type, st.row(page, slot, g), st.head_dim, out);
  }

  /// Predicts the pages the next observation of `next.layer` reads from the
  /// speculative token's queries `next.queries` (batch, Hq, d) post-RoPE.
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
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_state(st, on_device));
    KVP_RETURN_IF_ERROR(prefetch_detail::check_predict(kName, st.history, next.queries, next.table, next.page_size, st.num_kv_heads,
                                                       st.head_dim, out, G, on_device));
    KVP_REQUIRE(next.page_size == st.page_size, "specache: page_size is %d, the state has %d", next.page_size, st.page_size);
    KVP_REQUIRE(next.layer >= 0, "specache: layer is %d, must be >= 0", next.layer);
    return Status::ok();
  }

  template <class Backend, class Tq>
  Status predict_on_host(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, std::int32_t G,
                         PrefetchRequest& out) const noexcept {
    const PageTable& table = next.table;
    std::int64_t T = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) T = std::max(T, table.seq_len(b, st.page_size));
    const std::int64_t entries = prefetch_detail::table_entries(table), d = st.head_dim;
    const auto L = layout<Backend>(T, entries, G, d, st.page_size);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, L.total()));
    WorkspaceCarver c(ctx.workspace);
    float* probs = c.take<float>(static_cast<std::size_t>(G * std::max<std::int64_t>(T, 1)));
    float* mean = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(T, 1)));
    float* krow = c.take<float>(static_cast<std::size_t>(st.page_size * d));  // one page of one kv head
    float* qf = c.take<float>(static_cast<std::size_t>(G * d));
    std::int32_t* idx = c.take<std::int32_t>(static_cast<std::size_t>(std::max<std::int64_t>(T, 1)));
    const Workspace topk_ws{c.take<std::byte>(Backend::topk_workspace(T)), Backend::topk_workspace(T)};
    float* prio = c.take<float>(static_cast<std::size_t>(entries));
    std::uint64_t* keys = c.take<std::uint64_t>(static_cast<std::size_t>(entries));

    std::fill(prio, prio + entries, prefetch_detail::kNotPredicted);
    if (next.layer < params_.dense_layers) {
      prefetch_detail::predict_all(table, prio);
    } else {
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      for (std::int32_t b = 0; b < table.batch; ++b) {
        const std::int64_t n = table.seq_len(b, st.page_size);
        if (n == 0) continue;
        for (std::int32_t g = 0; g < st.num_kv_heads; ++g) {
          for (std::int32_t j = 0; j < G; ++j)  // the group's queries, fp32, scaled
            for (std::int64_t i = 0; i < d; ++i) qf[j * d + i] = to_float(next.queries(b, g * G + j, i)) * scale;
          for (std::int32_t p = 0; p < table.num_pages(b); ++p) {  // a page's rows of one kv head are contiguous
            const std::int64_t t0 = static_cast<std::int64_t>(p) * st.page_size;
            const std::int64_t slots = std::min<std::int64_t>(st.page_size, n - t0);
            // The page's rows of kv head g are consecutive blocks: one dequantize call for all of them.
            Backend::ggml_dequantize_row(params_.type, st.row(table.indices[table.indptr[b] + p], 0, g), slots * d, krow);
            for (std::int64_t sl = 0; sl < slots; ++sl)
              for (std::int32_t j = 0; j < G; ++j) probs[j * n + t0 + sl] = prefetch_detail::dot(qf + j * d, krow + sl * d, d);
          }
          for (std::int32_t j = 0; j < G; ++j) prefetch_detail::softmax(probs + j * n, n);
          Backend::group_reduce(probs, G, n, n, GroupReduce::kMean, mean);
          const std::int64_t k = std::min<std::int64_t>(params_.topk, n);
          Backend::topk(mean, n, k, idx, topk_ws);
          for (std::int64_t i = 0; i < k; ++i) {
            const std::int64_t e = prefetch_detail::entry_of(table, b, idx[i], st.page_size);
            prio[e] = (std::isnan(prio[e]) ? 0.0f : prio[e]) + (std::isnan(mean[idx[i]]) ? 0.0f : mean[idx[i]]);
          }
        }
      }
    }
    prefetch_detail::write_request(st.history, table, prio, keys, out);
    return Status::ok();
  }

  /// `predict` on a device backend (header comment, "On a device backend").
  template <class Backend, class Tq>
  Status predict_on_device(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, std::int32_t G,
                           PrefetchRequest& out) const noexcept {
    const PageTable& table = next.table;
    std::int64_t T = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) T = std::max(T, table.seq_len(b, st.page_size));
    const std::int64_t entries = prefetch_detail::table_entries(table);
    const DeviceLayout L = device_layout<Backend>(T, entries, G, st.num_kv_heads);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, L.total()));
    WorkspaceCarver c(ctx.workspace);
    float* prio = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(entries, 1)));
    float* probs = c.take<float>(static_cast<std::size_t>(L.probs_floats));
    float* mean = c.take<float>(static_cast<std::size_t>(L.rows_floats));
    std::int32_t* idx = c.take<std::int32_t>(static_cast<std::size_t>(L.rows_floats));
    const Workspace topk_ws{c.take<std::byte>(L.topk_bytes), L.topk_bytes};
    const Workspace request_ws{c.take<std::byte>(L.request_bytes), L.request_bytes};

    const ops::KeyCopyGeometry geo = geometry(st);
    const std::int32_t Hkv = st.num_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(st.head_dim));
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    const bool dense = next.layer < params_.dense_layers;
    if (entries > 0) Backend::fill(prio, entries, 1, dense ? 1.0f : prefetch_detail::kNotPredicted);
    for (std::int32_t b = 0; b < table.batch && !dense; ++b) {
      const std::int64_t n = table.seq_len(b, st.page_size);
      if (n == 0) continue;
      const std::int32_t* seq_pages = table.indices + table.indptr[b];
      const Tq* q = next.queries.data() + b * next.queries.stride(0);
      ops::specache_scores<Backend>(q, next.queries.stride(1), next.queries.stride(2), G, scale, st.codes, seq_pages, geo, n, probs, mean);
      const std::int64_t k = std::min<std::int64_t>(params_.topk, n);
      Backend::topk_rows_strided(mean, n, Hkv, n, k, idx, k, topk_ws);
      ops::specache_priorities<Backend>(st.page_size, n, Hkv, idx, k, mean, prio + table.indptr[b]);
    }
    prefetch_detail::write_request_on_device<Backend>(st.history, table, prio, out, request_ws);
    return call.end();
  }

  ops::KeyCopyGeometry geometry(const State& st) const noexcept {
    return ops::KeyCopyGeometry{st.page_size, st.num_kv_heads, st.head_dim, st.row_bytes, params_.type};
  }

  /// Device workspace: priorities, the probabilities (Hkv * G * T), the
  /// group means and the selected tokens (Hkv * T each), the top-k's and the
  /// request's scratch.
  struct DeviceLayout {
    std::int64_t entries = 0, rows_floats = 0, probs_floats = 0;
    std::size_t topk_bytes = 0, request_bytes = 0;
    std::size_t total() const noexcept {
      WorkspacePlan p;
      p.add<float>(static_cast<std::size_t>(std::max<std::int64_t>(entries, 1))).add<float>(static_cast<std::size_t>(probs_floats));
      p.add<float>(static_cast<std::size_t>(rows_floats)).add<std::int32_t>(static_cast<std::size_t>(rows_floats));
      p.add_bytes(topk_bytes).add_bytes(request_bytes);
      return p.total();
    }
  };
  template <class Backend>
  static DeviceLayout device_layout(std::int64_t T, std::int64_t entries, std::int64_t G, std::int64_t Hkv) noexcept {
    const std::int64_t t = std::max<std::int64_t>(T, 1);
    return DeviceLayout{entries, Hkv * t, Hkv * G * t, Backend::topk_workspace(t), ops::prefetch_request_workspace<Backend>(entries)};
  }

  Status check_head_dim(std::int64_t d) const noexcept {
    KVP_REQUIRE(d >= kGgmlBlock && d % kGgmlBlock == 0, "specache: head_dim %lld is not a multiple of the %s block (32 values)",
                static_cast<long long>(d), ggml_name(params_.type));
    return Status::ok();
  }
  Status check_state(const State& st, bool on_device) const noexcept {
    KVP_REQUIRE(
        st.page_size >= 1 && st.num_kv_heads >= 1 && st.row_bytes == row_bytes(st.head_dim),
        "specache: state (page_size %d, kv heads %d, row bytes %lld) does not match the policy's format %s; build it with make_state",
        st.page_size, st.num_kv_heads, static_cast<long long>(st.row_bytes), ggml_name(params_.type));
    KVP_REQUIRE(st.codes != nullptr || st.num_pages == 0, "specache: state codes is null");
    KVP_REQUIRE(st.history.num_pages == st.num_pages, "specache: history has %d pages, the state %d", st.history.num_pages, st.num_pages);
    return prefetch_detail::check_state_memory(kName, st.device, st.history, on_device);
  }
  template <class Backend>
  static WorkspacePlan layout(std::int64_t T, std::int64_t entries, std::int64_t G, std::int64_t d, std::int64_t page_size) noexcept {
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    WorkspacePlan p;
    p.add<float>(static_cast<std::size_t>(G) * t).add<float>(t).add<float>(static_cast<std::size_t>(page_size * d));
    p.add<float>(static_cast<std::size_t>(G * d)).add<std::int32_t>(t);
    p.add_bytes(Backend::topk_workspace(T));
    p.add<float>(static_cast<std::size_t>(entries)).add<std::uint64_t>(static_cast<std::size_t>(entries));
    return p;
  }

  Params params_{};
};

static_assert(PrefetchPolicy<SpeCache, float> && PrefetchPolicy<SpeCache, half>);

KVP_NAMESPACE_END
