// The one policy interface: every policy models its family concepts on every
// host backend; `requirements()` is the only size query and sizes exactly what
// the call needs; a workspace sized for another backend is a loud error; the
// vocabulary fixes (paged values, +inf protection); the batched op form; the
// owning convenience layer; and one table-driven "every backend against the
// scalar reference" check over every policy and input layout.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kvpolicy/kvpolicy.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using kvp_test::KeepSetBuffer;
using kvp_test::RandomCase;

// ---- concepts, for every (policy, backend) pair ------------------------------

template <class B>
constexpr bool all_policies_model_their_concepts() {
  using InF = ScoreInput<float, float>;
  using InH = ScoreInput<float, half>;
  using InB = ScoreInput<bfloat16, bfloat16>;
  static_assert(Scorer<SnapKV, InF, B> && EvictionPolicy<SnapKV, InH, B> && EvictionPolicy<SnapKV, InB, B>);
  static_assert(Scorer<LAQ, InF, B> && EvictionPolicy<LAQ, InH, B> && EvictionPolicy<LAQ, InB, B>);
  static_assert(EvictionPolicy<StreamingLLM, InF, B> && EvictionPolicy<StreamingLLM, InH, B>);
  static_assert(Scorer<ObservedAttention, InF, B> && EvictionPolicy<ObservedAttention, InH, B> &&
                EvictionPolicy<ObservedAttention, ScoreInput<float, float, half>, B>);
  static_assert(Scorer<TOVA, InF, B> && EvictionPolicy<TOVA, InH, B> && EvictionPolicy<TOVA, ScoreInput<float, float, bfloat16>, B>);
  static_assert(Scorer<PyramidKV, InF, B> && EvictionPolicy<PyramidKV, InH, B>);
  static_assert(Scorer<AdaKV<SnapKV>, InF, B> && EvictionPolicy<AdaKV<SnapKV>, InH, B>);
  static_assert(EvictionPolicy<AdaKV<ExpectedAttention>, ExpectedAttentionInput<float, half>, B>);
  static_assert(Scorer<ExpectedAttention, ExpectedAttentionInput<float, float>, B> &&
                EvictionPolicy<ExpectedAttention, ExpectedAttentionInput<half, half>, B>);
  static_assert(OnlineEvictionPolicy<H2O, InF, B> && OnlineEvictionPolicy<H2O, ScoreInput<float, half, half>, B>);
  static_assert(SelectionPolicy<Quest, float, float, float, B> && SelectionPolicy<Quest, half, half, half, B> &&
                SelectionPolicy<Quest, bfloat16, bfloat16, float, B>);
  static_assert(HostBackend<B>);
  return true;
}
static_assert(all_policies_model_their_concepts<backend::Scalar>());
static_assert(all_policies_model_their_concepts<backend::Cpu>());

// ---- the table: every policy, Scalar vs Cpu, dense / strided / paged, three dtypes

