// Sharded Ada-KV (tensor-parallel heads, core/collective.hpp) against one
// process: the fuzzer picks the layer (rows, tokens, protected tokens), the
// scores (ties, NaN, infinities), the variant and budget, and the number of
// ranks; the ranks run as threads (tests/distributed/thread_collective.hpp)
// and each rank's rows must equal the single-process rows of its heads, or
// every rank must fail and write nothing.
#include <span>
#include <string>
#include <vector>

#include "distributed/shard_cases.hpp"
#include "distributed/thread_collective.hpp"
#include "fuzz_util.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"

using namespace kvpolicy;

namespace {

/// Scores are the keys themselves (head_dim 1): score(h, j) = keys(h, j, 0), the last P tokens +inf.
/// Slicing the keys by heads slices the scores, exactly as a real scorer's would be.
struct KeyScorer {
  struct Params {};
  static constexpr const char* kName = "key_scorer";
  Params params_{};
  std::int64_t P = 0;
  const Params& params() const noexcept { return params_; }
  Status validate_params() const noexcept { return Status::ok(); }
  template <class Backend, class Tq, class Tk>
  Status score(const Context<Backend>&, const ScoreInput<Tq, Tk>& in, ScoreMap out) const noexcept {
    const std::int64_t T = in.keys.kv_len();
    for (std::int64_t h = 0; h < in.keys.kv_heads(); ++h)
      for (std::int64_t j = 0; j < T; ++j) out(h, j) = j >= T - P ? __builtin_inff() : to_float(in.keys.dense(h, j, 0));
    return Status::ok();
  }
  template <class Backend>
  Requirements requirements(const Context<Backend>&, const ProblemShape&) const noexcept {
    return Requirements{};
  }
  std::int64_t protected_tokens(std::int64_t T) const noexcept { return std::min(P, T); }
  template <class Tq, class Tk>
  Status validate(std::span<const ScoreInput<Tq, Tk>> batch, ProblemShape* shape) const noexcept {
    KVP_REQUIRE(!batch.empty(), "key_scorer: batch is empty");
    *shape = ProblemShape{batch[0].queries.extent(0), batch[0].keys.kv_heads(), 1, 0, 1};
    for (const auto& in : batch) shape->max_kv_len = std::max(shape->max_kv_len, in.keys.kv_len());
    return Status::ok();
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const int W = fdp.ConsumeIntegralInRange<int>(1, 4);
  const std::int64_t H = fdp.ConsumeIntegralInRange<std::int64_t>(W, 6), G = fdp.ConsumeBool() ? 1 : 2;
  const int B = fdp.ConsumeIntegralInRange<int>(1, 3);
  KeyScorer sc;
  sc.P = fdp.ConsumeIntegralInRange<std::int64_t>(0, 4);
  AdaKVParams p = fdp.ConsumeBool() ? AdaKVParams::kvpress(fdp.ConsumeFloatingPointInRange<double>(0.0, 1.0), 0.2)
                                    : AdaKVParams::original_gqa(fdp.ConsumeIntegralInRange<std::int64_t>(1, 80), 0.2, fdp.ConsumeBool());
  p.alpha = fdp.ConsumeFloatingPointInRange<double>(0.0, 1.0);
  if (fdp.ConsumeBool()) p.budget = p.budget.keep_at_least_one();
  const bool coarse = fdp.ConsumeBool();
  std::vector<std::int64_t> lens;
  std::vector<std::vector<float>> keys;
  std::vector<float> q(static_cast<std::size_t>(H * G), 0.0f);
  for (int b = 0; b < B; ++b) {
    const std::int64_t T = fdp.ConsumeIntegralInRange<std::int64_t>(1, 64);
    std::vector<float> k(static_cast<std::size_t>(H * T));
    for (auto& x : k) x = coarse ? static_cast<float>(fdp.ConsumeIntegralInRange<int>(-1, 1)) : kvp_fuzz::fuzz_float(fdp);
    lens.push_back(T);
    keys.push_back(std::move(k));
  }
  auto inputs = [&](std::int64_t h0, std::int64_t h1) {
    std::vector<ScoreInput<float, float>> in;
    for (int b = 0; b < B; ++b)
      in.push_back(ScoreInput<float, float>{TensorView<const float, 3>::contiguous(q.data() + h0 * G, {(h1 - h0) * G, 1, 1}),
                                            KVSource<float>::from(TensorView<const float, 3>::contiguous(
                                                keys[static_cast<std::size_t>(b)].data() + h0 * lens[static_cast<std::size_t>(b)],
                                                {h1 - h0, lens[static_cast<std::size_t>(b)], 1}))});
    return in;
  };
  const AdaKV<KeyScorer> policy(p, sc);
  auto run = [&](const std::vector<ScoreInput<float, float>>& in, const ExecContext& exec, kvp_test::KeepSetBuffer* out) {
    const ProblemShape shape{in[0].queries.extent(0), in[0].keys.kv_heads(), 1, *std::max_element(lens.begin(), lens.end()), 1, B};
    const Requirements req = policy.requirements(Context<backend::Cpu>{{}, exec}, shape);
    if (!req.status.is_ok()) return req.status;
    *out = kvp_test::KeepSetBuffer(req.output.rows, std::max<std::int64_t>(req.output.capacity, 1));
    out->fill_sentinel();
    std::vector<std::byte> ws(req.workspace_bytes);
    return policy.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, exec}, std::span<const ScoreInput<float, float>>(in),
                        out->view());
  };
  kvp_test::KeepSetBuffer full(1, 1);
  const Status sf = run(inputs(0, H), ExecContext{}, &full);
  kvp_test::ThreadGroup g(W);
  std::vector<Status> st(static_cast<std::size_t>(W));
  std::vector<kvp_test::KeepSetBuffer> mine(static_cast<std::size_t>(W), kvp_test::KeepSetBuffer(1, 1));
  g.run([&](int r) {
    const auto [h0, h1] = kvp_test::shard_range(H, W, r);
    const HeadShard shard{h0, H, H * G, &g.comm(r)};
    ExecContext exec;
    exec.shard = &shard;
    st[static_cast<std::size_t>(r)] = run(inputs(h0, h1), exec, &mine[static_cast<std::size_t>(r)]);
  });
  for (int r = 0; r < W; ++r) {
    const auto& s = st[static_cast<std::size_t>(r)];
    KVP_FUZZ_CHECK(s.is_ok() == sf.is_ok(), "rank %d: %s / one process: %s", r, s.message(), sf.message());
    const auto [h0, h1] = kvp_test::shard_range(H, W, r);
    const auto& m = mine[static_cast<std::size_t>(r)];
    if (!s.is_ok()) {
      KVP_FUZZ_CHECK(m.untouched() || m.indptr.size() == 2, "rank %d wrote a decision it failed", r);
      continue;
    }
    for (int b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < h1 - h0; ++h)
        KVP_FUZZ_CHECK(m.row(b * (h1 - h0) + h) == full.row(b * H + h0 + h), "rank %d of %d, sequence %d, head %lld differs", r, W, b,
                       static_cast<long long>(h0 + h));
  }
  return 0;
}
