// CaM's streaming merge, kvpress CAMPress and MiniCache on a device backend
// (the emulated device: backend::Scalar's reference ops behind a device call
// scope): torch's generator in the phases the device twists it in, dense plan
// rows whose drawn entries are the host plan's, merged value rows bit-identical
// to the host path's, MiniCache's store with device-written retained offsets,
// and the device paths' refusals with nothing written. backend::Cuda runs the
// same comparisons in tests/cuda/test_cuda_policies.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "kvpolicy/ops/cam_steps.hpp"
#include "kvpolicy/policy/merging/cam.hpp"
#include "kvpolicy/policy/merging/kvpress_cam.hpp"
#include "kvpolicy/policy/merging/minicache.hpp"
#include "merge_test_util.hpp"
#include "policy/emulated_device.hpp"

using namespace kvpolicy;
using namespace kvp_merge_test;
using Catch::Matchers::Contains;
using kvp_test::EmulatedDevice;
using kvp_test::kEmulatedDevice;

namespace {

/// Values (H, T, d) of type Tk and accumulated attention sums (rows, T) with zeros (0 / 0 windows) and a spread of magnitudes.
template <class Tk>
struct CamCase {
  std::int64_t H, T, d, rows;
  std::vector<Tk> v;
  std::vector<float> sums, scores;
  CamCase(std::int64_t h, std::int64_t t, std::int64_t dd, std::int64_t group, unsigned seed)
      : H(h), T(t), d(dd), rows(h * group), v(h * t * dd), sums(h * group * t), scores(h * t) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> ud(0.0f, 2.0f);
    for (auto& x : v) x = from_float<Tk>(nd(rng));
    for (std::size_t i = 0; i < sums.size(); ++i) sums[i] = (i * 13 + 5) % 11 == 0 ? 0.0f : ud(rng) * ((i % 9 == 0) ? 40.0f : 1.0f);
    for (std::size_t i = 0; i < scores.size(); ++i) scores[i] = static_cast<float>((i * 7) % 5);  // many equal means: ties by token id
  }
  MergeInput<Tk> input(Device dev, std::uint32_t seed, std::int64_t new_tokens = -1) const {
    MergeInput<Tk> in;
    in.values = KVSource<Tk>::from(TensorView<const Tk, 3>::contiguous(v.data(), {H, T, d}, dev));
    in.attention_sums = TensorView<const float, 2>::contiguous(sums.data(), {rows, T}, dev);
    in.scores = TensorView<const float, 2>::contiguous(scores.data(), {H, T}, dev);
    in.new_tokens = new_tokens;
    in.seed = seed;
    return in;
  }
};

MergePlan values_on_device(PlanBuffer& b) {
  MergePlan p = b.view();
  p.merged_values = TensorView<float, 2>::contiguous(b.values.data(), {b.rows * b.slots, b.d}, kEmulatedDevice);
  return p;
}

/// Dense device rows: `window` entries per candidate, candidates ascending, one src per block; the drawn
/// entries (dst >= 0) are the host plan's, the others weigh 0. Returns the number of candidates of row h.
std::int64_t require_cam_dense_of(const PlanBuffer& dev, const PlanBuffer& host, std::int64_t h, std::int64_t window) {
  const auto all = dev.entries(h);
  REQUIRE(all.size() % static_cast<std::size_t>(window) == 0);
  for (std::size_t i = 0; i < all.size(); ++i) {
    INFO("head " << h << " dense entry " << i);
    REQUIRE(all[i].src == all[i - i % static_cast<std::size_t>(window)].src);
    if (i >= static_cast<std::size_t>(window) && i % static_cast<std::size_t>(window) == 0) REQUIRE(all[i].src > all[i - 1].src);
  }
  require_dense_matches(all, host.entries(h), h);
  return static_cast<std::int64_t>(all.size()) / window;
}

/// Host run (compacted plan) and emulated-device run (dense plan) of `policy`; merged rows bit-identical.
template <class Policy, class Tk>
std::vector<std::int64_t> require_cam_device_equals_host(const Policy& policy, const CamCase<Tk>& cc, const Keep& keep, std::uint32_t seed,
                                                         std::int64_t window, std::int64_t new_tokens = -1) {
  const std::int64_t H = cc.H, T = cc.T, d = cc.d, cap = H * T * window;
  PlanBuffer a(H, cap, T, d, false), b(H, cap, T, d, false);
  const Status hs = run_merge<backend::Scalar>(policy, cc.input(kHost, seed, new_tokens), keep.view(), a.view(), H, T, d, cc.rows);
  INFO(hs.message());
  REQUIRE(hs.is_ok());
  auto ws = workspace_for<EmulatedDevice>(policy, H, T, d, cc.rows);
  const Status ds = policy.merge(Context<EmulatedDevice>{Workspace{ws.data(), ws.size()}}, cc.input(kEmulatedDevice, seed, new_tokens),
                                 keep.view(), values_on_device(b));
  INFO(ds.message());
  REQUIRE(ds.is_ok());
  std::vector<std::int64_t> candidates;
  for (std::int64_t h = 0; h < H; ++h) candidates.push_back(require_cam_dense_of(b, a, h, window));
  REQUIRE(a.values == b.values);
  return candidates;
}

