// SPDX-License-Identifier: Apache-2.0
// kvp_engine: run kvp-tiny, or a llama-architecture GGUF model (SmolLM2-135M-Instruct: --model file.gguf,
// its BPE tokenizer, no BOS), with KV-cache policies; --prompt mode prints prefill and decode tokens/s and the
// share of the request spent in policy hooks.
//
//   kvp_engine --model models/kvp-tiny --prompt "... the pass key is " --tokens 8 [--cache paged] [--policy snapkv --budget 128]
//   kvp_engine --model models/kvp-tiny --prompt "... the pass key is " --policy snapkv:compression_ratio=0.5,window=32
//       greedy continuation of one prompt (BOS is prepended; the text is bytes). --policy takes "full", the
//       name of a policy of all_policies() (eval.hpp: streaming_llm, h2o, tova, observed_attention, snapkv,
//       adakv, pyramidkv, expected_attention, quest, snapkv_original, laq, laq++, laq++_corrected, ...) run
//       at --budget tokens per kv head, or any kvpolicy
//       registry spec string `name:key=value,...` (one-shot eviction after the prefill, configured by the
//       spec alone; kvpolicy::describe_registry() lists the names and keys), whose errors are printed as
//       the registry states them
//   kvp_engine --model SmolLM2-135M-Instruct.Q4_1.gguf --prompt "..." --tokens 8 --export-trace t.safetensors
//              [--trace-layers 0,15,29] [--answer " 71234"]
//       writes the attention trace of the prompt and of --tokens greedy decode steps on the full cache
//       (trace_export.hpp; the format of include/kvpolicy/io/trace.hpp), which `kvpolicy-compare --trace`
//       replays; --answer marks its tokens' occurrences in the prompt as the trace's needles
//   kvp_engine --model models/kvp-tiny --eval tests/data/engine/eval_set.json [--cache paged] [--budgets 64,128,256] [--limit N]
//       end-to-end task accuracy, logit KL vs the full cache, decision time and bytes kept for every
//       policy of all_policies() that runs on the chosen cache layout, at each budget (eval.hpp)
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <map>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "engine/eval.hpp"
#include "engine/trace_export.hpp"
#include "kvpolicy/registry.hpp"

using namespace kvp_engine;

namespace {

struct Args {
  std::string model = "models/kvp-tiny", prompt, eval, policy = "full", export_trace, answer;
  std::vector<int> trace_layers;
  CacheKind cache = CacheKind::kContiguous;
  int tokens = 16;
  std::int64_t budget = 128;
  std::vector<std::int64_t> budgets = {64, 128, 256, 512};
  std::int64_t limit = -1;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "error: %s\nusage: kvp_engine --model DIR (--prompt TEXT [--tokens N] [--policy full|NAME [--budget B]|SPEC]\n"
               "                                | --eval FILE [--budgets B1,B2,..] [--limit N]) [--cache contiguous|paged]\n"
               "       kvp_engine --model DIR|FILE.gguf --prompt TEXT --tokens N --export-trace OUT.safetensors\n"
               "                  [--trace-layers L1,L2,..] [--answer TEXT]\n"
               "  NAME: streaming_llm, h2o, tova, observed_attention, snapkv, adakv, pyramidkv, expected_attention, quest,\n"
               "        snapkv_original, laq, laq++, laq++_corrected\n"
               "  SPEC: a kvpolicy registry spec string name:key=value,... (one-shot eviction), e.g.\n"
               "        snapkv:compression_ratio=0.5,window=32\n",
               msg);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value for " + k).c_str());
      return argv[++i];
    };
    if (k == "--model")
      a.model = val();
    else if (k == "--prompt")
      a.prompt = val();
    else if (k == "--eval")
      a.eval = val();
    else if (k == "--policy")
      a.policy = val();
    else if (k == "--tokens")
      a.tokens = std::stoi(val());
    else if (k == "--budget")
      a.budget = std::stoll(val());
    else if (k == "--export-trace")
      a.export_trace = val();
    else if (k == "--answer")
      a.answer = val();
    else if (k == "--trace-layers") {
      std::stringstream ss(val());
      for (std::string tok; std::getline(ss, tok, ',');) a.trace_layers.push_back(std::stoi(tok));
    } else if (k == "--limit")
      a.limit = std::stoll(val());
    else if (k == "--cache") {
      const std::string v = val();
      if (v == "paged")
        a.cache = CacheKind::kPaged;
      else if (v == "contiguous")
        a.cache = CacheKind::kContiguous;
      else
        usage("--cache must be contiguous or paged");
    } else if (k == "--budgets") {
      a.budgets.clear();
      std::stringstream ss(val());
      for (std::string tok; std::getline(ss, tok, ',');) a.budgets.push_back(std::stoll(tok));
    } else {
      usage(("unknown argument " + k).c_str());
    }
  }
  if (a.prompt.empty() == a.eval.empty()) usage("give exactly one of --prompt and --eval");
  if (!a.export_trace.empty() && (a.prompt.empty() || a.policy != "full"))
    usage("--export-trace records the full cache of one --prompt (no --policy)");
  return a;
}