namespace {

using Decide = std::function<KeepSetBuffer(const ScoreInput<float, half>&, bool cpu, const ExecContext&)>;

template <class P>
Decide one_shot(P p) {
  return [p](const ScoreInput<float, half>& in, bool cpu, const ExecContext& ex) {
    return cpu ? kvp_test::run_evict<backend::Cpu>(p, in, ex) : kvp_test::run_evict<backend::Scalar>(p, in, ex);
  };
}

template <class B>
KeepSetBuffer adakv_evict(const AdaKV<SnapKV>& p, const ScoreInput<float, half>& in, const ExecContext& ex) {
  const ProblemShape shape{in.queries.extent(0), in.keys.kv_heads(), in.keys.head_dim(), in.keys.kv_len(), in.queries.extent(1)};
  const Requirements r = p.requirements(Context<B>{{}, ex}, shape);
  REQUIRE(r.status.is_ok());
  KeepSetBuffer keep(r.output.rows, r.output.capacity);
  std::vector<std::byte> ws(r.workspace_bytes);
  REQUIRE(p.evict(Context<B>{Workspace{ws.data(), ws.size()}, ex}, in, keep.view()).is_ok());
  return keep;
}

template <class B>
KeepSetBuffer h2o_decide(const H2O& p, const ScoreInput<float, half>& in, const ExecContext& ex) {
  const ProblemShape shape{in.queries.extent(0), in.keys.kv_heads(), in.keys.head_dim(), in.keys.kv_len(), in.queries.extent(1)};
  const Requirements r = p.requirements(Context<B>{{}, ex}, shape);
  REQUIRE(r.status.is_ok());
  std::vector<float> scores(static_cast<std::size_t>(p.state_rows(shape) * shape.max_kv_len));
  H2OState st{TensorView<float, 2>::contiguous(scores.data(), {p.state_rows(shape), shape.max_kv_len}),
              in.keys.kv_len() - in.queries.extent(1)};
  std::vector<std::byte> ws(r.workspace_bytes);
  const Context<B> ctx{Workspace{ws.data(), ws.size()}, ex};
  std::fill(scores.begin(), scores.end(), 0.0f);
  REQUIRE(p.update(ctx, st, in).is_ok());
  KeepSetBuffer keep(r.output.rows, r.output.capacity);
  REQUIRE(p.evict(ctx, st, keep.view()).is_ok());
  return keep;
}

struct Entry {
  const char* name;
  Decide decide;
};

std::vector<Entry> table() {
  SnapKVParams grouped = SnapKVParams::kvpress(0.5, 8, 5);
  grouped.order = ReduceOrder::kGroupThenPool;
  grouped.pooling = Pooling::kMax;
  const AdaKV<SnapKV> ada(AdaKVParams::kvpress(0.5), SnapKV(adakv_scoring(8, 7)));
  const AdaKV<SnapKV> ada_orig(AdaKVParams::original(40, 0.2), SnapKV(adakv_scoring(8, 7)));
  const H2O h2o(H2OParams::original(8, 16));
  return {
      {"snapkv", one_shot(SnapKV(SnapKVParams::kvpress(0.5, 8, 5)))},
      {"snapkv group-then-pool max", one_shot(SnapKV(grouped))},
      {"streaming_llm", one_shot(StreamingLLM(StreamingLLMParams::kvpress(0.5, 4)))},
      {"tova", one_shot(TOVA(TOVAParams::kvpress(0.5)))},
      {"pyramidkv", one_shot(PyramidKV(PyramidKVParams::kvpress(0.5, 2, 4, 8)))},
      {"adakv kvpress",
       [ada](const ScoreInput<float, half>& in, bool cpu, const ExecContext& ex) {
         return cpu ? adakv_evict<backend::Cpu>(ada, in, ex) : adakv_evict<backend::Scalar>(ada, in, ex);
       }},
      {"adakv original",
       [ada_orig](const ScoreInput<float, half>& in, bool cpu, const ExecContext& ex) {
         return cpu ? adakv_evict<backend::Cpu>(ada_orig, in, ex) : adakv_evict<backend::Scalar>(ada_orig, in, ex);
       }},
      {"h2o from queries",
       [h2o](const ScoreInput<float, half>& in, bool cpu, const ExecContext& ex) {
         return cpu ? h2o_decide<backend::Cpu>(h2o, in, ex) : h2o_decide<backend::Scalar>(h2o, in, ex);
       }},
  };
}

}  // namespace

TEST_CASE("interface: every policy decides identically on Cpu and Scalar, dense / strided / paged, any thread count",
          "[interface][backends]") {
  const RandomCase<half> rc(8, 2, 97, 32, 8, 11);
  ThreadPool pool(2);
  const ExecContext par = pool.context();
  for (const Entry& e : table()) {
    INFO(e.name);
    const KeepSetBuffer ref = e.decide(rc.input(), false, {});
    for (const auto& in : {rc.input(), rc.strided_input(), rc.paged_input(16)}) {
      REQUIRE(e.decide(in, false, {}) == ref);
      REQUIRE(e.decide(in, true, {}) == ref);
      REQUIRE(e.decide(in, true, par) == ref);
    }
  }
}

