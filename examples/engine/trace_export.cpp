// SPDX-License-Identifier: Apache-2.0
// trace_export.hpp, compiled once into kvp_engine_lib.
#include "trace_export.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <stdexcept>
#include <string>

#include "engine.hpp"
#include "kvpolicy/io/safetensors.hpp"
#include "kvpolicy/io/trace.hpp"

namespace kvp_engine {

std::vector<std::int64_t> find_occurrences(std::span<const std::int32_t> prompt, std::span<const std::int32_t> needle) {
  std::vector<std::int64_t> out;
  if (needle.empty() || needle.size() > prompt.size()) return out;
  for (std::size_t i = 0; i + needle.size() <= prompt.size(); ++i)
    if (std::equal(needle.begin(), needle.end(), prompt.begin() + static_cast<std::ptrdiff_t>(i)))
      for (std::size_t j = 0; j < needle.size(); ++j) out.push_back(static_cast<std::int64_t>(i + j));
  return out;
}

namespace {

using Cache = ContiguousKVCache<float>;

/// One recorded layer's tensors, fp32, in the trace's (heads, tokens, head_dim) order.
struct LayerRecord {
  std::vector<float> q, k, v, qd, kd, vd;
};

std::string join(const std::vector<int>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s.push_back(',');
    s.append(std::to_string(v[i]));
  }
  return s;
}

}  // namespace

