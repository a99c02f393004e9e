// kvp_speed_driver: times one scoring policy's decision (`evict`, KeepSet
// written) on synthetic fp16 keys, for tools/compare_kvpress_speed.py.
//
//   kvp_speed_driver --policy snapkv|adakv|pyramidkv|SPEC [--backend cpu|scalar]
//                    [--tokens 32768] [--q-heads 32] [--kv-heads 8] [--head-dim 128]
//                    [--window 64] [--kernel 5] [--ratio 0.5] [--alpha 0.2]
//                    [--layer 0] [--num-layers 32] [--threads 1] [--reps 15] [--warmup 2]
//
// snapkv, adakv and pyramidkv are configured as their kvpress counterparts
// (SnapKVPress, AdaKVPress(SnapKVPress), PyramidKVPress) from --window,
// --kernel, --ratio, --alpha, --layer and --num-layers: average pooling, window
// mean, pool-then-group, n_kept = int(T (1 - r)). Any other --policy is a
// kvpolicy registry spec string (`snapkv:compression_ratio=0.5,window=32`,
// `streaming_llm`, ...; kvpolicy::describe_registry() lists them), a one-shot
// eviction policy configured by the spec alone, run type-erased
// (kvpolicy::AnyEvictionPolicy, make_eviction_policy; its errors are printed as
// the registry states them); it reads fp32 queries (the fp16 queries below,
// widened), the last min(--window, its query window) of them, and refuses to
// run when it needs more than --window. Queries are the last `window`
// post-RoPE queries in fp16, keys and values (kv_heads, tokens, head_dim) fp16,
// all N(0, 1) from a fixed seed, plus a few heavy keys (values are read by the
// policies that need them: Expected Attention's value norms). Workspace and output are
// sized by the policy's `requirements` and allocated once, outside the timed
// region (as an engine would). Prints one
// JSON object: the median, min and max wall time per call in milliseconds,
// and the median process CPU time per call (all threads; on a shared machine
// it shows how much of the wall time the process actually ran).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/registry.hpp"
#include "kvpolicy/util/thread_pool.hpp"

using namespace kvpolicy;

namespace {

struct Options {
  std::string policy = "snapkv", backend = "cpu";
  std::int64_t tokens = 32768, q_heads = 32, kv_heads = 8, head_dim = 128, window = 64, kernel = 5;
  double ratio = 0.5, alpha = 0.2;
  int layer = 0, num_layers = 32, threads = 1, reps = 15, warmup = 2;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr, "kvp_speed_driver: %s\n(see the header of tools/kvp_speed_driver.cpp for the options)\n", msg);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + a).c_str());
    const char* v = argv[++i];
    if (a == "--policy")
      o.policy = v;
    else if (a == "--backend")
      o.backend = v;
    else if (a == "--tokens")
      o.tokens = std::atoll(v);
    else if (a == "--q-heads")
      o.q_heads = std::atoll(v);
    else if (a == "--kv-heads")
      o.kv_heads = std::atoll(v);
    else if (a == "--head-dim")
      o.head_dim = std::atoll(v);
    else if (a == "--window")
      o.window = std::atoll(v);
    else if (a == "--kernel")
      o.kernel = std::atoll(v);
    else if (a == "--ratio")
      o.ratio = std::atof(v);
    else if (a == "--alpha")
      o.alpha = std::atof(v);
    else if (a == "--layer")
      o.layer = std::atoi(v);
    else if (a == "--num-layers")
      o.num_layers = std::atoi(v);
    else if (a == "--threads")
      o.threads = std::atoi(v);
    else if (a == "--reps")
      o.reps = std::atoi(v);
    else if (a == "--warmup")
      o.warmup = std::atoi(v);
    else
      usage(("unknown option " + a).c_str());
  }
  if (o.reps < 1 || o.threads < 1) usage("--reps and --threads must be >= 1");
  return o;
}

/// A registry policy (type-erased) behind the typed calls of run(); queries fp32.
template <class Backend>
struct Erased {
  AnyEvictionPolicy policy;
  static constexpr BackendKind kind = std::is_same_v<Backend, backend::Cpu> ? BackendKind::kCpu : BackendKind::kScalar;
  Requirements requirements(const Context<Backend>& cx, const ProblemShape& s) const noexcept {
    return policy.requirements(kind, s, cx.exec);
  }
  Status evict(const Context<Backend>& cx, const ScoreInput<float, half>& in, KeepSet out) const noexcept {
    return policy.evict(kind, in, out, cx.workspace, cx.exec);
  }
};

