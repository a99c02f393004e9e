// SPDX-License-Identifier: Apache-2.0
// model.hpp and weights.hpp: the safetensors and config readers, the loader and
// the fp32 matrix products (gemm.hpp), compiled once into kvp_engine_lib; also
// the task-set reader (task_set.hpp), so that nlohmann-json is compiled in one
// translation unit of the library.
#include "model.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "bpe_tokenizer.hpp"
#include "gemm.hpp"
#include "kvpolicy/io/gguf.hpp"
#include "kvpolicy/io/safetensors.hpp"
#include "task_set.hpp"
#include "weights.hpp"

namespace kvp_engine {

// ---- weights.hpp ----------------------------------------------------------------

std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open '" + path + "'");
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::map<std::string, WeightTensor> load_safetensors_f32(const std::string& path) {
  kvpolicy::io::SafetensorsFile file;
  const kvpolicy::Status st = kvpolicy::io::SafetensorsFile::open(path, &file);
  if (!st) throw std::runtime_error("'" + path + "': " + st.message());
  std::map<std::string, WeightTensor> out;
  for (const auto& e : file.tensors()) {
    if (e.dtype_name != "F32")
      throw std::runtime_error("safetensors '" + path + "': tensor '" + e.name + "' has dtype " + e.dtype_name + ", expected F32");
    WeightTensor t;
    t.shape = e.shape;
    t.data.resize(static_cast<std::size_t>(e.numel()));
    if (!t.data.empty()) std::memcpy(t.data.data(), file.bytes(e), t.data.size() * sizeof(float));
    out.emplace(e.name, std::move(t));
  }
  return out;
}

// ---- model.hpp ------------------------------------------------------------------

ModelConfig ModelConfig::from_json(const std::string& text) {
  const auto j = nlohmann::json::parse(text);
  ModelConfig c;
  c.vocab_size = j.at("vocab_size");
  c.d_model = j.at("d_model");
  c.n_layers = j.at("n_layers");
  c.n_heads = j.at("n_heads");
  c.n_kv_heads = j.at("n_kv_heads");
  c.head_dim = j.at("head_dim");
  c.ffn_hidden = j.at("ffn_hidden");
  c.rope_base = j.at("rope_base");
  c.norm_eps = j.at("norm_eps");
  c.max_seq_len = j.at("max_seq_len");
  c.tie_embeddings = j.at("tie_embeddings");
  c.bos_id = j.at("bos_id");
  c.eos_id = j.at("eos_id");
  c.pad_id = j.at("pad_id");
  if (j.value("rope_convention", "half_split") != "half_split")
    throw std::runtime_error("config: only the half_split RoPE convention is supported");
  if (c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0)
    throw std::runtime_error("config: n_heads " + std::to_string(c.n_heads) + " is not a multiple of n_kv_heads " +
                             std::to_string(c.n_kv_heads));
  if (c.head_dim % 2 != 0) throw std::runtime_error("config: head_dim must be even for RoPE");
  return c;
}

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// llama.cpp's converter permutes the rows of W_q and W_k so that its RoPE rotates adjacent pairs: within each
/// head, GGUF row 2j + s holds Hugging Face row s * (head_dim / 2) + j. Undone here, so the engine's half-split
/// RoPE (model.hpp) applies, as transformers does when it loads a GGUF.
void unpermute_rope_rows(std::vector<float>& w, int heads, int head_dim, int in) {
  const std::vector<float> src = w;
  const int half = head_dim / 2;
  for (int h = 0; h < heads; ++h)
    for (int s = 0; s < 2; ++s)
      for (int j = 0; j < half; ++j)
        std::memcpy(w.data() + (static_cast<std::size_t>(h) * head_dim + s * half + j) * in,
                    src.data() + (static_cast<std::size_t>(h) * head_dim + 2 * j + s) * in, sizeof(float) * in);
}

}  // namespace

