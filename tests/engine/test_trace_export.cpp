// SPDX-License-Identifier: Apache-2.0
// The engine's trace exporter (examples/engine/trace_export.hpp):
//  * on kvp-tiny it reproduces the committed trace that tools/trace/export_trace.py wrote with PyTorch from
//    the same model and prompt (tests/data/traces/kvp_tiny_passkey.safetensors, fp16): queries, keys and
//    values of the prompt and of the 4 greedy decode steps agree within fp16 rounding plus 2e-3 (the two
//    engines' fp32 arithmetic differs in summation order; the logits test bounds that at 1e-3);
//  * a subset of layers is written as trace layers 0..n-1 with their model layer numbers, which the
//    comparison reads back (tools/compare/trace_cases.hpp: rows report the model's layer; PyramidKV sees
//    the model's layer count);
//  * the answer's occurrences in the prompt become the needles;
//  * bad requests throw and leave no file behind;
//  * on SmolLM2 (KVP_SMOLLM2_GGUF; skipped without it) a short prompt's trace opens and replays, and the
//    comparison's real-model traces (tools/compare/real_traces.hpp) name their workloads and layers.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/trace_export.hpp"
#include "engine_fixture.hpp"
#include "kvpolicy/io/trace.hpp"
#include "real_traces.hpp"
#include "trace_cases.hpp"

using namespace kvp_engine;

namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvp_test_trace_" + std::to_string(::getpid()) + "_" + name)).string();
}

/// max |a - b| / (scale + |b|) over two trace tensors, as floats.
template <class A, class B>
double worst_diff(const kvpolicy::TensorView<const A, 3>& a, const kvpolicy::TensorView<const B, 3>& b, double abs_tol) {
  REQUIRE(a.extent(0) == b.extent(0));
  REQUIRE(a.extent(1) == b.extent(1));
  REQUIRE(a.extent(2) == b.extent(2));
  double worst = 0.0;
  for (std::int64_t i = 0; i < a.extent(0); ++i)
    for (std::int64_t j = 0; j < a.extent(1); ++j)
      for (std::int64_t k = 0; k < a.extent(2); ++k) {
        const double x = kvpolicy::to_float(a(i, j, k)), y = kvpolicy::to_float(b(i, j, k));
        worst = std::max(worst, std::abs(x - y) / (abs_tol + 1e-3 * std::abs(y)));
      }
  return worst;
}

}  // namespace

TEST_CASE("trace export: kvp-tiny's trace equals the one PyTorch exported from the same prompt", "[engine][trace]") {
  kvpolicy::io::Trace ref;
  REQUIRE(kvpolicy::io::Trace::open(std::string(KVP_TEST_DATA_DIR) + "/traces/kvp_tiny_passkey.safetensors", &ref).is_ok());
  const auto& info = ref.info();
  std::vector<std::int32_t> prompt;
  const auto& meta = ref.metadata();
  REQUIRE(meta.at("model") == "kvp-tiny:passkey");
  kvpolicy::io::SafetensorsFile raw;
  REQUIRE(kvpolicy::io::SafetensorsFile::open(std::string(KVP_TEST_DATA_DIR) + "/traces/kvp_tiny_passkey.safetensors", &raw).is_ok());
  const auto* tokens = raw.find("tokens");
  REQUIRE(tokens != nullptr);
  const auto* ids = reinterpret_cast<const std::int64_t*>(raw.bytes(*tokens));
  for (std::int64_t i = 0; i < tokens->numel(); ++i) prompt.push_back(static_cast<std::int32_t>(ids[i]));
  REQUIRE(static_cast<std::int64_t>(prompt.size()) == info.num_tokens);

  const std::string path = temp_path("tiny.safetensors");
  TraceExportOptions o;
  o.decode_steps = static_cast<int>(info.num_decode);
  o.fp16 = false;
  const TraceExportResult r = export_trace(engine_test::model(), prompt, o, path);
  REQUIRE(r.decoded.size() == static_cast<std::size_t>(info.num_decode));
  kvpolicy::io::Trace ours;
  REQUIRE(kvpolicy::io::Trace::open(path, &ours).is_ok());
  std::filesystem::remove(path);
  CHECK(ours.info().num_layers == info.num_layers);
  CHECK(ours.info().num_decode == info.num_decode);
  CHECK(ours.info().rope_theta == info.rope_theta);
  CHECK(ours.info().attn_scale == Approx(info.attn_scale).epsilon(1e-12));
  CHECK(ours.positions() == ref.positions());
  CHECK(ours.decode_positions() == ref.decode_positions());
  REQUIRE(ours.inv_freq().size() == ref.inv_freq().size());
  for (std::size_t i = 0; i < ours.inv_freq().size(); ++i)
    CHECK(ours.inv_freq()[i] == Approx(ref.inv_freq()[i]).epsilon(1e-6));  // ours: double, rounded once; HF: fp32 pow
  double worst = 0.0;
  for (std::int32_t l = 0; l < info.num_layers; ++l) {
    kvpolicy::io::TraceLayerView<float> a;
    kvpolicy::io::TraceLayerView<kvpolicy::half> b;
    REQUIRE(ours.layer(l, &a).is_ok());
    REQUIRE(ref.layer(l, &b).is_ok());
    INFO("layer " << l);
    // fp16 rounding of the reference (half an ulp: 2^-11 relative) is inside the 1e-3 relative term.
    for (auto [x, y] :
         {std::pair{a.q, b.q}, {a.k, b.k}, {a.v, b.v}, {a.q_decode, b.q_decode}, {a.k_decode, b.k_decode}, {a.v_decode, b.v_decode}})
      worst = std::max(worst, worst_diff(x, y, 2e-3));
  }
  CHECK(worst <= 1.0);
}