TEST_CASE("interface: ObservedAttention and Expected Attention agree across backends", "[interface][backends]") {
  const RandomCase<half> rc(4, 2, 64, 16, 64, 5);  // observed attention: q_len == kv_len
  const ObservedAttention oa(ObservedAttentionParams::kvpress(0.5));
  const auto ref = kvp_test::run_evict<backend::Scalar>(oa, rc.input());
  REQUIRE(kvp_test::run_evict<backend::Cpu>(oa, rc.input()) == ref);
  REQUIRE(kvp_test::run_evict<backend::Cpu>(oa, rc.paged_input(8)) == ref);

  std::vector<half> values(static_cast<std::size_t>(2 * 64 * 16));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = from_float<half>(std::sin(0.37f * static_cast<float>(i)));
  const auto in_dense = rc.input();
  ExpectedAttentionInput<float, half> ea_in;
  ea_in.queries = in_dense.queries;
  ea_in.keys = in_dense.keys;
  ea_in.values = KVSource<half>::from(TensorView<const half, 3>::contiguous(values.data(), {2, 64, 16}));
  const ExpectedAttention ea(ExpectedAttentionParams::kvpress(0.5, 64, 4));
  const ProblemShape shape{4, 2, 16, 64, 64};
  KeepSetBuffer a(2, 2 * ea.kept_count(64)), b(2, 2 * ea.kept_count(64));
  std::vector<std::byte> ws_s(ea.requirements(Context<backend::Scalar>{}, shape).workspace_bytes);
  std::vector<std::byte> ws_c(ea.requirements(Context<backend::Cpu>{}, shape).workspace_bytes);
  REQUIRE(ea.evict(Context<backend::Scalar>{Workspace{ws_s.data(), ws_s.size()}}, ea_in, a.view()).is_ok());
  REQUIRE(ea.evict(Context<backend::Cpu>{Workspace{ws_c.data(), ws_c.size()}}, ea_in, b.view()).is_ok());
  REQUIRE(a == b);
}

// ---- requirements: the one size query ---------------------------------------

TEST_CASE("interface: requirements() sizes exactly, one byte less is rejected and nothing is written", "[interface][requirements]") {
  const RandomCase<float> rc(8, 2, 120, 16, 8, 3);
  const auto in = rc.input();
  const ProblemShape shape{8, 2, 16, 120, 8};
  auto check = [&](const auto& policy) {
    INFO(policy.kName);
    const Context<backend::Cpu> sizing{};
    const Requirements r = policy.requirements(sizing, shape);
    REQUIRE(r.status.is_ok());
    REQUIRE(r.output.rows == 2);
    REQUIRE(r.output.capacity == 2 * policy.kept_count(120));
    std::vector<std::byte> ws(r.workspace_bytes + 64);
    KeepSetBuffer keep(r.output.rows, r.output.capacity);
    if (r.workspace_bytes > 0) {
      keep.fill_sentinel();
      const Status s = policy.evict(Context<backend::Cpu>{Workspace{ws.data(), r.workspace_bytes - 1}}, in, keep.view());
      REQUIRE(s.code() == StatusCode::kWorkspaceTooSmall);
      REQUIRE(keep.untouched());
    }
    REQUIRE(policy.evict(Context<backend::Cpu>{Workspace{ws.data(), r.workspace_bytes}}, in, keep.view()).is_ok());
  };
  check(SnapKV(SnapKVParams::kvpress(0.5, 8)));
  check(StreamingLLM(StreamingLLMParams::kvpress(0.5)));
  check(TOVA(TOVAParams::kvpress(0.5)));
  check(PyramidKV(PyramidKVParams::kvpress(0.5, 1, 4, 8)));
  SECTION("the query window each policy needs comes from requirements(), not from probing its params") {
    REQUIRE(SnapKV(SnapKVParams::kvpress(0.5, 8)).requirements(Context<backend::Scalar>{}, shape).query_window == 8);
    REQUIRE(PyramidKV(PyramidKVParams::kvpress(0.5, 1, 4, 8)).requirements(Context<backend::Scalar>{}, shape).query_window == 8);
    REQUIRE(TOVA(TOVAParams::kvpress(0.5)).requirements(Context<backend::Scalar>{}, shape).query_window == 1);
    REQUIRE(StreamingLLM(StreamingLLMParams::kvpress(0.5)).requirements(Context<backend::Scalar>{}, shape).query_window == 0);
    const AdaKV<SnapKV> ada(AdaKVParams::kvpress(0.5), SnapKV(adakv_scoring(8, 7)));
    REQUIRE(ada.requirements(Context<backend::Scalar>{}, shape).query_window == 8);
  }
  SECTION("invalid params x shape: a status that names the problem, no sizes") {
    const Requirements bad = SnapKV(SnapKVParams::kvpress(0.5, 200)).requirements(Context<backend::Scalar>{}, shape);
    REQUIRE_FALSE(bad.status.is_ok());
    REQUIRE_THAT(std::string(bad.status.message()), Catch::Contains("window 200 is larger than max_kv_len 120"));
    REQUIRE(bad.workspace_bytes == 0);
    const Requirements bad_shape = SnapKV().requirements(Context<backend::Scalar>{}, ProblemShape{6, 4, 16, 120, 8});
    REQUIRE_THAT(std::string(bad_shape.status.message()),
                 Catch::Contains("num_q_heads is 6, must be a positive multiple of num_kv_heads=4"));
  }
}