ModelConfig ModelConfig::from_gguf(const kvpolicy::io::GgufFile& f, const std::string& path) {
  auto fail = [&](const std::string& what) { return std::runtime_error("gguf '" + path + "': " + what); };
  auto check = [&](const kvpolicy::Status& s) {
    if (!s) throw fail(s.message());
  };
  std::string arch;
  check(f.get_string("general.architecture", &arch));
  if (arch != "llama") throw fail("architecture '" + arch + "' is not supported (the engine runs llama-architecture models)");
  auto u = [&](const std::string& key) {
    std::uint64_t v = 0;
    check(f.get_uint(key, &v));
    if (v > static_cast<std::uint64_t>(INT32_MAX)) throw fail("metadata '" + key + "' is too large");
    return static_cast<int>(v);
  };
  ModelConfig c;
  c.d_model = u("llama.embedding_length");
  c.n_layers = u("llama.block_count");
  c.n_heads = u("llama.attention.head_count");
  c.n_kv_heads = u("llama.attention.head_count_kv");
  c.ffn_hidden = u("llama.feed_forward_length");
  c.max_seq_len = u("llama.context_length");
  std::vector<std::string> tokens;
  check(f.get_strings("tokenizer.ggml.tokens", &tokens));
  c.vocab_size = f.find("llama.vocab_size") ? u("llama.vocab_size") : static_cast<int>(tokens.size());
  if (c.n_heads <= 0 || c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0 || c.d_model % c.n_heads != 0)
    throw fail("head counts (" + std::to_string(c.n_heads) + " query, " + std::to_string(c.n_kv_heads) + " kv) do not divide d_model " +
               std::to_string(c.d_model));
  c.head_dim = c.d_model / c.n_heads;
  if (f.find("llama.rope.dimension_count") && u("llama.rope.dimension_count") != c.head_dim)
    throw fail("partial RoPE (rope.dimension_count != head_dim) is not supported");
  if (c.head_dim % 2 != 0) throw fail("head_dim must be even for RoPE");
  double v = 10000.0;
  if (f.find("llama.rope.freq_base")) check(f.get_float("llama.rope.freq_base", &v));
  c.rope_base = v;
  check(f.get_float("llama.attention.layer_norm_rms_epsilon", &v));
  c.norm_eps = static_cast<float>(v);
  if (f.find("llama.rope.scaling.type")) throw fail("RoPE scaling is not supported");
  c.tie_embeddings = f.find_tensor("output.weight") == nullptr;
  c.bos_id = f.find("tokenizer.ggml.bos_token_id") ? u("tokenizer.ggml.bos_token_id") : -1;
  c.eos_id = f.find("tokenizer.ggml.eos_token_id") ? u("tokenizer.ggml.eos_token_id") : -1;
  c.pad_id = f.find("tokenizer.ggml.padding_token_id") ? u("tokenizer.ggml.padding_token_id") : -1;
  c.add_bos = false;
  if (f.find("tokenizer.ggml.add_bos_token")) check(f.get_bool("tokenizer.ggml.add_bos_token", &c.add_bos));
  if (c.add_bos && c.bos_id < 0) throw fail("tokenizer.ggml.add_bos_token is set but there is no bos_token_id");
  return c;
}

Model Model::load(const std::string& dir) {
  Model m;
  std::string base = dir;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  m.name_ = base.substr(base.find_last_of('/') + 1);
  if (ends_with(dir, ".gguf")) {
    m.name_ = m.name_.substr(0, m.name_.size() - 5);
    m.load_gguf(dir);
  } else {
    m.config_ = ModelConfig::from_json(read_text_file(dir + "/config.json"));
    m.tensors_ = load_safetensors_f32(dir + "/model.safetensors");
  }
  m.bind();
  return m;
}

