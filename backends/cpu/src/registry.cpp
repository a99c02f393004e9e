// SPDX-License-Identifier: Apache-2.0
// The built-in registry tables (kvpolicy/registry.hpp): compiled once here,
// because every erased policy is instantiated on Scalar and Cpu for three key
// dtypes.
#include "kvpolicy/registry.hpp"

#include <algorithm>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/kivi_quant.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/knorm.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/streaming_llm.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "kvpolicy/policy/selection/quest.hpp"

KVP_NAMESPACE_BEGIN

namespace {

/// Ada-KV over SnapKV scoring as one spec: the allocation's keys plus the scorer's.
struct AdaKVSpecParams {
  AdaKVParams alloc = AdaKVParams::kvpress(0.5);
  SnapKVParams scoring = adakv_scoring();

  static constexpr auto fields() noexcept {
    using P = AdaKVSpecParams;
    return std::tuple{
        ParamField<P, AdaKVVariant>{"variant", "allocation", [](const P& p) { return p.alloc.variant; },
                                    [](P& p, const AdaKVVariant& v) { p.alloc.variant = v; }},
        ParamField<P, HeadGranularity>{"heads", "rows per kv head or per query head", [](const P& p) { return p.alloc.heads; },
                                       [](P& p, const HeadGranularity& v) { p.alloc.heads = v; }},
        ParamField<P, double>{"alpha", "original: floor_alpha; kvpress: alpha_safeguard", [](const P& p) { return p.alloc.alpha; },
                              [](P& p, const double& v) { p.alloc.alpha = v; }},
        ParamField<P, bool>{"normalize", "original: normalise rows before the global top-k", [](const P& p) { return p.alloc.normalize; },
                            [](P& p, const bool& v) { p.alloc.normalize = v; }},
        ParamField<P, Budget>{"budget", "compression_ratio=r | tokens=n | keep_ratio=f", [](const P& p) { return p.alloc.budget; },
                              [](P& p, const Budget& v) { p.alloc.budget = v; }},
        ParamField<P, std::int32_t>{"window", "scoring window", [](const P& p) { return p.scoring.window; },
                                    [](P& p, const std::int32_t& v) { p.scoring.window = v; }},
        ParamField<P, std::int32_t>{"kernel", "pooling kernel (odd)", [](const P& p) { return p.scoring.kernel; },
                                    [](P& p, const std::int32_t& v) { p.scoring.kernel = v; }},
        ParamField<P, Pooling>{"pooling", "pooling along tokens", [](const P& p) { return p.scoring.pooling; },
                               [](P& p, const Pooling& v) { p.scoring.pooling = v; }},
        ParamField<P, GroupReduce>{"group_reduce", "reduction over a GQA group", [](const P& p) { return p.scoring.group_reduce; },
                                   [](P& p, const GroupReduce& v) { p.scoring.group_reduce = v; }}};
  }
};

/// Expected Attention behind the common ScoreInput: `queries` are read as the
/// prompt's pre-RoPE queries (the statistics come from them), `values` must be
/// given; no precomputed statistics.
class ExpectedAttentionOnScoreInput {
 public:
  using Params = ExpectedAttentionParams;
  static constexpr const char* kName = "expected_attention";
  explicit ExpectedAttentionOnScoreInput(const Params& p) : ea_(p) {}
  const Params& params() const noexcept { return ea_.params(); }
  Status validate_params() const noexcept { return ea_.validate_params(); }
  std::int64_t kept_count(std::int64_t n) const noexcept { return ea_.kept_count(n); }
  std::int64_t protected_tokens(std::int64_t n) const noexcept { return ea_.protected_tokens(n); }
  template <class B>
  Requirements requirements(const Context<B>& ctx, const ProblemShape& s) const noexcept {
    return ea_.requirements(ctx, s);
  }
  /// Expected Attention's scores of one sequence, (num_kv_heads, kv_len), sinks +inf.
  template <class B, class Tk>
  Status score(const Context<B>& ctx, const ScoreInput<float, Tk>& in, ScoreMap out) const noexcept {
    ExpectedAttentionInput<float, Tk> x;
    static_cast<ScoreInput<float, Tk>&>(x) = in;
    return ea_.score(ctx, x, out);
  }
  template <class B, class Tk>
  Status evict(const Context<B>& ctx, std::span<const ScoreInput<float, Tk>> batch, KeepSet out) const noexcept {
    try {
      std::vector<ExpectedAttentionInput<float, Tk>> in(batch.size());
      for (std::size_t b = 0; b < batch.size(); ++b) static_cast<ScoreInput<float, Tk>&>(in[b]) = batch[b];
      return ea_.evict(ctx, std::span<const ExpectedAttentionInput<float, Tk>>(in), out);
    } catch (const std::bad_alloc&) {
      return KVP_INVALID("expected_attention: out of memory building %zu inputs", batch.size());
    }
  }

