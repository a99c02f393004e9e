// SPDX-License-Identifier: Apache-2.0
//
// Reader for the cross-validation fixtures in tests/data/fixtures/<name>.json (written by
// tests/reference/make_fixtures.py; format in tests/reference/README.md).
//
//   #include "reference/fixture_reader.hpp"
//   for (const auto& c : kvp_fixtures::load_fixtures("snapkv_kvpress")) {
//     const std::vector<float> q = c.queries();        // (Hq, T, d), regenerated bit-exactly
//     const std::vector<float> k = c.keys();           // (Hkv, T, d)
//     const int w = c.param<int>("window_size");
//     ... run the policy, then compare against c.scores / c.kept (per head, ascending token ids)
//   }
//
// The inputs are not stored: they are regenerated with fixture_rng.hpp from (seed, shape), and every case carries a
// drift check (check_inputs()). Header-only; needs nlohmann-json (Debian nlohmann-json3-dev).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fixture_rng.hpp"

namespace kvp_fixtures {

using TokenList = std::vector<std::int32_t>;

// One generated input tensor as described in the fixture (role, shape and the drift check values).
struct TensorInfo {
  std::string role;  // "post_rope_queries", "pre_rope_queries", "post_rope_keys", "values"
  int heads = 0, tokens = 0, dim = 0;
  double sum = 0.0;                 // exact float64 sum of all elements
  std::uint64_t bits_checksum = 0;  // sum_i bits(x_i) * (2i+1) mod 2^64
  std::vector<double> first;        // the first 8 elements (flat order)
};

// Sampled reference scores: tokens[h][i] is a position, value[h][i] the reference score there (kvpress: its float32
// value widened; originals: float64), value_fp64[h][i] the float64 mirror (empty when the reference is float64).
struct ScoreSamples {
  std::vector<TokenList> tokens;
  std::vector<std::vector<double>> value;
  std::vector<std::vector<double>> value_fp64;
  std::optional<std::pair<int, int>> protected_range;  // [begin, end): padded (kvpress) or always kept (originals)
  std::optional<double> pad_value;                     // raw pad kvpress returned (global max + 1)
  std::optional<double> pad_value_fp64;
  bool is_protected(int token) const noexcept {
    return protected_range && token >= protected_range->first && token < protected_range->second;
  }
};

// Equal scores straddling a selection boundary (max-pooling plateaus): any n_tied_kept of `tied` are valid.
struct Ties {
  TokenList tied;
  int n_tied_kept = 0;
};

struct LayerResult {  // pyramidkv_*: one entry per recorded layer
  int layer_idx = 0;
  std::string regime;  // pyramidkv_factory: "none" | "uniform" | "pyramid"; empty for kvpress
  int n_kept = 0;
  std::vector<TokenList> kept;
  std::vector<std::optional<Ties>> kept_ties;
};

struct StepResult {  // h2o_original / tova_original: state after prefill (step 0) and some decode steps
  int step = 0;
  int n_seen = 0;               // tokens seen so far (prefill_len + step)
  std::vector<TokenList> kept;  // per kv head (H2O) or a single layer-wide set (TOVA)
  ScoreSamples scores;          // H2O: accumulated scores of kept tokens; TOVA: the scores that step decided on
};

struct FixtureCase {
  std::string id;
  std::string policy;
  std::uint64_t seed = 0;
  int num_q_heads = 0, num_kv_heads = 0, seq_len = 0, head_dim = 0;
  nlohmann::json params;  // the policy's parameters, by name (see the file's "conventions")
  TensorInfo queries_info, keys_info, values_info;
  std::string score_granularity;  // "kv_head" | "query_head" | "layer"
  std::optional<int> n_kept;
  ScoreSamples scores;
  std::vector<TokenList> kept;                 // per head (score_granularity), ascending
  std::vector<std::optional<Ties>> kept_ties;  // same length as kept, or empty
  std::vector<LayerResult> layers;
  std::vector<StepResult> steps;
  std::optional<double> min_rel_gap;  // smallest relative gap at any selection boundary
  nlohmann::json raw;                 // the whole case (counts, capacities, kept_counts, checks, ...)

  int group() const noexcept { return num_q_heads / num_kv_heads; }
  bool has_param(const char* name) const { return params.contains(name) && !params[name].is_null(); }
  template <class T>
  T param(const char* name) const {
    if (!params.contains(name)) throw std::runtime_error(id + ": no parameter '" + name + "'");
    return params.at(name).get<T>();
  }