Keep ragged_keep(std::int64_t H, std::int64_t T) {
  std::vector<std::vector<std::int32_t>> rows(static_cast<std::size_t>(H));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int32_t j = 0; j < T; ++j)
      if (j < 4 || j >= T - 8 || (j * 7 + h) % 5 == 0) rows[static_cast<std::size_t>(h)].push_back(j);
  rows[2] = {};  // head 2 keeps nothing: every candidate has an empty window
  rows[3].clear();
  for (std::int32_t j = 0; j < T; ++j) rows[3].push_back(j);  // head 3 keeps everything: no candidate
  return Keep(rows);
}

Keep shared_keep(std::int64_t H, std::int64_t T) {
  std::vector<std::int32_t> row;
  for (std::int32_t j = 0; j < T; ++j)
    if (j < 4 || j >= T - 6 || j % 3 == 0) row.push_back(j);
  return Keep(std::vector<std::vector<std::int32_t>>(static_cast<std::size_t>(H), row));
}

}  // namespace

TEST_CASE("torch's generator in the device's twist phases equals std::mt19937 output for output", "[merging][cam][device]") {
  for (const std::uint32_t seed : {0u, 1u, 42u, 5489u, 0xdeadbeefu}) {
    INFO("seed " << seed);
    std::mt19937 ref(seed);
    std::uint32_t mt[ops::kMtStateSize];
    ops::mt_seed(mt, seed);
    for (int twist = 0; twist < 6; ++twist) {
      ops::mt_twist_phases(mt);
      for (int i = 0; i < ops::kMtStateSize; ++i) REQUIRE(ops::mt_temper(mt[i]) == static_cast<std::uint32_t>(ref()));
    }
    std::vector<float> u(2000);
    backend::Scalar::torch_uniforms(seed, static_cast<std::int64_t>(u.size()), u.data());
    TorchBernoulli tb(seed);
    for (const float x : u) REQUIRE(same_bits(x, tb.uniform()));
  }
}

TEMPLATE_TEST_CASE("CaM streaming on a device backend: dense plan rows and merged values equal backend::Scalar's", "[merging][cam][device]",
                   float, half, bfloat16) {
  const std::int64_t H = 4, T = 70, d = 24;
  const Keep keep = ragged_keep(H, T);
  for (const std::int64_t group : {1, 2}) {
    const CamCase<TestType> cc(H, T, d, group, 11 + static_cast<unsigned>(group));
    for (const std::int32_t M : {16, 5, 1}) {
      for (const std::uint32_t seed : {0u, 3u, 1234u}) {
        INFO("group " << group << " merge_num " << M << " seed " << seed);
        const auto n = require_cam_device_equals_host(CaM(CaMParams::streaming(M)), cc, keep, seed, M);
        for (std::int64_t h = 0; h < H; ++h) REQUIRE(n[static_cast<std::size_t>(h)] == T - (keep.indptr[h + 1] - keep.indptr[h]));
      }
    }
  }
}

TEMPLATE_TEST_CASE("kvpress CAMPress on a device backend: candidates, dense plan rows and merged values equal backend::Scalar's",
                   "[merging][cam][device]", float, half) {
  const std::int64_t H = 3, T = 61, d = 16;
  const Keep keep = shared_keep(H, T);
  const std::int64_t n_evict = T - (keep.indptr[1] - keep.indptr[0]);
  for (const std::int64_t group : {1, 4}) {
    const CamCase<TestType> cc(H, T, d, group, 29);
    for (const std::int32_t M : {32, 3}) {
      for (const std::int64_t k : {std::int64_t{-1}, std::int64_t{7}, n_evict - 1, n_evict + 5}) {
        INFO("group " << group << " merge_budget " << M << " new_tokens " << k);
        const auto n = require_cam_device_equals_host(KvpressCAM(KvpressCAMParams{M}), cc, keep, 77, M, k);
        for (const std::int64_t c : n) REQUIRE(c == (k < 0 ? n_evict : std::min(k, n_evict)));
      }
    }
  }
}

