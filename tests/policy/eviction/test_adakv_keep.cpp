// Ada-KV's device form on the host: `ops::adakv_keep` (thresholds over the
// score map, ops/adakv_keep.hpp) gives the host allocation's counts and rows
// exactly, and the policy's device path (indptr written by the ops, a
// CallScope per call) runs end to end on an emulated device backend: the
// scalar ops on host memory behind a `CallScope`, so `kDeviceBackend` holds.
// This is what `backend::Cuda::adakv_keep` is compared with on a GPU
// (tests/cuda/test_cuda_policies.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/ops/adakv_keep.hpp"
#include "kvpolicy/policy/eviction/adakv.hpp"
#include "../emulated_device.hpp"
#include "../keep_set_buffer.hpp"

using namespace kvpolicy;

namespace {

using kvp_test::EmulatedDevice;
constexpr Device kTagged = kvp_test::kEmulatedDevice;

/// Scores with ties, zeros, NaN and -inf; the last `P` of each row +inf (protected), and `extra_inf` past +inf.
std::vector<float> score_map(std::int64_t rows, std::int64_t T, std::int64_t P, std::int64_t extra_inf, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> s(static_cast<std::size_t>(rows * T));
  for (auto& x : s) {
    const unsigned p = rng() % 20;
    x = p < 14   ? static_cast<float>(rng() % 50) * 0.125f
        : p < 17 ? static_cast<float>(rng() % 1000) * 1e-3f
        : p < 18 ? 0.0f
        : p < 19 ? -std::numeric_limits<float>::infinity()
                 : std::numeric_limits<float>::quiet_NaN();
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = std::max<std::int64_t>(T - P, 0); j < T; ++j) s[static_cast<std::size_t>(r * T + j)] = INFINITY;
  for (std::int64_t e = 0; e < extra_inf; ++e) s[rng() % static_cast<std::size_t>(rows * std::max<std::int64_t>(T - P, 1))] = INFINITY;
  return s;
}

/// The host allocation plus each row's top count (what `AdaKV::evict` does on the host).
void reference(const AdaKVAllocation& a, const std::vector<float>& S, std::int64_t rows, std::int64_t T, std::vector<std::int64_t>& counts,
               std::vector<std::int32_t>& indptr, std::vector<std::int32_t>& ids, std::int32_t first) {
  std::vector<std::byte> ws(a.workspace_bytes(Context<backend::Scalar>{}, rows, T), kvp_test::kWorkspacePoison);
  counts.assign(static_cast<std::size_t>(rows), -1);
  const Status st = a.allocate(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, T,
                               TensorView<const float, 2>::contiguous(S.data(), {rows, T}), std::span<std::int64_t>(counts));
  INFO(st.message());
  REQUIRE(st.is_ok());
  indptr.assign(static_cast<std::size_t>(rows + 1), first);
  ids.assign(static_cast<std::size_t>(first + rows * T), -7);
  std::vector<std::byte> tws(backend::Scalar::topk_workspace(T), kvp_test::kWorkspacePoison);
  for (std::int64_t r = 0; r < rows; ++r) {
    indptr[static_cast<std::size_t>(r + 1)] =
        static_cast<std::int32_t>(indptr[static_cast<std::size_t>(r)] + counts[static_cast<std::size_t>(r)]);
    backend::Scalar::topk(S.data() + r * T, T, counts[static_cast<std::size_t>(r)], ids.data() + indptr[static_cast<std::size_t>(r)],
                          Workspace{tws.data(), tws.size()});
  }
}

void check_op(const AdaKVAllocation& a, std::int64_t rows, std::int64_t T, std::int64_t extra_inf, std::uint32_t seed) {
  const std::vector<float> S = score_map(rows, T, a.num_protected, extra_inf, seed);
  const std::int32_t first = 5;  // the sequence's first offset, read by the op
  std::vector<std::int64_t> want_counts;
  std::vector<std::int32_t> want_indptr, want_ids;
  reference(a, S, rows, T, want_counts, want_indptr, want_ids, first);

  const AdaKVKeepSpec spec = a.keep_spec(T, rows);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(rows), -1);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(rows + 1), -7), ids(static_cast<std::size_t>(first + rows * T), -7);
  indptr[0] = first;
  std::vector<std::byte> ws(ops::adakv_keep_workspace<backend::Scalar>(rows, T), kvp_test::kWorkspacePoison);
  ops::adakv_keep<backend::Scalar>(S.data(), rows, T, spec, counts.data(), indptr.data(), ids.data(), Workspace{ws.data(), ws.size()});
  REQUIRE(counts == want_counts);
  REQUIRE(indptr == want_indptr);
  REQUIRE(std::equal(ids.begin(), ids.begin() + indptr.back(), want_ids.begin()));
  REQUIRE(std::all_of(ids.begin() + indptr.back(), ids.end(), [](std::int32_t v) { return v == -7; }));
  REQUIRE(std::all_of(ids.begin(), ids.begin() + first, [](std::int32_t v) { return v == -7; }));
}

}  // namespace