TEST_CASE("interface: a workspace sized for the scalar backend fails loudly on the CPU backend", "[interface][requirements]") {
  const RandomCase<half> rc(8, 2, 300, 64, 16, 9);
  const SnapKV snapkv(SnapKVParams::kvpress(0.5, 16));
  const ProblemShape shape{8, 2, 64, 300, 16};
  const std::size_t scalar_bytes = snapkv.requirements(Context<backend::Scalar>{}, shape).workspace_bytes;
  const std::size_t cpu_bytes = snapkv.requirements(Context<backend::Cpu>{}, shape).workspace_bytes;
  REQUIRE(cpu_bytes > scalar_bytes);  // the SIMD window kernel keeps its numerators between passes
  std::vector<std::byte> ws(scalar_bytes);
  KeepSetBuffer keep(2, 2 * snapkv.kept_count(300));
  const std::uint64_t fallbacks = backend::Cpu::reference_fallbacks();
  const Status s = snapkv.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, rc.input(), keep.view());
  REQUIRE(s.code() == StatusCode::kWorkspaceTooSmall);
  REQUIRE_THAT(std::string(s.message()), Catch::Contains("same backend"));
  ws.resize(cpu_bytes);
  REQUIRE(snapkv.evict(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, rc.input(), keep.view()).is_ok());
  REQUIRE(backend::Cpu::reference_fallbacks() == fallbacks);  // policies never reach the op-level reference fallback
  SECTION("an op called directly with a short workspace runs the reference and is counted") {
    std::vector<float> q(static_cast<std::size_t>(4 * 16 * 64), 0.1f), out(static_cast<std::size_t>(4 * 284));
    const WindowScoreShape ws_shape{4, 16, 64, 300, 284, 284, 0.125f, WindowReduce::kMean};
    std::vector<std::byte> small(backend::Scalar::window_scores_workspace(ws_shape));
    const auto in = rc.input();
    backend::Cpu::window_scores(ws_shape, q.data(), in.keys.rows(0), out.data(), Workspace{small.data(), small.size()});
    REQUIRE(backend::Cpu::reference_fallbacks() == fallbacks + 1);
  }
}

// ---- vocabulary ---------------------------------------------------------------