/// The hooks of --policy for one prompt of `prompt_len` tokens, and the prompt queries they need.
/// `on_prefill` receives the policy's request-level callback (LAQ), if it has one.
template <class Cache>
kvpolicy::Hooks<Cache> hooks_for(const Args& a, const Model& m, std::int64_t prompt_len, PrefillOptions* po,
                                 std::function<void(const Model&, const PrefillState&)>* on_prefill) {
  if (a.policy == "full") return {};
  if (a.policy.find(':') == std::string::npos) {  // a policy of the evaluation set, at --budget
    const PolicyUnderTest p = find_policy(m.config(), a.policy);
    po->query_window = p.query_window == PolicyUnderTest::kWholePrompt ? prompt_len : p.query_window;
    po->column_sums = p.column_sums;
    *on_prefill = p.on_prefill;
    if constexpr (Cache::kPaged) {
      if (p.paged) return p.paged(prompt_len, a.budget);
    } else {
      if (p.contiguous) return p.contiguous(prompt_len, a.budget);
    }
    usage(("policy " + a.policy + " does not run on this cache layout").c_str());
  }
  // A registry spec string: one-shot eviction after the prefill, the spec's own budget.
  kvpolicy::AnyEvictionPolicy policy;
  kvpolicy::throw_if_error(kvpolicy::make_eviction_policy(a.policy, &policy));
  const ModelConfig& c = m.config();
  const kvpolicy::ProblemShape shape{c.n_heads, c.n_kv_heads, c.head_dim, prompt_len, prompt_len};
  const kvpolicy::Requirements r = policy.requirements(kvpolicy::BackendKind::kCpu, shape);
  kvpolicy::throw_if_error(r.status);
  po->query_window = std::max<std::int64_t>(1, r.query_window);  // the queries the policy reads (prefill clamps to the prompt)
  return eviction_hooks<Cache>(std::move(policy));
}

/// The prompt's tokens: BOS when the model adds one (kvp-tiny; SmolLM2 does not), then the text's.
std::vector<std::int32_t> prompt_tokens(const Model& m, const std::string& text) {
  std::vector<std::int32_t> ids;
  if (m.config().add_bos) ids.push_back(m.config().bos_id);
  const std::vector<std::int32_t> t = m.encode(text);
  ids.insert(ids.end(), t.begin(), t.end());
  return ids;
}

