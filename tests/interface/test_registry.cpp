// The run-time registry: spec strings, errors that name the bad key and list
// the valid ones, erased eviction identical to the typed call, every policy
// listed with its family, paper and parameter defaults.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using Catch::Contains;

TEST_CASE("registry: spec strings parse into name and ordered key=value pairs", "[registry]") {
  PolicySpec s;
  REQUIRE(parse_policy_spec(" snapkv : compression_ratio=0.5 , window=64 ", &s).is_ok());
  REQUIRE(s.name == "snapkv");
  REQUIRE(s.args == std::vector<std::pair<std::string, std::string>>{{"compression_ratio", "0.5"}, {"window", "64"}});
  REQUIRE(parse_policy_spec("tova", &s).is_ok());
  REQUIRE(s.args.empty());
  REQUIRE_THAT(parse_policy_spec("snapkv:window", &s).message(), Contains("'window' is not key=value"));
  REQUIRE_THAT(parse_policy_spec(":window=3", &s).message(), Contains("empty policy name"));
}

TEST_CASE("registry: parameters set from specs, errors name the key and the valid ones", "[registry]") {
  SnapKV p;
  REQUIRE(make_policy("snapkv:compression_ratio=0.25,window=16,kernel=7,pooling=max,order=group_then_pool", &p, SnapKVParams::kvpress(0.5))
              .is_ok());
  REQUIRE(p.params().window == 16);
  REQUIRE(p.params().kernel == 7);
  REQUIRE(p.params().pooling == Pooling::kMax);
  REQUIRE(p.params().order == ReduceOrder::kGroupThenPool);
  REQUIRE(p.params().budget.kind == BudgetKind::kCompressionRatio);
  REQUIRE(p.params().budget.value == 0.25);
  SnapKV q;
  REQUIRE(make_policy("snapkv:tokens=128", &q, SnapKVParams::original(64)).is_ok());
  REQUIRE(q.params().budget.kind == BudgetKind::kTokens);
  REQUIRE(q.params().budget.allow_above_length);  // the preset's flags survive
  const Status bad_key = make_policy("snapkv:windw=3", &q);
  REQUIRE_THAT(bad_key.message(), Contains("unknown parameter 'windw'") && Contains("valid: window, kernel, pooling"));
  REQUIRE_THAT(make_policy("snapkv:kernel=4", &q).message(), Contains("pooling kernel is 4, must be odd"));
  REQUIRE_THAT(make_policy("snapkv:pooling=median", &q).message(), Contains("expected one of none|avg|max"));
  REQUIRE_THAT(make_policy("snapkv:window=abc", &q).message(), Contains("expected an integer"));
  REQUIRE_THAT(make_policy("snapkv:compression_ratio=1.5", &q).message(), Contains("compression_ratio is 1.5, must be in [0, 1)"));
  REQUIRE_THAT(make_policy("tova:window=3", &q).message(), Contains("names 'tova', expected 'snapkv'"));
  H2O h;
  REQUIRE(make_policy("h2o:hh_size=32,recent_size=96,granularity=query_head", &h).is_ok());
  REQUIRE(h.params().heavy.kind == BudgetKind::kTokens);
  REQUIRE(h.params().heavy.value == 32);
  REQUIRE(h.params().recent.value == 96);
  REQUIRE(h.params().granularity == H2OGranularity::kQueryHead);
  REQUIRE(make_policy("h2o:heavy_ratio=0.1,recent_ratio=0.2", &h).is_ok());
  REQUIRE(h.params().heavy.kind == BudgetKind::kKeepRatio);
  REQUIRE(h.cache_size(1000) == 300);
  REQUIRE_THAT(make_policy("h2o:compression_ratio=0.5", &h).message(),
               Contains("unknown parameter 'compression_ratio'") && Contains("valid: hh_size, heavy_ratio, recent_size, recent_ratio"));
  Quest qu;
  REQUIRE(make_policy("quest:token_budget=256,gqa=group_max", &qu).is_ok());
  REQUIRE(qu.params().gqa == QuestGqa::kGroupMax);
  PyramidKV py;
  REQUIRE(make_policy("pyramidkv:window=16,layer=3,num_layers=8", &py, PyramidKVParams::kvpress(0.5, 0, 32)).is_ok());
  REQUIRE(py.params().scoring.window == 16);
  REQUIRE(py.params().schedule.window == 16);  // one window, both places
}