TEST_CASE("interface: a paged values source reads values, a paged keys source reads keys", "[interface][vocabulary]") {
  const std::int32_t Hkv = 2, ps = 4, d = 8, pages = 3;
  const PageStrides st = PageStrides::contiguous(PageLayout::kHND, Hkv, ps, d);
  std::vector<float> k(static_cast<std::size_t>(pages) * st.page), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i);
    v[i] = -static_cast<float>(i) - 1.0f;
  }
  const std::vector<std::int32_t> indptr{0, 2}, indices{2, 0}, last{3};
  const PagedKVView<const float> paged{
      k.data(), v.data(), st, st, pages, Hkv, ps, d, PageTable{indptr.data(), indices.data(), last.data(), 1}, kHost};
  const auto keys = KVSource<float>::from_paged(paged, 0);
  const auto values = KVSource<float>::from_paged_values(paged, 0);
  REQUIRE(keys.kv_len() == 7);
  REQUIRE(values.kv_len() == 7);
  for (std::int32_t h = 0; h < Hkv; ++h)
    for (std::int32_t t = 0; t < 7; ++t) {
      REQUIRE(keys.rows(h).row(t) == paged.k_ptr(indices[t / ps], h, t % ps));
      REQUIRE(values.rows(h).row(t) == paged.v_ptr(indices[t / ps], h, t % ps));
      REQUIRE(values.rows(h).row(t)[0] < 0.0f);
    }
}

TEST_CASE("interface: protected tokens score +inf in every scorer", "[interface][vocabulary]") {
  const RandomCase<float> rc(4, 2, 40, 16, 8, 1);
  const auto in = rc.input();
  std::vector<float> s(2 * 40);
  const ScoreMap out = TensorView<float, 2>::contiguous(s.data(), {2, 40});
  auto scores_of = [&](const auto& p) {
    const Requirements r = p.requirements(Context<backend::Scalar>{}, ProblemShape{4, 2, 16, 40, 8});
    std::vector<std::byte> ws(r.workspace_bytes);
    REQUIRE(p.score(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, in, out).is_ok());
    std::int64_t inf = 0;
    for (float x : s) inf += std::isinf(x) && x > 0 ? 1 : 0;
    REQUIRE(inf == 2 * p.protected_tokens(40));
  };
  scores_of(SnapKV(SnapKVParams::kvpress(0.5, 8)));
  scores_of(TOVA(TOVAParams::kvpress(0.5)));
  scores_of(PyramidKV(PyramidKVParams::kvpress(0.5, 1, 4, 8)));
}

// ---- the batched op form ------------------------------------------------------

TEMPLATE_TEST_CASE("interface: ops::topk_rows equals one topk per row", "[interface][ops]", backend::Scalar, backend::Cpu) {
  const std::int64_t rows = 5, n = 300;
  std::vector<float> s(static_cast<std::size_t>(rows * n));
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = std::sin(0.913f * static_cast<float>(i)) + (i % 7 == 0 ? 0.0f : 0.25f);
  std::vector<std::int32_t> indptr{0, 10, 10, 50, 51, 351 - 50};
  indptr[5] = indptr[4] + 300;
  std::vector<std::int32_t> got(static_cast<std::size_t>(indptr.back())), want(got.size());
  KeepSet keep{indptr.data(), got.data(), rows, static_cast<std::int64_t>(got.size())};
  ThreadPool pool(2);
  const ExecContext ex = pool.context();
  std::vector<std::byte> ws(ops::topk_rows_workspace<TestType>(n, ex));
  ops::topk_rows<TestType>(s.data(), n, rows, n, keep, 0, Workspace{ws.data(), ws.size()}, ex);
  std::vector<std::byte> one(TestType::topk_workspace(n));
  for (std::int64_t r = 0; r < rows; ++r)
    backend::Scalar::topk(s.data() + r * n, n, indptr[r + 1] - indptr[r], want.data() + indptr[r], Workspace{one.data(), one.size()});
  REQUIRE(got == want);
}

// ---- the owning convenience layer ----------------------------------------------