template <class Cache>
int generate(const Model& m, const Args& a, Cache cache) {
  const std::vector<std::int32_t> prompt = prompt_tokens(m, a.prompt);
  PrefillOptions po;
  std::function<void(const Model&, const PrefillState&)> on_prefill;
  auto hooks = hooks_for<Cache>(a, m, static_cast<std::int64_t>(prompt.size()), &po, &on_prefill);
  Session<Cache> s(m, std::move(cache), std::move(hooks));
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const PrefillState pre = prefill(m, prompt, po);
  const auto t1 = clock::now();
  if (on_prefill) on_prefill(m, pre);
  s.load(pre);
  const auto t2 = clock::now();
  const auto out = s.greedy(a.tokens);
  const auto t3 = clock::now();
  std::printf("%s\n", m.decode(out).c_str());
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count(), decode_s = std::chrono::duration<double>(t3 - t2).count();
  const double total_s = std::chrono::duration<double>(t3 - t0).count();
  std::fprintf(stderr,
               "[%s, %lld prompt tokens, %lld evictions; prefill %.1f tokens/s, decode %.1f tokens/s; %.3f ms in policy hooks = %.2f %% of "
               "the request]\n",
               a.policy.c_str(), static_cast<long long>(prompt.size()), static_cast<long long>(s.stats().evictions),
               static_cast<double>(prompt.size()) / prefill_s, a.tokens > 1 ? (a.tokens - 1) / decode_s : 0.0, 1e3 * s.stats().hook_seconds,
               100.0 * s.stats().hook_seconds / total_s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  const Model m = Model::load(a.model);
  const ModelConfig& c = m.config();
  if (!a.prompt.empty()) {
    const std::int64_t cap = static_cast<std::int64_t>(prompt_tokens(m, a.prompt).size()) + a.tokens;
    if (cap > c.max_seq_len)
      usage(("the prompt and --tokens need " + std::to_string(cap) + " positions, the model's context is " + std::to_string(c.max_seq_len))
                .c_str());
    if (!a.export_trace.empty()) {
      TraceExportOptions to;
      to.layers = a.trace_layers;
      to.decode_steps = a.tokens;
      if (!a.answer.empty()) to.answer = m.encode(a.answer);
      to.metadata.emplace_back("prompt_source", "kvp_engine --prompt");
      const TraceExportResult r = export_trace(m, prompt_tokens(m, a.prompt), to, a.export_trace);
      std::printf("%s\n", m.decode(r.decoded).c_str());
      std::fprintf(stderr, "[trace %s: %lld prompt tokens, %d decode steps, %zu needle tokens]\n", a.export_trace.c_str(),
                   static_cast<long long>(r.prompt_tokens), a.tokens, r.needles.size());
      return 0;
    }
    const CacheShape shape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, cap};
    return a.cache == CacheKind::kPaged ? generate(m, a, PagedKVCache<float>(shape, 16)) : generate(m, a, ContiguousKVCache<float>(shape));
  }
  // kvp-tiny's byte task set, or a text task set (question-aware) for a GGUF model.
  const TextEncoder enc = [&m](const std::string& t) { return m.encode(t); };
  auto samples = m.bpe() == nullptr ? load_task_set(a.eval, c.bos_id)
                                    : load_text_task_set(a.eval, enc, QuestionSetup::kAware, c.add_bos ? c.bos_id : -1);
  if (a.limit >= 0 && static_cast<std::size_t>(a.limit) < samples.size()) {
    // Keep the task mix: take the first `limit / tasks` of every task.
    std::vector<TaskSample> sub;
    std::map<std::string, std::int64_t> seen;
    std::int64_t tasks = 0;
    for (const auto& s : samples) tasks += seen.emplace(s.task, 0).second ? 1 : 0;
    for (const auto& s : samples)
      if (seen[s.task]++ < std::max<std::int64_t>(1, a.limit / tasks)) sub.push_back(s);
    samples = std::move(sub);
  }
  const std::vector<PolicyUnderTest> policies = all_policies(c);
  EvalOptions opt;
  opt.cache = a.cache;
  const auto results = run_task_eval(m, samples, policies, a.budgets, opt);
  std::printf("%-20s %7s %9s", "policy", "budget", "accuracy");
  for (const auto& t : results[0].per_task) std::printf(" %9s", t.task.c_str());
  std::printf(" %10s %10s %10s %12s %12s %10s\n", "mean KL", "max KL", "attn err", "decide (ms)", "kept (KiB)", "read/step");
  for (const auto& r : results) {
    std::printf("%-20s %7lld %9.3f", r.policy.c_str(), static_cast<long long>(r.budget), r.accuracy);
    for (const auto& t : r.per_task) std::printf(" %9.3f", t.accuracy());
    std::printf(" %10.4f %10.4f %10.4f %12.2f %12.1f %10.1f\n", r.mean_kl, r.max_kl, r.mean_attn_err, 1e3 * r.decision_seconds,
                r.mean_kept_bytes / 1024.0, r.mean_attended_tokens);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvp_engine: %s\n", e.what());
  return 1;
}