TEST_CASE("adakv_keep: the threshold form gives the kvpress allocation's counts and rows", "[adakv][keep]") {
  std::uint32_t seed = 1;
  for (const std::int64_t T : {1, 9, 64, 301})
    for (const std::int64_t rows : {1, 3, 8})
      for (const double r : {0.0, 0.1, 0.5, 0.9, 0.99})
        for (const double alpha : {0.0, 0.2, 1.0})
          for (const bool at_least_one : {false, true}) {
            AdaKVParams p = AdaKVParams::kvpress(r, alpha);
            if (at_least_one) p.budget = p.budget.keep_at_least_one();
            const std::int64_t P = std::min<std::int64_t>(T, 4);
            const AdaKVAllocation a{p.variant, p.alpha, p.normalize, p.budget, P};
            INFO("T " << T << " rows " << rows << " r " << r << " alpha " << alpha << " at_least_one " << at_least_one);
            check_op(a, rows, T, 0, seed++);
            check_op(a, rows, T, T / 3, seed++);  // past tokens at +inf compete with the protected ones
          }
}

TEST_CASE("adakv_keep: the threshold form gives the original's capacities, normalised or not", "[adakv][keep]") {
  std::uint32_t seed = 100;
  for (const std::int64_t T : {8, 40, 257})
    for (const std::int64_t rows : {1, 4, 8})
      for (const std::int64_t P : {0, 3, 8})
        for (const double alpha : {0.0, 0.2, 0.5, 1.0})
          for (const bool normalize : {false, true})
            for (const std::int64_t C : {P, P + 1, T / 2 + P, T - 1, T, T + 7}) {
              if (P > T || C < P) continue;
              const AdaKVParams p = AdaKVParams::original(C, alpha, normalize);
              const AdaKVAllocation a{p.variant, p.alpha, p.normalize, p.budget, P};
              INFO("T " << T << " rows " << rows << " P " << P << " alpha " << alpha << " normalize " << normalize << " C " << C);
              check_op(a, rows, T, 0, seed++);
              check_op(a, rows, T, T / 2, seed++);  // many +inf: the shares can fall below P (uniform caps)
            }
}

