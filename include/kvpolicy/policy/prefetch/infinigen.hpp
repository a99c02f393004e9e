// SPDX-License-Identifier: Apache-2.0
// InfiniGen — "InfiniGen: Efficient Generative Inference of Large Language
// Models with Dynamic KV Cache Management" (Lee, Lee, Seo, Sim; OSDI 2024;
// reference code snu-comparch/InfiniGen). Next-layer speculation:
// reference/algorithms-other.md §3.1, §7 item 3.
//
// Algorithm (per decode step, while layer i runs, for layer i + 1 = `next.layer`):
//   prefill (`prepare`, per layer and kv head g):
//     A_g   skewing matrix: the eigenvectors of sum_t q_t q_t^T over the
//           prompt queries of g's query heads (= the right singular vectors of
//           Q), columns in descending eigenvalue order;
//     S_g   partial channels: the r = floor(ratio * d) columns c of the skewed
//           queries Q A_g with the largest sum_t |(q_t A_g)[c]|;
//     K~    partial key cache: (k_t A_g)[S_g] for every cached token.
//   decode (`on_append`): K~ of each appended token.
//   speculate (`predict`): q = the speculative query of layer i + 1 from layer
//     i's attention input (the model adapter, `InfiniGenModelAdapter`);
//       s[h][t] = (q_h A_g)[S_g] . K~_g[t] / sqrt(d)
//       count[h] = #{t : s[h][t] > max_t s[h][t] - alpha}
//       k = min(floor(mean over heads and sequences of count), max_num_kv)
//       pages = pages of top_k(s[h]) for every head h (one k for all heads)
//
// Choices, where the references differ or leave it open:
//  * RoPE. kvp-tiny, like Llama, rotates q and k, so as InfiniGen's Llama
//    accuracy code does the speculative query is the full projection of
//    layer i + 1 rotated at the current position, then skewed and reduced to
//    S_g; the OPT path (reading only the r rows of a skew-folded W_q) is
//    exact only without RoPE and is not offered. The adapter may still
//    compute only what it needs: the policy reads q through A_g[:, S_g].
//  * Skewing. Eigenvectors of Q^T Q (Jacobi rotations in double, cyclic
//    sweeps until the off-diagonal mass is below 1e-12 of the total or 64
//    sweeps; each vector's largest-magnitude entry made positive; equal
//    eigenvalues keep the lower index first). The reference orders the
//    columns by sigma_q * sigma_k; both spectra are sorted descending, so
//    the product order is the sigma_q order except where sigma_k is not
//    monotone in the same index, which this implementation does not model.
//    `skew = false` uses A = I (plain top-channel partial weights).
//  * GQA. A_g and S_g per kv head from all G query heads of the group (the
//    partial key cache is per kv head); scores, counts and top-k per query head.
//  * Which prompt queries. Whatever `prepare` is given (the engine's last W
//    post-RoPE prompt queries; the reference uses all of them).
//  * Threshold. Strict `>` in logit space (scaled by 1/sqrt(d), as the Llama
//    code), one k = floor of the mean count over every head and sequence of
//    the call, capped by `max_num_kv` and by each sequence's length.
//  * Dense layers (`dense_layers`, reference 2): InfiniGen loads layers 0 and
//    1 whole; `predict` for such a layer names every page. Layer 0 is never
//    predicted (there is no layer before it); the engine fetches it on demand.
//  * Priority of a page: the best speculative logit among its selected tokens.
//  * Ties in top-k: `Backend::topk` (higher score, then the more recent token).
//
// State: caller-owned (`InfiniGenState`), one per layer: A (Hkv, d, d), S
// (Hkv, r), K~ indexed by physical page and slot (num_pages, page_size, Hkv,
// r), the hit-rate history. Thread-safety: const; the state is the caller's.
//
// On a device backend (`on_append` / `predict` / `observe` with e.g.
// backend::Cuda) the state (`make_state` with a device tag; its history
// cleared with `history.reset(ctx)`), the keys' pool, the queries,
// `table.indices`, the request, the counters of `observe` and the workspace
// are device memory; `table.indptr` / `last_page_len`, `app.append_len` and
// the observed selection's `indptr` are host arrays. `prepare` stays on the
// host (its Jacobi eigen-decomposition is a serial prefill step): run it on a
// host state with the prompt queries (keys whose table is empty fold
// nothing), copy its skew (the first Hkv * d * d floats) and channels (the
// ints) into the device state's buffers, set the device state's `prepared`,
// then `on_append` every cached token on the device. The loops are the ops of
// ops/infinigen_ops.hpp: the fold on append; per sequence the skewed queries
// and logits, then each row's count above the threshold; then per sequence
// the selection (the call's k from the counts on the device, each row's k-th
// best (key, token) composite found by a radix select) raising the entries;
// then the request of the prefetch ops (device size, -1 padding). Every step
// is fixed-order fp32 arithmetic and exact keys, so the requests, priorities,
// stamps and counters are the host's bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/ops/infinigen_ops.hpp"
#include "kvpolicy/policy/concepts.hpp"
#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/policy/prefetch/history.hpp"

