// SPDX-License-Identifier: Apache-2.0
// A minimal inference loop for kvp-tiny that shows where an engine calls
// kvpolicy: prefill, then greedy decode over a contiguous or a paged KV cache,
// with policy hooks at the engine's natural points.
//
//   Model model = Model::load("models/kvp-tiny");
//   Session<PagedKVCache<float>> s(model, PagedKVCache<float>(shape, 16), hooks);
//   s.prefill(tokenize("... the pass key is "));   // logits of the last prompt token
//   std::vector<int32_t> out = s.greedy(5);          // decode 5 tokens
//
// Life of a request and the hook points: the library's lifecycle,
// `kvpolicy::Hooks<Cache>` (kvpolicy/policy/lifecycle.hpp; all optional
// std::function members; decisions go into kvpolicy::KeepBuffer /
// kvpolicy::SelectionBuffer, applied only when a hook marked them active;
// policies.hpp builds the hooks from kvpolicy policies):
//
//   prefill(prompt)                          computes every layer on the prompt (attention over the fresh
//   |                                        Q/K/V, as prefill kernels do), then writes K/V to the cache:
//   |-- on_append(cache, layer, n)           after the prompt's n tokens entered a layer (Quest metadata)
//   |-- on_prefill_attention(cache, layer, C)  the prompt's attention column sums (Hq, n), when the prefill
//   |                                        kept them (PrefillOptions::column_sums): H2O, CaM and D2O
//   |                                        accumulate them instead of recomputing Q K^T
//   |-- after_prefill(cache, layer, Q, keep) eviction: SnapKV, StreamingLLM, any EvictionPolicy. Q are the
//   |                                        last `query_window` post-RoPE prompt queries (Hq, W, d). A
//   |                                        filled `keep` is applied with compact_contiguous/compact_paged;
//   |-- on_compact(cache, layer)             then this fires (rebuild metadata of moved tokens)
//   decode(token), per layer:
//   |-- on_layer_input(cache, layer, pos, x) the layer's normalised input (1, d_model) before its projections
//   |                                        (InfiniGen's next-layer speculation; examples/engine/prefetch.hpp)
//   |-- on_append(cache, layer, 1)           the token's K/V are in the cache
//   |-- before_attention(cache, layer, q, sel)  selection: fill `sel` (PageSelection over the paged pool,
//   |                                        e.g. Quest) and this step attends to those pages only
//   |-- after_attention(cache, layer, P, keep)  online eviction (H2O, TOVA): P = this step's attention
//   |                                        weights (Hq, n) over the n cache slots (new token last);
//   |                                        a filled `keep` is applied at once, then on_compact fires
//
// Measurement: Session::measure_attention_error() keeps a shadow fp32 cache of
// every appended token that no hook sees, attends each decode step's query over
// it too, and records ||o - o_full|| / ||o_full|| per (layer, query head) in
// SessionStats (the evaluation's attention-output error).
//
// Positions: the RoPE position of a token is its logical position in the
// request (prompt index, then one more per decoded token); keys are cached
// post-RoPE, eviction moves rows and keeps their logical positions in the
// cache's positions array, and decoding continues at the next logical
// position whatever the cache length.
//
// Numerics: fp32 everywhere (the cache may store fp16). Against PyTorch
// (tools/model/model.py) the logits agree to max |diff| <= 1e-3 with an fp32
// cache (tests/engine/test_engine_logits.cpp; typically ~1e-5).
//
// Thread-safety: a Model is immutable and may be shared; a Session is one
// request and is used by one thread at a time.
//
// Build: prefill() is defined in engine.cpp, and Session is instantiated there
// for the four caches the project uses ({Contiguous,Paged}KVCache<{float,half}>,
// `extern template` below), all compiled once into kvp_engine_lib; a Session
// over another cache type instantiates the member definitions below.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "kv_cache.hpp"
#include "kvpolicy/policy/lifecycle.hpp"
#include "model.hpp"