TEST_CASE("adakv: the device path (ops::adakv_keep, indptr written by the ops) equals the host path", "[adakv][device]") {
  const std::int64_t Hq = 8, Hkv = 2, d = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  struct Seq {
    std::int64_t T;
    std::vector<float> q, k;
  };
  std::vector<Seq> seqs;
  for (const std::int64_t T : {300, 97, 40}) {
    Seq s{T, std::vector<float>(static_cast<std::size_t>(Hq * 32 * d)), std::vector<float>(static_cast<std::size_t>(Hkv * T * d))};
    for (auto& x : s.q) x = nd(rng);
    for (auto& x : s.k) x = nd(rng);
    seqs.push_back(std::move(s));
  }
  const auto inputs = [&](Device dev) {
    std::vector<ScoreInput<float, float>> in;
    for (const auto& s : seqs)
      in.push_back({TensorView<const float, 3>::contiguous(s.q.data(), {Hq, 32, d}, dev),
                    KVSource<float>::from(TensorView<const float, 3>::contiguous(s.k.data(), {Hkv, s.T, d}, dev))});
    return in;
  };
  const auto host_in = inputs(Device{}), dev_in = inputs(kTagged);
  const ProblemShape shape{Hq, Hkv, d, 300, 32, 3};
  const AdaKVParams variants[] = {AdaKVParams::kvpress(0.5), AdaKVParams::kvpress(0.9, 0.0),       AdaKVParams::kvpress(0.0),
                                  AdaKVParams::original(64), AdaKVParams::original(64, 0.5, true), AdaKVParams::original_gqa(48, 0.2, true),
                                  AdaKVParams::original(400)};
  for (const AdaKVParams& p : variants) {
    const AdaKV<SnapKV> policy(p, SnapKV(adakv_scoring()));
    const std::int64_t rows = policy.rows_per_sequence(Hq, Hkv);
    INFO("variant " << static_cast<int>(p.variant) << " rows " << rows);
    kvp_test::require_same_evict(policy, shape, std::span<const ScoreInput<float, float>>(host_in),
                                 std::span<const ScoreInput<float, float>>(dev_in));
  }
}

TEST_CASE("adakv on a device backend: host views, sharded layers and a small output are refused, nothing written", "[adakv][device]") {
  const std::int64_t Hq = 4, Hkv = 2, d = 8, T = 100;
  std::vector<float> q(static_cast<std::size_t>(Hq * 32 * d), 0.5f), k(static_cast<std::size_t>(Hkv * T * d), 0.25f);
  const ScoreInput<float, float> host{TensorView<const float, 3>::contiguous(q.data(), {Hq, 32, d}),
                                      KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {Hkv, T, d}))};
  const ScoreInput<float, float> dev{TensorView<const float, 3>::contiguous(q.data(), {Hq, 32, d}, kTagged),
                                     KVSource<float>::from(TensorView<const float, 3>::contiguous(k.data(), {Hkv, T, d}, kTagged))};
  const AdaKV<SnapKV> policy(AdaKVParams::kvpress(0.5), SnapKV(adakv_scoring()));
  const Requirements req = policy.requirements(Context<EmulatedDevice>{}, ProblemShape{Hq, Hkv, d, T, 32});
  REQUIRE(req.status.is_ok());
  std::vector<std::byte> ws(req.workspace_bytes, kvp_test::kWorkspacePoison);
  const Context<EmulatedDevice> cx{Workspace{ws.data(), ws.size()}};

  kvp_test::KeepSetBuffer out(req.output.rows, req.output.capacity);
  out.fill_sentinel();
  const Status host_view = policy.evict(cx, host, out.view());
  INFO(host_view.message());
  CHECK(host_view.code() == StatusCode::kInvalidArgument);
  CHECK(std::string(host_view.message()).find("host tensor") != std::string::npos);
  CHECK(out.untouched());

  kvp_test::KeepSetBuffer small(req.output.rows, req.output.capacity - 1);
  small.fill_sentinel();
  CHECK(policy.evict(cx, dev, small.view()).code() == StatusCode::kOutputTooSmall);
  CHECK(small.untouched());

  // A sharded layer (two ranks) is refused by requirements and by evict; the collective is never called.
  const Collective comm{0, 2, nullptr, [](void*, std::int64_t*, std::size_t) noexcept { return Status::ok(); },
                        [](void*, const void*, std::size_t, void*) noexcept { return Status::ok(); }};
  const HeadShard shard{0, 2 * Hkv, 2 * Hq, &comm};
  ExecContext sharded;
  sharded.shard = &shard;
  const Status req_sharded = policy.requirements(Context<EmulatedDevice>{{}, sharded}, ProblemShape{Hq, Hkv, d, T, 32}).status;
  CHECK(req_sharded.code() == StatusCode::kUnsupported);
  CHECK(std::string(req_sharded.message()).find("sharded") != std::string::npos);
  CHECK(policy.evict(Context<EmulatedDevice>{Workspace{ws.data(), ws.size()}, sharded}, dev, out.view()).code() ==
        StatusCode::kUnsupported);
  CHECK(out.untouched());
}