TEST_CASE("registry: erased eviction equals the typed call for every erased policy", "[registry]") {
  const kvp_test::RandomCase<half> rc(8, 2, 150, 32, 16, 7);
  const auto in = rc.input();
  const ProblemShape shape{8, 2, 32, 150, 16};
  for (const std::string spec : {"snapkv:compression_ratio=0.5,window=16", "streaming_llm:compression_ratio=0.75", "tova",
                                 "pyramidkv:window=16,layer=5", "adakv:window=16,compression_ratio=0.6"}) {
    INFO(spec);
    AnyEvictionPolicy p;
    REQUIRE(make_eviction_policy(spec, &p).is_ok());
    for (BackendKind b : {BackendKind::kScalar, BackendKind::kCpu}) {
      const Requirements r = p.requirements(b, shape);
      REQUIRE(r.status.is_ok());
      kvp_test::KeepSetBuffer keep(r.output.rows, r.output.capacity);
      std::vector<std::byte> ws(r.workspace_bytes);
      REQUIRE(p.evict(b, in, keep.view(), Workspace{ws.data(), ws.size()}).is_ok());
      if (spec.rfind("snapkv", 0) == 0) {
        REQUIRE(keep == kvp_test::run_evict<backend::Scalar>(SnapKV(SnapKVParams::kvpress(0.5, 16)), in));
      }
      if (spec == "tova") REQUIRE(keep == kvp_test::run_evict<backend::Scalar>(TOVA(TOVAParams::kvpress(0.5)), in));
    }
  }
  AnyEvictionPolicy ea;
  REQUIRE(make_eviction_policy("expected_attention:compression_ratio=0.5,n_sink=2", &ea).is_ok());
  std::vector<half> values(2 * 150 * 32, from_float<half>(0.5f));
  ScoreInput<float, half> with_values = in;
  with_values.values = KVSource<half>::from(TensorView<const half, 3>::contiguous(values.data(), {2, 150, 32}));
  const Requirements r = ea.requirements(BackendKind::kCpu, shape);
  kvp_test::KeepSetBuffer keep(r.output.rows, r.output.capacity);
  std::vector<std::byte> ws(r.workspace_bytes);
  REQUIRE(ea.evict(BackendKind::kCpu, with_values, keep.view(), Workspace{ws.data(), ws.size()}).is_ok());
}

TEST_CASE("registry: score gives the map whose per-row top-k is evict's kept set", "[registry][score]") {
  const kvp_test::RandomCase<half> rc(8, 2, 150, 32, 16, 11);
  ScoreInput<float, half> in = rc.input();
  std::vector<half> values(2 * 150 * 32);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = from_float<half>(static_cast<float>((i * 37) % 101) / 50.0f - 1.0f);
  in.values = KVSource<half>::from(TensorView<const half, 3>::contiguous(values.data(), {2, 150, 32}));
  const ProblemShape shape{8, 2, 32, 150, 16};
  for (const std::string spec :
       {"snapkv:compression_ratio=0.5,window=16", "tova", "pyramidkv:window=16,layer=5", "adakv:window=16,compression_ratio=0.6",
        "expected_attention:compression_ratio=0.5,n_sink=2", "knorm:compression_ratio=0.7"}) {
    INFO(spec);
    AnyEvictionPolicy p;
    REQUIRE(make_eviction_policy(spec, &p).is_ok());
    REQUIRE(p.has_scores());
    for (BackendKind b : {BackendKind::kScalar, BackendKind::kCpu}) {
      const Requirements r = p.requirements(b, shape);
      REQUIRE(r.status.is_ok());
      kvp_test::KeepSetBuffer keep(r.output.rows, r.output.capacity);
      std::vector<std::byte> ws(r.workspace_bytes);
      REQUIRE(p.evict(b, in, keep.view(), Workspace{ws.data(), ws.size()}).is_ok());
      const Requirements sr = p.score_requirements(b, shape);
      REQUIRE(sr.status.is_ok());
      std::vector<std::byte> sws(sr.workspace_bytes);
      std::vector<float> s(2 * 150);
      const Status st = p.score(b, in, TensorView<float, 2>::contiguous(s.data(), {2, 150}), Workspace{sws.data(), sws.size()});
      INFO(st.message());
      REQUIRE(st.is_ok());
      REQUIRE(keep.view().num_rows == 2);
      for (std::int64_t h = 0; h < 2; ++h) {
        const auto row = keep.row(h);
        std::vector<std::int32_t> top(row.size());
        std::vector<std::byte> tws(backend::Scalar::topk_workspace(150));
        backend::Scalar::topk(s.data() + h * 150, 150, static_cast<std::int64_t>(row.size()), top.data(),
                              Workspace{tws.data(), tws.size()});
        REQUIRE(row == top);
      }
      if (spec.rfind("snapkv", 0) == 0)  // the window scores +inf
        for (std::int64_t j = 150 - 16; j < 150; ++j) REQUIRE(s[j] == std::numeric_limits<float>::infinity());
    }
  }
  AnyEvictionPolicy sl;
  REQUIRE(make_eviction_policy("streaming_llm", &sl).is_ok());
  REQUIRE_FALSE(sl.has_scores());
  std::vector<float> s(2 * 150);
  REQUIRE_THAT(
      sl.score(BackendKind::kCpu, in, TensorView<float, 2>::contiguous(s.data(), {2, 150}), Workspace{}).message(),
      Contains("streaming_llm has no per-token scores: StreamingLLM keeps the attention sinks and the most recent tokens by position"));
  REQUIRE_THAT(sl.score_requirements(BackendKind::kCpu, shape).status.message(), Contains("streaming_llm has no per-token scores"));
}

