// SPDX-License-Identifier: Apache-2.0
// eval.hpp compiled once (kvp_engine_lib): the policy factories (their hooks
// instantiated here) and the evaluation harness; the task-set reader
// (task_set.hpp) is in model.cpp, with the other JSON readers.
#include "eval.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/registry.hpp"

namespace kvp_engine {

namespace {
/// The registry policy of `spec` with the request's budget appended (tokens=min(budget, prompt_len)); the spec
/// itself is checked at once, so a bad one fails here, not at the first request.
auto registry_maker(const std::string& spec) {
  kvpolicy::PolicySpec parsed;
  kvpolicy::throw_if_error(kvpolicy::parse_policy_spec(spec, &parsed));
  kvpolicy::AnyEvictionPolicy check;
  kvpolicy::throw_if_error(kvpolicy::make_eviction_policy(spec, &check));
  return [spec](std::int64_t prompt_len, std::int64_t budget) {
    const std::string s =
        spec + (spec.find(':') == std::string::npos ? ":" : ",") + "tokens=" + std::to_string(std::min(budget, prompt_len));
    kvpolicy::AnyEvictionPolicy p;
    kvpolicy::throw_if_error(kvpolicy::make_eviction_policy(s, &p));
    return p;
  };
}
}  // namespace

PolicyUnderTest registry_policy(const std::string& spec, std::int64_t query_window, const std::string& name) {
  kvpolicy::PolicySpec parsed;
  kvpolicy::throw_if_error(kvpolicy::parse_policy_spec(spec, &parsed));
  auto make = registry_maker(spec);
  PolicyUnderTest p;
  p.name = name.empty() ? parsed.name : name;
  p.query_window = query_window;
  p.contiguous = [make](std::int64_t prompt_len, std::int64_t budget) {
    return eviction_hooks<ContiguousKVCache<float>>(make(prompt_len, budget));
  };
  p.paged = [make](std::int64_t prompt_len, std::int64_t budget) { return eviction_hooks<PagedKVCache<float>>(make(prompt_len, budget)); };
  return p;
}

PolicyUnderTest pyramidkv_policy(std::int32_t num_layers, std::int32_t window) {
  return on_both_layouts("pyramidkv", 64, [=]<class Cache>(std::int64_t budget) {
    return eviction_hooks_by_layer<Cache>([=](int layer) {
      return kvpolicy::PyramidKV(kvpolicy::PyramidKVParams::original(budget, layer, num_layers, window, 7, kvpolicy::Pooling::kMax));
    });
  });
}

PolicyUnderTest adakv_policy(std::int32_t window, std::int32_t kernel) {
  PolicyUnderTest p;
  p.name = "adakv";
  p.contiguous = [=](std::int64_t, std::int64_t budget) {
    kvpolicy::AdaKVParams a = kvpolicy::AdaKVParams::kvpress(0.0, 0.2);
    a.budget = kvpolicy::Budget::tokens(budget).clamp_to_length();
    return eviction_hooks<ContiguousKVCache<float>>(
        kvpolicy::AdaKV<kvpolicy::SnapKV>(a, kvpolicy::SnapKV(kvpolicy::SnapKVParams::kvpress(0.0, window, kernel))));
  };
  return p;
}

PolicyUnderTest h2o_policy(bool from_column_sums) {
  PolicyUnderTest p = on_both_layouts("h2o", from_column_sums ? 1 : PolicyUnderTest::kWholePrompt, []<class Cache>(std::int64_t budget) {
    return h2o_hooks<Cache>(kvpolicy::H2O(kvpolicy::H2OParams::original(budget / 2, budget - budget / 2)));
  });
  p.column_sums = from_column_sums;
  return p;
}

PolicyUnderTest observed_attention_policy(bool from_column_sums) {
  if (!from_column_sums) return registry_policy("observed_attention", PolicyUnderTest::kWholePrompt);
  auto make = registry_maker("observed_attention");
  PolicyUnderTest p;
  p.name = "observed_attention";
  p.query_window = 1;  // the sums replace the prompt's queries
  p.column_sums = true;
  p.contiguous = [make](std::int64_t prompt_len, std::int64_t budget) {
    return column_sum_eviction_hooks<ContiguousKVCache<float>>(ErasedEvictionPolicy{make(prompt_len, budget)});
  };
  p.paged = [make](std::int64_t prompt_len, std::int64_t budget) {
    return column_sum_eviction_hooks<PagedKVCache<float>>(ErasedEvictionPolicy{make(prompt_len, budget)});
  };
  return p;
}

PolicyUnderTest expected_attention_policy(double rope_base) {
  return on_both_layouts("expected_attention", PolicyUnderTest::kWholePrompt, [rope_base]<class Cache>(std::int64_t budget) {
    kvpolicy::ExpectedAttentionParams q = kvpolicy::ExpectedAttentionParams::kvpress(0.0);
    q.budget = kvpolicy::Budget::tokens(budget).clamp_to_length();
    return expected_attention_hooks<Cache>(q, rope_base);
  });
}

PolicyUnderTest tova_policy() {
  return on_both_layouts("tova", 1, []<class Cache>(std::int64_t budget) {
    return tova_hooks<Cache>(kvpolicy::TOVA(kvpolicy::TOVAParams::original(budget)));
  });
}

PolicyUnderTest quest_policy(std::int32_t dense_layers) {
  PolicyUnderTest p;
  p.name = "quest";
  p.paged = [=](std::int64_t, std::int64_t budget) { return quest_hooks<float>(quest_with_budget(budget, dense_layers)); };
  return p;
}

namespace {
/// The typed K and V policies of a quantization spec (kvpolicy::visit_quant_spec), handed to f; f's result
/// (a PolicyUnderTest) returned. Throws on a bad spec.
template <class F>
PolicyUnderTest with_quant_policy(const std::string& spec, F&& f) {
  PolicyUnderTest out;
  kvpolicy::throw_if_error(kvpolicy::visit_quant_spec(spec, [&](auto k, auto v) {
    out = f(k, v);
    return Status::ok();
  }));
  return out;
}
}  // namespace

PolicyUnderTest quantization_policy(const std::string& spec, std::int32_t head_dim) {
  return with_quant_policy(spec, [&](auto k, auto v) {
    PolicyUnderTest p;
    p.name = spec;
    p.query_window = 1;
    p.kv_bytes_scale = (k.bytes_per_token(head_dim) + v.bytes_per_token(head_dim)) / (8.0 * head_dim);
    p.lossy = true;
    p.ignores_budget = true;  // every token is stored in the format whatever the budget
    using C = ContiguousKVCache<float>;
    if constexpr (std::is_same_v<decltype(k), kvpolicy::KiviQuant>) {
      p.fp16_tokens = std::max(k.params().residual, v.params().residual);
      p.contiguous = [k, v](std::int64_t, std::int64_t) { return kivi_hooks<C>(k, v); };
      p.paged = [k, v](std::int64_t, std::int64_t) { return kivi_hooks<PagedKVCache<float>>(k, v); };
    } else {
      p.contiguous = [k, v](std::int64_t, std::int64_t) { return quantize_hooks<C>(k, v, {}, {}); };
      // Paged: every row quantized at its slot of the pool, as the per-token formats allow.
      p.paged = [k, v](std::int64_t, std::int64_t) { return quantize_hooks<PagedKVCache<float>>(k, v, {}, {}); };
    }
    return p;
  });
}

PolicyUnderTest snapkv_quantized_policy(const std::string& quant_spec, std::int32_t head_dim) {
  return with_quant_policy(quant_spec, [&](auto k, auto v) {
    PolicyUnderTest p;
    p.name = "snapkv+" + quant_spec;
    p.query_window = 32;
    const double scale = (k.bytes_per_token(head_dim) + v.bytes_per_token(head_dim)) / (8.0 * head_dim);
    p.kv_bytes_scale = scale;
    p.lossy = true;
    if constexpr (std::is_same_v<decltype(k), kvpolicy::KiviQuant>) {
      // KIVI after SnapKV: the kept tokens are compacted first, then handed to KIVI (kivi_hooks.hpp). Its fp16
      // residual costs 0.5 of an fp32 token per token (up to R of them), the quantized ones `scale`: the kept
      // count whose bytes equal `budget` fp32 tokens' is 2 budget while everything fits in the residual, then
      // R + (budget - R / 2) / scale.
      const std::int64_t R = std::max(k.params().residual, v.params().residual);
      p.fp16_tokens = R;
      auto tokens_for = [R, scale](std::int64_t budget) {
        const double B = static_cast<double>(budget), r = static_cast<double>(R);
        return B <= 0.5 * r ? 2 * budget : R + static_cast<std::int64_t>((B - 0.5 * r) / scale);
      };
      p.contiguous = [k, v, tokens_for](std::int64_t, std::int64_t budget) {
        using C = ContiguousKVCache<float>;
        return kvpolicy::combine(eviction_hooks<C>(snapkv_with_budget(tokens_for(budget))), kivi_hooks<C>(k, v));
      };
      p.paged = [k, v, tokens_for](std::int64_t, std::int64_t budget) {
        using P = PagedKVCache<float>;
        return kvpolicy::combine(eviction_hooks<P>(snapkv_with_budget(tokens_for(budget))), kivi_hooks<P>(k, v));
      };
    } else {
      p.contiguous = [k, v, scale](std::int64_t, std::int64_t budget) {
        const auto tokens = static_cast<std::int64_t>(static_cast<double>(budget) / scale);
        using C = ContiguousKVCache<float>;
        return kvpolicy::combine(quantize_hooks<C>(k, v, {}, {}), eviction_hooks<C>(snapkv_with_budget(tokens)));
      };
    }
    return p;
  });
}

PolicyUnderTest snapkv_mixed_precision_policy(const std::string& quant_spec, std::int32_t head_dim, double full_share) {
  return with_quant_policy(quant_spec, [&](auto k, auto v) {
    using Q = decltype(k);
    if constexpr (std::is_same_v<Q, kvpolicy::KiviQuant>) {
      throw std::runtime_error("snapkv+mixed+" + quant_spec + ": KIVI is not a per-token format");
      return PolicyUnderTest{};
    } else {
      PolicyUnderTest p;
      p.name = "snapkv+mixed+" + quant_spec;
      p.query_window = 32;
      const double bq = (k.bytes_per_token(head_dim) + v.bytes_per_token(head_dim)) / 2.0;
      // Budget B fp32-token equivalents: full_share * B tokens at 4d bytes, the rest of the bytes at bq each.
      p.kv_bytes_scale = 1.0 / (full_share + (1.0 - full_share) * 4.0 * head_dim / bq);
      // Per run, as MixedPrecision::split counts (fp32-token units, r = bq / 4d): n_full = min(kept,
      // floor(full_share * budget)), raised to floor((budget - kept * r) / (1 - r)) when that is more (all kept
      // tokens fit: spare bytes buy precision); the other kept tokens cost r each.
      p.kv_bytes_scale_of = [full_share, bq, head_dim](double kept, std::int64_t budget) {
        if (kept <= 0.0) return 1.0;
        const double r = bq / (4.0 * head_dim), B = static_cast<double>(budget);
        double n_full = std::min(kept, std::floor(full_share * B));
        if (r < 1.0) n_full = std::clamp(std::max(n_full, std::floor((B - kept * r) / (1.0 - r))), 0.0, kept);
        return (n_full + (kept - n_full) * r) / kept;
      };
      p.lossy = false;  // a budget >= the prompt keeps every token in full precision
      p.contiguous = [k, v, full_share, head_dim](std::int64_t, std::int64_t budget) {
        kvpolicy::SnapKVParams sp = kvpolicy::SnapKVParams::kvpress(0.0, 32, 5);
        const kvpolicy::MixedPrecision<kvpolicy::SnapKV, Q> mp(
            kvpolicy::SnapKV(sp), k, kvpolicy::MixedPrecisionParams{0.25, static_cast<double>(budget) * 4.0 * head_dim, full_share});
        return mixed_precision_hooks<ContiguousKVCache<float>>(mp, k, v);
      };
      return p;
    }
  });
}

PolicyUnderTest laq_policy(std::int32_t window, kvpolicy::LookaheadMask mask) {
  auto req = std::make_shared<LaqRequest>();
  PolicyUnderTest p;
  p.name = std::string(window == 0 ? "laq" : "laq++") + (mask == kvpolicy::LookaheadMask::kCorrected ? "_corrected" : "");
  kvpolicy::LAQParams base = window == 0 ? kvpolicy::LAQParams::laq(0) : kvpolicy::LAQParams::laq_plus_plus(0);
  base.window = window;
  base.mask = mask;
  p.query_window = base.stage1_window;
  p.on_prefill = [req](const Model& m, const PrefillState& pre) { req->bind(m, pre); };
  auto make = [base](std::int64_t budget) {
    kvpolicy::LAQParams lp = base;
    lp.budget = kvpolicy::Budget::tokens(budget).clamp_to_length();
    return kvpolicy::LAQ(lp);
  };
  p.contiguous = [req, make](std::int64_t, std::int64_t budget) { return laq_hooks<ContiguousKVCache<float>>(make(budget), req); };
  p.paged = [req, make](std::int64_t, std::int64_t budget) { return laq_hooks<PagedKVCache<float>>(make(budget), req); };
  return p;
}

PolicyUnderTest snapkv_original_policy() {
  return eviction_policy("snapkv_original", [](std::int64_t budget) {
    return kvpolicy::SnapKV(kvpolicy::SnapKVParams::original(budget, 32, 7, kvpolicy::Pooling::kMax));
  });
}

PolicyUnderTest snapkv_merged_policy(const std::string& merge) {
  PolicyUnderTest p;
  p.name = "snapkv+" + merge;
  p.query_window = 32;
  auto with = [&](auto m) {
    using M = decltype(m);
    if constexpr (std::is_same_v<M, kvpolicy::CaM>) p.column_sums = true;  // the prompt's attention, from the prefill
    p.contiguous = [m](std::int64_t, std::int64_t budget) { return merge_hooks<ContiguousKVCache<float>>(snapkv_with_budget(budget), m); };
    p.paged = [m](std::int64_t, std::int64_t budget) { return merge_hooks<PagedKVCache<float>>(snapkv_with_budget(budget), m); };
  };
  if (merge == "kvpress_merging")
    with(kvpolicy::KvpressMerging{});
  else if (merge == "lookm_pivot")
    with(kvpolicy::LookMPivot{});
  else if (merge == "d2o")
    with(kvpolicy::D2O{});
  else if (merge == "nearest_kept")
    with(kvpolicy::NearestKeptMerge{});
  else if (merge == "cam")
    with(kvpolicy::CaM(kvpolicy::CaMParams::streaming()));
  else
    throw std::runtime_error("no merge policy named '" + merge + "'; expected kvpress_merging, lookm_pivot, d2o, nearest_kept or cam");
  return p;
}

PolicyUnderTest h2o_merged_policy(const std::string& merge) {
  PolicyUnderTest p;
  p.name = "h2o+" + merge;
  p.query_window = 1;  // the prompt's attention comes from the prefill's column sums
  p.column_sums = true;
  auto with = [&](auto m) {
    auto make = [m]<class Cache>(std::int64_t budget) {
      return merge_after<Cache>(h2o_hooks<Cache>(kvpolicy::H2O(kvpolicy::H2OParams::original(budget / 2, budget - budget / 2))), m);
    };
    p.contiguous = [make](std::int64_t, std::int64_t budget) { return make.template operator()<ContiguousKVCache<float>>(budget); };
    p.paged = [make](std::int64_t, std::int64_t budget) { return make.template operator()<PagedKVCache<float>>(budget); };
  };
  if (merge == "d2o")
    with(kvpolicy::D2O{});
  else if (merge == "nearest_kept")
    with(kvpolicy::NearestKeptMerge{});
  else if (merge == "cam")
    with(kvpolicy::CaM(kvpolicy::CaMParams::streaming()));
  else
    throw std::runtime_error("no online merge policy named '" + merge + "'; expected d2o, nearest_kept or cam");
  return p;
}

PolicyUnderTest snapkv_merged_quantized_policy(const std::string& merge, const std::string& quant_spec, std::int32_t head_dim) {
  return with_quant_policy(quant_spec, [&](auto k, auto v) {
    using Q = decltype(k);
    if constexpr (std::is_same_v<Q, kvpolicy::KiviQuant>) {
      throw std::runtime_error("snapkv+" + merge + "+" + quant_spec + ": KIVI is not a per-token format");
      return PolicyUnderTest{};
    } else {
      if (k.bytes_per_token(head_dim) != v.bytes_per_token(head_dim) || quant_spec.find('|') != std::string::npos)
        throw std::runtime_error("snapkv+" + merge + "+" + quant_spec + ": the pipeline stores K and V in one format");
      PolicyUnderTest p;
      p.name = "snapkv+" + merge + "+" + quant_spec;
      p.query_window = 32;
      const double scale = k.bytes_per_token(head_dim) / (4.0 * head_dim);
      p.kv_bytes_scale = scale;
      p.lossy = true;
      auto with = [&](auto m) {
        // One byte budget: what `budget` fp32 tokens of K + V take, per kv head.
        p.contiguous = [k, m, head_dim](std::int64_t, std::int64_t budget) {
          const auto bytes = static_cast<double>(budget) * 2.0 * 4.0 * head_dim;
          return pipeline_hooks(kvpolicy::Compress<kvpolicy::SnapKV, decltype(m), Q>(snapkv_with_budget(budget), m, k,
                                                                                     kvpolicy::PipelineBudget::bytes(bytes)));
        };
      };
      if (merge == "kvpress_merging")
        with(kvpolicy::KvpressMerging{});
      else
        throw std::runtime_error("no pipeline merge named '" + merge + "'; expected kvpress_merging");
      return p;
    }
  });
}

PolicyUnderTest kvpress_cam_policy(std::int64_t interval, std::int32_t merge_budget) {
  PolicyUnderTest p;
  p.name = "kvpress_cam";
  p.query_window = 1;  // reads no prompt query
  kvpolicy::KvpressCAMParams cp;
  cp.merge_budget = merge_budget;
  const kvpolicy::KvpressCAM cam(cp);
  p.contiguous = [cam, interval](std::int64_t, std::int64_t budget) {
    return kvpress_cam_hooks<ContiguousKVCache<float>>(cam, budget, interval);
  };
  p.paged = [cam, interval](std::int64_t, std::int64_t budget) { return kvpress_cam_hooks<PagedKVCache<float>>(cam, budget, interval); };
  return p;
}

PolicyUnderTest d2o_policy(bool protect_edge_layers) {
  PolicyUnderTest p;
  p.name = protect_edge_layers ? "d2o" : "d2o_all_layers";
  p.query_window = 1;  // the prompt's attention comes from the prefill's column sums
  p.column_sums = true;
  // Per request: each layer's head variances from the prompt's attention (on_prefill), then at the hooks'
  // first call the layer ratios for the run's budget.
  struct Shared {
    std::vector<float> head_var;  // (layers, q heads) of the current request
    std::int64_t layers = 0, heads = 0, prompt = 0;
  };
  auto sh = std::make_shared<Shared>();
  p.on_prefill = [sh](const Model& m, const PrefillState& pre) {
    const ModelConfig& c = m.config();
    const std::int64_t T = pre.length, Hq = c.n_heads;
    if (pre.column_sums.size() != static_cast<std::size_t>(c.n_layers))
      throw std::runtime_error("d2o: needs the prefill's attention column sums (PrefillOptions::column_sums)");
    sh->layers = c.n_layers;
    sh->heads = Hq;
    sh->prompt = T;
    sh->head_var.assign(static_cast<std::size_t>(c.n_layers * Hq), 0.0f);
    // Per query head: Var_j of its column sums (D2O's v before the head min-max).
    for (int l = 0; l < c.n_layers; ++l)
      kvpolicy::throw_if_error(kvpolicy::D2O::column_variance(
          TensorView<const float, 2>::contiguous(pre.column_sums[static_cast<std::size_t>(l)].data(), {Hq, T}),
          std::span<float>(sh->head_var.data() + l * Hq, static_cast<std::size_t>(Hq))));
  };
  auto make = [sh, protect_edge_layers]<class Cache>(std::int64_t budget) {
    // rho = budget / prompt, split evenly between heavy hitters and recent tokens (the paper's 0.1 + 0.1).
    auto ratios = std::make_shared<std::vector<double>>();
    auto at = [sh, budget, ratios, protect_edge_layers](int layer) {
      if (ratios->empty()) {
        if (sh->layers == 0) throw std::runtime_error("d2o: no prefill seen (on_prefill was not called)");
        ratios->assign(static_cast<std::size_t>(sh->layers), 1.0);
        if (budget < sh->prompt) {  // a budget >= the prompt keeps everything (the harness's contract)
          const double rho = static_cast<double>(budget) / static_cast<double>(sh->prompt);
          kvpolicy::D2OParams lp;
          lp.hh_ratio = lp.recent_ratio = rho / 2;
          lp.protect_edge_layers = protect_edge_layers;
          kvpolicy::throw_if_error(kvpolicy::D2O(lp).layer_ratios(
              TensorView<const float, 2>::contiguous(sh->head_var.data(), {sh->layers, sh->heads}), *ratios));
        }
      }
      const double r = (*ratios)[static_cast<std::size_t>(layer)];
      // r = 1: the layer is never compressed (D2O's layers 0, 1 and the last), not even as decoding grows it.
      const std::int64_t kept = r >= 1.0 ? (std::int64_t{1} << 40) : static_cast<std::int64_t>(r * static_cast<double>(sh->prompt));
      kvpolicy::D2OParams tp;
      tp.heavy = kept / 2;
      tp.recent = kept - kept / 2;
      return kvpolicy::D2O(tp);
    };
    return d2o_hooks<Cache>(at);
  };
  p.contiguous = [make](std::int64_t, std::int64_t budget) { return make.template operator()<ContiguousKVCache<float>>(budget); };
  p.paged = [make](std::int64_t, std::int64_t budget) { return make.template operator()<PagedKVCache<float>>(budget); };
  return p;
}

std::vector<PolicyUnderTest> all_policies(const ModelConfig& c) {
  // One-shot eviction the registry builds from a spec string (the budget is appended), and the policies with
  // their own hooks (see the header comment).
  return {registry_policy("streaming_llm:sinks=4"), h2o_policy(), tova_policy(), observed_attention_policy(),
          registry_policy("snapkv:window=32,kernel=5"),
          // The two settings that decide retrieval on SmolLM2: an observation window about the question's length,
          // and more protected leading tokens (the chat template and system prompt of instruct models).
          registry_policy("snapkv:window=16,kernel=5", 64, "snapkv_w16"),
          registry_policy("streaming_llm:sinks=64", 64, "streaming_llm_sinks64"), adakv_policy(), pyramidkv_policy(c.n_layers),
          expected_attention_policy(c.rope_base), quest_policy(), snapkv_original_policy(), laq_policy(0), laq_policy(8),
          laq_policy(8, kvpolicy::LookaheadMask::kCorrected), quantization_policy("ggml:type=q8_0", c.head_dim),
          quantization_policy("ggml:type=q4_0", c.head_dim), quantization_policy("fp8:format=e4m3", c.head_dim),
          snapkv_quantized_policy("ggml:type=q4_0", c.head_dim), snapkv_quantized_policy("ggml:type=q8_0", c.head_dim),
          // Token-wise INT4: llama.cpp's rotation rule (none at head_dim 32, 64 on SmolLM2), none, and SAW-INT4's
          // K-only BDR with its code's default block 16; q4_0 rotated; KIVI with the 32-token residual of its
          // examples; INT4 after SnapKV on one byte budget.
          quantization_policy("int4", c.head_dim), quantization_policy("int4:rotation=none", c.head_dim),
          quantization_policy("int4:rotation=block,block=16|int4:rotation=none", c.head_dim),
          quantization_policy("ggml:type=q4_0,rotation=llama_cpp", c.head_dim), quantization_policy("kivi:bits=2,residual=32", c.head_dim),
          quantization_policy("kivi:bits=4,residual=32", c.head_dim), snapkv_quantized_policy("int4", c.head_dim),
          // KIVI with the reference's 128-token residual (its README and LongBench scripts), and KIVI after SnapKV on
          // one byte budget (the kept tokens compacted, then quantized, the 32-token residual counted).
          quantization_policy("kivi:bits=2,residual=128", c.head_dim), quantization_policy("kivi:bits=4,residual=128", c.head_dim),
          snapkv_quantized_policy("kivi:bits=2,residual=32", c.head_dim), snapkv_quantized_policy("kivi:bits=4,residual=32", c.head_dim),
          // Mixed precision (ZipCache / ARKV): SnapKV's ranking, half the bytes on full-precision tokens, the rest INT4.
          snapkv_mixed_precision_policy("int4", c.head_dim, 0.5), snapkv_merged_policy("kvpress_merging"),
          snapkv_merged_policy("lookm_pivot"), snapkv_merged_policy("d2o"), snapkv_merged_policy("nearest_kept"),
          snapkv_merged_policy("cam"), h2o_merged_policy("d2o"), h2o_merged_policy("nearest_kept"), h2o_merged_policy("cam"),
          kvpress_cam_policy(), d2o_policy(), d2o_policy(false),
          snapkv_merged_quantized_policy("kvpress_merging", "ggml:type=q4_0", c.head_dim)};
}

PolicyUnderTest find_policy(const ModelConfig& c, const std::string& name) {
  std::string known;
  for (auto& p : all_policies(c)) {
    if (p.name == name) return std::move(p);
    known += (known.empty() ? "" : ", ") + p.name;
  }
  throw std::runtime_error("no engine policy named '" + name + "'; known: " + known);
}

namespace detail {

double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  auto log_softmax = [](std::span<const float> x) {
    double mx = -INFINITY;
    for (float v : x) mx = std::max(mx, static_cast<double>(v));
    double s = 0.0;
    for (float v : x) s += std::exp(static_cast<double>(v) - mx);
    std::vector<double> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<double>(x[i]) - mx - std::log(s);
    return out;
  };
  const auto lp = log_softmax(p_logits), lq = log_softmax(q_logits);
  double kl = 0.0;
  for (std::size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(0.0, kl);
}

template std::vector<std::vector<float>> run_sample(const Model&, const PrefillState&, const TaskSample&, ContiguousKVCache<float>,
                                                    Hooks<ContiguousKVCache<float>>, SessionStats*, double*, bool);
template std::vector<std::vector<float>> run_sample(const Model&, const PrefillState&, const TaskSample&, PagedKVCache<float>,
                                                    Hooks<PagedKVCache<float>>, SessionStats*, double*, bool);

}  // namespace detail

std::vector<TaskEvalResult> run_task_eval(const Model& m, std::span<const TaskSample> samples, std::span<const PolicyUnderTest> policies,
                                          std::span<const std::int64_t> budgets, const EvalOptions& opt) {
  const ModelConfig& c = m.config();
  std::int64_t max_len = 0;
  for (const auto& s : samples)
    max_len = std::max<std::int64_t>(max_len, static_cast<std::int64_t>(s.prompt.size() + s.question.size() + s.answer.size()));
  const CacheShape shape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, max_len};

