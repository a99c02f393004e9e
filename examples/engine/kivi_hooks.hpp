// SPDX-License-Identifier: Apache-2.0
// KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
// Cache", ICML 2024) in the engine's decode loop, on the contiguous and the
// paged cache alike: per layer a real KIVI store (codes, scales and the fp16
// residual of kvpolicy::KiviQuant::append), K and V each with its own policy.
//
// Order. A token is handed to KIVI after its own attention, as the reference
// does: the prompt at the first moment the cache is read after the prefill
// hooks (the first decode step's on_append, before that step's attention:
// the engine's prefill attends over fresh Q/K/V, never over the cache), each
// decode token at the next step's on_append. Whenever KIVI quantizes tokens,
// their decoded rows replace the engine's rows, so the engine attends over
// concat(quantized, full precision) exactly as KIVI does; the residual tokens
// keep the engine's rows. KIVI's key groups are G consecutive cache slots.
//
// Compactions (the rule; on_compact, after any keep set the engine applied).
// The store is rebuilt from the compacted cache: emptied, then every token the
// cache now holds (all of them have had their attention) is handed to it as
// one append, in slot order, so key groups are re-formed over the compacted,
// consecutive kept tokens and the flush rule (keys: the first n - n mod R,
// values: all but the last R) applies to the new length n.
//  * After a one-shot eviction at prefill (SnapKV, any after_prefill keep
//    set) nothing was quantized yet: the eviction scores full-precision keys,
//    then KIVI stores the kept tokens. That is "evict, then quantize", and no
//    token is quantized twice.
//  * After KIVI quantized tokens (an online eviction during decode: H2O, TOVA)
//    the engine's rows of those tokens hold their decoded values (fp16-valued),
//    so re-quantizing from them is defined, but the error compounds: keys are
//    re-grouped (every group after an evicted slot shifts, so its tokens are
//    quantized again, against new group minimums and scales), values are
//    re-quantized per token from their own decoding (usually the same codes,
//    not guaranteed bit for bit). A token that was never quantized keeps the
//    engine's row bit for bit while the rebuilt store holds it in its
//    residual; the flush rule may quantize it at the rebuild (e.g. keys when
//    n is a multiple of R), as KIVI would a sequence of n tokens.
// Cost: a rebuild quantizes the whole layer again (O(n d) per kv head), at
// every compaction. Ragged keep sets (per-head counts, e.g. Ada-KV on the
// contiguous cache) are refused with a message: one KIVI store holds one token
// count for every kv head.
//
// Validation, before anything is written: each policy's parameters and the
// head dimension (KiviQuant::validate_params / check_head_dim), the keys
// policy's role keys and the values policy's role values. A failing append
// (a value outside fp16) leaves the engine's rows untouched and the layer's
// store empty. Thread-safety: one request at a time (the hooks' state is the
// request's).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/policy.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"

namespace kvp_engine {

/// One role's (K or V) KIVI store of one layer: codes, scales and the fp16 residual, sized for the cache.
struct KiviRoleStore {
  std::vector<kvpolicy::half> residual;
  std::vector<std::uint8_t> codes, scales;
  kvpolicy::KiviState st;   // (kv_heads, max(R, 1), head_dim) residual view
  kvpolicy::QuantizedKV q;  // (kv_heads, code_rows(capacity), row bytes) codes and scales

  /// A fresh store for `capacity` tokens of H kv heads.
  void assign(const kvpolicy::KiviQuant& p, std::int64_t H, std::int64_t capacity, std::int64_t d) {
    const std::int64_t res = std::max<std::int64_t>(p.params().residual, 1), rows = p.code_rows(capacity);
    residual.assign(static_cast<std::size_t>(H * res * d), kvpolicy::half{});
    codes.assign(static_cast<std::size_t>(H * rows * p.codes_row_bytes(d)), 0);
    scales.assign(static_cast<std::size_t>(H * rows * p.scales_row_bytes(d)), 0);
    st = kvpolicy::KiviState{kvpolicy::TensorView<kvpolicy::half, 3>::contiguous(residual.data(), {H, res, d}), 0};
    q = kvpolicy::QuantizedKV{p.layout(), kvpolicy::TensorView<std::uint8_t, 3>::contiguous(codes.data(), {H, rows, p.codes_row_bytes(d)}),
                              kvpolicy::TensorView<std::uint8_t, 3>::contiguous(scales.data(), {H, rows, p.scales_row_bytes(d)}), 0};
  }
  /// Empty again (nothing quantized, nothing in the residual); the buffers are kept.
  void clear() noexcept {
    q.tokens = 0;
    st.residual_len = 0;
  }
};

/// Per layer the two stores and how many cache slots have been handed to them (every kv head alike).
struct KiviLayerStore {
  KiviRoleStore role[2];  // keys, values
  std::int64_t handed = 0;
  std::int64_t rebuilds = 0;  ///< compactions this request that rebuilt the store

