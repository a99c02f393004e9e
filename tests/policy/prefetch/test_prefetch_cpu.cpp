// The four prefetch policies on backend::Cpu (every ISA level this machine
// has) against backend::Scalar on identical inputs: identical requests
// (pages and priorities) and counters. Quest lookahead runs on integer-valued
// keys and queries, whose bounds are exact in fp32 on every backend.
#include <catch2/catch.hpp>

#include "kvpolicy/backends/cpu.hpp"
#include "policy/prefetch/prefetch_fixture.hpp"

using namespace kvpolicy;
using namespace prefetch_test;
using Cpu = backend::Cpu;
using Scalar = backend::Scalar;

namespace {

template <class F>
void for_each_isa(F&& f) {
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!Cpu::set_isa(isa)) continue;
    INFO("isa " << cpu_isa_name(isa));
    f();
  }
  Cpu::set_isa(Cpu::best_isa());
}

// Batch of two sequences over a shuffled pool of 24 pages of 4 tokens, 4 q heads on 2 kv heads, d = 32.
Pool make_pool(bool integers) {
  Pool pool(24, 2, 4, 32);
  pool.add_sequence({5, 17, 2, 9, 21, 0, 13, 7, 19, 3}, 38);
  pool.add_sequence({11, 4, 23, 8, 15, 1, 20}, 27);
  if (integers)
    pool.fill_integers(7);
  else
    pool.fill_random(7);
  return pool;
}
std::vector<float> queries(bool integers, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<float> q(2 * 4 * 32);
  std::uniform_int_distribution<int> ui(-3, 3);
  std::uniform_real_distribution<float> uf(-1, 1);
  for (auto& x : q) x = integers ? static_cast<float>(ui(rng)) : uf(rng);
  return q;
}

template <class B, class P, class St>
std::pair<std::vector<std::int32_t>, std::vector<float>> run(const P& pol, St& st, Pool& pool, const std::vector<float>& q,
                                                             std::size_t ws) {
  Scratch s;
  const auto ctx = s.context<B>(ws);
  Request r(static_cast<std::int64_t>(pool.indices.size()));
  const auto qv = TensorView<const float, 3>::contiguous(q.data(), {2, 4, 32});
  REQUIRE(pol.predict(ctx, st, DecodeInput<float>{qv, pool.table(), pool.page_size, 3}, r.req).is_ok());
  return {r.list(), std::vector<float>(r.priority.begin(), r.priority.begin() + r.req.size)};
}

const ProblemShape kShape{.num_q_heads = 4, .num_kv_heads = 2, .head_dim = 32, .max_kv_len = 40, .batch = 2};

}  // namespace

TEST_CASE("prefetch cpu: Quest lookahead matches the scalar reference", "[prefetch]") {
  Pool pool = make_pool(true);
  QuestMeta qm(pool);
  const QuestLookahead<float> pol(QuestLookaheadParams{.page_budget = 4, .dense_layers = 0});
  const auto q = queries(true, 1);
  const std::size_t ws =
      std::max(pol.requirements(Context<Scalar>{}, kShape, 4).workspace_bytes, pol.requirements(Context<Cpu>{}, kShape, 4).workspace_bytes);
  HistoryBuf hs;
  QuestLookaheadState<float> ss{qm.meta, hs.make(24)};
  const auto ref = run<Scalar>(pol, ss, pool, q, ws);
  REQUIRE(ref.first.size() >= 4);
  for_each_isa([&] {
    HistoryBuf hc;
    QuestLookaheadState<float> sc{qm.meta, hc.make(24)};
    const auto got = run<Cpu>(pol, sc, pool, q, ws);
    CHECK(got.first == ref.first);
    CHECK(got.second == ref.second);
  });
}

TEST_CASE("prefetch cpu: InfiniGen, SpeCache and ShadowKV match the scalar reference", "[prefetch]") {
  Pool pool = make_pool(false);
  const auto q = queries(false, 2);
  std::vector<float> prompt(4 * 6 * 32);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : prompt) x = u(rng);
  const auto pq = TensorView<const float, 3>::contiguous(prompt.data(), {4, 6, 32});

  const InfiniGen ig(InfiniGenParams{.alpha = 2.0f, .dense_layers = 0});
  const SpeCache sc(SpeCacheParams{.topk = 6});
  const ShadowKV sk(ShadowKVParams{.chunk_size = 2, .chunk_budget = 3, .outlier_chunks = 1, .local_chunks = 1});
  auto ws_of = [&](const auto& pol) {
    return std::max(pol.requirements(Context<Scalar>{}, kShape, 4).workspace_bytes,
                    pol.requirements(Context<Cpu>{}, kShape, 4).workspace_bytes);
  };
  auto ig_state = [&](InfiniGenBuf& b, auto ctx) { REQUIRE(ig.prepare(ctx, pq, pool.cview(), b.st).is_ok()); };
  auto sc_state = [&](SpeCacheBuf& b, auto ctx) { REQUIRE(sc.on_append(ctx, AppendInput<float>{pool.cview(), nullptr}, b.st).is_ok()); };
  auto sk_state = [&](ShadowKVBuf& b, auto ctx) { REQUIRE(sk.on_append(ctx, AppendInput<float>{pool.cview(), nullptr}, b.st).is_ok()); };

  Scratch s0;
  InfiniGenBuf igs(ig, pool);
  ig_state(igs, s0.context<Scalar>(ws_of(ig)));
  SpeCacheBuf scs(sc, pool);
  sc_state(scs, Context<Scalar>{});
  ShadowKVBuf sks(sk, pool);
  sk_state(sks, Context<Scalar>{});
  const auto ig_ref = run<Scalar>(ig, igs.st, pool, q, ws_of(ig));
  const auto sc_ref = run<Scalar>(sc, scs.st, pool, q, ws_of(sc));
  const auto sk_ref = run<Scalar>(sk, sks.st, pool, q, ws_of(sk));
  REQUIRE(!ig_ref.first.empty());
  REQUIRE(!sc_ref.first.empty());
  REQUIRE(!sk_ref.first.empty());
  for_each_isa([&] {
    Scratch s1;
    InfiniGenBuf igc(ig, pool);
    ig_state(igc, s1.context<Cpu>(ws_of(ig)));
    CHECK(igc.floats == igs.floats);
    CHECK(igc.ints == igs.ints);
    SpeCacheBuf scc(sc, pool);
    sc_state(scc, Context<Cpu>{});
    CHECK(scc.codes == scs.codes);
    ShadowKVBuf skc(sk, pool);
    sk_state(skc, Context<Cpu>{});
    CHECK(skc.floats == sks.floats);
    const auto ig_got = run<Cpu>(ig, igc.st, pool, q, ws_of(ig));
    const auto sc_got = run<Cpu>(sc, scc.st, pool, q, ws_of(sc));
    const auto sk_got = run<Cpu>(sk, skc.st, pool, q, ws_of(sk));
    CHECK(ig_got == ig_ref);
    CHECK(sc_got == sc_ref);
    CHECK(sk_got == sk_ref);
  });
}
