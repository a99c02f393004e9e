// Compress<E, M, Q>: evict -> merge -> quantize on one budget (tokens or
// bytes) equals the four steps called by hand, with memory accounting; a
// quantizer that cannot take the shape fails before the cache is touched.
#include <catch2/catch.hpp>

#include <random>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"
#include "kvpolicy/policy/pipeline.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "merge_test_util.hpp"

using namespace kvpolicy;
using namespace kvp_merge_test;
using Catch::Matchers::Contains;

namespace {

struct Setup {
  std::int64_t Hq = 4, H = 2, T = 64, d, w = 8;
  std::vector<float> q, k, v;
  std::vector<std::int32_t> pos;
  explicit Setup(std::int64_t dd) : d(dd), q(Hq * w * dd), k(H * T * dd), v(H * T * dd), pos(H * T) {
    std::mt19937 rng(3);
    std::normal_distribution<float> nd;
    for (auto& x : q) x = nd(rng);
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    for (std::int64_t i = 0; i < H * T; ++i) pos[i] = static_cast<std::int32_t>(i % T);
  }
  ScoreInput<float, float> score_in() const {
    return {TensorView<const float, 3>::contiguous(q.data(), {Hq, w, d}),
            KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {H, T, d}))};
  }
  MergeInput<float> merge_in() const {
    MergeInput<float> in;
    in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {H, T, d}));
    in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {H, T, d}));
    return in;
  }
  CompressCache<float> cache() {
    return {TensorView<float, 3>::contiguous(k.data(), {H, T, d}), TensorView<float, 3>::contiguous(v.data(), {H, T, d}),
            TensorView<std::int32_t, 2>::contiguous(pos.data(), {H, T}), T};
  }
};

struct Codes {
  std::vector<std::uint8_t> kb, vb;
  QuantizedKV k, v;
  Codes(const GgmlQuant& q, std::int64_t H, std::int64_t n, std::int64_t d)
      : kb(static_cast<std::size_t>(H * n * q.row_bytes(d)), 0), vb(kb.size(), 0) {
    k.layout = v.layout = q.layout();
    k.codes = TensorView<std::uint8_t, 3>::contiguous(kb.data(), {H, n, q.row_bytes(d)});
    v.codes = TensorView<std::uint8_t, 3>::contiguous(vb.data(), {H, n, q.row_bytes(d)});
  }
};

}  // namespace

TEST_CASE("compress pipeline: SnapKV -> LOOK-M -> q8_0 on a token budget equals the steps by hand, with memory accounting",
          "[merging][pipeline]") {
  const std::int64_t n = 24;
  const SnapKV snap(SnapKVParams::kvpress(0.5, 8, 3));
  const GgmlQuant q8(GgmlQuantParams{GgmlType::kQ8_0});
  const Compress<SnapKV, LookMPivot, GgmlQuant> pipe(snap, LookMPivot{}, q8, PipelineBudget::tokens(n));
  Setup a(32), b(32);
  const Context<backend::Cpu> probe{};
  const Requirements r = pipe.requirements(probe, ProblemShape{a.Hq, a.H, a.d, a.T, a.w});
  REQUIRE(r.status.is_ok());
  REQUIRE(r.output.capacity == a.H * n);
  std::vector<std::byte> ws(r.workspace_bytes + 64);
  const Context<backend::Cpu> ctx{Workspace{ws.data(), ws.size()}};
  // Pipeline.
  KeepSetBuffer keep(a.H, a.H * n);
  PlanBuffer plan(a.H, a.H * a.T, n, a.d);
  Codes codes(q8, a.H, n, a.d);
  std::vector<std::int64_t> lens(a.H);
  MemoryAccount acc;
  REQUIRE(
      pipe.run(ctx, a.score_in(), a.merge_in(), a.cache(), CompressOutput{keep.view(), plan.view(), codes.k, codes.v, lens, &acc}).is_ok());
  REQUIRE(lens == std::vector<std::int64_t>{n, n});
  REQUIRE(acc.tokens_before == 64);
  REQUIRE(acc.tokens_after == n);
  REQUIRE(acc.bytes_per_token_before == 2.0 * 32 * 4);
  REQUIRE(acc.bytes_per_token_after == 2.0 * 34);  // q8_0: 34 bytes per 32 values
  REQUIRE(acc.bytes_before == 256.0 * 64 * 2);
  REQUIRE(acc.bytes_after == 68.0 * n * 2);
  REQUIRE(acc.bytes_per_prompt_token_after() == Approx(68.0 * n / 64));
  // By hand.
  KeepSetBuffer keep2(b.H, b.H * n);
  SnapKVParams sp = snap.params();
  sp.budget = Budget::tokens(n).clamp_to_length();
  const auto sin = b.score_in();
  REQUIRE(SnapKV(sp).evict(ctx, std::span<const ScoreInput<float, float>>(&sin, 1), keep2.view()).is_ok());
  REQUIRE(keep2 == keep);
  PlanBuffer plan2(b.H, b.H * b.T, n, b.d);
  REQUIRE(LookMPivot{}.merge(ctx, b.merge_in(), keep2.view(), plan2.view()).is_ok());
  REQUIRE((plan2.keys == plan.keys && plan2.values == plan.values && plan2.indptr == plan.indptr));
  std::vector<std::int64_t> lens2(b.H);
  auto cb = b.cache();
  REQUIRE(merge_and_compact_contiguous(cb.keys, cb.values, cb.positions, b.T, keep2.view(), 0, plan2.view(), lens2).is_ok());
  Codes codes2(q8, b.H, n, b.d);
  GgmlQuant::State st;
  codes2.k.tokens = codes2.v.tokens = n;
  REQUIRE(q8.quantize(ctx, TensorView<const float, 3>(cb.keys.narrow(1, 0, n)), st, codes2.k).is_ok());
  REQUIRE(q8.quantize(ctx, TensorView<const float, 3>(cb.values.narrow(1, 0, n)), st, codes2.v).is_ok());
  REQUIRE(codes2.kb == codes.kb);
  REQUIRE(codes2.vb == codes.vb);
  REQUIRE(a.k == b.k);
  REQUIRE(a.pos == b.pos);
  // The merged rows reached the cache: some kept key differs from every original key of its head.
  REQUIRE(plan.indptr.back() > 0);
}