TEST_CASE(
    "CaM / CAMPress on a device backend: host memory, the prefill form, unequal rows and short workspaces are refused, nothing "
    "written",
    "[merging][cam][device]") {
  const std::int64_t H = 4, T = 40, d = 16;
  const CamCase<half> cc(H, T, d, 1, 5);
  const Keep ragged = ragged_keep(H, T), shared = shared_keep(H, T);
  auto refused = [&](const auto& policy, const MergeInput<half>& in, const Keep& keep, bool device_plan, std::size_t ws_bytes,
                     const char* what) {
    auto ws = workspace_for<EmulatedDevice>(policy, H, T, d);
    PlanBuffer p(H, H * T * 32, T, d, false);
    const Status s = policy.merge(Context<EmulatedDevice>{Workspace{ws.data(), std::min(ws_bytes, ws.size())}}, in, keep.view(),
                                  device_plan ? values_on_device(p) : p.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(what));
    REQUIRE(p.untouched());
    return s.code();
  };
  const MergeInput<half> dev = cc.input(kEmulatedDevice, 1);
  MergeInput<half> host_sums = dev;
  host_sums.attention_sums = TensorView<const float, 2>::contiguous(cc.sums.data(), {H, T});
  const CaM cam;
  refused(cam, dev, ragged, false, SIZE_MAX, "merged_values is a host tensor");
  refused(cam, host_sums, ragged, true, SIZE_MAX, "attention_sums is a host tensor");
  refused(cam, cc.input(kHost, 1), ragged, true, SIZE_MAX, "values is a host tensor");
  refused(cam, dev, ragged, true, 16, "workspace");
  REQUIRE(refused(CaM(CaMParams::prefill(4, 8)), dev, shared, true, SIZE_MAX, "host backends only") == StatusCode::kUnsupported);
  const KvpressCAM press;
  refused(press, dev, ragged, true, SIZE_MAX, "evicts the same tokens from every kv head");
  MergeInput<half> host_scores = cc.input(kEmulatedDevice, 1, 3);
  host_scores.scores = TensorView<const float, 2>::contiguous(cc.scores.data(), {H, T});
  refused(press, host_scores, shared, true, SIZE_MAX, "scores is a host tensor");
  refused(press, host_sums, shared, true, SIZE_MAX, "attention_sums is a host tensor");
  // The device requirements are the draws and the candidates', not the host rows'.
  const Requirements r = press.requirements(Context<EmulatedDevice>{}, ProblemShape{H, H, d, T, 1});
  REQUIRE(r.status.is_ok());
  REQUIRE(r.workspace_bytes >= static_cast<std::size_t>(H * T) * sizeof(float) + backend::Scalar::cam_candidates_workspace(T));
}

namespace {

/// MiniCache's store for (H, T, d), worst-case retained capacity, optionally tagged as device memory.
struct MiniBuffers {
  std::vector<float> dir, np, nc, rp, rc;
  std::vector<std::int32_t> indptr, idx;
  MiniCacheMerged m;
  MiniBuffers(std::int64_t H, std::int64_t T, std::int64_t d, Device dev)
      : dir(H * T * d, -7.0f),
        np(H * T, -7.0f),
        nc(H * T, -7.0f),
        rp(H * T * d, -7.0f),
        rc(H * T * d, -7.0f),
        indptr(H + 1, -7),
        idx(H * T, -7) {
    m.direction = TensorView<float, 3>::contiguous(dir.data(), {H, T, d}, dev);
    m.norm_prev = TensorView<float, 2>::contiguous(np.data(), {H, T}, dev);
    m.norm_cur = TensorView<float, 2>::contiguous(nc.data(), {H, T}, dev);
    m.retained = KeepSet{indptr.data(), idx.data(), H, H * T};
    m.retained_prev = TensorView<float, 2>::contiguous(rp.data(), {H * T, d}, dev);
    m.retained_cur = TensorView<float, 2>::contiguous(rc.data(), {H * T, d}, dev);
  }
  bool untouched() const {
    auto all = [](const auto& v, auto x) { return std::all_of(v.begin(), v.end(), [&](auto y) { return y == x; }); };
    return all(dir, -7.0f) && all(np, -7.0f) && all(nc, -7.0f) && all(rp, -7.0f) && all(rc, -7.0f) && all(indptr, -7) && all(idx, -7);
  }
};

}  // namespace

