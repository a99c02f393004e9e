// SPDX-License-Identifier: Apache-2.0
// engine.hpp compiled once (kvp_engine_lib): the prefill (gemm.hpp) and Session
// over the four caches the project uses.
#include "engine.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "gemm.hpp"

namespace kvp_engine {

PrefillState prefill(const Model& m, std::span<const std::int32_t> tokens, const PrefillOptions& opt) {
  const ModelConfig& c = m.config();
  const std::int64_t T = static_cast<std::int64_t>(tokens.size());
  if (T == 0) throw std::runtime_error("prefill: empty prompt");
  const int d = c.d_model, hd = c.head_dim, Hq = c.n_heads, Hkv = c.n_kv_heads, G = c.group_size();
  const int qd = Hq * hd, kvd = Hkv * hd;
  PrefillState st;
  st.length = T;
  st.vocab = c.vocab_size;
  st.window = std::min<std::int64_t>(opt.query_window, T);
  std::vector<float> x(static_cast<std::size_t>(T * d)), xn(x.size()), q(static_cast<std::size_t>(T * qd)), attn(q.size()), mlp_scratch;
  for (std::int64_t t = 0; t < T; ++t) {
    if (tokens[static_cast<std::size_t>(t)] < 0 || tokens[static_cast<std::size_t>(t)] >= c.vocab_size)
      throw std::runtime_error("prefill: token id out of range at " + std::to_string(t));
    std::copy_n(m.embedding(tokens[static_cast<std::size_t>(t)]), d, x.data() + t * d);
  }
  std::vector<float> cos_t(static_cast<std::size_t>(T * hd)), sin_t(cos_t.size());
  for (std::int64_t t = 0; t < T; ++t) rope_table(t, hd, c.rope_base, cos_t.data() + t * hd, sin_t.data() + t * hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  constexpr std::int64_t kBlock = 64;
  std::vector<float> s(static_cast<std::size_t>(std::min(kBlock, T) * T));  // one block's scores, rows of `cols` floats
  for (int l = 0; l < c.n_layers; ++l) {
    const Model::Layer& L = m.layer(l);
    auto& k = st.k.emplace_back(static_cast<std::size_t>(T * kvd));
    auto& v = st.v.emplace_back(static_cast<std::size_t>(T * kvd));
    if (opt.column_sums) st.column_sums.emplace_back(static_cast<std::size_t>(Hq * T), 0.0f);
    rms_norm(x.data(), L.attn_norm, T, d, c.norm_eps, xn.data());
    linear(xn.data(), L.wq, T, d, qd, q.data());
    linear(xn.data(), L.wk, T, d, kvd, k.data());
    linear(xn.data(), L.wv, T, d, kvd, v.data());
    for (std::int64_t t = 0; t < T; ++t) {
      apply_rope(q.data() + t * qd, Hq, hd, cos_t.data() + t * hd, sin_t.data() + t * hd);
      apply_rope(k.data() + t * kvd, Hkv, hd, cos_t.data() + t * hd, sin_t.data() + t * hd);
    }
    for (int h = 0; h < Hq; ++h) {
      const int g = h / G;
      // Head h's rows: Q (T, hd) with stride qd, K and V (T, hd) with stride kvd, O (T, hd) with stride qd.
      const float* Q = q.data() + h * hd;
      const float* K = k.data() + g * hd;
      const float* V = v.data() + g * hd;
      float* O = attn.data() + h * hd;
      for (std::int64_t r0 = 0; r0 < T; r0 += kBlock) {
        const std::int64_t nb = std::min(kBlock, T - r0), cols = r0 + nb;  // keys [0, cols) cover the block's causal range
        gemm_nt(Q + r0 * qd, qd, K, kvd, s.data(), cols, nb, cols, hd);    // S = Q_blk K^T
        softmax_causal(s.data(), cols, nb, cols, r0 + 1, scale);           // query r0+i sees keys [0, r0+i]
        gemm_nn(s.data(), cols, V, kvd, O + r0 * qd, qd, nb, hd, cols);    // O_blk = P V
        if (opt.column_sums) {  // the kernel's own probabilities, summed over the block's rows in order
          float* cs = st.column_sums.back().data() + h * T;
          for (std::int64_t i = 0; i < nb; ++i)
            for (std::int64_t j = 0; j <= r0 + i; ++j) cs[j] += s[static_cast<std::size_t>(i * cols + j)];
        }
      }
    }
    // Keep the last `window` queries per head for the eviction hooks: (Hq, W, hd).
    auto& qw = st.q_window.emplace_back(static_cast<std::size_t>(Hq * st.window * hd));
    for (int h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < st.window; ++i)
        std::copy_n(q.data() + (T - st.window + i) * qd + h * hd, hd, qw.data() + (h * st.window + i) * hd);
    linear_add(attn.data(), L.wo, T, qd, d, x.data());
    mlp_block(m, L, x.data(), T, mlp_scratch);
  }
  // Logits at the requested positions; the last prompt position always comes last (last_logits()).
  st.positions = opt.logit_positions;
  if (st.positions.empty() || st.positions.back() != T - 1) st.positions.push_back(T - 1);
  std::vector<float> rows;
  for (auto p : st.positions) {
    if (p < 0 || p >= T) throw std::runtime_error("prefill: logit position out of range");
    rows.insert(rows.end(), x.begin() + p * d, x.begin() + (p + 1) * d);
  }
  st.logits.resize(st.positions.size() * static_cast<std::size_t>(c.vocab_size));
  final_logits(m, rows.data(), static_cast<std::int64_t>(st.positions.size()), st.logits.data());
  return st;
}

template class Session<ContiguousKVCache<float>>;
template class Session<PagedKVCache<float>>;
template class Session<ContiguousKVCache<half>>;
template class Session<PagedKVCache<half>>;

}  // namespace kvp_engine