namespace kvp_engine {

// The engine's hook points are the library's lifecycle (kvpolicy/policy/lifecycle.hpp).
using kvpolicy::Hooks;
using kvpolicy::KeepBuffer;
using kvpolicy::SelectionBuffer;

/// Everything the prompt leaves behind, independent of the cache layout, so one
/// prefill can be written into several caches (prefix reuse; the evaluation
/// harness compares policies on one shared prefill this way).
struct PrefillState {
  std::int64_t length = 0;
  std::vector<std::vector<float>> k, v;      ///< per layer (length, kv_heads, head_dim), keys post-RoPE
  std::vector<std::vector<float>> q_window;  ///< per layer (num_q_heads, window, head_dim): last post-RoPE queries
  /// Per layer (num_q_heads, length): column sums of the prompt's causal attention probabilities, summed over
  /// the query rows in ascending order, fp32 (PrefillOptions::column_sums; empty otherwise).
  std::vector<std::vector<float>> column_sums;
  std::int64_t window = 0;
  std::vector<float> logits;            ///< (positions.size(), vocab) for the requested positions
  std::vector<std::int64_t> positions;  ///< prompt indices whose logits were computed; the last is T-1
  std::span<const float> last_logits() const noexcept {
    return {logits.data() + logits.size() - static_cast<std::size_t>(vocab), static_cast<std::size_t>(vocab)};
  }
  std::int64_t vocab = 0;
};

struct PrefillOptions {
  std::int64_t query_window = 64;             ///< queries kept per layer for after_prefill hooks (clamped to the prompt)
  std::vector<std::int64_t> logit_positions;  ///< prompt indices whose logits are wanted; the last is always added
  bool column_sums = false;                   ///< also keep each layer's attention column sums (Hooks::on_prefill_attention)
};

/// Runs kvp-tiny over a prompt (positions 0..T-1). Causal attention per head in
/// blocks of 64 query rows (gemm.hpp); cost O(T * params + T^2 * d * heads).
PrefillState prefill(const Model& m, std::span<const std::int32_t> tokens, const PrefillOptions& opt = {});

/// Time spent in hooks (the policies' decisions and metadata work), and what they did.
struct SessionStats {
  double hook_seconds = 0.0;
  std::int64_t evictions = 0;           ///< keep sets applied
  std::int64_t selections = 0;          ///< decode attentions restricted by a selection
  std::int64_t attended_tokens = 0;     ///< (query head, cached token) pairs read by decode attention
  std::int64_t decode_layer_steps = 0;  ///< decode steps x layers
  /// Attention-output error (Session::measure_attention_error): per (decode step, layer, query head),
  /// ||o - o_full|| / ||o_full|| of this step's attention output o against o_full, the same query over
  /// every token the request has seen, unevicted, unmerged and unquantized (a shadow fp32 cache).
  double attn_err_sum = 0.0, attn_err_max = 0.0;
  std::int64_t attn_err_count = 0;
  double mean_attention_error() const noexcept { return attn_err_count ? attn_err_sum / static_cast<double>(attn_err_count) : 0.0; }
};

inline std::int32_t argmax(std::span<const float> logits) noexcept {
  std::int32_t best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[static_cast<std::size_t>(best)]) best = static_cast<std::int32_t>(i);
  return best;
}

/// One request: a cache, the hooks, the next logical position and the latest logits.
template <class Cache>
class Session {
 public:
  Session(const Model& m, Cache cache, Hooks<Cache> hooks = {}) : model_(&m), cache_(std::move(cache)), hooks_(std::move(hooks)) {
    const ModelConfig& c = m.config();
    const CacheShape& s = cache_.shape();
    if (s.n_layers != c.n_layers || s.num_kv_heads != c.n_kv_heads || s.num_q_heads != c.n_heads || s.head_dim != c.head_dim)
      throw std::runtime_error("session: cache shape does not match the model");
  }

  /// Prefill the prompt into this session's cache; returns the last prompt position's logits.
  std::span<const float> prefill(std::span<const std::int32_t> prompt, const PrefillOptions& opt = {});

  /// Writes a computed prefill into the (empty) cache, fires on_append, runs
  /// after_prefill eviction layer by layer; returns the last prompt logits.
  std::span<const float> load(const PrefillState& p);

  /// Feeds one token at the next logical position; returns its logits.
  std::span<const float> decode(std::int32_t token);

  /// Greedy continuation of `n` tokens from the current logits.
  std::vector<std::int32_t> greedy(int n);

  /// Measure every decode step's attention-output error against the full cache (SessionStats::attn_err_*):
  /// the session keeps a shadow fp32 contiguous cache of every token it appends, which no hook sees or
  /// changes, and attends each step's query over it too (twice the decode attention's cost and memory).
  /// Call before load() / prefill().
  void measure_attention_error() {
    if (position_ != 0) throw std::runtime_error("session: measure_attention_error() before load()");
    const CacheShape& s = cache_.shape();
    shadow_ = std::make_unique<ContiguousKVCache<float>>(s);
  }