TEST_CASE("registry: unknown and typed-only names give a clear error", "[registry]") {
  AnyEvictionPolicy p;
  REQUIRE_THAT(make_eviction_policy("snapkvv", &p).message(), Contains("no eviction policy named 'snapkvv'; known: streaming_llm, snapkv"));
  REQUIRE_THAT(make_eviction_policy("h2o", &p).message(), Contains("caller-owned state; build it with make_policy"));
  REQUIRE_FALSE(p);
  REQUIRE_FALSE(p.requirements(BackendKind::kCpu, {}).status.is_ok());
}

TEST_CASE("registry: every policy is listed with family, paper and parameter defaults", "[registry]") {
  const auto& reg = registry();
  std::vector<std::string> names;
  for (const auto& p : reg) names.emplace_back(p.name);
  REQUIRE(names == std::vector<std::string>{"streaming_llm", "snapkv", "observed_attention", "tova", "pyramidkv", "adakv",
                                            "expected_attention", "knorm", "h2o", "quest", "ggml", "fp8", "kivi", "int4"});
  for (const auto& p : reg) {
    INFO(p.name);
    REQUIRE(!p.family.empty());
    REQUIRE_THAT(std::string(p.paper), Contains("arXiv") || Contains("github.com"));
    REQUIRE(!p.params.empty());
  }
  const std::string text = describe_registry();
  REQUIRE_THAT(text, Contains("snapkv") && Contains("window=64") && Contains("compression_ratio=0.5") && Contains("kernel=5"));
  REQUIRE_THAT(text, Contains("quest") && Contains("selection") && Contains("token_budget=512"));
  REQUIRE_THAT(text, Contains("ggml") && Contains("quantization") && Contains("type=q8_0"));
  GgmlQuant g;
  REQUIRE(make_policy("ggml:type=iq4_nl", &g).is_ok());
  REQUIRE(g.params().type == GgmlType::kIQ4_NL);
  REQUIRE_THAT(make_policy("ggml:type=q3_k", &g).message(), Contains("expected one of q8_0|q4_0|q4_1|q5_0|q5_1|iq4_nl"));
  REQUIRE(make_policy("ggml:type=q4_0,rotation=llama_cpp,role=values", &g).is_ok());
  REQUIRE(g.rotation_block(128) == 64);
  KiviQuant kivi;
  REQUIRE(make_policy("kivi:role=values,bits=4,residual=32", &kivi).is_ok());
  REQUIRE(
      (kivi.params().role == QuantRole::kValues && kivi.params().bits == 4 && kivi.params().group == 32 && kivi.params().residual == 32));
  REQUIRE_THAT(make_policy("kivi:bits=3", &kivi).message(), Contains("bits is 3"));
  Int4Quant int4;
  REQUIRE(make_policy("int4:rotation=block,block=16", &int4).is_ok());
  REQUIRE(int4.rotation_block(128) == 16);
  REQUIRE_THAT(make_policy("int4:rotation=hadamard", &int4).message(), Contains("none|llama_cpp|block"));
}

TEST_CASE("registry: a size query that fails reports no sizes, so the README's allocation idiom is safe", "[registry][requirements]") {
  // Issue #16.11: a failing size query used to return 2^64 - 64 workspace bytes, and `std::vector ws(bytes)`
  // threw before the call could report the bad parameter. Now every failing requirements() carries zeros.
  const ProblemShape bad_gqa{3, 2, 32, 400, 16};  // 3 query heads over 2 kv heads
  for (const char* spec : {"snapkv", "streaming_llm", "tova", "observed_attention", "pyramidkv:layer=1,num_layers=4", "adakv",
                           "expected_attention", "snapkv:tokens=100000"}) {
    INFO(spec);
    AnyEvictionPolicy p;
    REQUIRE(make_eviction_policy(spec, &p).is_ok());
    const ProblemShape shape = std::string(spec).find("tokens=") != std::string::npos ? ProblemShape{8, 2, 32, 400, 16} : bad_gqa;
    const Requirements r = p.requirements(BackendKind::kCpu, shape);
    REQUIRE(!r.status.is_ok());
    REQUIRE(r.workspace_bytes == 0);
    REQUIRE(r.output.rows == 0);
    REQUIRE(r.output.capacity == 0);
    std::vector<std::byte> ws(r.workspace_bytes);  // the idiom: never throws
    REQUIRE(ws.empty());
  }
}
