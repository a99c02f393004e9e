#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/knorm.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

STATIC_ASSERT_POLICY(Knorm);

namespace {

/// Keys (H, T, D) of a closed form both sides can compute: sin(1 + 31h + 7j + 3c) * (1 + 0.1 * ((5j) mod 7)).
std::vector<half> formula_keys(std::int64_t H, std::int64_t T, std::int64_t D) {
  std::vector<half> k(static_cast<std::size_t>(H * T * D));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t j = 0; j < T; ++j)
      for (std::int64_t c = 0; c < D; ++c)
        k[(h * T + j) * D + c] = from_float<half>(static_cast<float>(std::sin(1.0 + h * 31 + j * 7 + c * 3) * (1 + 0.1 * ((j * 5) % 7))));
  return k;
}

template <class Tk>
ScoreInput<float, Tk> keys_only(const std::vector<Tk>& k, std::int64_t H, std::int64_t T, std::int64_t D) {
  ScoreInput<float, Tk> in;
  in.keys = KVSource<Tk>::from(TensorView<const Tk, 3>::contiguous(k.data(), {H, T, D}));
  return in;
}

template <class Backend, class Tk>
std::vector<float> scores_of(const Knorm& p, const ScoreInput<float, Tk>& in) {
  std::vector<float> s(static_cast<std::size_t>(in.keys.kv_heads() * in.keys.kv_len()));
  const Status st = p.score(Context<Backend>{}, in, TensorView<float, 2>::contiguous(s.data(), {in.keys.kv_heads(), in.keys.kv_len()}));
  INFO(st.message());
  REQUIRE(st.is_ok());
  return s;
}

}  // namespace

TEST_CASE("knorm: scores are minus the key norms and the smallest norms are kept (hand computation)", "[knorm]") {
  // One kv head, 6 tokens, head_dim 2: norms 5, 1, 13, 2, 5, 0 (3-4-5 and 5-12-13 triangles).
  const std::vector<float> k = {3, 4, 1, 0, 5, 12, 0, -2, -4, 3, 0, 0};
  const auto in = keys_only(k, 1, 6, 2);
  for (const auto& s :
       {scores_of<backend::Scalar>(Knorm(KnormParams::kvpress(0.5)), in), scores_of<backend::Cpu>(Knorm(KnormParams::kvpress(0.5)), in)})
    REQUIRE(s == std::vector<float>{-5, -1, -13, -2, -5, -0.0f});
  // r = 0.5 keeps int(6 * 0.5) = 3: norms 0, 1, 2 -> tokens 5, 1, 3.
  REQUIRE(run_evict<backend::Scalar>(Knorm(KnormParams::kvpress(0.5)), in).row(0) == std::vector<std::int32_t>{1, 3, 5});
  // Keeping 4: tokens 0 and 4 tie at norm 5; the later one (4) survives (score_order_key).
  REQUIRE(run_evict<backend::Cpu>(Knorm({Budget::tokens(4)}), in).row(0) == std::vector<std::int32_t>{1, 3, 4, 5});
  // kvpress >= 0.5.5 keeps one token at least: int(6 * 0.1) = 0 -> 1, the zero key.
  REQUIRE(run_evict<backend::Scalar>(Knorm(KnormParams::kvpress(0.9)), in).row(0) == std::vector<std::int32_t>{5});
  REQUIRE(Knorm(KnormParams::kvpress(0.9)).kept_count(6) == 1);
  REQUIRE(Knorm(KnormParams::kvpress(0.0)).kept_count(6) == 6);
  REQUIRE(Knorm().protected_tokens(6) == 0);
}

TEST_CASE("knorm: kept sets equal kvpress 0.5.5 KnormPress on fp16 keys", "[knorm][golden]") {
  // kvpress: KnormPress(compression_ratio=r).score(...) then scores.topk(compute_n_kept(20, r)) on the same
  // fp16 keys (2 kv heads, 20 tokens, head_dim 16), sorted per head.
  const std::int64_t H = 2, T = 20, D = 16;
  const auto k = formula_keys(H, T, D);
  const auto in = keys_only(k, H, T, D);
  struct Case {
    double r;
    std::vector<std::int32_t> h0, h1;
  };
  const std::vector<Case> cases = {
      {0.25, {0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 13, 14, 16, 17, 18}, {0, 1, 2, 3, 5, 6, 7, 9, 10, 13, 14, 16, 17, 18, 19}},
      {0.5, {0, 3, 5, 6, 7, 9, 10, 13, 14, 17}, {0, 1, 5, 6, 7, 9, 10, 13, 14, 17}},
      {0.9, {0}, {14}}};
  for (const auto& c : cases) {
    INFO("compression_ratio " << c.r);
    const Knorm p(KnormParams::kvpress(c.r));
    for (const auto& keep : {run_evict<backend::Scalar>(p, in), run_evict<backend::Cpu>(p, in)}) {
      REQUIRE(keep.row(0) == c.h0);
      REQUIRE(keep.row(1) == c.h1);
    }
  }
  // kvpress's fp32 scores of head 0, tokens 0..2 (torch.linalg.vector_norm(dtype=float32)).
  const auto s = scores_of<backend::Scalar>(Knorm(), in);
  REQUIRE(s[0] == Approx(-2.3019333f).epsilon(1e-6));
  REQUIRE(s[1] == Approx(-4.052331f).epsilon(1e-6));
  REQUIRE(s[2] == Approx(-4.2141514f).epsilon(1e-6));
  REQUIRE(s[T] == Approx(-2.5356958f).epsilon(1e-6));
}

