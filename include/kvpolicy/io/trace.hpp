// SPDX-License-Identifier: Apache-2.0
// Attention traces: the post-RoPE queries, keys and values a model produced on
// one prompt (and optionally on a few decode steps), per layer, stored as a
// safetensors file. Policies are compared on identical tensors by replaying a
// trace (tools/compare); tools/trace/export_trace.py writes traces from any
// Hugging Face causal LM.
//
// Format (version 1). Tensors, all q/k/v/out of one dtype (F32, F16 or BF16):
//   layer.{i}.q          (num_q_heads,  num_tokens, head_dim)  post-RoPE prompt queries
//   layer.{i}.k          (num_kv_heads, num_tokens, head_dim)  post-RoPE prompt keys
//   layer.{i}.v          (num_kv_heads, num_tokens, head_dim)  prompt values
//   layer.{i}.q_decode   (num_q_heads,  num_decode, head_dim)  required when num_decode > 0
//   layer.{i}.k_decode   (num_kv_heads, num_decode, head_dim)  optional (with v_decode)
//   layer.{i}.v_decode   (num_kv_heads, num_decode, head_dim)  optional (with k_decode)
//   layer.{i}.out        (num_q_heads,  num_tokens, head_dim)  optional: the model's attention output (before o_proj)
//   layer.{i}.out_decode (num_q_heads,  num_decode, head_dim)  optional: the same for the decode steps
//   positions            (num_tokens,)  I64   optional (default 0 .. num_tokens-1): RoPE positions
//   positions_decode     (num_decode,)  I64   optional (default num_tokens ..)
//   rope.inv_freq        (head_dim / 2,) F32  optional: the model's rotary frequencies (scaling included)
//   needles              (n,)           I64   optional: prompt token ids a later query must retrieve
// for i in [0, num_layers). `__metadata__` (strings):
//   format = "kvpolicy-trace", version = "1",
//   num_layers, num_q_heads, num_kv_heads, head_dim, num_tokens   (decimal integers, required)
//   num_decode (default 0), rope_theta, rope_attention_scaling (default 1), attn_scale (default
//   1/sqrt(head_dim)), model, prompt, ... (free-form, kept in `metadata()`).
// Token t of the prompt is at index t of every tensor; decode step s attends to
// the whole prompt and to decode keys 0..s (when k_decode is present).
//
// Validation at open (each failure names the tensor / key and the constraint):
// everything `SafetensorsFile` checks (truncation, absurd header length, ...),
// the format/version tag, required integer keys (strict decimal, sane ranges),
// num_q_heads a multiple of num_kv_heads, every required layer tensor present
// with the expected shape, one dtype for all of them, no layer index outside
// [0, num_layers), k_decode and v_decode both or neither, and the optional
// tensors' shapes and dtypes.
//
// Needs nlohmann-json (through safetensors.hpp), like everything in kvpolicy/io/.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kvpolicy/core/checked.hpp"
#include "kvpolicy/io/safetensors.hpp"

KVP_NAMESPACE_BEGIN
namespace io {

inline constexpr const char* kTraceFormat = "kvpolicy-trace";
inline constexpr const char* kTraceVersion = "1";

/// Model and prompt description of a trace.
struct TraceInfo {
  std::int32_t num_layers = 0;
  std::int32_t num_q_heads = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int64_t num_tokens = 0;
  std::int64_t num_decode = 0;
  double rope_theta = 0.0;  ///< 0 when unknown
  double rope_attention_scaling = 1.0;
  double attn_scale = 0.0;  ///< logit scale; 1/sqrt(head_dim) unless the metadata says otherwise
  std::string model;        ///< free-form, may be empty
};

/// Typed views of one layer. Optional tensors are empty views when absent.
template <class T>
struct TraceLayerView {
  TensorView<const T, 3> q, k, v;                       // (Hq, T, d), (Hkv, T, d), (Hkv, T, d)
  TensorView<const T, 3> q_decode, k_decode, v_decode;  // (Hq, D, d), (Hkv, D, d), (Hkv, D, d)
  TensorView<const T, 3> out, out_decode;               // (Hq, T, d), (Hq, D, d)
};

/// A validated trace. Immutable after open; concurrent reads are safe.
class Trace {
 public:
  Trace() = default;