KVP_NAMESPACE_BEGIN

struct InfiniGenParams {
  float alpha = 5.0f;             ///< logit-space threshold below the max (Llama accuracy default 5; OPT speed 4)
  float partial_ratio = 0.2f;     ///< r = floor(ratio * head_dim) partial channels (reference 0.2)
  std::int32_t max_num_kv = 400;  ///< cap on the tokens speculated per head (reference OPT script 400)
  std::int32_t dense_layers = 2;  ///< layers loaded whole (reference 2)
  bool skew = true;               ///< skew the channels (A from the prompt queries) or use A = I

  static constexpr auto fields() noexcept {
    return std::tuple{param_field<&InfiniGenParams::alpha>("alpha", "logit threshold below the max"),
                      param_field<&InfiniGenParams::partial_ratio>("partial_ratio", "fraction of channels in the partial weights"),
                      param_field<&InfiniGenParams::max_num_kv>("max_num_kv", "cap on speculated tokens per head"),
                      param_field<&InfiniGenParams::dense_layers>("dense_layers", "layers loaded whole"),
                      param_field<&InfiniGenParams::skew>("skew", "skew the channels with the prompt queries' singular vectors")};
  }
};

/// Caller-owned state of one layer (see the header comment). Build with `InfiniGen::make_state`.
struct InfiniGenState {
  float* skew = nullptr;             // (num_kv_heads, head_dim, head_dim): A_g[i][c]
  std::int32_t* channels = nullptr;  // (num_kv_heads, partial_dim) ascending skewed channel ids
  float* partial_keys = nullptr;     // (num_pages, num_kv_heads, page_size, partial_dim): a page's slots contiguous per kv head
  std::int32_t num_pages = 0, page_size = 0, num_kv_heads = 0, head_dim = 0, partial_dim = 0;
  bool prepared = false;
  PrefetchHistory history{};
  Device device{};  ///< where the buffers live (a device backend needs device memory)

  float* key_row(std::int32_t page, std::int32_t slot, std::int32_t g) const noexcept {
    return partial_keys + ((static_cast<std::int64_t>(page) * num_kv_heads + g) * page_size + slot) * partial_dim;
  }
};

/// What a model supplies to InfiniGen: the speculative post-RoPE query of
/// `target_layer` from the attention input of the layer before it.
///   x:         (batch, d_model) normalised attention input of layer target_layer - 1
///   positions: (batch) the position each sequence decodes
///   q:         (batch, num_q_heads, head_dim) written by the adapter
template <class A>
concept InfiniGenModelAdapter = requires(const A& a, std::int32_t target_layer, const std::int64_t* positions, TensorView<const float, 2> x,
                                         TensorView<float, 3> q) {
  { a.speculative_query(target_layer, positions, x, q) } -> std::same_as<Status>;
};

class InfiniGen {
 public:
  using Params = InfiniGenParams;
  using State = InfiniGenState;
  static constexpr const char* kName = "infinigen";

  constexpr InfiniGen() noexcept = default;
  explicit constexpr InfiniGen(const Params& p) noexcept : params_(p) {}
  constexpr const Params& params() const noexcept { return params_; }

  Status validate_params() const noexcept {
    KVP_RETURN_IF_ERROR(check_enum_fields(kName, params_));
    KVP_REQUIRE(params_.alpha > 0.0f && std::isfinite(params_.alpha), "infinigen: alpha is %g, must be finite and > 0",
                static_cast<double>(params_.alpha));
    KVP_REQUIRE(params_.partial_ratio > 0.0f && params_.partial_ratio <= 1.0f, "infinigen: partial_ratio is %g, must be in (0, 1]",
                static_cast<double>(params_.partial_ratio));
    KVP_REQUIRE(params_.max_num_kv >= 1, "infinigen: max_num_kv is %d, must be >= 1", params_.max_num_kv);
    KVP_REQUIRE(params_.dense_layers >= 0, "infinigen: dense_layers is %d, must be >= 0", params_.dense_layers);
    return Status::ok();
  }
  /// r = floor(partial_ratio * head_dim) (0 for a ratio too small: rejected by `make_state`).
  std::int32_t partial_dim(std::int32_t head_dim) const noexcept {
    return static_cast<std::int32_t>(std::floor(static_cast<double>(params_.partial_ratio) * head_dim));
  }