void Model::load_gguf(const std::string& path) {
  kvpolicy::io::GgufFile f;
  const kvpolicy::Status st = kvpolicy::io::GgufFile::open(path, &f);
  if (!st) throw std::runtime_error("'" + path + "': " + st.message());
  config_ = ModelConfig::from_gguf(f, path);
  try {
    tokenizer_ = std::make_shared<const BpeTokenizer>(BpeTokenizer::from_gguf(f));
  } catch (const std::exception& e) {
    throw std::runtime_error("gguf '" + path + "': tokenizer: " + e.what());
  }
  const ModelConfig& c = config_;
  // GGUF name -> the engine's name; ne = {in, out} is a row-major (out, in) matrix.
  auto take = [&](const std::string& gname, const std::string& name) -> WeightTensor& {
    const kvpolicy::io::GgufTensorInfo* t = f.find_tensor(gname);
    if (t == nullptr) throw std::runtime_error("gguf '" + path + "': missing tensor '" + gname + "'");
    WeightTensor w;
    for (auto it = t->ne.rbegin(); it != t->ne.rend(); ++it) w.shape.push_back(*it);
    w.data.resize(static_cast<std::size_t>(t->elements));
    const kvpolicy::Status s = f.dequantize(*t, w.data);
    if (!s) throw std::runtime_error("gguf '" + path + "': " + s.message());
    return tensors_.emplace(name, std::move(w)).first->second;
  };
  take("token_embd.weight", "embed_tokens.weight");
  take("output_norm.weight", "norm.weight");
  if (!c.tie_embeddings) take("output.weight", "lm_head.weight");
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string g = "blk." + std::to_string(i) + ".", p = "layers." + std::to_string(i) + ".";
    take(g + "attn_norm.weight", p + "attn_norm.weight");
    take(g + "ffn_norm.weight", p + "mlp_norm.weight");
    unpermute_rope_rows(take(g + "attn_q.weight", p + "attn.q_proj.weight").data, c.n_heads, c.head_dim, c.d_model);
    unpermute_rope_rows(take(g + "attn_k.weight", p + "attn.k_proj.weight").data, c.n_kv_heads, c.head_dim, c.d_model);
    take(g + "attn_v.weight", p + "attn.v_proj.weight");
    take(g + "attn_output.weight", p + "attn.o_proj.weight");
    take(g + "ffn_gate.weight", p + "mlp.gate_proj.weight");
    take(g + "ffn_up.weight", p + "mlp.up_proj.weight");
    take(g + "ffn_down.weight", p + "mlp.down_proj.weight");
  }
}

void Model::bind() {
  Model& m = *this;
  const ModelConfig& c = m.config_;
  const std::int64_t d = c.d_model, q = c.n_heads * c.head_dim, kv = c.n_kv_heads * c.head_dim, f = c.ffn_hidden;
  m.embed_ = m.get("embed_tokens.weight", {c.vocab_size, d});
  m.norm_ = m.get("norm.weight", {d});
  m.lm_head_ = c.tie_embeddings ? m.embed_ : m.get("lm_head.weight", {c.vocab_size, d});
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    m.layers_.push_back(Layer{
        m.get(p + "attn_norm.weight", {d}), m.get(p + "mlp_norm.weight", {d}), m.get(p + "attn.q_proj.weight", {q, d}),
        m.get(p + "attn.k_proj.weight", {kv, d}), m.get(p + "attn.v_proj.weight", {kv, d}), m.get(p + "attn.o_proj.weight", {d, q}),
        m.get(p + "mlp.gate_proj.weight", {f, d}), m.get(p + "mlp.up_proj.weight", {f, d}), m.get(p + "mlp.down_proj.weight", {d, f})});
  }
}

std::vector<std::int32_t> Model::encode(const std::string& text) const {
  if (tokenizer_) return tokenizer_->encode(text);
  std::vector<std::int32_t> ids = tokenize(text, config_.bos_id);
  ids.erase(ids.begin());  // tokenize() puts BOS first
  return ids;
}

std::string Model::decode(std::span<const std::int32_t> ids) const { return tokenizer_ ? tokenizer_->decode(ids) : detokenize(ids); }

const float* Model::get(const std::string& name, std::vector<std::int64_t> shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw std::runtime_error("model: missing tensor '" + name + "'");
  if (it->second.shape != shape) throw std::runtime_error("model: tensor '" + name + "' has an unexpected shape");
  return it->second.data.data();
}

// x and W both run along `in`: the NT product (a GEMV streaming W when rows = 1, in decode).
void linear(const float* x, const float* w, std::int64_t rows, int in, int out, float* y) { gemm_nt(x, in, w, in, y, out, rows, out, in); }