TEST_CASE("compress pipeline: a byte budget picks the tokens whose quantized K and V fit, bad quantizer shapes fail before writing",
          "[merging][pipeline]") {
  const GgmlQuant q4(GgmlQuantParams{GgmlType::kQ4_0});  // 18 bytes per 32 values
  const double per = 2.0 * q4.bytes_per_token(32);
  const Compress<SnapKV, KvpressMerging, GgmlQuant> pipe(SnapKV(SnapKVParams::kvpress(0.5, 8, 3)), KvpressMerging{}, q4,
                                                         PipelineBudget::bytes(per * 10 + 5));
  REQUIRE(pipe.kept_tokens(64, 32) == 10);
  REQUIRE(pipe.kept_tokens(7, 32) == 7);
  Setup a(32);
  const Requirements r = pipe.requirements(Context<backend::Scalar>{}, ProblemShape{a.Hq, a.H, a.d, a.T, a.w});
  std::vector<std::byte> ws(r.workspace_bytes + 64);
  const Context<backend::Scalar> ctx{Workspace{ws.data(), ws.size()}};
  KeepSetBuffer keep(a.H, a.H * 10);
  PlanBuffer plan(a.H, a.H * a.T, 10, a.d, /*with_keys=*/false);
  Codes codes(q4, a.H, 10, a.d);
  std::vector<std::int64_t> lens(a.H);
  MemoryAccount acc;
  REQUIRE(
      pipe.run(ctx, a.score_in(), a.merge_in(), a.cache(), CompressOutput{keep.view(), plan.view(), codes.k, codes.v, lens, &acc}).is_ok());
  REQUIRE(acc.tokens_after == 10);
  REQUIRE(acc.bytes_after / a.H <= per * 10 + 5);
  // head_dim 48 is not a multiple of the q4_0 block: rejected, cache and positions unchanged.
  Setup bad(48);
  const std::vector<float> k0 = bad.k, v0 = bad.v;
  const std::vector<std::int32_t> p0 = bad.pos;
  Codes c2(q4, bad.H, 10, 64);
  PlanBuffer plan2(bad.H, bad.H * bad.T, 10, bad.d, false);
  KeepSetBuffer keep2(bad.H, bad.H * 10);
  const Status s = pipe.run(ctx, bad.score_in(), bad.merge_in(), bad.cache(), CompressOutput{keep2.view(), plan2.view(), c2.k, c2.v, lens});
  REQUIRE_THAT(s.message(), Contains("not a multiple"));
  REQUIRE((bad.k == k0 && bad.v == v0 && bad.pos == p0));
  // Codes with too few token rows: rejected before anything is written.
  Setup c(32);
  const std::vector<float> kc = c.k;
  Codes few(q4, c.H, 9, 32);
  const Status s2 = pipe.run(ctx, c.score_in(), c.merge_in(), c.cache(), CompressOutput{keep.view(), plan.view(), few.k, few.v, lens});
  REQUIRE_THAT(s2.message(), Contains("codes hold"));
  REQUIRE(c.k == kc);
}
