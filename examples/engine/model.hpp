// SPDX-License-Identifier: Apache-2.0
// kvp-tiny in C++: the model weights and the fp32 math of one forward pass.
//
// Mirrors tools/model/model.py exactly (Llama-style: RMSNorm, RoPE half-split
// with base 10000, grouped-query attention, SwiGLU MLP, tied embeddings; byte
// tokenizer 0..255 + BOS 256, EOS 257, PAD 258). Matrices are torch Linear
// weights, row-major (out_features, in_features), multiplied by the engine's
// own kernels (gemm.hpp); everything is fp32. The KV cache and the policies
// live in engine.hpp.
//
// Compiled once: the matrix products, the config parser and the loader are
// defined in model.cpp (kvp_engine_lib); this header includes no nlohmann-json.
// The element-wise helpers (rms_norm, RoPE) stay inline.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvpolicy/core/version.hpp"
#include "weights.hpp"

KVP_NAMESPACE_BEGIN
namespace io {
class GgufFile;
}
KVP_NAMESPACE_END

namespace kvp_engine {

struct ModelConfig {
  int vocab_size = 259, d_model = 128, n_layers = 3, n_heads = 4, n_kv_heads = 2, head_dim = 32, ffn_hidden = 384;
  double rope_base = 10000.0;
  float norm_eps = 1e-5f;
  int max_seq_len = 1024;
  bool tie_embeddings = true;
  int bos_id = 256, eos_id = 257, pad_id = 258;
  bool add_bos = true;  ///< prompts start with BOS (kvp-tiny; a GGUF's tokenizer.ggml.add_bos_token, SmolLM2: false)

  int group_size() const noexcept { return n_heads / n_kv_heads; }

  /// Parses config.json; throws std::runtime_error on a missing key or an unsupported model.
  static ModelConfig from_json(const std::string& text);
  /// From a GGUF's `llama.*` and `tokenizer.ggml.*` metadata (llama architecture only; `path` names the file
  /// in messages); throws std::runtime_error naming the key or the unsupported feature.
  static ModelConfig from_gguf(const kvpolicy::io::GgufFile& f, const std::string& path);
};

/// Byte tokenizer: BOS, then the UTF-8 bytes of the text.
inline std::vector<std::int32_t> tokenize(const std::string& text, int bos_id = 256) {
  std::vector<std::int32_t> ids{bos_id};
  for (unsigned char ch : text) ids.push_back(ch);
  return ids;
}
inline std::string detokenize(std::span<const std::int32_t> ids) {
  std::string s;
  for (auto t : ids)
    if (t >= 0 && t < 256) s.push_back(static_cast<char>(t));
  return s;
}

class BpeTokenizer;

class Model {
 public:
  struct Layer {
    const float *attn_norm, *mlp_norm;
    const float *wq, *wk, *wv, *wo;  // (Hq*hd, d), (Hkv*hd, d), (Hkv*hd, d), (d, Hq*hd)
    const float *wg, *wu, *wd;       // (ffn, d), (ffn, d), (d, ffn)
  };

  /// Loads `<dir>/config.json` and `<dir>/model.safetensors` (kvp-tiny), or a llama-architecture `.gguf`
  /// file (SmolLM2: every tensor dequantized to fp32 at load, W_q/W_k rows un-permuted to the half-split RoPE
  /// layout); throws on a missing tensor, a shape that disagrees with the config or an unsupported model,
  /// and nothing is half-loaded.
  static Model load(const std::string& dir);