 private:
  ExpectedAttention ea_;
};

using Make = std::function<Status(const PolicySpec&, AnyEvictionPolicy*)>;

struct Entry {
  PolicyInfo info;
  Make make;  // null: typed only (make_policy<P>)
};

/// `no_scores`: why a policy that is not a Scorer has no per-token scores (AnyEvictionPolicy::score's message).
template <class P>
Entry erased(std::string_view family, std::string_view paper, typename P::Params defaults, std::string no_scores = {}) {
  Entry e;
  e.info = PolicyInfo{P::kName, family, paper, describe_params(defaults), true};
  e.make = [defaults, no_scores](const PolicySpec& spec, AnyEvictionPolicy* out) -> Status {
    typename P::Params p = defaults;
    KVP_RETURN_IF_ERROR(apply_spec_args(P::kName, spec, p));
    const P policy(p);
    KVP_RETURN_IF_ERROR(policy.validate_params());
    *out = AnyEvictionPolicy::of(policy, P::kName, no_scores);
    return Status::ok();
  };
  return e;
}

template <class P>
Entry typed(std::string_view family, std::string_view paper, const typename P::Params& defaults) {
  return Entry{PolicyInfo{P::kName, family, paper, describe_params(defaults), false}, nullptr};
}

const std::vector<Entry>& entries() {
  static const std::vector<Entry> table = [] {
    std::vector<Entry> t;
    t.push_back(erased<StreamingLLM>(
        "eviction", "Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks, arXiv 2309.17453",
        StreamingLLMParams::kvpress(0.5), "StreamingLLM keeps the attention sinks and the most recent tokens by position"));
    t.push_back(erased<SnapKV>("eviction", "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation, arXiv 2404.14469",
                               SnapKVParams::kvpress(0.5)));
    t.push_back(erased<ObservedAttention>("eviction", "kvpress ObservedAttentionPress (one-shot H2O scores), arXiv 2306.14048",
                                          ObservedAttentionParams::kvpress(0.5)));
    t.push_back(
        erased<TOVA>("eviction", "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA), arXiv 2401.06104", TOVAParams::kvpress(0.5)));
    t.push_back(erased<PyramidKV>("eviction", "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression, arXiv 2406.02069",
                                  PyramidKVParams::kvpress(0.5, 0, 32)));
    {
      Entry e;
      const AdaKVSpecParams defaults{};
      e.info =
          PolicyInfo{"adakv", "eviction", "Feng et al. 2024, Ada-KV: Adaptive Budget Allocation, arXiv 2407.11550 (over SnapKV scores)",
                     describe_params(defaults), true};
      e.make = [defaults](const PolicySpec& spec, AnyEvictionPolicy* out) -> Status {
        AdaKVSpecParams p = defaults;
        KVP_RETURN_IF_ERROR(apply_spec_args("adakv", spec, p));
        const AdaKV<SnapKV> policy(p.alloc, SnapKV(p.scoring));
        KVP_RETURN_IF_ERROR(policy.validate_params());
        KVP_RETURN_IF_ERROR(policy.scorer().validate_params());
        *out = AnyEvictionPolicy::of(policy, "adakv");
        return Status::ok();
      };
      t.push_back(std::move(e));
    }
    t.push_back(erased<ExpectedAttentionOnScoreInput>(
        "eviction", "Devoto et al. 2025, Expected Attention, arXiv 2510.00636 (queries = pre-RoPE prompt queries; values required)",
        ExpectedAttentionParams::kvpress(0.5)));
    t.push_back(erased<Knorm>(
        "eviction", "Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, arXiv 2406.11430",
        KnormParams::kvpress(0.5)));
    t.push_back(
        typed<H2O>("eviction (online)", "Zhang et al. 2023, H2O: Heavy-Hitter Oracle, arXiv 2306.14048 (state: H2OState)", H2OParams{}));
    t.push_back(
        typed<Quest>("selection", "Tang et al. 2024, Quest: Query-Aware Sparsity, arXiv 2406.10774 (state: page metadata)", QuestParams{}));
    t.push_back(typed<GgmlQuant>("quantization",
                                 "llama.cpp KV cache types, github.com/ggml-org/llama.cpp ggml-common.h (bit-exact with gguf-py 0.19)",
                                 GgmlQuantParams{}));
    t.push_back(typed<Fp8Quant>(
        "quantization",
        "OCP FP8 e4m3 / e5m2 KV caches with vLLM's scale layouts, github.com/vllm-project/vllm (saturating, as CUDA SATFINITE)",
        Fp8QuantParams{}));
    t.push_back(typed<KiviQuant>("quantization",
                                 "Liu et al. 2024, KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache, arXiv 2402.02750 "
                                 "(state: KiviState residual; bit-exact with the reference's fp16 arithmetic)",
                                 KiviQuantParams{}));
    t.push_back(typed<Int4Quant>("quantization",
                                 "SAW-INT4 token-wise INT4 + block-diagonal Hadamard rotation, arXiv 2604.19157; llama.cpp attn_rot "
                                 "(PR #21038) block sizes by default",
                                 Int4QuantParams{}));
    return t;
  }();
  return table;
}

std::string known_names() {
  std::string s;
  for (const auto& e : entries()) {
    if (!e.make) continue;
    if (!s.empty()) s += ", ";
    s += e.info.name;
  }
  return s;
}

}  // namespace