  std::span<const float> logits() const noexcept { return logits_; }
  std::int64_t position() const noexcept { return position_; }
  Cache& cache() noexcept { return cache_; }
  const SessionStats& stats() const noexcept { return stats_; }

 private:
  template <class F>
  void timed(F&& f);
  void apply_keep(int l);

  const Model* model_;
  Cache cache_;
  Hooks<Cache> hooks_;
  std::int64_t position_ = 0;
  SessionStats stats_;
  KeepBuffer keep_;
  SelectionBuffer sel_;
  std::vector<float> logits_, x_, xn_, q_, k_, v_, attn_, cos_, sin_, probs_, mlp_scratch_, shadow_out_;
  std::unique_ptr<ContiguousKVCache<float>> shadow_;  // measure_attention_error(): every token, untouched by hooks
};

// ---- Session's members (not inline: `extern template` below keeps them out of the users' TUs) ----

template <class Cache>
std::span<const float> Session<Cache>::prefill(std::span<const std::int32_t> prompt, const PrefillOptions& opt) {
  return load(kvp_engine::prefill(*model_, prompt, opt));
}

template <class Cache>
std::span<const float> Session<Cache>::load(const PrefillState& p) {
  if (position_ != 0) throw std::runtime_error("session: load() needs a fresh session");
  const ModelConfig& c = model_->config();
  const std::int64_t kvd = static_cast<std::int64_t>(c.n_kv_heads) * c.head_dim;
  for (int l = 0; l < c.n_layers; ++l) {
    for (std::int64_t t = 0; t < p.length; ++t) {
      const float* kr = p.k[static_cast<std::size_t>(l)].data() + t * kvd;
      const float* vr = p.v[static_cast<std::size_t>(l)].data() + t * kvd;
      cache_.append(l, kr, vr, static_cast<std::int32_t>(t));
      if (shadow_) shadow_->append(l, kr, vr, static_cast<std::int32_t>(t));
    }
    if (hooks_.on_append) timed([&] { return hooks_.on_append(cache_, l, p.length); });
  }
  if (hooks_.on_prefill_attention && p.column_sums.size() == static_cast<std::size_t>(c.n_layers))
    for (int l = 0; l < c.n_layers; ++l) {
      const auto cs = TensorView<const float, 2>::contiguous(p.column_sums[static_cast<std::size_t>(l)].data(), {c.n_heads, p.length});
      timed([&] { return hooks_.on_prefill_attention(cache_, l, cs); });
    }
  if (hooks_.after_prefill) {
    for (int l = 0; l < c.n_layers; ++l) {
      const TensorView<const float, 3> q =
          TensorView<const float, 3>::contiguous(p.q_window[static_cast<std::size_t>(l)].data(), {c.n_heads, p.window, c.head_dim});
      keep_.active = false;
      timed([&] { return hooks_.after_prefill(cache_, l, q, keep_); });
      if (keep_.active) apply_keep(l);
    }
  }
  position_ = p.length;
  logits_.assign(p.last_logits().begin(), p.last_logits().end());
  return logits_;
}