template <class Backend, class Policy, class Tq>
int run(const Options& o, const Policy& policy, const ScoreInput<Tq, half>& in) {
  ThreadPool pool(o.threads);
  const ExecContext ctx = pool.context();
  const ProblemShape shape{o.q_heads, o.kv_heads, o.head_dim, o.tokens, in.queries.extent(1)};
  const Requirements req = policy.requirements(Context<Backend>{{}, ctx}, shape);
  if (!req) {
    std::fprintf(stderr, "kvp_speed_driver: %s\n", req.status.message());
    return 1;
  }
  std::vector<std::byte> ws(req.workspace_bytes);
  const std::int64_t rows = req.output.rows, capacity = req.output.capacity;
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(rows + 1)), indices(static_cast<std::size_t>(capacity));
  const KeepSet keep{indptr.data(), indices.data(), rows, capacity};
  const Context<Backend> cx{Workspace{ws.data(), ws.size()}, ctx};
  std::vector<double> ms, cpu_ms;
  for (int it = 0; it < o.warmup + o.reps; ++it) {
    const std::clock_t c0 = std::clock();
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = policy.evict(cx, in, keep);
    const auto t1 = std::chrono::steady_clock::now();
    const std::clock_t c1 = std::clock();
    if (!s.is_ok()) {
      std::fprintf(stderr, "kvp_speed_driver: %s\n", s.message());
      return 1;
    }
    if (it >= o.warmup) {
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      cpu_ms.push_back(1e3 * static_cast<double>(c1 - c0) / CLOCKS_PER_SEC);
    }
  }
  auto median_of = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  const double median = median_of(ms), cpu_median = median_of(cpu_ms);
  std::sort(ms.begin(), ms.end());
  std::printf(
      "{\"impl\": \"kvpolicy\", \"policy\": \"%s\", \"backend\": \"%s\", \"isa\": \"%s\", \"tokens\": %lld, \"q_heads\": %lld, "
      "\"kv_heads\": %lld, \"head_dim\": %lld, \"window\": %lld, \"threads\": %d, \"reps\": %d, \"kept\": %d, "
      "\"median_ms\": %.4f, \"min_ms\": %.4f, \"max_ms\": %.4f, \"cpu_median_ms\": %.4f}\n",
      o.policy.c_str(), o.backend.c_str(), o.backend == "cpu" ? backend::Cpu::isa_name() : "scalar", static_cast<long long>(o.tokens),
      static_cast<long long>(o.q_heads), static_cast<long long>(o.kv_heads), static_cast<long long>(o.head_dim),
      static_cast<long long>(o.window), o.threads, o.reps, indptr[rows], median, ms.front(), ms.back(), cpu_median);
  return 0;
}

template <class Backend>
int dispatch_policy(const Options& o, const ScoreInput<half, half>& in) {
  const auto w = static_cast<std::int32_t>(o.window), k = static_cast<std::int32_t>(o.kernel);
  if (o.policy == "snapkv") {
    const SnapKV p(SnapKVParams::kvpress(o.ratio, w, k));
    return run<Backend>(o, p, in);
  }
  if (o.policy == "adakv") {
    const AdaKV<SnapKV> p(AdaKVParams::kvpress(o.ratio, o.alpha), SnapKV(SnapKVParams::kvpress(o.ratio, w, k)));
    return run<Backend>(o, p, in);
  }
  if (o.policy == "pyramidkv") {
    const PyramidKV p(PyramidKVParams::kvpress(o.ratio, o.layer, o.num_layers, w, k));
    return run<Backend>(o, p, in);
  }
  // A registry spec string.
  Erased<Backend> p;
  if (const Status s = make_eviction_policy(o.policy, &p.policy); !s.is_ok()) {
    std::fprintf(stderr, "kvp_speed_driver: %s\n", s.message());
    return 2;
  }
  const Requirements r = p.requirements(Context<Backend>{}, ProblemShape{o.q_heads, o.kv_heads, o.head_dim, o.tokens, o.window});
  if (!r) {
    std::fprintf(stderr, "kvp_speed_driver: %s\n", r.status.message());
    return 1;
  }
  if (r.query_window > o.window) {
    std::fprintf(stderr, "kvp_speed_driver: %s reads the last %lld queries; pass --window %lld\n", o.policy.c_str(),
                 static_cast<long long>(r.query_window), static_cast<long long>(r.query_window));
    return 2;
  }
  const std::int64_t qw = r.query_window;
  std::vector<float> qf(static_cast<std::size_t>(o.q_heads * qw * o.head_dim));
  for (std::int64_t h = 0; h < o.q_heads; ++h)
    for (std::int64_t t = 0; t < qw; ++t)
      for (std::int64_t c = 0; c < o.head_dim; ++c)
        qf[static_cast<std::size_t>((h * qw + t) * o.head_dim + c)] = to_float(in.queries(h, o.window - qw + t, c));
  ScoreInput<float, half> fin{TensorView<const float, 3>::contiguous(qf.data(), {o.q_heads, qw, o.head_dim}), in.keys};
  fin.values = in.values;  // Expected Attention scales by the value norms
  return run<Backend>(o, p, fin);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::vector<half> q(static_cast<std::size_t>(o.q_heads * o.window * o.head_dim)),
      keys(static_cast<std::size_t>(o.kv_heads * o.tokens * o.head_dim));
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd;
  std::vector<float> qf(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = to_half(qf[i] = nd(rng));
  for (auto& x : keys) x = to_half(nd(rng));
  std::uniform_int_distribution<std::int64_t> pick(0, o.tokens - 1);
  for (int r = 0; r < 16; ++r) {  // heavy keys aligned with a query so that scores are not flat
    const std::int64_t j = pick(rng);
    for (std::int64_t h = 0; h < o.kv_heads; ++h)
      for (std::int64_t c = 0; c < o.head_dim; ++c) {
        auto& x = keys[static_cast<std::size_t>((h * o.tokens + j) * o.head_dim + c)];
        x = to_half(to_float(x) + qf[static_cast<std::size_t>(c)]);
      }
  }
  std::vector<half> values(keys.size());
  for (auto& x : values) x = to_half(nd(rng));
  ScoreInput<half, half> in{TensorView<const half, 3>::contiguous(q.data(), {o.q_heads, o.window, o.head_dim}),
                            KVSource<half>::from(TensorView<const half, 3>::contiguous(keys.data(), {o.kv_heads, o.tokens, o.head_dim}))};
  in.values = KVSource<half>::from(TensorView<const half, 3>::contiguous(values.data(), {o.kv_heads, o.tokens, o.head_dim}));
  if (o.backend == "cpu") return dispatch_policy<backend::Cpu>(o, in);
  if (o.backend == "scalar") return dispatch_policy<backend::Scalar>(o, in);
  usage(("unknown backend " + o.backend).c_str());
}