  static Status open(const std::string& path, Trace* out) noexcept {
    SafetensorsFile f;
    KVP_RETURN_IF_ERROR(SafetensorsFile::open(path, &f));
    Status s = from_file(std::move(f), out);
    if (!s) return Status::error(s.code(), "%s (file '%s')", s.message(), path.c_str());
    return s;
  }
  static Status from_bytes(std::vector<std::byte> bytes, Trace* out) noexcept {
    SafetensorsFile f;
    KVP_RETURN_IF_ERROR(SafetensorsFile::from_bytes(std::move(bytes), &f));
    return from_file(std::move(f), out);
  }
  /// Validate an opened safetensors file as a trace (takes it over).
  static Status from_file(SafetensorsFile file, Trace* out) noexcept {
    try {
      Trace t;
      t.file_ = std::move(file);
      KVP_RETURN_IF_ERROR(t.validate());
      *out = std::move(t);
      return Status::ok();
    } catch (const std::bad_alloc&) {
      return KVP_INVALID("trace: out of memory");
    }
  }

  const TraceInfo& info() const noexcept { return info_; }
  /// Element type of every q/k/v tensor.
  DType dtype() const noexcept { return dtype_; }
  bool has_decode_kv() const noexcept { return has_decode_kv_; }
  bool has_attention_output() const noexcept { return has_out_; }
  /// All `__metadata__` strings (the parsed ones included).
  const std::map<std::string, std::string>& metadata() const noexcept { return file_.metadata(); }
  const SafetensorsFile& file() const noexcept { return file_; }

  /// Typed views of layer `i`; fails when T is not the trace's dtype.
  template <class T>
  Status layer(std::int32_t i, TraceLayerView<T>* out) const noexcept {
    KVP_REQUIRE(i >= 0 && i < info_.num_layers, "trace: layer %d out of range [0, num_layers=%d)", i, info_.num_layers);
    if (dtype_v<T> != dtype_) return KVP_INVALID("trace: layer tensors are %s, requested %s", dtype_name(dtype_), dtype_name(dtype_v<T>));
    TraceLayerView<T> v;
    KVP_RETURN_IF_ERROR(file_.view(name(i, "q"), &v.q));
    KVP_RETURN_IF_ERROR(file_.view(name(i, "k"), &v.k));
    KVP_RETURN_IF_ERROR(file_.view(name(i, "v"), &v.v));
    if (info_.num_decode > 0) KVP_RETURN_IF_ERROR(file_.view(name(i, "q_decode"), &v.q_decode));
    if (has_decode_kv_) {
      KVP_RETURN_IF_ERROR(file_.view(name(i, "k_decode"), &v.k_decode));
      KVP_RETURN_IF_ERROR(file_.view(name(i, "v_decode"), &v.v_decode));
    }
    if (has_out_) {
      KVP_RETURN_IF_ERROR(file_.view(name(i, "out"), &v.out));
      if (info_.num_decode > 0) KVP_RETURN_IF_ERROR(file_.view(name(i, "out_decode"), &v.out_decode));
    }
    *out = v;
    return Status::ok();
  }

  /// RoPE positions of the prompt tokens and of the decode steps.
  const std::vector<std::int64_t>& positions() const noexcept { return positions_; }
  const std::vector<std::int64_t>& decode_positions() const noexcept { return decode_positions_; }
  /// The model's rotary frequencies (head_dim/2), empty when the trace lacks them.
  const std::vector<float>& inv_freq() const noexcept { return inv_freq_; }
  /// Prompt token ids of planted needles (empty when none).
  const std::vector<std::int64_t>& needles() const noexcept { return needles_; }

  static std::string name(std::int32_t layer, const char* what) { return "layer." + std::to_string(layer) + "." + what; }

