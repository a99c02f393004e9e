// The device paths of the query-window policies (SnapKV with and without
// lookahead rows, LAQ / LAQ++ under both masks, PyramidKV), run on the CPU
// through the emulated device backend: kept sets identical to the host path
// (same reference ops, so exact). The same paths on backend::Cuda are
// compared with backend::Scalar on a GPU in tests/cuda/test_cuda_policies.cpp.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "kvpolicy/policy/eviction/expected_attention.hpp"
#include "kvpolicy/policy/eviction/laq.hpp"
#include "kvpolicy/policy/eviction/pyramidkv.hpp"
#include "kvpolicy/policy/eviction/snapkv.hpp"
#include "../emulated_device.hpp"
#include "../keep_set_buffer.hpp"

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
      const Requirements hreq = policy.requirements(Context<backend::Scalar>{}, shape);
      const Requirements dreq = policy.requirements(Context<EmulatedDevice>{}, shape);
      REQUIRE(hreq.status.is_ok());
      REQUIRE(dreq.status.is_ok());
      std::vector<std::byte> hws(hreq.workspace_bytes), dws(dreq.workspace_bytes);
      std::vector<float> hs(static_cast<std::size_t>(Hkv * T)), ds(hs.size(), -1.0f);
      REQUIRE(policy
                  .score(Context<backend::Scalar>{Workspace{hws.data(), hws.size()}}, input(Device{}),
                         TensorView<float, 2>::contiguous(hs.data(), {Hkv, T}))
                  .is_ok());
      const Status st = policy.score(Context<EmulatedDevice>{Workspace{dws.data(), dws.size()}}, input(kvp_test::kEmulatedDevice),
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