  /// Element counts of a state's buffers.
  struct StateSize {
    std::int64_t floats = 0, ints = 0, history = 0;
  };
  StateSize state_size(std::int32_t num_pages, std::int32_t page_size, std::int32_t num_kv_heads, std::int32_t head_dim) const noexcept {
    const std::int64_t r = partial_dim(head_dim);
    return StateSize{
        static_cast<std::int64_t>(num_kv_heads) * head_dim * head_dim + static_cast<std::int64_t>(num_pages) * page_size * num_kv_heads * r,
        static_cast<std::int64_t>(num_kv_heads) * r, PrefetchHistory::buffer_size(num_pages)};
  }
  /// A state over caller buffers of `state_size` elements (not yet prepared).
  /// Host memory (the default `device`): the history is cleared here. Device
  /// memory: nothing is written here; clear the history with
  /// `out->history.reset(ctx)` on the device's backend.
  Status make_state(float* floats, std::int32_t* ints, std::int64_t* history, std::int32_t num_pages, std::int32_t page_size,
                    std::int32_t num_kv_heads, std::int32_t head_dim, State* out, Device device = {}) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_REQUIRE(num_pages >= 0 && page_size >= 1 && num_kv_heads >= 1 && head_dim >= 1,
                "infinigen: state (num_pages %d, page_size %d, kv heads %d, head_dim %d) must be >= 0, >= 1, >= 1, >= 1", num_pages,
                page_size, num_kv_heads, head_dim);
    const std::int32_t r = partial_dim(head_dim);
    KVP_REQUIRE(r >= 1, "infinigen: partial_ratio %g of head_dim %d leaves no channel; must give >= 1",
                static_cast<double>(params_.partial_ratio), head_dim);
    KVP_REQUIRE(floats != nullptr && ints != nullptr && (history != nullptr || num_pages == 0), "infinigen: state buffers are null");
    State s;
    s.skew = floats;
    s.partial_keys = floats + static_cast<std::int64_t>(num_kv_heads) * head_dim * head_dim;
    s.channels = ints;
    s.num_pages = num_pages;
    s.page_size = page_size;
    s.num_kv_heads = num_kv_heads;
    s.head_dim = head_dim;
    s.partial_dim = r;
    s.history = device.is_host() ? PrefetchHistory::over(history, num_pages) : PrefetchHistory::wrap(history, num_pages);
    s.device = device;
    *out = s;
    return Status::ok();
  }

  /// Worst-case workspace of `prepare`, `on_append` and `predict` for
  /// `shape` (batch, heads, head_dim, max_kv_len) in `page_size`-token pages;
  /// output: one request entry per page of the batch.
  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape& shape, std::int32_t page_size) const noexcept {
    Requirements r;
    r.status = validate_params();
    if (r.status.is_ok() && (page_size < 1 || shape.head_dim < 1 || shape.max_kv_len < 0 || shape.batch < 1 || shape.num_q_heads < 1))
      r.status = KVP_INVALID("infinigen: shape (batch %lld, q heads %lld, head_dim %lld, max_kv_len %lld) or page_size %d out of range",
                             static_cast<long long>(shape.batch), static_cast<long long>(shape.num_q_heads),
                             static_cast<long long>(shape.head_dim), static_cast<long long>(shape.max_kv_len), page_size);
    if (!r.status.is_ok()) return r;
    const std::int64_t entries = shape.batch * ((shape.max_kv_len + page_size - 1) / page_size);
    if constexpr (kDeviceBackend<Backend>)
      r.workspace_bytes = device_layout<Backend>(shape.max_kv_len, entries, shape.batch, shape.num_q_heads, shape.head_dim).total();
    else
      r.workspace_bytes =
          std::max(prepare_layout<Backend>(shape.head_dim).total(),
                   predict_layout<Backend>(shape.max_kv_len, entries, shape.batch * shape.num_q_heads, shape.head_dim).total());
    r.output = OutputSize{1, entries};
    r.query_window = 1;
    return r;
  }

  /// Prefill: skewing matrices, partial channels and the partial key cache
  /// of every token `keys.table` holds. `queries` (Hq, W, d) post-RoPE prompt
  /// queries (W >= 1; several sequences may be concatenated along W).
  template <class Backend, class Tq, class Tk>
  Status prepare(const Context<Backend>& ctx, TensorView<const Tq, 3> queries, const PagedKVView<const Tk>& keys,
                 State& st) const noexcept {
    if constexpr (kDeviceBackend<Backend>)
      return Status::error(StatusCode::kUnsupported,
                           "infinigen: prepare runs on the host (a serial eigen-decomposition per kv head): run it on a host state, copy "
                           "its skew and channels into the device state, set `prepared`, then on_append the keys on the device");
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_state(st, false));
    KVP_RETURN_IF_ERROR(check_keys(keys, st, false));
    KVP_RETURN_IF_ERROR(queries.check_basic(kName, "queries"));
    KVP_REQUIRE(queries.device().is_host(), "infinigen: queries is a device tensor; this entry point reads host memory");
    KVP_REQUIRE(queries.extent(2) == st.head_dim, "infinigen: queries head_dim is %lld, the state has %d",
                static_cast<long long>(queries.extent(2)), st.head_dim);
    KVP_REQUIRE(queries.extent(1) >= 1, "infinigen: queries has %lld prompt positions, must be >= 1",
                static_cast<long long>(queries.extent(1)));
    KVP_REQUIRE(queries.extent(0) % st.num_kv_heads == 0, "infinigen: queries has %lld heads, not a multiple of the %d kv heads",
                static_cast<long long>(queries.extent(0)), st.num_kv_heads);
    const auto L = prepare_layout<Backend>(st.head_dim);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, L.total()));
    const std::int64_t d = st.head_dim, G = queries.extent(0) / st.num_kv_heads, W = queries.extent(1);
    WorkspaceCarver c(ctx.workspace);
    double* cov = c.take<double>(static_cast<std::size_t>(d * d));
    double* vec = c.take<double>(static_cast<std::size_t>(d * d));
    double* eig = c.take<double>(static_cast<std::size_t>(d));
    float* acc = c.take<float>(static_cast<std::size_t>(d));
    std::int32_t* order = c.take<std::int32_t>(static_cast<std::size_t>(d));
    const Workspace topk_ws{c.take<std::byte>(Backend::topk_workspace(d)), Backend::topk_workspace(d)};
    for (std::int32_t g = 0; g < st.num_kv_heads; ++g) {
      float* A = st.skew + g * d * d;
      if (params_.skew) {
        std::fill(cov, cov + d * d, 0.0);
        for (std::int64_t j = 0; j < G; ++j)
          for (std::int64_t t = 0; t < W; ++t)
            for (std::int64_t a = 0; a < d; ++a) {
              const double qa = to_float(queries(g * G + j, t, a));
              for (std::int64_t b = 0; b < d; ++b) cov[a * d + b] += qa * static_cast<double>(to_float(queries(g * G + j, t, b)));
            }
        symmetric_eigen(cov, d, eig, vec);
        // Columns by descending eigenvalue, ties: lower index first.
        for (std::int64_t i = 0; i < d; ++i) order[i] = static_cast<std::int32_t>(i);
        std::stable_sort(order, order + d, [&](std::int32_t x, std::int32_t y) { return eig[x] > eig[y]; });
        for (std::int64_t col = 0; col < d; ++col)
          for (std::int64_t i = 0; i < d; ++i) A[i * d + col] = static_cast<float>(vec[i * d + order[col]]);
      } else {
        for (std::int64_t i = 0; i < d; ++i)
          for (std::int64_t col = 0; col < d; ++col) A[i * d + col] = i == col ? 1.0f : 0.0f;
      }
      // Partial channels: largest sum_t |(q_t A)[c]| over the group's prompt queries.
      std::fill(acc, acc + d, 0.0f);
      for (std::int64_t j = 0; j < G; ++j)
        for (std::int64_t t = 0; t < W; ++t)
          for (std::int64_t col = 0; col < d; ++col) {
            float v = 0.0f;
            for (std::int64_t i = 0; i < d; ++i) v += to_float(queries(g * G + j, t, i)) * A[i * d + col];
            acc[col] += std::fabs(v);
          }
      Backend::topk(acc, d, st.partial_dim, st.channels + static_cast<std::int64_t>(g) * st.partial_dim, topk_ws);
    }
    st.prepared = true;
    return fold_keys(ctx, keys, st, nullptr);
  }

  /// Partial keys of the tokens just appended (`app.append_len[b]` per
  /// sequence; nullptr: every token of the table). Needs `prepare` first.
  template <class Backend, class Tk>
  Status on_append(const Context<Backend>& ctx, const AppendInput<Tk>& app, State& st) const noexcept {
    constexpr bool on_device = kDeviceBackend<Backend>;
    KVP_RETURN_IF_ERROR(check_state(st, on_device));
    KVP_REQUIRE(st.prepared, "infinigen: on_append before prepare (the partial channels come from the prompt queries)");
    KVP_RETURN_IF_ERROR(check_keys(app.kv, st, on_device));
    if (app.append_len != nullptr)
      for (std::int32_t b = 0; b < app.kv.table.batch; ++b)
        KVP_REQUIRE(app.append_len[b] >= 0 && app.append_len[b] <= app.kv.seq_len(b),
                    "infinigen: append_len[%d] is %d, must be in [0, sequence length %lld]", b, app.append_len[b],
                    static_cast<long long>(app.kv.seq_len(b)));
    return fold_keys(ctx, app.kv, st, app.append_len);
  }

  /// Speculates the pages layer `next.layer` reads: `next.queries` (batch,
  /// Hq, d) is the adapter's speculative post-RoPE query of that layer. Every
  /// input is validated before `out` or the history is written.
  template <class Backend, class Tq>
  Status predict(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, PrefetchRequest& out) const noexcept {
    std::int32_t G = 0;
    KVP_RETURN_IF_ERROR(check_predict_call(st, next, out, kDeviceBackend<Backend>, &G));
    if constexpr (kDeviceBackend<Backend>)
      return predict_on_device(ctx, st, next, G, out);
    else
      return predict_on_host(ctx, st, next, G, out);
  }

 private:
  /// Everything `predict` checks before it writes: the parameters and state (its memory against the
  /// backend), the history, queries, table and request, the page size and layer; a prepared state for a sparse layer.
  /// `*G` receives the query heads per kv head.
  template <class Tq>
  Status check_predict_call(const State& st, const DecodeInput<Tq>& next, const PrefetchRequest& out, bool on_device,
                            std::int32_t* G) const noexcept {
    KVP_RETURN_IF_ERROR(validate_params());
    KVP_RETURN_IF_ERROR(check_state(st, on_device));
    KVP_RETURN_IF_ERROR(prefetch_detail::check_predict(kName, st.history, next.queries, next.table, next.page_size, st.num_kv_heads,
                                                       st.head_dim, out, G, on_device));
    KVP_REQUIRE(next.page_size == st.page_size, "infinigen: page_size is %d, the state has %d", next.page_size, st.page_size);
    KVP_REQUIRE(next.layer >= 0, "infinigen: layer is %d, must be >= 0", next.layer);
    KVP_REQUIRE(next.layer < params_.dense_layers || st.prepared, "infinigen: predict before prepare");
    return Status::ok();
  }

  template <class Backend, class Tq>
  Status predict_on_host(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, std::int32_t G,
                         PrefetchRequest& out) const noexcept {
    const bool dense = next.layer < params_.dense_layers;
    const PageTable& table = next.table;
    std::int64_t T = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) T = std::max(T, table.seq_len(b, st.page_size));
    const std::int64_t entries = prefetch_detail::table_entries(table), Hq = next.queries.extent(1);
    const auto L = predict_layout<Backend>(T, entries, table.batch * Hq, st.head_dim);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, L.total()));
    WorkspaceCarver c(ctx.workspace);
    const auto t1 = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    float* scores = c.take<float>(static_cast<std::size_t>(table.batch * Hq) * t1);  // (batch * Hq, T)
    std::int32_t* idx = c.take<std::int32_t>(t1);
    const Workspace topk_ws{c.take<std::byte>(Backend::topk_workspace(T)), Backend::topk_workspace(T)};
    float* qt = c.take<float>(static_cast<std::size_t>(G) * static_cast<std::size_t>(st.partial_dim));
    float* prio = c.take<float>(static_cast<std::size_t>(entries));
    std::uint64_t* keys = c.take<std::uint64_t>(static_cast<std::size_t>(entries));

    std::fill(prio, prio + entries, prefetch_detail::kNotPredicted);
    if (dense) {
      prefetch_detail::predict_all(table, prio);
    } else {
      // One pass over the partial keys per (sequence, kv head) for the group's G heads; then counts, k, top-k.
      for (std::int32_t b = 0; b < table.batch; ++b)
        for (std::int32_t g = 0; g < st.num_kv_heads; ++g)
          score_group(st, next, b, g, G, qt, scores + (b * Hq + g * G) * static_cast<std::int64_t>(t1), t1);
      std::int64_t total = 0, rows = 0;
      for (std::int32_t b = 0; b < table.batch; ++b) {
        const std::int64_t n = table.seq_len(b, st.page_size);
        if (n == 0) continue;
        for (std::int64_t h = 0; h < Hq; ++h) {
          const float* row = scores + (b * Hq + h) * static_cast<std::int64_t>(t1);
          float mx = -std::numeric_limits<float>::infinity();
          for (std::int64_t t = 0; t < n; ++t) mx = std::max(mx, row[t]);
          for (std::int64_t t = 0; t < n; ++t) total += row[t] > mx - params_.alpha ? 1 : 0;
          ++rows;
        }
      }
      const std::int64_t k = rows == 0 ? 0 : std::min<std::int64_t>(total / rows, params_.max_num_kv);
      for (std::int32_t b = 0; b < table.batch; ++b)
        for (std::int64_t h = 0; h < Hq; ++h) {
          const std::int64_t n = table.seq_len(b, st.page_size), kk = std::min(k, n);
          if (kk <= 0) continue;
          const float* row = scores + (b * Hq + h) * static_cast<std::int64_t>(t1);
          Backend::topk(row, n, kk, idx, topk_ws);
          for (std::int64_t i = 0; i < kk; ++i)
            prefetch_detail::raise(prio, prefetch_detail::entry_of(table, b, idx[i], st.page_size), row[idx[i]]);
        }
    }
    prefetch_detail::write_request(st.history, table, prio, keys, out);
    return Status::ok();
  }

  /// `predict` on a device backend (header comment, "On a device backend").
  template <class Backend, class Tq>
  Status predict_on_device(const Context<Backend>& ctx, State& st, const DecodeInput<Tq>& next, std::int32_t G,
                           PrefetchRequest& out) const noexcept {
    const bool dense = next.layer < params_.dense_layers;
    const PageTable& table = next.table;
    std::int64_t T = 0;
    for (std::int32_t b = 0; b < table.batch; ++b) T = std::max(T, table.seq_len(b, st.page_size));
    const std::int64_t entries = prefetch_detail::table_entries(table), Hq = next.queries.extent(1);
    const DeviceLayout L = device_layout<Backend>(T, entries, table.batch, Hq, st.head_dim);
    KVP_RETURN_IF_ERROR(check_workspace(kName, ctx.workspace, L.total()));
    WorkspaceCarver c(ctx.workspace);
    const std::int64_t t1 = std::max<std::int64_t>(T, 1);
    float* prio = c.take<float>(static_cast<std::size_t>(std::max<std::int64_t>(entries, 1)));
    float* scores = c.take<float>(static_cast<std::size_t>(table.batch * Hq * t1));  // (batch * Hq, T)
    float* qt = c.take<float>(static_cast<std::size_t>(Hq * st.head_dim));
    std::int64_t* counts = c.take<std::int64_t>(static_cast<std::size_t>(std::max<std::int64_t>(table.batch * Hq, 1)));
    std::uint64_t* thr = c.take<std::uint64_t>(static_cast<std::size_t>(Hq));
    std::uint64_t* keys = c.take<std::uint64_t>(L.select_bytes / sizeof(std::uint64_t));
    const Workspace request_ws{c.take<std::byte>(L.request_bytes), L.request_bytes};

    const ops::PartialKeyGeometry geo = geometry(st);
    const float scale = 1.0f / std::sqrt(static_cast<float>(st.head_dim));
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    if (entries > 0) Backend::fill(prio, entries, 1, dense ? 1.0f : prefetch_detail::kNotPredicted);
    if (!dense) {
      std::int64_t count_rows = 0;  // rows of the non-empty sequences, in order
      for (std::int32_t b = 0; b < table.batch; ++b) {
        const std::int64_t n = table.seq_len(b, st.page_size);
        if (n == 0) continue;
        float* sb = scores + b * Hq * t1;
        ops::infinigen_scores<Backend>(next.queries.data() + b * next.queries.stride(0), next.queries.stride(1), next.queries.stride(2), G,
                                       scale, st.skew, st.channels, st.partial_keys, table.indices + table.indptr[b], geo, n, qt, sb, t1);
        ops::infinigen_counts<Backend>(sb, Hq, n, t1, params_.alpha, counts + count_rows);
        count_rows += Hq;
      }
      for (std::int32_t b = 0; b < table.batch; ++b) {
        const std::int64_t n = table.seq_len(b, st.page_size);
        if (n == 0) continue;
        ops::infinigen_select<Backend>(scores + b * Hq * t1, Hq, n, t1, counts, count_rows, params_.max_num_kv, st.page_size, keys, thr,
                                       prio + table.indptr[b]);
      }
    }
    prefetch_detail::write_request_on_device<Backend>(st.history, table, prio, out, request_ws);
    return call.end();
  }

 public:
  /// `predict` from layer `target_layer - 1`'s normalised attention input
  /// `x` (batch, d_model): the adapter writes the speculative query into `q`
  /// (batch, Hq, d; caller scratch), then `predict` runs on it. The state,
  /// table and `out` are checked before the adapter runs; an adapter error is
  /// returned as is, with `out` and the history untouched.
  template <class Backend, class Adapter>
    requires InfiniGenModelAdapter<Adapter> Status predict_from_input(const Context<Backend>& ctx, State& st, const Adapter& adapter,
                                                                      TensorView<const float, 2> x, const std::int64_t* positions,
                                                                      const PageTable& table, std::int32_t target_layer,
                                                                      TensorView<float, 3> q, PrefetchRequest& out)
  const noexcept {
    KVP_REQUIRE(positions != nullptr || table.batch == 0, "infinigen: positions is null");
    KVP_REQUIRE(x.extent(0) == table.batch && q.extent(0) == table.batch,
                "infinigen: x has %lld rows and q %lld sequences, the page table has batch %d", static_cast<long long>(x.extent(0)),
                static_cast<long long>(q.extent(0)), table.batch);
    KVP_RETURN_IF_ERROR(x.check_basic(kName, "x"));
    // Everything predict checks, before the adapter writes q (a failing adapter leaves out and the history alone).
    const DecodeInput<float> in{TensorView<const float, 3>(q), table, st.page_size, target_layer};
    std::int32_t G = 0;
    KVP_RETURN_IF_ERROR(check_predict_call(st, in, out, kDeviceBackend<Backend>, &G));
    KVP_RETURN_IF_ERROR(adapter.speculative_query(target_layer, positions, x, q));
    return predict(ctx, st, in, out);
  }

  template <class Backend>
  Status observe(const Context<Backend>& ctx, State& st, const PageSelection& actual, PrefetchCounters& counters) const noexcept {
    KVP_RETURN_IF_ERROR(check_state(st, kDeviceBackend<Backend>));
    return prefetch_detail::observe(ctx, kName, st.history, actual, counters);
  }

  /// Eigen-decomposition of the symmetric n x n matrix `a` (row-major,
  /// destroyed): eigenvalues in `eig`, eigenvector j in column j of `vec`
  /// (row-major), each with its largest-magnitude entry positive. Cyclic
  /// Jacobi rotations, deterministic.
  static void symmetric_eigen(double* a, std::int64_t n, double* eig, double* vec) noexcept {
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < n; ++j) vec[i * n + j] = i == j ? 1.0 : 0.0;
    double total = 0.0;
    for (std::int64_t i = 0; i < n * n; ++i) total += a[i] * a[i];
    for (int sweep = 0; sweep < 64; ++sweep) {
      double off = 0.0;
      for (std::int64_t p = 0; p < n; ++p)
        for (std::int64_t q = p + 1; q < n; ++q) off += 2.0 * a[p * n + q] * a[p * n + q];
      if (off <= 1e-24 * total || off == 0.0) break;
      for (std::int64_t p = 0; p < n; ++p)
        for (std::int64_t q = p + 1; q < n; ++q) {
          const double apq = a[p * n + q];
          if (apq == 0.0) continue;
          const double theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
          const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
          const double cs = 1.0 / std::sqrt(t * t + 1.0), sn = t * cs;
          for (std::int64_t k = 0; k < n; ++k) {  // columns p, q
            const double akp = a[k * n + p], akq = a[k * n + q];
            a[k * n + p] = cs * akp - sn * akq;
            a[k * n + q] = sn * akp + cs * akq;
          }
          for (std::int64_t k = 0; k < n; ++k) {  // rows p, q
            const double apk = a[p * n + k], aqk = a[q * n + k];
            a[p * n + k] = cs * apk - sn * aqk;
            a[q * n + k] = sn * apk + cs * aqk;
          }
          for (std::int64_t k = 0; k < n; ++k) {
            const double vkp = vec[k * n + p], vkq = vec[k * n + q];
            vec[k * n + p] = cs * vkp - sn * vkq;
            vec[k * n + q] = sn * vkp + cs * vkq;
          }
        }
    }
    for (std::int64_t j = 0; j < n; ++j) {
      eig[j] = a[j * n + j];
      std::int64_t best = 0;
      for (std::int64_t i = 1; i < n; ++i)
        if (std::fabs(vec[i * n + j]) > std::fabs(vec[best * n + j])) best = i;
      if (vec[best * n + j] < 0)
        for (std::int64_t i = 0; i < n; ++i) vec[i * n + j] = -vec[i * n + j];
    }
  }

 private:
  struct Layout {
    WorkspacePlan plan;
    std::size_t total() const noexcept { return plan.total(); }
  };
  template <class Backend>
  static Layout prepare_layout(std::int64_t d) noexcept {
    Layout l;
    const auto n = static_cast<std::size_t>(d);
    l.plan.add<double>(n * n).add<double>(n * n).add<double>(n).add<float>(n).add<std::int32_t>(n);
    l.plan.add_bytes(Backend::topk_workspace(d));
    return l;
  }
  template <class Backend>
  static Layout predict_layout(std::int64_t T, std::int64_t entries, std::int64_t rows, std::int64_t d) noexcept {
    Layout l;
    const auto t = static_cast<std::size_t>(std::max<std::int64_t>(T, 1));
    l.plan.add<float>(static_cast<std::size_t>(rows) * t).add<std::int32_t>(t);
    l.plan.add_bytes(Backend::topk_workspace(T));
    l.plan.add<float>(static_cast<std::size_t>(d) * static_cast<std::size_t>(rows));  // G * r <= rows * d
    l.plan.add<float>(static_cast<std::size_t>(entries)).add<std::uint64_t>(static_cast<std::size_t>(entries));
    return l;
  }

  static Status check_state(const State& st, bool on_device) noexcept {
    KVP_REQUIRE(st.skew != nullptr && st.channels != nullptr && st.partial_keys != nullptr, "infinigen: state buffers are null");
    KVP_REQUIRE(st.page_size >= 1 && st.num_kv_heads >= 1 && st.head_dim >= 1 && st.partial_dim >= 1 && st.partial_dim <= st.head_dim,
                "infinigen: state dims (page_size %d, kv heads %d, head_dim %d, partial_dim %d) are invalid; build it with make_state",
                st.page_size, st.num_kv_heads, st.head_dim, st.partial_dim);
    KVP_REQUIRE(st.history.num_pages == st.num_pages, "infinigen: history has %d pages, the state %d", st.history.num_pages, st.num_pages);
    return prefetch_detail::check_state_memory(kName, st.device, st.history, on_device);
  }
  template <class Tk>
  static Status check_keys(const PagedKVView<const Tk>& keys, const State& st, bool on_device) noexcept {
    KVP_RETURN_IF_ERROR(keys.validate(kName, /*need_values=*/false, /*check_ids=*/!on_device));
    if (on_device) {
      KVP_REQUIRE(!keys.device.is_host(), "infinigen: keys are host memory; a device backend reads device memory (tag the view kCUDA)");
    } else {
      KVP_REQUIRE(keys.device.is_host(), "infinigen: keys are on a device; this entry point reads host memory");
    }
    KVP_REQUIRE(keys.k_strides.dim == 1, "infinigen: keys' dim stride is %lld, must be 1", static_cast<long long>(keys.k_strides.dim));
    KVP_REQUIRE(keys.num_pages == st.num_pages && keys.page_size == st.page_size && keys.num_kv_heads == st.num_kv_heads &&
                    keys.head_dim == st.head_dim,
                "infinigen: keys (pages %d, page_size %d, kv heads %d, head_dim %d) do not match the state (%d, %d, %d, %d)",
                keys.num_pages, keys.page_size, keys.num_kv_heads, keys.head_dim, st.num_pages, st.page_size, st.num_kv_heads, st.head_dim);
    return Status::ok();
  }

  /// K~ of tokens [len - append[b], len) (append null: every token): one op per sequence on every backend
  /// (on the host its reference, ops/infinigen_ops.hpp).
  template <class Backend, class Tk>
  static Status fold_keys(const Context<Backend>& ctx, const PagedKVView<const Tk>& keys, State& st, const std::int32_t* append) noexcept {
    const ops::PartialKeyGeometry geo = geometry(st);
    const detail::BackendCall<Backend> call(ctx);
    KVP_RETURN_IF_ERROR(call.begin());
    for (std::int32_t b = 0; b < keys.table.batch; ++b) {
      const std::int64_t len = keys.seq_len(b), from = append ? len - append[b] : 0;
      if (len > from)
        ops::infinigen_fold<Backend>(keys.k_data, keys.k_strides, keys.table.indices + keys.table.indptr[b], geo, st.skew, st.channels,
                                     from, len - from, st.partial_keys);
    }
    return call.end();
  }

  static ops::PartialKeyGeometry geometry(const State& st) noexcept {
    return ops::PartialKeyGeometry{st.page_size, st.num_kv_heads, st.head_dim, st.partial_dim};
  }

  /// Device workspace: priorities, the scores (batch * Hq, T), the skewed
  /// queries, the per-row counts, the row thresholds, the select op's scratch
  /// and the request's.
  struct DeviceLayout {
    std::int64_t entries = 0, T = 0, batch = 0, Hq = 0, d = 0;
    std::size_t select_bytes = 0, request_bytes = 0;
    std::size_t total() const noexcept {
      WorkspacePlan p;
      const std::int64_t t1 = std::max<std::int64_t>(T, 1);
      p.add<float>(static_cast<std::size_t>(std::max<std::int64_t>(entries, 1))).add<float>(static_cast<std::size_t>(batch * Hq * t1));
      p.add<float>(static_cast<std::size_t>(Hq * d)).add<std::int64_t>(static_cast<std::size_t>(std::max<std::int64_t>(batch * Hq, 1)));
      p.add<std::uint64_t>(static_cast<std::size_t>(Hq)).add<std::uint64_t>(select_bytes / sizeof(std::uint64_t));
      p.add_bytes(request_bytes);
      return p.total();
    }
  };
  template <class Backend>
  static DeviceLayout device_layout(std::int64_t T, std::int64_t entries, std::int64_t batch, std::int64_t Hq, std::int64_t d) noexcept {
    return DeviceLayout{
        entries, T, batch, Hq, d, ops::infinigen_select_workspace<Backend>(T), ops::prefetch_request_workspace<Backend>(entries)};
  }

  /// Speculative logits of the G query heads of kv head g of sequence b
  /// over its tokens into out rows (G, ld), page by page (a page's partial
  /// keys of one kv head are contiguous).
  template <class Tq>
  static void score_group(const State& st, const DecodeInput<Tq>& next, std::int32_t b, std::int32_t g, std::int32_t G, float* qt,
                          float* out, std::size_t ld) noexcept {
    const std::int64_t n = next.table.seq_len(b, st.page_size), d = st.head_dim, r = st.partial_dim;
    if (n == 0) return;
    const float* A = st.skew + g * d * d;
    const std::int32_t* ch = st.channels + static_cast<std::int64_t>(g) * r;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (std::int32_t j = 0; j < G; ++j)
      for (std::int64_t c = 0; c < r; ++c) {
        float v = 0.0f;
        for (std::int64_t i = 0; i < d; ++i) v += to_float(next.queries(b, g * G + j, i)) * A[i * d + ch[c]];
        qt[j * r + c] = v * scale;  // the 1/sqrt(d) folded into the query
      }
    const std::int32_t pages = next.table.num_pages(b);
    for (std::int32_t p = 0; p < pages; ++p) {
      const std::int64_t t0 = static_cast<std::int64_t>(p) * st.page_size;
      const std::int64_t slots = std::min<std::int64_t>(st.page_size, n - t0);
      const float* kp = st.key_row(next.table.indices[next.table.indptr[b] + p], 0, g);
      for (std::int32_t j = 0; j < G; ++j) {
        const float* q = qt + j * r;
        float* o = out + static_cast<std::size_t>(j) * ld + static_cast<std::size_t>(t0);
        for (std::int64_t sl = 0; sl < slots; ++sl) o[sl] = prefetch_detail::dot(q, kp + sl * r, r);
      }
    }
  }

  Params params_{};
};

static_assert(PrefetchPolicy<InfiniGen, float> && PrefetchPolicy<InfiniGen, half>);

KVP_NAMESPACE_END
