// The device paths of the query-window policies (SnapKV with and without
// lookahead rows, LAQ / LAQ++ under both masks, PyramidKV), run on the CPU
// through the emulated device backend: kept sets identical to the host path
// (same reference ops, so exact). Every key-reading policy's device path also
// takes a paged pool (device pool and page ids, host CSR offsets) and keeps
// what the host keeps from the same keys stored densely. The same paths on backend::Cuda are
// compared with backend::Scalar on a GPU in tests/cuda/test_cuda_policies.cpp.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvpolicy/policy/eviction/adakv.hpp"
#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/h2o.hpp"
#include "kvpolicy/policy/eviction/knorm.hpp"
#include "kvpolicy/policy/eviction/laq.hpp"
#include "kvpolicy/policy/eviction/observed_attention.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "kvpolicy/policy/eviction/streaming_llm.hpp"
#include "kvpolicy/policy/eviction/tova.hpp"
#include "../emulated_device.hpp"
#include "../keep_set_buffer.hpp"
#include "policy/policy_test_util.hpp"

using namespace kvpolicy;
using kvp_test::EmulatedDevice;

namespace {

struct Problem {
  std::int64_t Hq, Hkv, d, T, rows, lookahead;
  std::vector<float> q, k;
  Problem(std::int64_t hq, std::int64_t hkv, std::int64_t dd, std::int64_t t, std::int64_t r, std::int64_t la, std::uint32_t seed)
      : Hq(hq),
        Hkv(hkv),
        d(dd),
        T(t),
        rows(r),
        lookahead(la),
        q(static_cast<std::size_t>(hq * r * dd)),
        k(static_cast<std::size_t>(hkv * t * dd)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (auto& x : q) x = nd(rng);
    for (auto& x : k) x = nd(rng);
  }
  ScoreInput<float, float> input(Device dev) const {
    ScoreInput<float, float> in{TensorView<const float, 3>::contiguous(q.data(), {Hq, rows, d}, dev),
                                KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {Hkv, T, d}, dev))};
    in.lookahead = lookahead;
    return in;
  }
};

/// `policy.evict` on Scalar (host views) and on the emulated device (device-tagged views): identical KeepSets.
template <class Policy>
void same_on_both(const Policy& policy, const Problem& p) {
  const auto host = p.input(Device{}), device = p.input(kvp_test::kEmulatedDevice);
  kvp_test::require_same_evict(policy, ProblemShape{p.Hq, p.Hkv, p.d, p.T, p.rows}, std::span<const ScoreInput<float, float>>(&host, 1),
                               std::span<const ScoreInput<float, float>>(&device, 1));
}

}  // namespace

TEST_CASE("device path: SnapKV, with and without lookahead rows, keeps what the host path keeps", "[device][snapkv]") {
  same_on_both(SnapKV(SnapKVParams::kvpress(0.5, 32, 5)), Problem(8, 2, 16, 300, 32, 0, 1));
  same_on_both(SnapKV(SnapKVParams::original(96, 16, 7)), Problem(4, 4, 32, 257, 16, 0, 2));
  SnapKVParams la = SnapKVParams::kvpress(0.6, 16, 5);
  same_on_both(SnapKV(la), Problem(8, 2, 16, 300, 16 + 6, 6, 3));  // kCorrected: lookahead rows see every key
  la.lookahead_mask = LookaheadMask::kReference;
  same_on_both(SnapKV(la), Problem(8, 2, 16, 300, 16 + 6, 6, 4));
  same_on_both(SnapKV(SnapKVParams::kvpress(0.0, 16, 5)), Problem(2, 1, 8, 40, 16, 0, 5));  // keep everything
}