TEST_CASE("interface: Evictor gives the policy's decision in one call and throws its message", "[interface][easy]") {
  const RandomCase<half> rc(8, 2, 200, 32, 16, 21);
  Evictor<SnapKV> snapkv(SnapKVParams::kvpress(0.5, 16));
  const KeepSet& keep = snapkv.evict(rc.input());
  const auto ref = kvp_test::run_evict<backend::Cpu>(snapkv.policy(), rc.input());
  REQUIRE(keep.num_rows == 2);
  for (std::int64_t r = 0; r < 2; ++r) REQUIRE(std::vector<std::int32_t>(keep.row(r).begin(), keep.row(r).end()) == ref.row(r));
  // views over an engine's padded head-major buffer
  std::vector<half> cache(static_cast<std::size_t>(2 * 256 * 32));
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t t = 0; t < 200; ++t)
      for (std::int64_t c = 0; c < 32; ++c) cache[(h * 256 + t) * 32 + c] = rc.keys_t[(h * 200 + t) * 32 + c];
  const KeepSet& again = snapkv.evict(rc.input().queries, heads_major(cache.data(), 2, 200, 32, 256));
  for (std::int64_t r = 0; r < 2; ++r) REQUIRE(std::vector<std::int32_t>(again.row(r).begin(), again.row(r).end()) == ref.row(r));
  Evictor<SnapKV> wrong(SnapKVParams::kvpress(0.5, 64));
  REQUIRE_THROWS_WITH(wrong.evict(rc.input()), Catch::Contains("snapkv"));
}

// ---- composition ----------------------------------------------------------------

TEST_CASE("interface: Budgeted<SnapKV, UniformAllocation> is SnapKV's decision for every budget", "[interface][compose]") {
  const RandomCase<half> rc(8, 2, 130, 32, 16, 17);
  for (const Budget b : {Budget::compression_ratio(0.5), Budget::compression_ratio(0.9), Budget::tokens(10), Budget::tokens(40),
                         Budget::keep_ratio(0.3), Budget::tokens(20).protected_on_top()}) {
    SnapKVParams p = SnapKVParams::kvpress(0.5, 16);
    p.budget = b;
    const SnapKV snap(p);
    const Budgeted<SnapKV, UniformAllocation> composed(snap, UniformAllocation{b, 0});
    const ProblemShape shape{8, 2, 32, 130, 16};
    const Requirements r = composed.requirements("budgeted", Context<backend::Cpu>{}, shape);
    REQUIRE(r.status.is_ok());
    KeepSetBuffer keep(r.output.rows, r.output.capacity);
    std::vector<std::byte> ws(r.workspace_bytes);
    const auto in = rc.input();
    REQUIRE(composed
                .evict("budgeted", Context<backend::Cpu>{Workspace{ws.data(), ws.size()}}, std::span<const ScoreInput<float, half>>(&in, 1),
                       keep.view())
                .is_ok());
    REQUIRE(keep == kvp_test::run_evict<backend::Scalar>(snap, in));
  }
}

TEST_CASE("interface: allocators give every row the layer's budget and reject a wrong count buffer", "[interface][compose]") {
  std::vector<float> s(3 * 100, 0.0f);
  const auto scores = TensorView<const float, 2>::contiguous(s.data(), {3, 100});
  std::vector<std::int64_t> counts(3, -1);
  UniformAllocation u{Budget::compression_ratio(0.75), 8};
  REQUIRE(u.allocate(Context<backend::Scalar>{}, 100, scores, counts).is_ok());
  REQUIRE(counts == std::vector<std::int64_t>{25, 25, 25});
  const LayerAllocation pyramid{LayerSchedule::pyramid_kvpress(0.5, 8, 4), 0, 8};
  const LayerAllocation top{LayerSchedule::pyramid_kvpress(0.5, 8, 4), 3, 8};
  std::vector<std::int64_t> c0(3), c3(3);
  REQUIRE(pyramid.allocate(Context<backend::Scalar>{}, 100, scores, c0).is_ok());
  REQUIRE(top.allocate(Context<backend::Scalar>{}, 100, scores, c3).is_ok());
  REQUIRE(c0[0] > c3[0]);  // the pyramid keeps more in the lower layers
  REQUIRE(c0[0] == PyramidKV(PyramidKVParams::kvpress(0.5, 0, 4, 8)).kept_count(100));
  REQUIRE(c3[0] == PyramidKV(PyramidKVParams::kvpress(0.5, 3, 4, 8)).kept_count(100));
  std::vector<std::int64_t> wrong(2);
  REQUIRE_THAT(std::string(u.allocate(Context<backend::Scalar>{}, 100, scores, wrong).message()), Catch::Contains("2 counts for 3 rows"));
}