const std::vector<PolicyInfo>& registry() {
  static const std::vector<PolicyInfo> infos = [] {
    std::vector<PolicyInfo> v;
    for (const auto& e : entries()) v.push_back(e.info);
    return v;
  }();
  return infos;
}

Status make_eviction_policy(std::string_view spec_text, AnyEvictionPolicy* out) {
  KVP_REQUIRE(out != nullptr, "make_eviction_policy: out is null");
  PolicySpec spec;
  KVP_RETURN_IF_ERROR(parse_policy_spec(spec_text, &spec));
  for (const auto& e : entries()) {
    if (e.info.name != spec.name) continue;
    KVP_REQUIRE(e.make != nullptr, "%s: a %s policy with caller-owned state; build it with make_policy<>() (one-shot eviction: %s)",
                spec.name.c_str(), std::string(e.info.family).c_str(), known_names().c_str());
    AnyEvictionPolicy p;
    KVP_RETURN_IF_ERROR(e.make(spec, &p));
    *out = std::move(p);
    return Status::ok();
  }
  return KVP_INVALID("no eviction policy named '%s'; known: %s", spec.name.c_str(), known_names().c_str());
}

std::string describe_registry() {
  std::size_t w_name = 4, w_family = 6;
  for (const auto& p : registry()) {
    w_name = std::max(w_name, p.name.size());
    w_family = std::max(w_family, p.family.size());
  }
  std::string out;
  for (const auto& p : registry()) {
    std::string line = std::string(p.name);
    line.resize(w_name + 2, ' ');
    line += p.family;
    line.resize(w_name + 2 + w_family + 2, ' ');
    line += p.paper;
    line += "\n   ";
    for (const auto& a : p.params) line += " " + a.name + "=" + a.value;
    out += line + "\n";
  }
  return out;
}

KVP_NAMESPACE_END