TEST_CASE("device path: LAQ and LAQ++ (stage 2) under both masks keep what the host path keeps", "[device][laq]") {
  for (const LookaheadMask mask : {LookaheadMask::kReference, LookaheadMask::kCorrected}) {
    LAQParams laq = LAQParams::laq(64);
    laq.mask = mask;
    same_on_both(LAQ(laq), Problem(8, 2, 16, 400, 8, 8, 11));  // W2 = 0: the 8 pseudo queries alone
    same_on_both(LAQ(laq), Problem(8, 2, 16, 400, 3, 3, 12));  // fewer pseudo tokens (EOS)
    LAQParams pp = LAQParams::laq_plus_plus(96);
    pp.mask = mask;
    same_on_both(LAQ(pp), Problem(4, 1, 32, 333, 8 + 8, 8, 13));
    same_on_both(LAQ(LAQParams::laq(500)), Problem(8, 2, 16, 400, 8, 8, 14));  // T <= C: kept whole
  }
}

TEST_CASE("device path: PyramidKV keeps what the host path keeps", "[device][pyramidkv]") {
  for (const int layer : {0, 13, 31}) {
    INFO("layer " << layer);
    same_on_both(PyramidKV(PyramidKVParams::kvpress(0.5, layer, 32, 32)),
                 Problem(8, 2, 16, 500, 32, 0, 20 + static_cast<std::uint32_t>(layer)));
  }
}

TEST_CASE("device path: Expected Attention (scores and kept sets) equals the host path", "[device][expected_attention]") {
  const std::int64_t Hq = 8, Hkv = 2, d = 16, q_len = 70;
  std::mt19937 rng(40);
  std::normal_distribution<float> nd;
  for (const std::int64_t T : {300, 97}) {
    std::vector<float> q(static_cast<std::size_t>(Hq * q_len * d)), k(static_cast<std::size_t>(Hkv * T * d)),
        v(static_cast<std::size_t>(Hkv * T * d));
    for (auto* buf : {&q, &k, &v})
      for (auto& x : *buf) x = nd(rng);
    const auto input = [&](Device dev) {
      ExpectedAttentionInput<float, float> in;
      in.queries = TensorView<const float, 3>::contiguous(q.data(), {Hq, q_len, d}, dev);
      in.keys = KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {Hkv, T, d}, dev));
      in.values = KVSource<float>::from(TensorView<const float, 3>::contiguous(v.data(), {Hkv, T, d}, dev));
      return in;
    };
    const ExpectedAttentionParams variants[] = {ExpectedAttentionParams::kvpress(0.5),
                                                ExpectedAttentionParams::kvpress(0.8, 64, 2, false, true),
                                                ExpectedAttentionParams::kvpress(0.3, 16, 0, true, false, 0.01f)};
    for (const auto& params : variants) {
      const ExpectedAttention policy(params);
      INFO("T " << T << " cov " << params.use_covariance << " vnorm " << params.use_vnorm);
      const ProblemShape shape{Hq, Hkv, d, T, q_len};
      kvp_test::TwoSides sides = kvp_test::two_sides(policy, shape);
      std::vector<float> hs(static_cast<std::size_t>(Hkv * T)), ds(hs.size(), -1.0f);
      REQUIRE(policy
                  .score(Context<backend::Scalar>{sides.host_workspace()}, input(Device{}),
                         TensorView<float, 2>::contiguous(hs.data(), {Hkv, T}))
                  .is_ok());
      const Status st = policy.score(Context<EmulatedDevice>{sides.device_workspace()}, input(kvp_test::kEmulatedDevice),
                                     TensorView<float, 2>::contiguous(ds.data(), {Hkv, T}, kvp_test::kEmulatedDevice));
      INFO(st.message());
      REQUIRE(st.is_ok());
      REQUIRE(std::memcmp(hs.data(), ds.data(), hs.size() * sizeof(float)) == 0);
      const auto host = input(Device{}), device = input(kvp_test::kEmulatedDevice);
      kvp_test::require_same_evict(policy, shape, std::span<const ExpectedAttentionInput<float, float>>(&host, 1),
                                   std::span<const ExpectedAttentionInput<float, float>>(&device, 1));
    }
  }
}