 private:
  /// Strict decimal integer in [lo, hi] from metadata key `key`.
  Status meta_int(const char* key, bool required, std::int64_t lo, std::int64_t hi, std::int64_t dflt, std::int64_t* out) const {
    const auto& m = file_.metadata();
    auto it = m.find(key);
    if (it == m.end()) {
      KVP_REQUIRE(!required, "trace: metadata key '%s' is missing", key);
      *out = dflt;
      return Status::ok();
    }
    const std::string& s = it->second;
    std::int64_t v = 0;
    auto r = std::from_chars(s.data(), s.data() + s.size(), v);
    KVP_REQUIRE(r.ec == std::errc() && r.ptr == s.data() + s.size() && !s.empty(),
                "trace: metadata '%s' = '%.40s' is not a decimal integer", key, s.c_str());
    KVP_REQUIRE(v >= lo && v <= hi, "trace: metadata '%s' = %lld out of range [%lld, %lld]", key, static_cast<long long>(v),
                static_cast<long long>(lo), static_cast<long long>(hi));
    *out = v;
    return Status::ok();
  }
  Status meta_double(const char* key, double dflt, double* out) const {
    const auto& m = file_.metadata();
    auto it = m.find(key);
    if (it == m.end()) {
      *out = dflt;
      return Status::ok();
    }
    const std::string& s = it->second;
    double v = 0;
    auto r = std::from_chars(s.data(), s.data() + s.size(), v);
    KVP_REQUIRE(r.ec == std::errc() && r.ptr == s.data() + s.size() && !s.empty() && std::isfinite(v) && v >= 0,
                "trace: metadata '%s' = '%.40s' is not a finite non-negative number", key, s.c_str());
    *out = v;
    return Status::ok();
  }

  /// Tensor `nm` must exist with `shape` (and dtype `want`, or the trace dtype when `want_trace_dtype`).
  Status expect(const std::string& nm, std::initializer_list<std::int64_t> shape, const char* dims, bool trace_dtype, DType want) {
    const SafetensorsEntry* e = file_.find(nm);
    KVP_REQUIRE(e != nullptr, "trace: tensor '%s' is missing", nm.c_str());
    KVP_REQUIRE(e->supported, "trace: tensor '%s' has dtype %s", nm.c_str(), e->dtype_name.c_str());
    if (trace_dtype) {
      KVP_REQUIRE(e->dtype == DType::kF32 || e->dtype == DType::kF16 || e->dtype == DType::kBF16,
                  "trace: tensor '%s' has dtype %s, expected F32, F16 or BF16", nm.c_str(), e->dtype_name.c_str());
      if (!dtype_set_) dtype_ = e->dtype, dtype_set_ = true;
      KVP_REQUIRE(e->dtype == dtype_, "trace: tensor '%s' has dtype %s, other layer tensors are %s", nm.c_str(), e->dtype_name.c_str(),
                  safetensors_dtype_name(dtype_));
    } else {
      KVP_REQUIRE(e->dtype == want, "trace: tensor '%s' has dtype %s, expected %s", nm.c_str(), e->dtype_name.c_str(),
                  safetensors_dtype_name(want));
    }
    // The expected shape comes from metadata: its element count must fit before it is compared with anything.
    std::int64_t count = 0;
    KVP_REQUIRE(checked_extent_product(shape.begin(), static_cast<int>(shape.size()), &count),
                "trace: tensor '%s' expected shape %s overflows int64 (metadata dimensions too large)", nm.c_str(), dims);
    bool same = e->shape.size() == shape.size();
    for (std::size_t k = 0; same && k < shape.size(); ++k) same = e->shape[k] == shape.begin()[k];
    if (!same) {
      std::string got = "(";
      for (std::size_t k = 0; k < e->shape.size(); ++k) got += (k ? ", " : "") + std::to_string(e->shape[k]);
      got += ")";
      std::string exp = "(";
      std::size_t k = 0;
      for (auto x : shape) exp += (k++ ? ", " : "") + std::to_string(x);
      exp += ")";
      return KVP_INVALID("trace: tensor '%s' has shape %s, expected %s = %s", nm.c_str(), got.c_str(), dims, exp.c_str());
    }
    return Status::ok();
  }

  Status read_i64(const std::string& nm, std::int64_t n, std::vector<std::int64_t>* out) {
    TensorView<const std::int64_t, 1> v;
    KVP_RETURN_IF_ERROR(file_.view(nm, &v));
    KVP_REQUIRE(n < 0 || v.extent(0) == n, "trace: tensor '%s' has %lld entries, expected %lld", nm.c_str(),
                static_cast<long long>(v.extent(0)), static_cast<long long>(n));
    out->assign(v.data(), v.data() + v.extent(0));
    return Status::ok();
  }