  std::vector<TaskEvalResult> results;
  auto add_result = [&](std::string name, std::int64_t budget) -> TaskEvalResult& {
    TaskEvalResult r;
    r.policy = std::move(name);
    r.budget = budget;
    r.cache = opt.cache;
    results.push_back(std::move(r));
    return results.back();
  };
  add_result("full", -1);
  for (const auto& p : policies) {
    const bool runs = opt.cache == CacheKind::kContiguous ? static_cast<bool>(p.contiguous) : static_cast<bool>(p.paged);
    if (!runs) continue;
    for (auto b : budgets) add_result(p.name, b).kv_bytes_scale = p.kv_bytes_scale;
  }
  std::vector<std::int64_t> kl_steps(results.size(), 0), err_count(results.size(), 0);

  // Prompt queries to keep: the largest window any policy asks for.
  std::int64_t window = 1;
  bool column_sums = false;
  for (const auto& p : policies) {
    window = p.query_window == PolicyUnderTest::kWholePrompt ? max_len : std::max(window, p.query_window);
    column_sums = column_sums || p.column_sums;
  }

  for (std::size_t si = 0; si < samples.size(); ++si) {
    const TaskSample& s = samples[si];
    if (s.answer.empty()) throw std::runtime_error("run_task_eval: sample with an empty answer");
    PrefillOptions po;
    po.query_window = window;
    po.column_sums = column_sums;
    const PrefillState pre = prefill(m, s.prompt, po);
    for (const auto& p : policies)
      if (p.on_prefill) p.on_prefill(m, pre);
    // Scores one run of this sample into result `ri`; `ref` is the full-cache run (null for the reference itself).
    auto score = [&](std::size_t ri, const std::vector<std::vector<float>>& steps, const std::vector<std::vector<float>>* ref,
                     const SessionStats& st, double kept_bytes, double kept_fp32_bytes) {
      TaskEvalResult& r = results[ri];
      r.mean_kept_fp32_bytes += kept_fp32_bytes;
      bool ok = true, same = true;
      for (std::size_t i = 0; i < steps.size(); ++i) {
        ok = ok && argmax(steps[i]) == s.answer[i];
        if (ref != nullptr) {
          const double kl = detail::kl_divergence((*ref)[i], steps[i]);
          r.mean_kl += kl;
          r.max_kl = std::max(r.max_kl, kl);
          same = same && steps[i] == (*ref)[i];
        }
      }
      kl_steps[ri] += static_cast<std::int64_t>(steps.size());
      auto it = std::find_if(r.per_task.begin(), r.per_task.end(), [&](const TaskScore& t) { return t.task == s.task; });
      if (it == r.per_task.end()) it = r.per_task.insert(r.per_task.end(), TaskScore{s.task, 0, 0});
      it->correct += ok;
      ++it->count;
      r.correct += ok;
      ++r.count;
      r.identical_to_full += same ? 1 : 0;
      r.decision_seconds += st.hook_seconds;
      r.mean_attn_err += st.attn_err_sum;  // a sum until the end
      r.max_attn_err = std::max(r.max_attn_err, st.attn_err_max);
      err_count[ri] += st.attn_err_count;
      r.mean_kept_bytes += kept_bytes;
      r.mean_full_bytes += static_cast<double>(pre.length) * c.n_layers * static_cast<double>(m.kv_bytes_per_token(sizeof(float)));
      r.mean_attended_tokens +=
          st.decode_layer_steps ? static_cast<double>(st.attended_tokens) / static_cast<double>(st.decode_layer_steps * c.n_heads) : 0.0;
      r.sample_correct.push_back(ok ? 1 : 0);
    };
    // One teacher-forced run on a fresh cache of the configured layout.
    auto run = [&](const PolicyUnderTest* p, std::int64_t budget, SessionStats* st, double* kept) {
      if (opt.cache == CacheKind::kContiguous) {
        using C = ContiguousKVCache<float>;
        return detail::run_sample<C>(m, pre, s, C(shape), p ? p->contiguous(pre.length, budget) : Hooks<C>{}, st, kept, p != nullptr);
      }
      using P = PagedKVCache<float>;
      return detail::run_sample<P>(m, pre, s, P(shape, opt.page_size), p ? p->paged(pre.length, budget) : Hooks<P>{}, st, kept,
                                   p != nullptr);
    };
    SessionStats st;
    double kept = 0.0;
    const auto full = run(nullptr, -1, &st, &kept);
    score(0, full, nullptr, st, kept, kept);
    std::size_t ri = 1;
    for (const auto& p : policies) {
      const bool runs = opt.cache == CacheKind::kContiguous ? static_cast<bool>(p.contiguous) : static_cast<bool>(p.paged);
      if (!runs) continue;
      std::vector<std::vector<float>> steps;
      bool ran = false;
      for (auto b : budgets) {
        if (!p.ignores_budget || !ran) {  // a budget-free policy runs once per sample; its run scores every budget
          st = SessionStats{};
          steps = run(&p, b, &st, &kept);
          ran = true;
        }
        // KIVI's residual: up to fp16_tokens of each (layer, kv head)'s kept tokens at 2 bytes per value
        // (0.5 of fp32) instead of the format's bytes. `kept` is fp32 K+V bytes over all layers and heads.
        const auto& mc = m.config();
        const double per_head = kept / (static_cast<double>(mc.n_layers) * mc.n_kv_heads * 8.0 * mc.head_dim);
        const double fp16_share = per_head > 0.0 ? std::min(static_cast<double>(p.fp16_tokens), per_head) / per_head : 0.0;
        const double scale = p.kv_bytes_scale_of ? p.kv_bytes_scale_of(per_head, b) : p.kv_bytes_scale;
        score(ri++, steps, &full, st, kept * (scale + fp16_share * (0.5 - scale)), kept);
      }
    }
    if (opt.progress) opt.progress(si + 1, samples.size());
  }
  for (std::size_t i = 0; i < results.size(); ++i) {
    auto& r = results[i];
    const double n = static_cast<double>(std::max<std::int64_t>(r.count, 1));
    r.accuracy = static_cast<double>(r.correct) / n;
    r.mean_kl = kl_steps[i] ? r.mean_kl / static_cast<double>(kl_steps[i]) : 0.0;
    r.mean_attn_err = err_count[i] ? r.mean_attn_err / static_cast<double>(err_count[i]) : 0.0;
    r.mean_kept_bytes /= n;
    r.mean_kept_fp32_bytes /= n;
    r.mean_full_bytes /= n;
    r.mean_attended_tokens /= n;
  }
  return results;
}

TaskEvalResult run_task_eval(const Model& m, std::span<const TaskSample> samples, const PolicyUnderTest& policy, std::int64_t budget,
                             const EvalOptions& opt) {
  const std::int64_t b[] = {budget};
  return run_task_eval(m, samples, std::span<const PolicyUnderTest>(&policy, 1), b, opt).at(1);
}

}  // namespace kvp_engine