  const ModelConfig& config() const noexcept { return config_; }
  const Layer& layer(int i) const noexcept { return layers_[static_cast<std::size_t>(i)]; }
  const float* embedding(std::int32_t token) const noexcept { return embed_ + static_cast<std::int64_t>(token) * config_.d_model; }
  const float* final_norm() const noexcept { return norm_; }
  const float* lm_head() const noexcept { return lm_head_; }
  /// Text to token ids, no BOS added: the GGUF's byte-level BPE tokenizer (special tokens such as
  /// <|im_start|> parsed), or kvp-tiny's bytes.
  std::vector<std::int32_t> encode(const std::string& text) const;
  /// Token ids back to text (BPE, or bytes; ids outside the byte range are dropped for kvp-tiny).
  std::string decode(std::span<const std::int32_t> ids) const;
  /// The BPE tokenizer of a GGUF model, null for kvp-tiny.
  const BpeTokenizer* bpe() const noexcept { return tokenizer_.get(); }
  /// A short name for tables: the GGUF's file name without ".gguf", or the model directory's name.
  const std::string& name() const noexcept { return name_; }
  /// Bytes of one token's K and V in one layer at element size `elem`.
  std::int64_t kv_bytes_per_token(std::size_t elem) const noexcept {
    return 2 * static_cast<std::int64_t>(config_.n_kv_heads) * config_.head_dim * static_cast<std::int64_t>(elem);
  }

 private:
  const float* get(const std::string& name, std::vector<std::int64_t> shape) const;
  void load_gguf(const std::string& path);
  void bind();  ///< the layer pointers into tensors_, shapes checked against the config

  ModelConfig config_;
  std::string name_;
  std::shared_ptr<const BpeTokenizer> tokenizer_;
  std::map<std::string, WeightTensor> tensors_;
  const float *embed_ = nullptr, *norm_ = nullptr, *lm_head_ = nullptr;
  std::vector<Layer> layers_;
};

// ---- fp32 math shared by prefill and decode ----------------------------------

/// out = x * rsqrt(mean(x^2) + eps) * w for each of `rows` rows of length d.
inline void rms_norm(const float* x, const float* w, std::int64_t rows, int d, float eps, float* out) noexcept {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float ss = 0.0f;
    for (int i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int i = 0; i < d; ++i) out[r * d + i] = xr[i] * inv * w[i];
  }
}

/// y (rows, out) = x (rows, in) * W^T, W (out, in) row-major.
void linear(const float* x, const float* w, std::int64_t rows, int in, int out, float* y);
/// y (rows, out) += x (rows, in) * W^T (the attention output projection onto the residual stream).
void linear_add(const float* x, const float* w, std::int64_t rows, int in, int out, float* y);

/// cos/sin of RoPE for one position, half-split layout: entries i and i + d/2
/// share angle pos * base^(-2i/d). Computed in double, rounded to float (as
/// model.py does), so the C++ and PyTorch rotations agree to the last bit of
/// the tables.
inline void rope_table(std::int64_t pos, int head_dim, double base, float* cos_out, float* sin_out) noexcept {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double inv_freq = 1.0 / std::pow(base, static_cast<double>(2 * i) / head_dim);
    const double ang = static_cast<double>(pos) * inv_freq;
    cos_out[i] = cos_out[i + half] = static_cast<float>(std::cos(ang));
    sin_out[i] = sin_out[i + half] = static_cast<float>(std::sin(ang));
  }
}

/// Rotates `heads` rows of head_dim values (contiguous) in place.
inline void apply_rope(float* x, int heads, int head_dim, const float* cos_t, const float* sin_t) noexcept {
  const int half = head_dim / 2;
  for (int h = 0; h < heads; ++h) {
    float* r = x + static_cast<std::int64_t>(h) * head_dim;
    for (int i = 0; i < half; ++i) {
      const float a = r[i], b = r[i + half];
      r[i] = a * cos_t[i] + (-b) * sin_t[i];
      r[i + half] = b * cos_t[i + half] + a * sin_t[i + half];
    }
  }
}

/// In place: x (rows, d) += MLP(rms_norm(x)) with SwiGLU, using scratch of rows*(d + 2*ffn) floats.
void mlp_block(const Model& m, const Model::Layer& L, float* x, std::int64_t rows, std::vector<float>& scratch);

/// logits (rows, vocab) = rms_norm(x) * lm_head^T.
void final_logits(const Model& m, const float* x, std::int64_t rows, float* logits);

}  // namespace kvp_engine