  /// Bytes the layer's store holds: codes and scales of the quantized tokens, the fp16 residual, K + V.
  double bytes(const kvpolicy::KiviQuant& keys, const kvpolicy::KiviQuant& values, std::int64_t H, std::int64_t d) const noexcept {
    double b = 0.0;
    for (int r = 0; r < 2; ++r) {
      const kvpolicy::KiviQuant& p = r == 0 ? keys : values;
      b += static_cast<double>(H) * (static_cast<double>(role[r].q.tokens) * p.bytes_per_token(d) +
                                     static_cast<double>(role[r].st.residual_len) * 2.0 * static_cast<double>(d));
    }
    return b;
  }
};

/// The hooks' state: one store per layer (a caller may pass its own to inspect it) and the row scratch.
struct KiviHookState {
  std::vector<KiviLayerStore> layers;
  std::vector<float> rows, decoded;  // (kv_heads, n, head_dim) gathered rows, decoded rows
};

namespace detail {

/// Row t of kv head h of layer l (keys: role 0, values: role 1) wherever the layout keeps it.
template <class Cache>
typename Cache::element_type* kivi_row(Cache& c, int l, int role, std::int64_t h, std::int64_t t) {
  if constexpr (Cache::kPaged) {
    const auto& v = c.view(l);
    return role == 0 ? v.key(0, static_cast<std::int32_t>(h), t) : v.value(0, static_cast<std::int32_t>(h), t);
  } else {
    return &(role == 0 ? c.keys(l) : c.values(l))(h, t, 0);
  }
}

/// Checks one policy of the pair before anything is sized or written.
inline Status kivi_check(const kvpolicy::KiviQuant& p, kvpolicy::QuantRole role, std::int64_t d) noexcept {
  const char* name = role == kvpolicy::QuantRole::kKeys ? "keys" : "values";
  KVP_REQUIRE(p.params().role == role, "engine kivi: the %s policy has role %s, must be %s", name,
              p.params().role == kvpolicy::QuantRole::kKeys ? "keys" : "values", name);
  KVP_RETURN_IF_ERROR(p.validate_params());
  return p.check_head_dim(d);
}

/// Hands cache slots [L.handed, upto) of layer l to both stores; the tokens they quantize get their decoded
/// rows written back into the cache. Both appends run before any row is written: a failure leaves the
/// cache's rows as they were and the layer's store empty.
template <class Cache, class Backend>
Status kivi_hand(Cache& cache, int l, std::int64_t upto, const kvpolicy::KiviQuant& keys, const kvpolicy::KiviQuant& values,
                 KiviLayerStore& L, KiviHookState& S, kvpolicy::ExecContext ctx) {
  using T = typename Cache::element_type;
  const CacheShape& s = cache.shape();
  const std::int64_t H = s.num_kv_heads, d = s.head_dim, from = L.handed, n = upto - from;
  if (n <= 0) return Status::ok();
  const kvpolicy::Context<Backend> cx{kvpolicy::Workspace{}, ctx};
  const std::size_t per_role = static_cast<std::size_t>(H * n * d);
  S.rows.resize(2 * per_role);
  for (int r = 0; r < 2; ++r)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < n; ++t) {
        const T* src = kivi_row(cache, l, r, h, from + t);
        float* dst = S.rows.data() + static_cast<std::size_t>(r) * per_role + static_cast<std::size_t>((h * n + t) * d);
        for (std::int64_t i = 0; i < d; ++i) dst[i] = kvpolicy::to_float(src[i]);
      }
  std::int64_t before[2] = {0, 0};
  for (int r = 0; r < 2; ++r) {
    const kvpolicy::KiviQuant& p = r == 0 ? keys : values;
    KiviRoleStore& R = L.role[r];
    before[r] = R.q.tokens;
    const auto rows = kvpolicy::TensorView<const float, 3>::contiguous(S.rows.data() + static_cast<std::size_t>(r) * per_role, {H, n, d});
    const Status st = p.append(cx, rows, R.st, R.q);
    if (!st.is_ok()) {
      L.role[0].clear();
      L.role[1].clear();
      L.handed = 0;
      return st;
    }
  }
  for (int r = 0; r < 2; ++r) {
    const kvpolicy::KiviQuant& p = r == 0 ? keys : values;
    KiviRoleStore& R = L.role[r];
    const std::int64_t b = before[r], m = R.q.tokens - b;  // slots [b, b + m) were quantized by this call
    if (m == 0) continue;
    const std::int64_t row0 = p.code_rows(b), rows = p.code_rows(R.q.tokens) - row0;
    const kvpolicy::QuantizedKV fresh{R.q.layout, R.q.codes.narrow(1, row0, rows), R.q.scales.narrow(1, row0, rows), m};
    S.decoded.resize(static_cast<std::size_t>(H * m * d));
    KVP_RETURN_IF_ERROR(p.dequantize(cx, fresh, kvpolicy::TensorView<float, 3>::contiguous(S.decoded.data(), {H, m, d})));
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < m; ++t) {
        T* dst = kivi_row(cache, l, r, h, b + t);
        const float* src = S.decoded.data() + static_cast<std::size_t>((h * m + t) * d);
        for (std::int64_t i = 0; i < d; ++i) dst[i] = kvpolicy::from_float<T>(src[i]);
      }
  }
  L.handed = upto;
  return Status::ok();
}