TEMPLATE_TEST_CASE("MiniCache on a device backend: norms, directions, retained ids and rows equal backend::Scalar's",
                   "[merging][minicache][device]", float, half, bfloat16) {
  const std::int64_t H = 3, T = 45, d = 20;
  std::mt19937 rng(8);
  std::normal_distribution<float> nd;
  std::vector<TestType> prev(H * T * d), cur(H * T * d);
  for (std::size_t i = 0; i < prev.size(); ++i) {
    const float x = nd(rng);
    prev[i] = from_float<TestType>(x);
    cur[i] = from_float<TestType>(i % 7 == 0 ? nd(rng) : x + 0.1f * nd(rng));  // mostly near-parallel pairs, some far apart
  }
  for (std::int64_t c = 0; c < d; ++c) {
    prev[(1 * T + 3) * d + c] = from_float<TestType>(0.0f);                                 // a zero row in layer l-1
    cur[(2 * T + 4) * d + c] = from_float<TestType>(0.0f);                                  // and in layer l
    cur[(2 * T + 5) * d + c] = from_float<TestType>(-to_float(prev[(2 * T + 5) * d + c]));  // an antipodal pair
  }
  auto input = [&](Device dev) {
    return MiniCacheInput<TestType>{KVSource<TestType>::from(TensorView<const TestType, 3>::contiguous(prev.data(), {H, T, d}, dev)),
                                    KVSource<TestType>::from(TensorView<const TestType, 3>::contiguous(cur.data(), {H, T, d}, dev))};
  };
  for (const MiniCacheParams p :
       {MiniCacheParams{}, MiniCacheParams{0.5f, 0.0f}, MiniCacheParams{0.3f, 0.4f}, MiniCacheParams{1.0f, 1.0f}}) {
    INFO("t " << p.t << " gamma " << p.gamma);
    const MiniCache mc(p);
    MiniBuffers hb(H, T, d, kHost), db(H, T, d, kEmulatedDevice);
    auto hws = workspace_for<backend::Scalar>(mc, H, T, d);
    const Status hs = mc.merge(Context<backend::Scalar>{Workspace{hws.data(), hws.size()}}, input(kHost), hb.m);
    INFO(hs.message());
    REQUIRE(hs.is_ok());
    auto dws = workspace_for<EmulatedDevice>(mc, H, T, d);
    const Status ds = mc.merge(Context<EmulatedDevice>{Workspace{dws.data(), dws.size()}}, input(kEmulatedDevice), db.m);
    INFO(ds.message());
    REQUIRE(ds.is_ok());
    REQUIRE(hb.np == db.np);
    REQUIRE(hb.nc == db.nc);
    REQUIRE(hb.dir == db.dir);
    REQUIRE(hb.indptr == db.indptr);
    const auto n = static_cast<std::size_t>(hb.indptr[H]);
    REQUIRE(std::equal(hb.idx.begin(), hb.idx.begin() + n, db.idx.begin()));
    REQUIRE(std::equal(hb.rp.begin(), hb.rp.begin() + n * d, db.rp.begin()));
    REQUIRE(std::equal(hb.rc.begin(), hb.rc.begin() + n * d, db.rc.begin()));
    if (p.gamma < 1.0f) REQUIRE(n > 0);
  }
}

TEST_CASE("MiniCache on a device backend: host memory, short retained buffers and workspaces are refused, nothing written",
          "[merging][minicache][device]") {
  const std::int64_t H = 2, T = 12, d = 8;
  std::vector<float> x(H * T * d, 0.5f);
  const MiniCacheInput<float> dev{KVSource<float>::from(TensorView<const float, 3>::contiguous(x.data(), {H, T, d}, kEmulatedDevice)),
                                  KVSource<float>::from(TensorView<const float, 3>::contiguous(x.data(), {H, T, d}, kEmulatedDevice))};
  const MiniCacheInput<float> host{KVSource<float>::from(TensorView<const float, 3>::contiguous(x.data(), {H, T, d})),
                                   KVSource<float>::from(TensorView<const float, 3>::contiguous(x.data(), {H, T, d}))};
  const MiniCache mc;
  auto ws = workspace_for<EmulatedDevice>(mc, H, T, d);
  auto refused = [&](const MiniCacheInput<float>& in, MiniBuffers& b, std::size_t ws_bytes, const char* what) {
    const Status s = mc.merge(Context<EmulatedDevice>{Workspace{ws.data(), std::min(ws_bytes, ws.size())}}, in, b.m);
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(what));
    REQUIRE(b.untouched());
  };
  MiniBuffers ok(H, T, d, kEmulatedDevice), host_store(H, T, d, kHost), short_rows(H, T, d, kEmulatedDevice),
      small(H, T, d, kEmulatedDevice);
  refused(host, ok, SIZE_MAX, "prev is a host tensor");
  refused(dev, host_store, SIZE_MAX, "direction is a host tensor");
  short_rows.m.retained_prev = TensorView<float, 2>::contiguous(short_rows.rp.data(), {H * T - 1, d}, kEmulatedDevice);
  refused(dev, short_rows, SIZE_MAX, "worst case");
  small.m.retained.capacity = H * T - 1;
  refused(dev, small, SIZE_MAX, "capacity");
  refused(dev, ok, 16, "workspace");
  const Requirements r = mc.requirements(Context<EmulatedDevice>{}, ProblemShape{H, H, d, T, 1});
  REQUIRE(r.status.is_ok());
  REQUIRE(r.workspace_bytes == backend::Scalar::minicache_workspace(T, d));
}