TEMPLATE_TEST_CASE("knorm: layouts, dtypes, batches and threads give the same decision", "[knorm]", backend::Scalar, backend::Cpu) {
  const RandomCase<half> a(4, 2, 77, 32, 1, 3), b(4, 2, 40, 32, 1, 4);
  const RandomCase<bfloat16> a16(4, 2, 77, 32, 1, 3);
  const Knorm p(KnormParams::kvpress(0.5));
  const auto dense = run_evict<TestType>(p, a.input());
  REQUIRE(run_evict<TestType>(p, a.strided_input()) == dense);
  REQUIRE(run_evict<TestType>(p, a.paged_input(16)) == dense);
  REQUIRE(dense.row(0).size() == 38);
  // Each row is the top-38 of its scores under score_order_key.
  const auto s = scores_of<TestType>(p, a.input());
  for (std::int64_t h = 0; h < 2; ++h) {
    std::vector<std::int32_t> order(77);
    for (std::int32_t j = 0; j < 77; ++j) order[j] = j;
    std::sort(order.begin(), order.end(), [&](std::int32_t x, std::int32_t y) {
      const std::uint32_t kx = score_order_key(s[h * 77 + x]), ky = score_order_key(s[h * 77 + y]);
      return kx != ky ? kx > ky : x > y;
    });
    std::vector<std::int32_t> top(order.begin(), order.begin() + 38);
    std::sort(top.begin(), top.end());
    REQUIRE(dense.row(h) == top);
  }
  const auto bf = run_evict<TestType>(p, a16.input());
  REQUIRE(bf.row(0).size() == 38);
  ThreadPool pool(3);
  const auto batched = run_evict_batch<TestType>(p, std::vector{a.input(), b.input()}, pool.context());
  const auto second = run_evict<TestType>(p, b.input());
  REQUIRE(batched.row(0) == dense.row(0));
  REQUIRE(batched.row(1) == dense.row(1));
  REQUIRE(batched.row(2) == second.row(0));
  REQUIRE(batched.row(3) == second.row(1));
}

TEST_CASE("knorm: NaN keys are evicted first, bad input gets a clear message and writes nothing", "[knorm][errors]") {
  std::vector<float> k = {1, 0, 2, 0, 3, 0, 4, 0};
  k[0] = std::numeric_limits<float>::quiet_NaN();
  const auto in = keys_only(k, 1, 4, 2);
  REQUIRE(run_evict<backend::Scalar>(Knorm({Budget::tokens(3)}), in).row(0) == std::vector<std::int32_t>{1, 2, 3});
  REQUIRE(run_evict<backend::Cpu>(Knorm({Budget::tokens(1)}), in).row(0) == std::vector<std::int32_t>{1});

  REQUIRE_THAT(Knorm({Budget::compression_ratio(1.0)}).validate_params().message(), Contains("knorm: compression_ratio is 1"));
  REQUIRE(Knorm({Budget::compression_ratio(1.0)}).kept_count(10) == -1);
  KeepSetBuffer keep(1, 8);
  keep.fill_sentinel();
  std::vector<std::byte> ws(4096);
  const Context<backend::Scalar> cx{Workspace{ws.data(), ws.size()}, {}};
  REQUIRE_THAT(Knorm({Budget::tokens(5)}).evict(cx, in, keep.view()).message(),
               Contains("token budget 5 is larger than the sequence length 4"));
  ScoreInput<float, float> empty;
  REQUIRE(keep.untouched());
  REQUIRE_THAT(Knorm().evict(cx, empty, keep.view()).message(), Contains("knorm"));
  REQUIRE(keep.untouched());
  REQUIRE_THAT(Knorm().evict(Context<backend::Scalar>{}, in, keep.view()).message(), Contains("workspace has 0 bytes"));
  REQUIRE(keep.untouched());
  std::vector<float> s(3);
  REQUIRE_THAT(Knorm().score(Context<backend::Scalar>{}, in, TensorView<float, 2>::contiguous(s.data(), {1, 3})).message(),
               Contains("scores has shape (1, 3), expected (num_kv_heads=1, kv_len=4)"));
}