TEST_CASE("trace export: a subset of layers keeps the model's layer numbers through the comparison", "[engine][trace]") {
  const auto& s = engine_test::eval_samples()[engine_test::samples_of("passkey", 1)[0]];
  const std::vector<std::int32_t> prompt(s.prompt.begin(), s.prompt.begin() + 96);
  const std::string path = temp_path("subset.safetensors");
  TraceExportOptions o;
  o.layers = {3, 1};
  o.decode_steps = 2;
  o.answer = {prompt[40], prompt[41]};
  const TraceExportResult r = export_trace(engine_test::model(), prompt, o, path);
  REQUIRE(!r.needles.empty());
  for (std::size_t i = 0; i < r.needles.size(); i += 2) {  // every occurrence of the two tokens, both tokens of it
    CHECK(prompt[static_cast<std::size_t>(r.needles[i])] == prompt[40]);
    CHECK(r.needles[i + 1] == r.needles[i] + 1);
  }
  kvpolicy::io::Trace tr;
  REQUIRE(kvpolicy::io::Trace::open(path, &tr).is_ok());
  CHECK(tr.info().num_layers == 2);
  CHECK(tr.info().num_tokens == 96);
  CHECK(tr.info().num_decode == 2);
  CHECK(tr.metadata().at("source_layers") == "3,1");
  CHECK(tr.needles() == r.needles);
  // The full export's layer 3 equals the subset's trace layer 0, bit for bit.
  const std::string all = temp_path("all.safetensors");
  o.layers.clear();
  export_trace(engine_test::model(), prompt, o, all);
  kvpolicy::io::Trace full;
  REQUIRE(kvpolicy::io::Trace::open(all, &full).is_ok());
  kvpolicy::io::TraceLayerView<kvpolicy::half> a, b;
  REQUIRE(tr.layer(0, &a).is_ok());
  REQUIRE(full.layer(3, &b).is_ok());
  CHECK(worst_diff(a.q, b.q, 1e-30) == 0.0);
  CHECK(worst_diff(a.k_decode, b.k_decode, 1e-30) == 0.0);
  std::vector<kvp_compare::LayerCase> cases;
  REQUIRE(kvp_compare::load_trace_cases(path, &cases).is_ok());
  REQUIRE(cases.size() == 2);
  CHECK(cases[0].layer == 3);
  CHECK(cases[1].layer == 1);
  CHECK(cases[0].num_layers == engine_test::model().config().n_layers);
  CHECK(cases[0].num_eval == 2);
  // Malformed source_layers metadata is refused by name (no overflow on a long number).
  for (const char* bad : {"3,,1", "3,x", "3,99999999999999999999", "3"}) {
    INFO(bad);
    o.layers = {3, 1};
    o.metadata = {{"source_layers", bad}};
    export_trace(engine_test::model(), prompt, o, path);
    std::vector<kvp_compare::LayerCase> none;
    const kvpolicy::Status st = kvp_compare::load_trace_cases(path, &none);
    CHECK(!st.is_ok());
    CHECK_THAT(st.message(), Catch::Contains("source_layers"));
  }
  std::filesystem::remove(path);
  std::filesystem::remove(all);
}