template <class Cache>
std::span<const float> Session<Cache>::decode(std::int32_t token) {
  const ModelConfig& c = model_->config();
  if (token < 0 || token >= c.vocab_size) throw std::runtime_error("decode: token id out of range");
  const int d = c.d_model, hd = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads;
  x_.assign(model_->embedding(token), model_->embedding(token) + d);
  xn_.resize(static_cast<std::size_t>(d));
  q_.resize(static_cast<std::size_t>(Hq * hd));
  k_.resize(static_cast<std::size_t>(Hkv * hd));
  v_.resize(k_.size());
  attn_.resize(q_.size());
  cos_.resize(static_cast<std::size_t>(hd));
  sin_.resize(cos_.size());
  rope_table(position_, hd, c.rope_base, cos_.data(), sin_.data());
  const auto pos = static_cast<std::int32_t>(position_);
  for (int l = 0; l < c.n_layers; ++l) {
    const Model::Layer& L = model_->layer(l);
    rms_norm(x_.data(), L.attn_norm, 1, d, c.norm_eps, xn_.data());
    if (hooks_.on_layer_input)
      timed([&] { return hooks_.on_layer_input(cache_, l, position_, TensorView<const float, 2>::contiguous(xn_.data(), {1, d})); });
    linear(xn_.data(), L.wq, 1, d, Hq * hd, q_.data());
    linear(xn_.data(), L.wk, 1, d, Hkv * hd, k_.data());
    linear(xn_.data(), L.wv, 1, d, Hkv * hd, v_.data());
    apply_rope(q_.data(), Hq, hd, cos_.data(), sin_.data());
    apply_rope(k_.data(), Hkv, hd, cos_.data(), sin_.data());
    cache_.append(l, k_.data(), v_.data(), pos);
    if (shadow_) shadow_->append(l, k_.data(), v_.data(), pos);
    if (hooks_.on_append) timed([&] { return hooks_.on_append(cache_, l, 1); });
    const PageSelection* sel = nullptr;
    if (hooks_.before_attention) {
      sel_.active = false;
      timed([&] { return hooks_.before_attention(cache_, l, TensorView<const float, 3>::contiguous(q_.data(), {1, Hq, hd}), sel_); });
      if (sel_.active) {
        sel = &sel_.sel;
        ++stats_.selections;
      }
    }
    if constexpr (Cache::kPaged) {
      if (sel != nullptr) {
        for (int h = 0; h < Hq; ++h)
          stats_.attended_tokens += sel->row_tokens(sel->num_rows == Hq ? h : h / c.group_size(), cache_.page_size());
      } else {
        stats_.attended_tokens += cache_.kept_tokens(l) * c.group_size();
      }
    } else {
      stats_.attended_tokens += cache_.kept_tokens(l) * c.group_size();
    }
    ++stats_.decode_layer_steps;
    float* probs = nullptr;
    std::int64_t n = 0;
    if (hooks_.after_attention) {
      n = cache_.uniform_length(l);
      probs_.assign(static_cast<std::size_t>(Hq * n), 0.0f);
      probs = probs_.data();
    }
    cache_.attend(l, q_.data(), attn_.data(), probs, sel);
    if (shadow_) {
      shadow_out_.resize(attn_.size());
      shadow_->attend(l, q_.data(), shadow_out_.data(), nullptr, nullptr);
      for (int h = 0; h < Hq; ++h) {
        double num = 0.0, den = 0.0;
        for (int i = 0; i < hd; ++i) {
          const double o = attn_[static_cast<std::size_t>(h * hd + i)], f = shadow_out_[static_cast<std::size_t>(h * hd + i)];
          num += (o - f) * (o - f);
          den += f * f;
        }
        const double e = den > 0.0 ? std::sqrt(num / den) : (num > 0.0 ? 1.0 : 0.0);
        stats_.attn_err_sum += e;
        stats_.attn_err_max = std::max(stats_.attn_err_max, e);
        ++stats_.attn_err_count;
      }
    }
    if (hooks_.after_attention) {
      keep_.active = false;
      timed([&] { return hooks_.after_attention(cache_, l, TensorView<const float, 2>::contiguous(probs_.data(), {Hq, n}), keep_); });
      if (keep_.active) apply_keep(l);
    }
    linear_add(attn_.data(), L.wo, 1, Hq * hd, d, x_.data());
    mlp_block(*model_, L, x_.data(), 1, mlp_scratch_);
  }
  logits_.resize(static_cast<std::size_t>(c.vocab_size));
  final_logits(*model_, x_.data(), 1, logits_.data());
  ++position_;
  return logits_;
}

template <class Cache>
std::vector<std::int32_t> Session<Cache>::greedy(int n) {
  std::vector<std::int32_t> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(argmax(logits_));
    if (i + 1 < n) decode(out.back());
  }
  return out;
}

template <class Cache>
template <class F>
void Session<Cache>::timed(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = f();
  stats_.hook_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  kvpolicy::throw_if_error(s);
}

template <class Cache>
void Session<Cache>::apply_keep(int l) {
  kvpolicy::throw_if_error(cache_.apply_keep(l, keep_.set));
  ++stats_.evictions;
  if (hooks_.on_compact) timed([&] { return hooks_.on_compact(cache_, l); });
}

// Compiled once, in engine.cpp (kvp_engine_lib).
extern template class Session<ContiguousKVCache<float>>;
extern template class Session<PagedKVCache<float>>;
extern template class Session<ContiguousKVCache<half>>;
extern template class Session<PagedKVCache<half>>;

}  // namespace kvp_engine