  Status validate() {
    const auto& m = file_.metadata();
    auto fmt = m.find("format");
    KVP_REQUIRE(fmt != m.end() && fmt->second == kTraceFormat, "trace: metadata 'format' is %s, expected '%s' (not a kvpolicy trace)",
                fmt == m.end() ? "missing" : ("'" + fmt->second.substr(0, 40) + "'").c_str(), kTraceFormat);
    auto ver = m.find("version");
    KVP_REQUIRE(ver != m.end() && ver->second == kTraceVersion, "trace: metadata 'version' is %s, this reader supports '%s'",
                ver == m.end() ? "missing" : ("'" + ver->second.substr(0, 40) + "'").c_str(), kTraceVersion);
    std::int64_t L = 0, Hq = 0, Hkv = 0, d = 0, T = 0, D = 0;
    KVP_RETURN_IF_ERROR(meta_int("num_layers", true, 1, 4096, 0, &L));
    KVP_RETURN_IF_ERROR(meta_int("num_q_heads", true, 1, 4096, 0, &Hq));
    KVP_RETURN_IF_ERROR(meta_int("num_kv_heads", true, 1, 4096, 0, &Hkv));
    KVP_RETURN_IF_ERROR(meta_int("head_dim", true, 1, 4096, 0, &d));
    KVP_RETURN_IF_ERROR(meta_int("num_tokens", true, 1, INT32_MAX, 0, &T));
    KVP_RETURN_IF_ERROR(meta_int("num_decode", false, 0, INT32_MAX, 0, &D));
    KVP_REQUIRE(Hq % Hkv == 0, "trace: num_q_heads %lld is not a multiple of num_kv_heads %lld", static_cast<long long>(Hq),
                static_cast<long long>(Hkv));
    info_.num_layers = static_cast<std::int32_t>(L);
    info_.num_q_heads = static_cast<std::int32_t>(Hq);
    info_.num_kv_heads = static_cast<std::int32_t>(Hkv);
    info_.head_dim = static_cast<std::int32_t>(d);
    info_.num_tokens = T;
    info_.num_decode = D;
    KVP_RETURN_IF_ERROR(meta_double("rope_theta", 0.0, &info_.rope_theta));
    KVP_RETURN_IF_ERROR(meta_double("rope_attention_scaling", 1.0, &info_.rope_attention_scaling));
    KVP_RETURN_IF_ERROR(meta_double("attn_scale", 1.0 / std::sqrt(static_cast<double>(d)), &info_.attn_scale));
    KVP_REQUIRE(info_.attn_scale > 0, "trace: metadata 'attn_scale' must be > 0");
    if (auto it = m.find("model"); it != m.end()) info_.model = it->second;

    // Every tensor name is either known or a layer tensor of a valid layer.
    for (const auto& e : file_.tensors()) {
      const std::string& n = e.name;
      if (n.rfind("layer.", 0) != 0) continue;
      std::int64_t li = -1;
      const char* b = n.data() + 6;
      auto r = std::from_chars(b, n.data() + n.size(), li);
      KVP_REQUIRE(r.ec == std::errc() && r.ptr < n.data() + n.size() && *r.ptr == '.', "trace: tensor name '%s' is not layer.<i>.<what>",
                  n.c_str());
      KVP_REQUIRE(li >= 0 && li < L, "trace: tensor '%s' names layer %lld, outside [0, num_layers=%lld)", n.c_str(),
                  static_cast<long long>(li), static_cast<long long>(L));
    }
    has_decode_kv_ = file_.find(name(0, "k_decode")) != nullptr;
    has_out_ = file_.find(name(0, "out")) != nullptr;
    KVP_REQUIRE(!has_decode_kv_ || D > 0, "trace: layer.0.k_decode is present but num_decode is 0");
    for (std::int32_t i = 0; i < L; ++i) {
      KVP_RETURN_IF_ERROR(expect(name(i, "q"), {Hq, T, d}, "(num_q_heads, num_tokens, head_dim)", true, DType::kF32));
      KVP_RETURN_IF_ERROR(expect(name(i, "k"), {Hkv, T, d}, "(num_kv_heads, num_tokens, head_dim)", true, DType::kF32));
      KVP_RETURN_IF_ERROR(expect(name(i, "v"), {Hkv, T, d}, "(num_kv_heads, num_tokens, head_dim)", true, DType::kF32));
      if (D > 0) KVP_RETURN_IF_ERROR(expect(name(i, "q_decode"), {Hq, D, d}, "(num_q_heads, num_decode, head_dim)", true, DType::kF32));
      const bool kd = file_.find(name(i, "k_decode")) != nullptr, vd = file_.find(name(i, "v_decode")) != nullptr;
      KVP_REQUIRE(kd == vd, "trace: layer %d has %s without %s", i, kd ? "k_decode" : "v_decode", kd ? "v_decode" : "k_decode");
      KVP_REQUIRE(kd == has_decode_kv_, "trace: layer %d %s k_decode/v_decode but layer 0 %s", i, kd ? "has" : "lacks",
                  has_decode_kv_ ? "has" : "lacks");
      if (kd) {
        KVP_RETURN_IF_ERROR(expect(name(i, "k_decode"), {Hkv, D, d}, "(num_kv_heads, num_decode, head_dim)", true, DType::kF32));
        KVP_RETURN_IF_ERROR(expect(name(i, "v_decode"), {Hkv, D, d}, "(num_kv_heads, num_decode, head_dim)", true, DType::kF32));
      }
      const bool od = file_.find(name(i, "out")) != nullptr;
      KVP_REQUIRE(od == has_out_, "trace: layer %d %s 'out' but layer 0 %s", i, od ? "has" : "lacks", has_out_ ? "has" : "lacks");
      if (od) {
        KVP_RETURN_IF_ERROR(expect(name(i, "out"), {Hq, T, d}, "(num_q_heads, num_tokens, head_dim)", true, DType::kF32));
        if (D > 0) KVP_RETURN_IF_ERROR(expect(name(i, "out_decode"), {Hq, D, d}, "(num_q_heads, num_decode, head_dim)", true, DType::kF32));
      }
    }
    if (file_.find("positions")) {
      KVP_RETURN_IF_ERROR(expect("positions", {T}, "(num_tokens)", false, DType::kI64));
      KVP_RETURN_IF_ERROR(read_i64("positions", T, &positions_));
    } else {
      positions_.resize(static_cast<std::size_t>(T));
      for (std::int64_t t = 0; t < T; ++t) positions_[static_cast<std::size_t>(t)] = t;
    }
    if (file_.find("positions_decode")) {
      KVP_RETURN_IF_ERROR(expect("positions_decode", {D}, "(num_decode)", false, DType::kI64));
      KVP_RETURN_IF_ERROR(read_i64("positions_decode", D, &decode_positions_));
    } else {
      decode_positions_.resize(static_cast<std::size_t>(D));
      for (std::int64_t s = 0; s < D; ++s) decode_positions_[static_cast<std::size_t>(s)] = T + s;
    }
    if (file_.find("rope.inv_freq")) {
      KVP_RETURN_IF_ERROR(expect("rope.inv_freq", {d / 2}, "(head_dim / 2)", false, DType::kF32));
      TensorView<const float, 1> f;
      KVP_RETURN_IF_ERROR(file_.view("rope.inv_freq", &f));
      inv_freq_.assign(f.data(), f.data() + f.extent(0));
    }
    if (const SafetensorsEntry* e = file_.find("needles")) {
      KVP_REQUIRE(e->shape.size() == 1 && e->supported && e->dtype == DType::kI64, "trace: tensor 'needles' must be a 1-d I64 tensor");
      KVP_RETURN_IF_ERROR(read_i64("needles", -1, &needles_));
      for (auto p : needles_)
        KVP_REQUIRE(p >= 0 && p < T, "trace: needle token %lld outside the prompt [0, %lld)", static_cast<long long>(p),
                    static_cast<long long>(T));
    }
    return Status::ok();
  }

  SafetensorsFile file_;
  TraceInfo info_;
  DType dtype_ = DType::kF32;
  bool dtype_set_ = false;
  bool has_decode_kv_ = false;
  bool has_out_ = false;
  std::vector<std::int64_t> positions_, decode_positions_, needles_;
  std::vector<float> inv_freq_;
};

}  // namespace io
KVP_NAMESPACE_END