TraceExportResult export_trace(const Model& m, std::span<const std::int32_t> prompt, const TraceExportOptions& opt,
                               const std::string& path) {
  const ModelConfig& c = m.config();
  const std::int64_t T = static_cast<std::int64_t>(prompt.size());
  const int D = opt.decode_steps, Hq = c.n_heads, Hkv = c.n_kv_heads, hd = c.head_dim;
  if (T == 0) throw std::runtime_error("export_trace: empty prompt");
  if (D < 0) throw std::runtime_error("export_trace: decode_steps must be >= 0");
  if (T + D > c.max_seq_len)
    throw std::runtime_error("export_trace: the prompt (" + std::to_string(T) + " tokens) and " + std::to_string(D) +
                             " decode steps exceed the model's context of " + std::to_string(c.max_seq_len));
  std::vector<int> layers = opt.layers;
  if (layers.empty())
    for (int l = 0; l < c.n_layers; ++l) layers.push_back(l);
  std::vector<int> where(static_cast<std::size_t>(c.n_layers), -1);  // model layer -> trace layer
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const int l = layers[i];
    if (l < 0 || l >= c.n_layers)
      throw std::runtime_error("export_trace: layer " + std::to_string(l) + " is outside [0, " + std::to_string(c.n_layers) + ")");
    if (where[static_cast<std::size_t>(l)] >= 0) throw std::runtime_error("export_trace: layer " + std::to_string(l) + " is listed twice");
    where[static_cast<std::size_t>(l)] = static_cast<int>(i);
  }
  if (path.empty()) throw std::runtime_error("export_trace: empty output path");

  // The prompt: every query is kept (query_window = T gives (Hq, T, hd) per layer, the trace's layout).
  PrefillOptions po;
  po.query_window = T;
  const PrefillState pre = prefill(m, prompt, po);
  std::vector<LayerRecord> rec(layers.size());
  const std::int64_t kvd = static_cast<std::int64_t>(Hkv) * hd;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const auto l = static_cast<std::size_t>(layers[i]);
    LayerRecord& r = rec[i];
    r.q = pre.q_window[l];
    r.k.resize(static_cast<std::size_t>(kvd * T));
    r.v.resize(r.k.size());
    for (int h = 0; h < Hkv; ++h)  // (T, Hkv, hd) -> (Hkv, T, hd)
      for (std::int64_t t = 0; t < T; ++t)
        for (int e = 0; e < hd; ++e) {
          const std::size_t src = static_cast<std::size_t>(t * kvd + h * hd + e), dst = static_cast<std::size_t>((h * T + t) * hd + e);
          r.k[dst] = pre.k[l][src];
          r.v[dst] = pre.v[l][src];
        }
  }

  // The decode steps on the full cache: the query as attention sees it, and the token's key / value rows.
  TraceExportResult res;
  res.prompt_tokens = T;
  if (D > 0) {
    bool decoding = false;
    kvpolicy::Hooks<Cache> hooks;
    hooks.before_attention = [&](Cache&, int l, TensorView<const float, 3> q, SelectionBuffer&) {
      const int i = where[static_cast<std::size_t>(l)];
      if (i >= 0)
        for (int h = 0; h < Hq; ++h)
          for (int e = 0; e < hd; ++e) rec[static_cast<std::size_t>(i)].qd.push_back(q(0, h, e));
      return kvpolicy::Status::ok();
    };
    hooks.on_append = [&](Cache& cache, int l, std::int64_t n) {
      const int i = where[static_cast<std::size_t>(l)];
      if (!decoding || i < 0 || n != 1) return kvpolicy::Status::ok();
      const std::int64_t slot = cache.uniform_length(l) - 1;
      auto K = cache.keys(l);
      auto V = cache.values(l);
      for (int h = 0; h < Hkv; ++h)
        for (int e = 0; e < hd; ++e) {
          rec[static_cast<std::size_t>(i)].kd.push_back(K(h, slot, e));
          rec[static_cast<std::size_t>(i)].vd.push_back(V(h, slot, e));
        }
      return kvpolicy::Status::ok();
    };
    const CacheShape shape{c.n_layers, Hq, Hkv, hd, T + D + 1};
    Session<Cache> s(m, Cache(shape), std::move(hooks));
    s.load(pre);
    decoding = true;
    std::span<const float> logits = s.logits();
    for (int step = 0; step < D; ++step) {
      const std::int32_t tok = argmax(logits);
      res.decoded.push_back(tok);
      logits = s.decode(tok);
    }
    // Recorded step-major (D, H, hd); the trace wants (H, D, hd).
    for (auto& r : rec) {
      auto head_major = [&](std::vector<float>& x, int heads) {
        std::vector<float> y(x.size());
        for (int st = 0; st < D; ++st)
          for (int h = 0; h < heads; ++h)
            std::copy_n(x.data() + (static_cast<std::size_t>(st) * heads + h) * hd, hd,
                        y.data() + (static_cast<std::size_t>(h) * D + st) * hd);
        x.swap(y);
      };
      head_major(r.qd, Hq);
      head_major(r.kd, Hkv);
      head_major(r.vd, Hkv);
    }
  }
  res.needles = find_occurrences(prompt, opt.answer);

  // The file.
  kvpolicy::io::SafetensorsWriter w;
  auto put = [&](const std::string& name, const std::vector<float>& x, std::int64_t heads, std::int64_t len) {
    kvpolicy::Status st;
    if (opt.fp16) {
      std::vector<kvpolicy::half> h(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) h[i] = kvpolicy::to_half(x[i]);
      st = w.add(name, {heads, len, hd}, h.data());
    } else {
      st = w.add(name, {heads, len, hd}, x.data());
    }
    kvpolicy::throw_if_error(st);
  };
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::string p = "layer." + std::to_string(i) + ".";
    put(p + "q", rec[i].q, Hq, T);
    put(p + "k", rec[i].k, Hkv, T);
    put(p + "v", rec[i].v, Hkv, T);
    if (D > 0) {
      put(p + "q_decode", rec[i].qd, Hq, D);
      put(p + "k_decode", rec[i].kd, Hkv, D);
      put(p + "v_decode", rec[i].vd, Hkv, D);
    }
  }
  std::vector<std::int64_t> pos(static_cast<std::size_t>(T)), pos_d(static_cast<std::size_t>(D)), toks(prompt.begin(), prompt.end());
  for (std::int64_t t = 0; t < T; ++t) pos[static_cast<std::size_t>(t)] = t;
  for (int st = 0; st < D; ++st) pos_d[static_cast<std::size_t>(st)] = T + st;
  std::vector<float> inv(static_cast<std::size_t>(hd / 2));
  for (int i = 0; i < hd / 2; ++i)  // as rope_table: base^(-2i/d) in double, rounded once
    inv[static_cast<std::size_t>(i)] = static_cast<float>(1.0 / std::pow(c.rope_base, static_cast<double>(2 * i) / hd));
  kvpolicy::throw_if_error(w.add("positions", {T}, pos.data()));
  if (D > 0) kvpolicy::throw_if_error(w.add("positions_decode", {static_cast<std::int64_t>(D)}, pos_d.data()));
  kvpolicy::throw_if_error(w.add("tokens", {T}, toks.data()));
  kvpolicy::throw_if_error(w.add("rope.inv_freq", {static_cast<std::int64_t>(hd / 2)}, inv.data()));
  if (!res.needles.empty()) kvpolicy::throw_if_error(w.add("needles", {static_cast<std::int64_t>(res.needles.size())}, res.needles.data()));
  w.set_metadata("format", kvpolicy::io::kTraceFormat);
  w.set_metadata("version", kvpolicy::io::kTraceVersion);
  w.set_metadata("num_layers", std::to_string(layers.size()));
  w.set_metadata("num_q_heads", std::to_string(Hq));
  w.set_metadata("num_kv_heads", std::to_string(Hkv));
  w.set_metadata("head_dim", std::to_string(hd));
  w.set_metadata("num_tokens", std::to_string(T));
  w.set_metadata("num_decode", std::to_string(D));
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", c.rope_base);
  w.set_metadata("rope_theta", buf);
  std::snprintf(buf, sizeof buf, "%.17g", 1.0 / std::sqrt(static_cast<double>(hd)));
  w.set_metadata("attn_scale", buf);
  w.set_metadata("dtype", opt.fp16 ? "float16" : "float32");
  w.set_metadata("model", opt.model_name.empty() ? m.name() : opt.model_name);
  w.set_metadata("exporter", "kvp_engine (examples/engine/trace_export.cpp)");
  w.set_metadata("source_layers", join(layers));
  w.set_metadata("source_num_layers", std::to_string(c.n_layers));
  for (const auto& [k, v] : opt.metadata) w.set_metadata(k, v);
  // Written to a temporary name first, so a failed write leaves no half file under `path`.
  const std::string tmp = path + ".partial";
  const kvpolicy::Status st = w.write(tmp);
  if (!st) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    kvpolicy::throw_if_error(st);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw std::runtime_error("export_trace: cannot move the trace to '" + path + "'");
  }
  return res;
}

}  // namespace kvp_engine
