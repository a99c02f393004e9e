// SPDX-License-Identifier: Apache-2.0
// A trace file (include/kvpolicy/io/trace.hpp) as LayerCases, one per layer.
//
// Evaluation queries: the trace's decode steps (q_decode, with k_decode /
// v_decode as always-readable decode keys when present); a trace without
// decode steps holds out its last min(16, T/4) prompt tokens instead (their
// queries become the evaluation queries, their keys/values the decode keys),
// so that the policies never see what they are judged by.
// Pre-RoPE queries (Expected Attention) are recovered by rotating the post-RoPE
// ones back with the trace's frequencies (rope.inv_freq, or 1/theta^(2i/d)
// from rope_theta as Hugging Face computes them) at the recorded positions:
// HF's y = (x cos + rotate_half(x) sin) * s inverts to
// x1 = (y1 cos + y2 sin) / s, x2 = (y2 cos - y1 sin) / s. A trace with neither
// frequencies nor rope_theta gets no pre-RoPE queries (Expected Attention is
// then skipped for it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvpolicy/io/trace.hpp"
#include "layer_case.hpp"

namespace kvp_compare {

namespace detail {

template <class T>
void to_float(const kvpolicy::TensorView<const T, 3>& v, std::int64_t t0, std::int64_t len, std::vector<float>* out) {
  out->resize(static_cast<std::size_t>(v.extent(0) * len * v.extent(2)));
  std::size_t i = 0;
  for (std::int64_t h = 0; h < v.extent(0); ++h)
    for (std::int64_t t = t0; t < t0 + len; ++t)
      for (std::int64_t c = 0; c < v.extent(2); ++c) (*out)[i++] = kvpolicy::to_float(v(h, t, c));
}

template <class E>
kvpolicy::Status layer_cases(const kvpolicy::io::Trace& tr, const std::string& workload, std::vector<LayerCase>* out) {
  using namespace kvpolicy;
  const auto& info = tr.info();
  const std::int64_t T0 = info.num_tokens, D = info.num_decode;
  const std::int64_t hold = D > 0 ? 0 : std::min<std::int64_t>(16, T0 / 4);
  const std::int64_t T = T0 - hold;
  KVP_REQUIRE(T >= 8, "compare: trace '%s' has %lld prompt tokens; at least 8 are needed", workload.c_str(), static_cast<long long>(T));
  KVP_REQUIRE(D > 0 || hold > 0, "compare: trace '%s' has no decode steps and too few tokens to hold out", workload.c_str());
  std::vector<float> inv = tr.inv_freq();
  const std::int32_t d = info.head_dim;
  if (inv.empty() && info.rope_theta > 0) {
    inv.resize(static_cast<std::size_t>(d / 2));
    for (std::int32_t i = 0; i < d / 2; ++i)
      inv[static_cast<std::size_t>(i)] = static_cast<float>(1.0 / std::pow(info.rope_theta, static_cast<double>(2 * i) / d));
  }
  // A trace of some of a model's layers (the engine's exporter) names them: trace layer i is model layer
  // source_layers[i] of source_num_layers (rows report the model's layer; PyramidKV's schedule uses both).
  std::vector<std::int32_t> source_layers;
  std::int32_t source_num_layers = 0;
  if (auto it = tr.metadata().find("source_layers"); it != tr.metadata().end()) {
    std::int32_t v = 0, top = -1;
    bool in_number = false;
    for (char ch : it->second + ",") {
      if (ch >= '0' && ch <= '9') {
        KVP_REQUIRE(v < (1 << 20), "compare: trace '%s' metadata source_layers '%.60s' names a layer beyond 2^20", workload.c_str(),
                    it->second.c_str());
        v = v * 10 + (ch - '0');
        in_number = true;
      } else {
        KVP_REQUIRE(ch == ',' && in_number && v < (1 << 20), "compare: trace '%s' metadata source_layers '%.60s' is not a list of layers",
                    workload.c_str(), it->second.c_str());
        source_layers.push_back(v);
        top = std::max(top, v);
        v = 0;
        in_number = false;
      }
    }
    KVP_REQUIRE(static_cast<std::int32_t>(source_layers.size()) == info.num_layers,
                "compare: trace '%s' lists %zu source_layers for %d layers", workload.c_str(), source_layers.size(), info.num_layers);
    source_num_layers = top + 1;
    if (auto n = tr.metadata().find("source_num_layers"); n != tr.metadata().end()) {
      const long long x = std::atoll(n->second.c_str());
      KVP_REQUIRE(x > top && x < (1 << 20), "compare: trace '%s' source_num_layers '%.20s' must exceed every source layer",
                  workload.c_str(), n->second.c_str());
      source_num_layers = static_cast<std::int32_t>(x);
    }
  }
  for (std::int32_t li = 0; li < info.num_layers; ++li) {
    io::TraceLayerView<E> lv;
    KVP_RETURN_IF_ERROR(tr.layer(li, &lv));
    LayerCase c;
    c.workload = workload;
    c.model = info.model;
    c.layer = li < static_cast<std::int32_t>(source_layers.size()) ? source_layers[static_cast<std::size_t>(li)] : li;
    c.num_layers = source_num_layers > 0 ? source_num_layers : info.num_layers;
    c.num_q_heads = info.num_q_heads;
    c.num_kv_heads = info.num_kv_heads;
    c.head_dim = d;
    c.kv_len = T;
    c.window = static_cast<std::int32_t>(std::min<std::int64_t>(32, T / 4));
    c.sinks = 4;
    c.scale = static_cast<float>(info.attn_scale);
    c.storage = tr.dtype();
    to_float(lv.q, 0, T, &c.q);
    to_float(lv.k, 0, T, &c.k);
    to_float(lv.v, 0, T, &c.v);
    if (D > 0) {
      c.num_eval = D;
      to_float(lv.q_decode, 0, D, &c.eq);
      if (tr.has_decode_kv()) {
        to_float(lv.k_decode, 0, D, &c.ek);
        to_float(lv.v_decode, 0, D, &c.ev);
      }
    } else {
      c.num_eval = hold;
      to_float(lv.q, T, hold, &c.eq);
      to_float(lv.k, T, hold, &c.ek);
      to_float(lv.v, T, hold, &c.ev);
    }
    for (auto p : tr.needles())
      if (p < T) c.needles.push_back(static_cast<std::int32_t>(p));
    if (!inv.empty()) {
      c.inv_freq = inv;
      c.rope_scaling = static_cast<float>(info.rope_attention_scaling);
      c.q_pre.resize(c.q.size());
      const std::int32_t half = d / 2;
      const double s = info.rope_attention_scaling;
      for (std::int32_t h = 0; h < c.num_q_heads; ++h)
        for (std::int64_t t = 0; t < T; ++t) {
          const float pos = static_cast<float>(tr.positions()[static_cast<std::size_t>(t)]);
          const float* y = &c.q[(static_cast<std::size_t>(h) * T + t) * d];
          float* x = &c.q_pre[(static_cast<std::size_t>(h) * T + t) * d];
          for (std::int32_t i = 0; i < half; ++i) {
            const float ang = inv[static_cast<std::size_t>(i)] * pos;  // fp32, as HF
            const double cs = std::cos(ang), sn = std::sin(ang);
            x[i] = static_cast<float>((y[i] * cs + y[i + half] * sn) / s);
            x[i + half] = static_cast<float>((y[i + half] * cs - y[i] * sn) / s);
          }
        }
    }
    out->push_back(std::move(c));
  }
  return Status::ok();
}

}  // namespace detail

/// One LayerCase per layer of the trace at `path`; the workload is "trace:<stem>".
inline kvpolicy::Status load_trace_cases(const std::string& path, std::vector<LayerCase>* out) {
  using namespace kvpolicy;
  io::Trace tr;
  KVP_RETURN_IF_ERROR(io::Trace::open(path, &tr));
  std::string stem = path.substr(path.find_last_of('/') + 1);
  if (auto dot = stem.find(".safetensors"); dot != std::string::npos) stem.resize(dot);
  const std::string wl = "trace:" + stem;
  switch (tr.dtype()) {
    case DType::kF32: return detail::layer_cases<float>(tr, wl, out);
    case DType::kF16: return detail::layer_cases<half>(tr, wl, out);
    case DType::kBF16: return detail::layer_cases<bfloat16>(tr, wl, out);
    default: return KVP_INVALID("compare: trace '%s' has dtype %s", path.c_str(), dtype_name(tr.dtype()));
  }
}

}  // namespace kvp_compare