  // Regenerated inputs, row-major (head, token, dim); [t0, t1) selects a token slice (t1 = -1: to seq_len).
  std::vector<float> queries(int t0 = 0, int t1 = -1) const {
    return gen_queries(seed, num_q_heads, num_kv_heads, seq_len, head_dim, t0, t1);
  }
  std::vector<float> keys(int t0 = 0, int t1 = -1) const { return gen_keys(seed, num_kv_heads, seq_len, head_dim, t0, t1); }
  std::vector<float> values(int t0 = 0, int t1 = -1) const { return gen_values(seed, num_kv_heads, seq_len, head_dim, t0, t1); }
};

struct FixtureFile {
  std::string policy;
  nlohmann::json conventions;
  nlohmann::json versions;
  nlohmann::json raw;  // the whole document minus "cases" (budget_grid, schedule_grid, ...)
  std::vector<FixtureCase> cases;
};

// ---- decoding helpers -----------------------------------------------------------------------------------------

// {count, idx: [...]} or {count, bitmap: hex} (hex char i = tokens 4i..4i+3, bit b = token 4i+b) -> ascending ids.
inline TokenList decode_set(const nlohmann::json& j) {
  TokenList out;
  if (j.contains("idx")) {
    out = j.at("idx").get<TokenList>();
  } else if (j.contains("bitmap")) {
    const std::string& hex = j.at("bitmap").get_ref<const std::string&>();
    for (std::size_t i = 0; i < hex.size(); ++i) {
      const char ch = hex[i];
      int v = 0;
      if (ch >= '0' && ch <= '9')
        v = ch - '0';
      else if (ch >= 'a' && ch <= 'f')
        v = ch - 'a' + 10;
      else
        throw std::runtime_error("fixture bitmap: bad hex digit");
      for (int b = 0; b < 4; ++b)
        if (v & (1 << b)) out.push_back(static_cast<std::int32_t>(4 * i + b));
    }
  } else {
    throw std::runtime_error("fixture set: neither idx nor bitmap");
  }
  if (j.contains("count") && static_cast<std::size_t>(j.at("count").get<long long>()) != out.size())
    throw std::runtime_error("fixture set: count does not match the decoded set");
  return out;
}

namespace detail {

inline std::uint64_t parse_hex64(const std::string& s) { return static_cast<std::uint64_t>(std::stoull(s, nullptr, 16)); }

inline TensorInfo parse_tensor(const nlohmann::json& j) {
  TensorInfo t;
  t.role = j.at("role").get<std::string>();
  const auto shape = j.at("shape").get<std::vector<int>>();
  if (shape.size() != 3) throw std::runtime_error("fixture tensor: shape must have 3 extents");
  t.heads = shape[0];
  t.tokens = shape[1];
  t.dim = shape[2];
  t.sum = j.at("sum").get<double>();
  t.bits_checksum = parse_hex64(j.at("bits_checksum").get<std::string>());
  t.first = j.at("first").get<std::vector<double>>();
  return t;
}

inline std::optional<double> opt_double(const nlohmann::json& j, const char* key) {
  if (!j.contains(key) || j.at(key).is_null()) return std::nullopt;
  return j.at(key).get<double>();
}

inline ScoreSamples parse_scores(const nlohmann::json& j) {
  ScoreSamples s;
  s.tokens = j.at("tokens").get<std::vector<TokenList>>();
  s.value = j.at("value").get<std::vector<std::vector<double>>>();
  if (j.contains("value_fp64")) s.value_fp64 = j.at("value_fp64").get<std::vector<std::vector<double>>>();
  if (j.contains("protected") && !j.at("protected").is_null()) {
    const auto p = j.at("protected").get<std::vector<int>>();
    s.protected_range = std::make_pair(p.at(0), p.at(1));
  }
  s.pad_value = opt_double(j, "pad_value");
  s.pad_value_fp64 = opt_double(j, "pad_value_fp64");
  return s;
}

inline std::vector<TokenList> parse_sets(const nlohmann::json& j) {
  std::vector<TokenList> out;
  for (const auto& e : j) out.push_back(decode_set(e));
  return out;
}

inline std::vector<std::optional<Ties>> parse_ties(const nlohmann::json& parent) {
  std::vector<std::optional<Ties>> out;
  if (!parent.contains("kept_ties")) return out;
  for (const auto& e : parent.at("kept_ties")) {
    if (e.is_null()) {
      out.emplace_back(std::nullopt);
    } else {
      out.emplace_back(Ties{decode_set(e.at("tied")), e.at("n_tied_kept").get<int>()});
    }
  }
  return out;
}

inline FixtureCase parse_case(const nlohmann::json& j, const std::string& policy) {
  FixtureCase c;
  c.raw = j;
  c.policy = policy;
  c.id = j.at("id").get<std::string>();
  c.seed = j.at("seed").get<std::uint64_t>();
  c.num_q_heads = j.at("num_q_heads").get<int>();
  c.num_kv_heads = j.at("num_kv_heads").get<int>();
  c.seq_len = j.at("seq_len").get<int>();
  c.head_dim = j.at("head_dim").get<int>();
  c.params = j.at("params");
  const auto& in = j.at("inputs");
  if (in.at("recipe").get<std::string>() != "kvp-fixture-v1")
    throw std::runtime_error(c.id + ": unknown input recipe " + in.at("recipe").get<std::string>());
  c.queries_info = parse_tensor(in.at("queries"));
  c.keys_info = parse_tensor(in.at("keys"));
  c.values_info = parse_tensor(in.at("values"));
  c.score_granularity = j.value("score_granularity", std::string{});
  if (j.contains("n_kept") && !j.at("n_kept").is_null()) c.n_kept = j.at("n_kept").get<int>();
  if (j.contains("scores")) c.scores = parse_scores(j.at("scores"));
  if (j.contains("kept")) c.kept = parse_sets(j.at("kept"));
  c.kept_ties = parse_ties(j);
  if (j.contains("layers")) {
    for (const auto& l : j.at("layers")) {
      LayerResult r;
      r.layer_idx = l.at("layer_idx").get<int>();
      r.regime = l.value("regime", std::string{});
      r.n_kept = l.at("n_kept").get<int>();
      r.kept = parse_sets(l.at("kept"));
      r.kept_ties = parse_ties(l);
      c.layers.push_back(std::move(r));
    }
  }
  if (j.contains("steps")) {
    for (const auto& s : j.at("steps")) {
      StepResult r;
      r.step = s.at("step").get<int>();
      r.n_seen = s.at("n_seen").get<int>();
      r.kept = parse_sets(s.at("kept"));
      r.scores = parse_scores(s.at("scores"));
      c.steps.push_back(std::move(r));
    }
  }
  if (j.contains("checks")) c.min_rel_gap = opt_double(j.at("checks"), "min_rel_gap");
  return c;
}

}  // namespace detail

// Directory of the fixture files: $KVP_FIXTURE_DIR, else KVP_TEST_DATA_DIR "/fixtures" (set by kvp_add_test).
inline std::string fixture_dir() {
  if (const char* env = std::getenv("KVP_FIXTURE_DIR"); env != nullptr && *env != '\0') return env;
#ifdef KVP_TEST_DATA_DIR
  return std::string(KVP_TEST_DATA_DIR) + "/fixtures";
#else
  return "tests/data/fixtures";
#endif
}

// Loads <fixture_dir>/<name>.json (name without extension, e.g. "snapkv_kvpress").
inline FixtureFile load_fixture_file(std::string_view name) {
  const std::string path = fixture_dir() + "/" + std::string(name) + ".json";
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open fixture file " + path);
  nlohmann::json doc = nlohmann::json::parse(f);
  if (doc.at("format").get<std::string>() != "kvp-fixtures" || doc.at("format_version").get<int>() != 1)
    throw std::runtime_error(path + ": not a kvp-fixtures v1 file");
  FixtureFile out;
  out.policy = doc.at("policy").get<std::string>();
  out.conventions = doc.at("conventions");
  out.versions = doc.value("versions", nlohmann::json::object());
  for (const auto& c : doc.at("cases")) out.cases.push_back(detail::parse_case(c, out.policy));
  doc.erase("cases");
  out.raw = std::move(doc);
  return out;
}

inline std::vector<FixtureCase> load_fixtures(std::string_view name) { return load_fixture_file(name).cases; }

// Every fixture file name (without .json) the generator writes.
inline const std::vector<std::string>& fixture_names() {
  static const std::vector<std::string> names = {"snapkv_kvpress",
                                                 "streamingllm_kvpress",
                                                 "tova_kvpress",
                                                 "observed_attention_kvpress",
                                                 "expected_attention_kvpress",
                                                 "adakv_snapkv_kvpress",
                                                 "adakv_expected_attention_kvpress",
                                                 "pyramidkv_kvpress",
                                                 "snapkv_original",
                                                 "pyramidkv_factory",
                                                 "adakv_original",
                                                 "h2o_original",
                                                 "tova_original"};
  return names;
}

// kvpress's budget: max(1, int(T * (1 - r))) with the product in double (T=1000, r=0.8 -> 199).
inline int kvpress_n_kept(int T, double compression_ratio) noexcept {
  if (compression_ratio >= 1.0) return 0;
  const auto n = static_cast<long long>(static_cast<double>(T) * (1.0 - compression_ratio));
  return static_cast<int>(n < 1 ? 1 : n);
}

// Drift check of one regenerated tensor against the fixture: empty string when it matches.
inline std::string check_tensor(const TensorInfo& info, const std::vector<float>& x) {
  std::ostringstream err;
  const std::size_t n = static_cast<std::size_t>(info.heads) * info.tokens * info.dim;
  if (x.size() != n) err << info.role << ": size " << x.size() << " != " << n << "; ";
  const TensorChecksum c = checksum(x);
  if (c.sum != info.sum) err << info.role << ": sum " << c.sum << " != " << info.sum << "; ";
  if (c.bits_checksum != info.bits_checksum) err << info.role << ": bits checksum differs; ";
  for (std::size_t i = 0; i < info.first.size() && i < x.size(); ++i)
    if (static_cast<double>(x[i]) != info.first[i]) {
      err << info.role << ": element " << i << " is " << x[i] << ", fixture has " << info.first[i] << "; ";
      break;
    }
  return err.str();
}

// Regenerates all three inputs of a case and checks them (empty string when everything matches).
inline std::string check_inputs(const FixtureCase& c) {
  return check_tensor(c.queries_info, c.queries()) + check_tensor(c.keys_info, c.keys()) + check_tensor(c.values_info, c.values());
}

}  // namespace kvp_fixtures
