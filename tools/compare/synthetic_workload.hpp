// SPDX-License-Identifier: Apache-2.0
// A built-in synthetic attention workload with the structure real prompts
// show, so that eviction policies can be told apart:
//  * attention sinks: the first tokens carry a key aligned with the mean query;
//  * a local band: a shared positional feature makes nearby tokens similar;
//  * heavy hitters: ~2% of tokens get a large component along the mean query;
//  * needles: a few tokens per kv head carry a unique direction; the
//    observation window (the "question") mentions them weakly, and the future
//    decode queries look for them strongly;
//  * prompt-body queries (every position before the window): noise, the sink
//    direction and the positional features, so policies that read the whole
//    prompt's attention (H2O, observed attention, Expected Attention) see a
//    causal prompt with a local band and sinks, and no hint of the needles.
// Keys are rounded to fp16 (the engine's storage type); queries are fp32.
// There is no rotary embedding: positions enter additively, so the
// "pre-RoPE" queries are the queries themselves (identity rotation).
// The body queries come from their own random stream, so every other tensor
// is independent of whether they are generated.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/core/dtype.hpp"
#include "layer_case.hpp"

namespace kvp_compare {

struct WorkloadShape {
  int num_q_heads = 32, num_kv_heads = 8, head_dim = 128;
  int kv_len = 2560;    ///< prompt tokens in the cache (not a power of two: ratio budgets fall between the token budgets)
  int window = 32;      ///< observation window (last prompt queries)
  int num_future = 16;  ///< decode queries used to evaluate a decision
  int needles = 8;      ///< planted per kv head
  int sinks = 4;
};

struct Workload {
  WorkloadShape s;
  std::vector<float> window_q;                 // (Hq, window, d)
  std::vector<float> prompt_q;                 // (Hq, T, d): body queries, then the window queries
  std::vector<kvpolicy::half> keys;            // (Hkv, T, d)
  std::vector<float> keys_f, values;           // (Hkv, T, d) fp32 copies (values only exist in fp32 here)
  std::vector<float> future_q;                 // (Hq, num_future, d)
  std::vector<std::int32_t> needle_pos;        // (Hkv, needles)
  std::vector<std::int32_t> needle_of_future;  // (Hq, num_future): needle index looked for, or -1
  std::vector<float> mean_q;                   // (Hkv, d): each kv head's mean query (sink) direction
};

inline Workload make_workload(const WorkloadShape& s, unsigned seed) {
  Workload w;
  w.s = s;
  const int Hq = s.num_q_heads, Hkv = s.num_kv_heads, d = s.head_dim, T = s.kv_len, G = Hq / Hkv;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  auto unit = [&](std::vector<float>& v) {
    v.resize(d);
    double n = 0;
    for (auto& x : v) x = nd(rng), n += double(x) * x;
    for (auto& x : v) x = static_cast<float>(x / std::sqrt(n));
  };
  // Component strengths are set in logit units: a shared unit direction with
  // weight a on the query and b on the key adds a*b/sqrt(d) to the logit.
  const float sd = std::sqrt(static_cast<float>(d));
  auto amp = [&](float logit) { return std::sqrt(logit * sd); };
  const float a_sink = amp(7.0f), a_hh = 3.5f * sd / a_sink, a_pos = amp(4.0f), a_needle = amp(8.0f), a_hint = 5.5f * sd / a_needle;
  // Positional features: random Fourier features of a Gaussian kernel over position.
  const int F = 16;
  std::vector<float> freq(F), phase(F);
  for (int f = 0; f < F; ++f) freq[f] = nd(rng) / 24.0f, phase[f] = std::uniform_real_distribution<float>(0, 6.2831853f)(rng);
  std::vector<std::vector<float>> pos_dir(2 * F);
  for (auto& u : pos_dir) unit(u);
  auto add_pos = [&](float* x, int t, float a) {
    for (int f = 0; f < 2 * F; ++f) {
      const float phi = std::cos(freq[f / 2] * t + phase[f / 2] + (f % 2) * 1.5707963f) / std::sqrt(float(F));
      for (int c = 0; c < d; ++c) x[c] += a * phi * pos_dir[f][c];
    }
  };

  w.keys_f.assign(static_cast<std::size_t>(Hkv) * T * d, 0.0f);
  w.values.assign(w.keys_f.size(), 0.0f);
  w.window_q.assign(static_cast<std::size_t>(Hq) * s.window * d, 0.0f);
  w.future_q.assign(static_cast<std::size_t>(Hq) * s.num_future * d, 0.0f);
  w.needle_pos.assign(static_cast<std::size_t>(Hkv) * s.needles, 0);
  w.needle_of_future.assign(static_cast<std::size_t>(Hq) * s.num_future, -1);

  std::vector<int> heavy;
  for (int t = s.sinks; t < T - s.window; ++t)
    if (std::uniform_real_distribution<float>(0, 1)(rng) < 0.02f) heavy.push_back(t);
  std::vector<int> needle_tokens;
  for (int n = 0; n < s.needles; ++n) needle_tokens.push_back(std::uniform_int_distribution<int>(T / 16, T - 2 * s.window)(rng));

  for (int h = 0; h < Hkv; ++h) {
    std::vector<float> mean_q, bias;
    unit(mean_q);
    unit(bias);
    w.mean_q.insert(w.mean_q.end(), mean_q.begin(), mean_q.end());
    std::vector<std::vector<float>> needle_dir(s.needles);
    for (auto& u : needle_dir) unit(u);
    for (int t = 0; t < T; ++t) {
      float* k = &w.keys_f[(static_cast<std::size_t>(h) * T + t) * d];
      float* v = &w.values[(static_cast<std::size_t>(h) * T + t) * d];
      for (int c = 0; c < d; ++c) {
        k[c] = nd(rng) + 2.0f * bias[c];
        v[c] = nd(rng);
      }
      add_pos(k, t, a_pos);
      if (t < s.sinks)
        for (int c = 0; c < d; ++c) k[c] += a_sink * mean_q[c];
    }
    for (int t : heavy) {
      float* k = &w.keys_f[(static_cast<std::size_t>(h) * T + t) * d];
      const float strength = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
      for (int c = 0; c < d; ++c) k[c] += strength * a_hh * mean_q[c];
    }
    for (int n = 0; n < s.needles; ++n) {
      const int t = needle_tokens[n];
      w.needle_pos[static_cast<std::size_t>(h) * s.needles + n] = t;
      float* k = &w.keys_f[(static_cast<std::size_t>(h) * T + t) * d];
      for (int c = 0; c < d; ++c) k[c] += a_needle * needle_dir[n][c];
    }
    for (int g = 0; g < G; ++g) {
      const int qh = h * G + g;
      for (int i = 0; i < s.window; ++i) {
        const int pos = T - s.window + i;
        float* q = &w.window_q[(static_cast<std::size_t>(qh) * s.window + i) * d];
        const int n = (i + g) % s.needles;
        for (int c = 0; c < d; ++c) q[c] = nd(rng) + a_sink * mean_q[c] + a_hint * needle_dir[n][c];
        add_pos(q, pos, a_pos);
      }
      for (int i = 0; i < s.num_future; ++i) {
        const int pos = T + i;
        float* q = &w.future_q[(static_cast<std::size_t>(qh) * s.num_future + i) * d];
        const int n = (3 * i + g) % s.needles;
        w.needle_of_future[static_cast<std::size_t>(qh) * s.num_future + i] = n;
        for (int c = 0; c < d; ++c) q[c] = nd(rng) + a_sink * mean_q[c] + a_needle * needle_dir[n][c];
        add_pos(q, pos, a_pos);
      }
    }
  }
  // Body queries (positions 0 .. T-window-1) from a separate stream; the
  // window rows of prompt_q are the window queries.
  std::mt19937 body_rng(seed ^ 0x9e3779b9u);
  std::normal_distribution<float> bnd;
  w.prompt_q.assign(static_cast<std::size_t>(Hq) * T * d, 0.0f);
  for (int qh = 0; qh < Hq; ++qh) {
    const int h = qh / G;
    for (int t = 0; t < T; ++t) {
      float* q = &w.prompt_q[(static_cast<std::size_t>(qh) * T + t) * d];
      if (t >= T - s.window) {
        const float* src = &w.window_q[(static_cast<std::size_t>(qh) * s.window + (t - (T - s.window))) * d];
        for (int c = 0; c < d; ++c) q[c] = src[c];
        continue;
      }
      const float* mq = &w.mean_q[static_cast<std::size_t>(h) * d];
      for (int c = 0; c < d; ++c) q[c] = bnd(body_rng) + a_sink * mq[c];
      add_pos(q, t, a_pos);
    }
  }
  w.keys.resize(w.keys_f.size());
  for (std::size_t i = 0; i < w.keys_f.size(); ++i) {
    w.keys[i] = kvpolicy::to_half(w.keys_f[i]);
    w.keys_f[i] = kvpolicy::to_float(w.keys[i]);  // evaluate on exactly what the cache stores
  }
  return w;
}

/// The workload as a comparison case (one layer, fp32 copies of fp16 keys).
inline LayerCase to_layer_case(Workload&& w, int instance) {
  const auto& s = w.s;
  LayerCase c;
  c.workload = "synthetic";
  c.layer = 0;
  c.num_layers = 1;
  c.instance = instance;
  c.num_q_heads = s.num_q_heads;
  c.num_kv_heads = s.num_kv_heads;
  c.head_dim = s.head_dim;
  c.kv_len = s.kv_len;
  c.num_eval = s.num_future;
  c.window = s.window;
  c.sinks = s.sinks;
  c.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  c.storage = kvpolicy::DType::kF16;
  c.q = std::move(w.prompt_q);
  c.inv_freq.assign(static_cast<std::size_t>(s.head_dim / 2), 0.0f);  // no RoPE: identity rotation
  c.k = std::move(w.keys_f);
  c.v = std::move(w.values);
  c.eq = std::move(w.future_q);
  // Needles sit at the same tokens in every kv head.
  for (int n = 0; n < s.needles; ++n) c.needles.push_back(w.needle_pos[static_cast<std::size_t>(n)]);
  c.needle_of_query = std::move(w.needle_of_future);
  return c;
}

}  // namespace kvp_compare