namespace {

/// `policy` over case `rc`'s keys: dense host views on Scalar against the paged pool (page size `ps`, shuffled
/// page ids, spare pages) tagged as the emulated device's, with `lookahead` set on both; identical KeepSets.
template <class Policy, class Tk>
void same_from_paged(const Policy& policy, const kvp_test::RandomCase<Tk>& rc, std::int32_t ps, std::int64_t lookahead = 0,
                     bool keys_only = false) {
  INFO("page size " << ps << ", T " << rc.T << ", rows " << rc.w);
  ScoreInput<float, Tk> host = rc.input(), device = rc.paged_input(ps, kvp_test::kEmulatedDevice);
  host.lookahead = device.lookahead = lookahead;
  if (keys_only) host.queries = device.queries = {};
  kvp_test::require_same_evict(policy, ProblemShape{rc.Hq, rc.Hkv, rc.d, rc.T, keys_only ? 0 : rc.w},
                               std::span<const ScoreInput<float, Tk>>(&host, 1), std::span<const ScoreInput<float, Tk>>(&device, 1));
}

}  // namespace

TEST_CASE("device path: paged keys (device pool, host offsets) keep what dense host keys keep", "[device][paged]") {
  for (const std::int32_t ps : {16, 7}) {
    const kvp_test::RandomCase<half> window(8, 2, 300, 32, 32, 61);
    same_from_paged(SnapKV(SnapKVParams::kvpress(0.5, 32, 5)), window, ps);
    same_from_paged(PyramidKV(PyramidKVParams::kvpress(0.5, 13, 32, 32)), window, ps);
    same_from_paged(AdaKV<SnapKV>(AdaKVParams::kvpress(0.5), SnapKV(adakv_scoring())), window, ps);  // device-written indptr
    same_from_paged(AdaKV<SnapKV>(AdaKVParams::original_gqa(48, 0.2, true), SnapKV(adakv_scoring())), window, ps);
    const kvp_test::RandomCase<float> lookahead(8, 2, 300, 16, 16 + 6, 62);
    SnapKVParams la = SnapKVParams::kvpress(0.6, 16, 5);
    same_from_paged(SnapKV(la), lookahead, ps, 6);
    const kvp_test::RandomCase<float> pseudo(8, 2, 400, 16, 8, 63);
    same_from_paged(LAQ(LAQParams::laq(64)), pseudo, ps, 8);
    const kvp_test::RandomCase<bfloat16> last(8, 2, 257, 32, 1, 64);
    same_from_paged(TOVA(TOVAParams{Budget::compression_ratio(0.5)}), last, ps);
    const kvp_test::RandomCase<half> prompt(4, 2, 150, 16, 150, 65);
    same_from_paged(ObservedAttention(ObservedAttentionParams{}), prompt, ps);
    same_from_paged(Knorm(KnormParams::kvpress(0.5)), window, ps, 0, /*keys_only=*/true);
    same_from_paged(StreamingLLM(StreamingLLMParams{4, Budget::tokens(100), 0}), window, ps, 0, /*keys_only=*/true);
  }
}