void linear_add(const float* x, const float* w, std::int64_t rows, int in, int out, float* y) {
  gemm_nt(x, in, w, in, y, out, rows, out, in, /*accumulate=*/true);
}

void mlp_block(const Model& m, const Model::Layer& L, float* x, std::int64_t rows, std::vector<float>& scratch) {
  const ModelConfig& c = m.config();
  const int d = c.d_model, f = c.ffn_hidden;
  scratch.resize(static_cast<std::size_t>(rows * (d + 2 * f)));
  float* xn = scratch.data();
  float* g = xn + rows * d;
  float* u = g + rows * f;
  rms_norm(x, L.mlp_norm, rows, d, c.norm_eps, xn);
  linear(xn, L.wg, rows, d, f, g);
  linear(xn, L.wu, rows, d, f, u);
  for (std::int64_t i = 0; i < rows * f; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  linear_add(g, L.wd, rows, f, d, x);
}

void final_logits(const Model& m, const float* x, std::int64_t rows, float* logits) {
  const ModelConfig& c = m.config();
  std::vector<float> xn(static_cast<std::size_t>(rows * c.d_model));
  rms_norm(x, m.final_norm(), rows, c.d_model, c.norm_eps, xn.data());
  linear(xn.data(), m.lm_head(), rows, c.d_model, c.vocab_size, logits);
}

// ---- task_set.hpp ---------------------------------------------------------------

std::vector<TaskSample> load_task_set(const std::string& path, int bos_id) {
  const auto j = nlohmann::json::parse(read_text_file(path));
  std::vector<TaskSample> out;
  for (const auto& s : j.at("samples")) {
    TaskSample t;
    t.task = s.at("task");
    t.prompt = tokenize(s.at("prompt").get<std::string>(), bos_id);
    const std::string a = s.at("answer");
    for (unsigned char ch : a) t.answer.push_back(ch);
    for (const auto& p : s.at("needle_pos")) t.needle_pos.push_back(p.get<std::int64_t>());
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<TaskSample> load_text_task_set(const std::string& path, const TextEncoder& encode, QuestionSetup setup, std::int32_t bos_id) {
  const auto j = nlohmann::json::parse(read_text_file(path));
  std::vector<TaskSample> out;
  std::size_t i = 0;
  for (const auto& s : j.at("samples")) {
    const std::string where = "task set '" + path + "' sample " + std::to_string(i++);
    auto field = [&](const char* k) -> std::string {
      if (!s.contains(k) || !s.at(k).is_string()) throw std::runtime_error(where + ": missing text field '" + k + "'");
      return s.at(k).get<std::string>();
    };
    TaskSample t;
    t.task = field("task");
    if (s.contains("filler")) t.task += ":" + s.at("filler").get<std::string>();
    if (s.contains("length")) t.task += ":" + std::to_string(s.at("length").get<long long>());
    const std::string answer = field("answer");
    if (answer.empty()) throw std::runtime_error(where + ": empty answer");
    std::string prompt_text, question_text;
    if (setup == QuestionSetup::kAgnostic) {
      prompt_text = field("context");
      question_text = field("question");
    } else {
      prompt_text = s.contains("prompt") ? field("prompt") : field("context") + field("question");
    }
    if (bos_id >= 0) t.prompt.push_back(bos_id);
    const std::vector<std::int32_t> p = encode(prompt_text);
    t.prompt.insert(t.prompt.end(), p.begin(), p.end());
    if (!question_text.empty()) t.question = encode(question_text);
    // The answer as the model would continue: what encoding it after its lead-in adds.
    const std::string& lead = question_text.empty() ? prompt_text : question_text;
    const std::vector<std::int32_t> base = question_text.empty() ? p : t.question, both = encode(lead + answer);
    if (both.size() > base.size() && std::equal(base.begin(), base.end(), both.begin()))
      t.answer.assign(both.begin() + static_cast<std::ptrdiff_t>(base.size()), both.end());
    else
      t.answer = encode(answer);
    if (t.answer.empty()) throw std::runtime_error(where + ": the answer encodes to no tokens");
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace kvp_engine