TEST_CASE("trace export: bad requests throw and write nothing", "[engine][trace]") {
  const auto& s = engine_test::eval_samples()[engine_test::samples_of("passkey", 1)[0]];
  const std::vector<std::int32_t> prompt(s.prompt.begin(), s.prompt.begin() + 32);
  const std::string path = temp_path("bad.safetensors");
  const int n_layers = engine_test::model().config().n_layers;
  auto refused = [&](TraceExportOptions o, std::span<const std::int32_t> p, const std::string& what, const std::string& out) {
    INFO(what);
    CHECK_THROWS_WITH(export_trace(engine_test::model(), p, o, out), Catch::Contains(what));
    CHECK(!std::filesystem::exists(out));
    CHECK(!std::filesystem::exists(out + ".partial"));
  };
  TraceExportOptions o;
  o.layers = {n_layers};
  refused(o, prompt, "outside [0, " + std::to_string(n_layers) + ")", path);
  o.layers = {-1};
  refused(o, prompt, "outside", path);
  o.layers = {1, 1};
  refused(o, prompt, "listed twice", path);
  o.layers = {};
  refused(o, {}, "empty prompt", path);
  o.decode_steps = -1;
  refused(o, prompt, "decode_steps", path);
  o.decode_steps = engine_test::model().config().max_seq_len;
  refused(o, prompt, "exceed the model's context", path);
  o.decode_steps = 1;
  refused(o, prompt, "cannot create", "/nonexistent-dir/x.safetensors");
}

TEST_CASE("trace export: SmolLM2's layers replay in the comparison", "[engine][trace][smollm2]") {
  const char* g = std::getenv("KVP_SMOLLM2_GGUF");
  if (g == nullptr || *g == '\0' || !std::ifstream(g)) {
    WARN("KVP_SMOLLM2_GGUF not set: skipped");
    return;
  }
  static const Model m = Model::load(g);
  const std::vector<std::int32_t> prompt =
      m.encode("The pass key is 71234. Remember it. The grass is green. The sky is blue. What is the pass key? The pass key is");
  const std::string path = temp_path("smollm2.safetensors");
  TraceExportOptions o;
  o.layers = {0, 29};
  o.decode_steps = 7;
  o.answer = m.encode(" 71234");  // " ", then one token per digit
  const TraceExportResult r = export_trace(m, prompt, o, path);
  INFO("decoded: '" << m.decode(r.decoded) << "'");
  CHECK(m.decode(r.decoded).find("71234") != std::string::npos);  // the model answers, from the full cache
  CHECK(r.needles.size() == o.answer.size());
  std::vector<kvp_compare::LayerCase> cases;
  REQUIRE(kvp_compare::load_trace_cases(path, &cases).is_ok());
  std::filesystem::remove(path);
  REQUIRE(cases.size() == 2);
  CHECK(cases[1].layer == 29);
  CHECK(cases[1].num_layers == 30);
  CHECK(cases[1].num_q_heads == 9);
  CHECK(cases[1].num_kv_heads == 3);
  CHECK(cases[1].head_dim == 64);
  CHECK(!cases[1].q_pre.empty());  // pre-RoPE queries recovered from the trace's frequencies (Expected Attention)
}

TEST_CASE("real traces: the comparison traces the task set's prompts and names the workloads", "[engine][trace][smollm2]") {
  const char* g = std::getenv("KVP_SMOLLM2_GGUF");
  if (g == nullptr || *g == '\0' || !std::ifstream(g)) {
    WARN("KVP_SMOLLM2_GGUF not set: skipped");
    return;
  }
  kvp_compare::RealTraceOptions o;
  o.model = g;
  o.task_set = engine_test::fixture_dir() + "/smollm2_tasks.json";
  o.out_dir = temp_path("real");
  o.max_tasks = 1;
  o.layers = {29};
  o.decode_steps = 2;
  std::vector<kvp_compare::LayerCase> cases;
  const std::vector<std::string> paths = kvp_compare::load_real_traces(o, &cases);
  REQUIRE(paths.size() == 1);
  CHECK(paths[0] == o.out_dir + "/traces/SmolLM2-passkey-prose-512.safetensors");
  REQUIRE(cases.size() == 1);
  CHECK(cases[0].workload == "trace:SmolLM2-passkey-prose-512");
  CHECK(cases[0].layer == 29);
  CHECK(cases[0].num_eval == 2);
  CHECK(!cases[0].needles.empty());  // the answer's digits occur in the prompt
  std::filesystem::remove_all(o.out_dir);
  o.filler = "nonesuch";
  CHECK_THROWS_WITH(kvp_compare::load_real_traces(o, &cases), Catch::Contains("no sample of haystack 'nonesuch'"));
}