TEST_CASE("device path: H2O's update from queries over paged keys equals the dense host update", "[device][paged][h2o]") {
  const std::int64_t Hq = 8, Hkv = 2, d = 16, T = 150, cap = 200;  // T > 64: several query blocks
  const kvp_test::RandomCase<half> rc(Hq, Hkv, T, d, T, 91);
  for (const GroupReduce red : {GroupReduce::kSum, GroupReduce::kMean}) {
    H2OParams params = H2OParams::original(10, 20);
    params.group_reduce = red;
    const H2O policy(params);
    for (const std::int32_t ps : {16, 7}) {
      INFO("page size " << ps << " reduce " << static_cast<int>(red));
      kvp_test::TwoSides sides = kvp_test::two_sides(policy, ProblemShape{Hq, Hkv, d, T, T});
      std::vector<float> hs(static_cast<std::size_t>(Hkv * cap), -1.0f), ds(hs.size(), -1.0f);
      H2OState hst{TensorView<float, 2>::contiguous(hs.data(), {Hkv, cap}), 0};
      H2OState dst{TensorView<float, 2>::contiguous(ds.data(), {Hkv, cap}, kvp_test::kEmulatedDevice), 0};
      REQUIRE(policy.update(Context<backend::Scalar>{sides.host_workspace()}, hst, rc.input()).is_ok());
      const Status st =
          policy.update(Context<EmulatedDevice>{sides.device_workspace()}, dst, rc.paged_input(ps, kvp_test::kEmulatedDevice));
      INFO(st.message());
      REQUIRE(st.is_ok());
      REQUIRE(dst.length == hst.length);
      REQUIRE(std::memcmp(hs.data(), ds.data(), hs.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("device path: Expected Attention over paged keys and values equals the dense host path", "[device][paged][expected_attention]") {
  const std::int64_t Hq = 8, Hkv = 2, d = 16, T = 300, q_len = 70;
  // Two cases with the same T and page size share the page permutation, so one table serves both pools.
  const kvp_test::RandomCase<float> kc(Hq, Hkv, T, d, q_len, 71), vc(Hq, Hkv, T, d, q_len, 72);
  for (const std::int32_t ps : {16, 7}) {
    INFO("page size " << ps);
    const auto kin = kc.input(), kpin = kc.paged_input(ps, kvp_test::kEmulatedDevice);
    const auto vin = vc.input();
    (void)vc.paged_input(ps, kvp_test::kEmulatedDevice);
    REQUIRE(kc.indices == vc.indices);
    PagedKVView<const float> pool = kc.paged;
    pool.v_data = vc.paged.k_data;
    pool.v_strides = vc.paged.k_strides;
    ExpectedAttentionInput<float, float> host, device;
    host.queries = kin.queries;
    host.keys = kin.keys;
    host.values = vin.keys;
    device.queries = kpin.queries;
    device.keys = KVSource<float>::from_paged(pool, 0);
    device.values = KVSource<float>::from_paged_values(pool, 0);
    for (const auto& params : {ExpectedAttentionParams::kvpress(0.5), ExpectedAttentionParams::kvpress(0.3, 16, 0, true, false, 0.01f)}) {
      kvp_test::require_same_evict(ExpectedAttention(params), ProblemShape{Hq, Hkv, d, T, q_len},
                                   std::span<const ExpectedAttentionInput<float, float>>(&host, 1),
                                   std::span<const ExpectedAttentionInput<float, float>>(&device, 1));
    }
  }
}

TEST_CASE("device path: a paged pool in host memory is refused by name, nothing written", "[device][paged]") {
  const kvp_test::RandomCase<float> rc(8, 2, 300, 16, 16, 81);
  ScoreInput<float, float> in = rc.paged_input(16, kvp_test::kEmulatedDevice);
  PagedKVView<const float> host_pool = rc.paged;
  host_pool.device = kHost;
  in.keys = KVSource<float>::from_paged(host_pool, 0);
  const SnapKV policy(SnapKVParams::kvpress(0.5, 16, 5));
  const ProblemShape shape{8, 2, 16, 300, 16};
  const Requirements req = policy.requirements(Context<EmulatedDevice>{}, shape);
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes, kvp_test::kWorkspacePoison);
  KeepSetBuffer out(req.output.rows, req.output.capacity);
  out.fill_sentinel();
  const Status s = policy.evict(Context<EmulatedDevice>{Workspace{ws.data(), ws.size()}}, in, out.view());
  INFO(s.message());
  REQUIRE(s.code() == StatusCode::kInvalidArgument);
  REQUIRE(std::string(s.message()).find("keys is a paged pool in host memory") != std::string::npos);
  REQUIRE(out.untouched());
  // A sequence outside the table is refused the same way on the device.
  in.keys = KVSource<float>::from_paged(rc.paged, 1);
  const Status r = policy.evict(Context<EmulatedDevice>{Workspace{ws.data(), ws.size()}}, in, out.view());
  REQUIRE(std::string(r.message()).find("sequence 1 out of range") != std::string::npos);
  REQUIRE(out.untouched());
}