/// The layer's token count, shared by every kv head (a ragged contiguous layer is refused).
template <class Cache>
Status kivi_length(const Cache& cache, int l, std::int64_t* len) noexcept {
  *len = cache.length(l, 0);
  if constexpr (!Cache::kPaged)
    for (int h = 1; h < cache.shape().num_kv_heads; ++h)
      KVP_REQUIRE(cache.length(l, h) == *len,
                  "engine kivi: layer %d's kv heads hold %lld and %lld tokens (kv heads 0 and %d); one KIVI store keeps one token "
                  "count for every kv head, so a ragged eviction (per-head budgets) cannot precede KIVI",
                  l, static_cast<long long>(*len), static_cast<long long>(cache.length(l, h)), h);
  return Status::ok();
}

}  // namespace detail

/// KIVI in the decode loop on a contiguous or paged cache, alone or after an eviction (see the header comment:
/// the hand-over order and the rebuild rule after a compaction). `keys` must have role keys, `values` role
/// values. `state` (optional) is where the per-layer stores live, for a caller that inspects them; a fresh
/// state otherwise. Compose with an eviction as kvpolicy::combine(eviction, kivi_hooks(...)) (either order).
template <class Cache, class Backend = kvpolicy::backend::Cpu>
Hooks<Cache> kivi_hooks(kvpolicy::KiviQuant keys, kvpolicy::KiviQuant values, kvpolicy::ExecContext ctx = {},
                        std::shared_ptr<KiviHookState> state = {}) {
  auto S = state ? std::move(state) : std::make_shared<KiviHookState>();
  Hooks<Cache> h;
  h.on_append = [keys, values, ctx, S](Cache& cache, int layer, std::int64_t appended) -> Status {
    const CacheShape& s = cache.shape();
    std::int64_t len = 0;
    KVP_RETURN_IF_ERROR(detail::kivi_length(cache, layer, &len));
    if (appended == len) {  // a new request: check, then fresh stores sized for the cache; the prompt is handed later
      KVP_RETURN_IF_ERROR(detail::kivi_check(keys, kvpolicy::QuantRole::kKeys, s.head_dim));
      KVP_RETURN_IF_ERROR(detail::kivi_check(values, kvpolicy::QuantRole::kValues, s.head_dim));
      if (S->layers.size() <= static_cast<std::size_t>(layer)) S->layers.resize(static_cast<std::size_t>(layer) + 1);
      KiviLayerStore& L = S->layers[static_cast<std::size_t>(layer)];
      L.role[0].assign(keys, s.num_kv_heads, s.capacity, s.head_dim);
      L.role[1].assign(values, s.num_kv_heads, s.capacity, s.head_dim);
      L.handed = 0;
      L.rebuilds = 0;
      return Status::ok();
    }
    if (S->layers.size() <= static_cast<std::size_t>(layer))
      return KVP_INVALID("engine kivi: layer %d appended %lld tokens before its prompt (no store yet)", layer,
                         static_cast<long long>(appended));
    // Everything before this step's new tokens has had its attention: hand it to KIVI (the whole prompt at the first step).
    return detail::kivi_hand<Cache, Backend>(cache, layer, len - appended, keys, values, S->layers[static_cast<std::size_t>(layer)], *S,
                                             ctx);
  };
  h.on_compact = [keys, values, ctx, S](Cache& cache, int layer) -> Status {
    if (S->layers.size() <= static_cast<std::size_t>(layer))
      return KVP_INVALID("engine kivi: layer %d was compacted before its prompt (no store yet)", layer);
    std::int64_t len = 0;
    KVP_RETURN_IF_ERROR(detail::kivi_length(cache, layer, &len));
    KiviLayerStore& L = S->layers[static_cast<std::size_t>(layer)];
    L.role[0].clear();
    L.role[1].clear();
    L.handed = 0;
    ++L.rebuilds;
    return detail::kivi_hand<Cache, Backend>(cache, layer, len, keys, values, L, *S, ctx);
  };
  return h;
}

}  // namespace kvp_engine
