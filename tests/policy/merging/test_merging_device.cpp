// The merging policies' device path (kvpress MergingPress, LOOK-M,
// NearestKeptMerge through `Backend::merge_head`; D2O through merge_nearest,
// d2o_decide and merge_apply) on the emulated device:
// dense plan rows whose merged entries are the host plan's, merged rows and
// state bit-identical to backend::Scalar, on contiguous and paged (device
// tagged) caches; device-side argument checks with nothing written.
// backend::Cuda runs the same comparison in tests/cuda/test_cuda_policies.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "kvpolicy/policy/merging/d2o.hpp"
#include "kvpolicy/policy/merging/kvpress_merging.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"
#include "kvpolicy/policy/merging/nearest_kept.hpp"
#include "merge_test_util.hpp"
#include "policy/emulated_device.hpp"

using namespace kvpolicy;
using namespace kvp_merge_test;
using Catch::Matchers::Contains;
using kvp_test::EmulatedDevice;
using kvp_test::kEmulatedDevice;

namespace {

/// One sequence's keys and values (H, T, d) of type Tk, contiguous and in two page pools.
template <class Tk>
struct Cache {
  std::int64_t H, T, d;
  std::vector<Tk> k, v, kpool, vpool;
  std::vector<std::int32_t> ids, indptr, last;
  PagedKVView<const Tk> paged{};

  Cache(std::int64_t h, std::int64_t t, std::int64_t dd, unsigned seed) : H(h), T(t), d(dd), k(h * t * dd), v(h * t * dd) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (auto& x : k) x = from_float<Tk>(nd(rng));
    for (auto& x : v) x = from_float<Tk>(nd(rng));
    for (std::int64_t hh = 0; hh < H; ++hh)  // exact copies: cosine ties between kept tokens, decided by the earliest
      for (std::int64_t c = 0; c < d; ++c) {
        k[(hh * T + 9) * d + c] = k[(hh * T + 2) * d + c];
        k[(hh * T + 10) * d + c] = k[(hh * T + 2) * d + c];
      }
    for (std::int64_t c = 0; c < d; ++c) k[(1 * T + 5) * d + c] = from_float<Tk>(0.0f);  // a zero key (norm clamped at eps)
  }
  MergeInput<Tk> dense(Device dev) const {
    MergeInput<Tk> in;
    in.keys = KVSource<Tk>::from(TensorView<const Tk, 3>::contiguous(k.data(), {H, T, d}, dev));
    in.values = KVSource<Tk>::from(TensorView<const Tk, 3>::contiguous(v.data(), {H, T, d}, dev));
    return in;
  }
  MergeInput<Tk> paged_input(std::int32_t ps, Device dev) {
    auto at = [](const std::vector<Tk>& x, std::int64_t T_, std::int64_t d_) {
      return [&x, T_, d_](std::int64_t h, std::int64_t t, std::int64_t c) { return x[(h * T_ + t) * d_ + c]; };
    };
    const auto shape =
        kvp_test::fill_page_pool(H, T, d, ps, PageLayout::kNHD, from_float<Tk>(-1e6f), at(k, T, d), kpool, ids, indptr, last);
    kvp_test::fill_page_pool(H, T, d, ps, PageLayout::kNHD, from_float<Tk>(-1e6f), at(v, T, d), vpool, ids, indptr, last);
    paged = kvp_test::page_pool_view<Tk>(kpool.data(), vpool.data(), shape, H, ps, d, indptr.data(), ids.data(), last.data(), dev);
    MergeInput<Tk> in;
    in.keys = KVSource<Tk>::from_paged(paged, 0);
    in.values = KVSource<Tk>::from_paged_values(paged, 0);
    return in;
  }
};

/// `plan` with its merged buffers tagged as the emulated device's memory.
MergePlan on_device(PlanBuffer& b) {
  MergePlan p = b.view();
  if (!b.keys.empty()) p.merged_keys = TensorView<float, 2>::contiguous(b.keys.data(), {b.rows * b.slots, b.d}, kEmulatedDevice);
  if (!b.values.empty()) p.merged_values = TensorView<float, 2>::contiguous(b.values.data(), {b.rows * b.slots, b.d}, kEmulatedDevice);
  return p;
}

/// The device plan's rows are dense (every evicted token, ascending) and, without the dst = -1 entries, the host's.
void require_dense_of(const PlanBuffer& dev, const PlanBuffer& host, const Keep& keep, std::int64_t H, std::int64_t T) {
  REQUIRE(dev.indptr[0] == 0);
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t C = keep.indptr[h + 1] - keep.indptr[h];
    REQUIRE(dev.indptr[h + 1] - dev.indptr[h] == T - C);
    std::vector<std::int32_t> evicted;
    for (std::int32_t j = 0, k = keep.indptr[h]; j < T; ++j) {
      if (k < keep.indptr[h + 1] && keep.indices[k] == j) {
        ++k;
        continue;
      }
      evicted.push_back(j);
    }
    const auto all = dev.entries(h);
    REQUIRE(all.size() == evicted.size());
    for (std::size_t i = 0; i < all.size(); ++i) REQUIRE(all[i].src == evicted[i]);
    require_dense_matches(all, host.entries(h), h);
  }
}

template <class Policy, class In>
void require_device_equals_host(const Policy& policy, const In& host_in, const In& dev_in, const Keep& keep, std::int64_t H, std::int64_t T,
                                std::int64_t d, bool keys) {
  PlanBuffer a(H, H * T, T, d, keys), b(H, H * T, T, d, keys);
  const Status hs = run_merge<backend::Scalar>(policy, host_in, keep.view(), a.view(), H, T, d);
  INFO(hs.message());
  REQUIRE(hs.is_ok());
  auto ws = workspace_for<EmulatedDevice>(policy, H, T, d);
  const Status ds = policy.merge(Context<EmulatedDevice>{Workspace{ws.data(), ws.size()}}, dev_in, keep.view(), on_device(b));
  INFO(ds.message());
  REQUIRE(ds.is_ok());
  require_dense_of(b, a, keep, H, T);
  REQUIRE(a.keys == b.keys);
  REQUIRE(a.values == b.values);
  REQUIRE(a.indptr.back() > 0);  // something merged
}

Keep ragged_keep(std::int64_t H, std::int64_t T) {
  std::vector<std::vector<std::int32_t>> rows(static_cast<std::size_t>(H));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int32_t j = 0; j < T; ++j)
      if (j < 4 || j >= T - 8 || (j * 7 + h) % 5 == 0) rows[static_cast<std::size_t>(h)].push_back(j);
  rows[2] = {};  // head 2 keeps nothing: no merge, every entry dst = -1
  rows[3].clear();
  for (std::int32_t j = 0; j < T; ++j) rows[3].push_back(j);  // head 3 keeps everything: no entry
  return Keep(rows);
}

}  // namespace

TEMPLATE_TEST_CASE("merging on a device backend: dense plan rows, merged rows and state equal backend::Scalar's", "[merging][device]",
                   float, half) {
  const std::int64_t H = 4, T = 53, d = 24;
  Cache<TestType> cache(H, T, d, 17);
  const Keep keep = ragged_keep(H, T);
  const MergeInput<TestType> host = cache.dense(kHost);
  for (const std::int32_t ps : {0, 16, 7}) {
    INFO("page size " << ps << " (0: contiguous)");
    const MergeInput<TestType> dev = ps == 0 ? cache.dense(kEmulatedDevice) : cache.paged_input(ps, kEmulatedDevice);
    SECTION("kvpress MergingPress, threshold and fraction gates") {
      require_device_equals_host(KvpressMerging(KvpressMergingParams{0.0f, 1.0f}), host, dev, keep, H, T, d, false);
      require_device_equals_host(KvpressMerging(KvpressMergingParams{0.1f, 1.0f}), host, dev, keep, H, T, d, false);
      require_device_equals_host(KvpressMerging(KvpressMergingParams{0.0f, 0.6f}), host, dev, keep, H, T, d, false);
      require_device_equals_host(KvpressMerging(KvpressMergingParams{0.05f, 0.25f}), host, dev, keep, H, T, d, false);
    }
    SECTION("LOOK-M pivot") { require_device_equals_host(LookMPivot{}, host, dev, keep, H, T, d, true); }
    SECTION("nearest-kept merge: persistent weights re-packed the same way") {
      for (const bool by_sim : {false, true})
        for (const float thr : {-1.0f, 0.15f}) {
          INFO("scale_by_similarity " << by_sim << " threshold " << thr);
          std::vector<float> w1(static_cast<std::size_t>(H * T)), w2;
          for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = 0.5f + static_cast<float>(i % 7) * 0.25f;
          w2 = w1;
          NearestKeptInput<TestType> hin, din;
          static_cast<MergeInput<TestType>&>(hin) = host;
          static_cast<MergeInput<TestType>&>(din) = dev;
          hin.state.weights = TensorView<float, 2>::contiguous(w1.data(), {H, T});
          din.state.weights = TensorView<float, 2>::contiguous(w2.data(), {H, T}, kEmulatedDevice);
          require_device_equals_host(NearestKeptMerge(NearestKeptMergeParams{thr, by_sim}), hin, din, keep, H, T, d, true);
          REQUIRE(w1 == w2);
        }
    }
  }
}

TEMPLATE_TEST_CASE("merging on a device backend: D2O's shared decision, EMA state and merged rows equal backend::Scalar's",
                   "[merging][device]", float, half) {
  const std::int64_t H = 4, T = 53, d = 24;
  Cache<TestType> cache(H, T, d, 29);
  std::vector<std::vector<std::int32_t>> rows(static_cast<std::size_t>(H));
  for (std::int64_t h = 0; h < H; ++h) {  // equal counts (D2O's shared decision), different tokens per head
    auto& r = rows[static_cast<std::size_t>(h)];
    for (std::int32_t j = 0; j < 4; ++j) r.push_back(j);
    for (std::int64_t k = 0; k < 10; ++k) r.push_back(static_cast<std::int32_t>(4 + (k * 5 + h) % (T - 12)));
    for (std::int32_t j = static_cast<std::int32_t>(T) - 8; j < T; ++j) r.push_back(j);
    std::sort(r.begin(), r.end());
  }
  const Keep keep(rows);
  const MergeInput<TestType> host = cache.dense(kHost);
  for (const std::int32_t ps : {0, 16}) {
    for (const D2OWeighting wt : {D2OWeighting::kAsCoded, D2OWeighting::kNormalized}) {
      INFO("page size " << ps << " weighting " << static_cast<int>(wt));
      D2OParams prm;
      prm.weighting = wt;
      const D2O policy(prm);
      const MergeInput<TestType> dev = ps == 0 ? cache.dense(kEmulatedDevice) : cache.paged_input(ps, kEmulatedDevice);
      D2OState hs, ds;
      D2OInput<TestType> hin, din;
      static_cast<MergeInput<TestType>&>(hin) = host;
      static_cast<MergeInput<TestType>&>(din) = dev;
      hin.state = &hs;
      din.state = &ds;
      for (int step = 0; step < 2; ++step) {  // the first call sets tau, the second blends it (EMA)
        require_device_equals_host(policy, hin, din, keep, H, T, d, true);
        REQUIRE(ds.initialised);
        REQUIRE(same_bits(hs.tau, ds.tau));
      }
    }
  }
  SECTION("no kept token: dense rows of unmerged entries, the state untouched") {
    const Keep none(std::vector<std::vector<std::int32_t>>(static_cast<std::size_t>(H)));
    D2OState ds;
    D2OInput<TestType> din;
    static_cast<MergeInput<TestType>&>(din) = cache.dense(kEmulatedDevice);
    din.state = &ds;
    PlanBuffer b(H, H * T, T, d);
    auto ws = workspace_for<EmulatedDevice>(D2O{}, H, T, d);
    REQUIRE(D2O{}.merge(Context<EmulatedDevice>{Workspace{ws.data(), ws.size()}}, din, none.view(), on_device(b)).is_ok());
    REQUIRE(b.indptr.back() == H * T);
    for (std::int64_t i = 0; i < H * T; ++i) REQUIRE((b.dst[i] == -1 && b.src[i] == i % T && b.weight[i] == 0.0f));
    REQUIRE(!ds.initialised);
  }
}

TEST_CASE("merging on a device backend: host memory, bad keep rows and short workspaces are refused, nothing written",
          "[merging][device]") {
  const std::int64_t H = 4, T = 40, d = 16;
  Cache<half> cache(H, T, d, 3);
  const Keep keep = ragged_keep(H, T);
  const MergeInput<half> dev = cache.dense(kEmulatedDevice), host = cache.dense(kHost);
  const LookMPivot policy;
  auto ws = workspace_for<EmulatedDevice>(policy, H, T, d);
  const Context<EmulatedDevice> cx{Workspace{ws.data(), ws.size()}};
  auto refused = [&](const MergeInput<half>& in, const KeepSet& k, bool device_plan, std::size_t ws_bytes, const char* what) {
    PlanBuffer p(H, H * T, T, d);
    const Status s = policy.merge(cx.with_workspace(Workspace{ws.data(), ws_bytes}), in, k, device_plan ? on_device(p) : p.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(what));
    REQUIRE(p.untouched());
  };
  refused(host, keep.view(), true, ws.size(), "keys is a host tensor");
  refused(dev, keep.view(), false, ws.size(), "merged_keys is a host tensor");
  refused(dev, keep.view(), true, 16, "workspace");
  Keep bad = keep;
  bad.indptr[1] = bad.indptr[0] + static_cast<std::int32_t>(T) + 1;  // a row longer than kv_len
  refused(dev, bad.view(), true, ws.size(), "not a range of at most kv_len");
  NearestKeptInput<half> nin;
  static_cast<MergeInput<half>&>(nin) = dev;
  std::vector<float> w(static_cast<std::size_t>(H * T), 1.0f);
  nin.state.weights = TensorView<float, 2>::contiguous(w.data(), {H, T});  // host-tagged state on a device backend
  PlanBuffer p(H, H * T, T, d);
  const Status s = NearestKeptMerge{}.merge(Context<EmulatedDevice>{Workspace{ws.data(), ws.size()}}, nin, keep.view(), on_device(p));
  REQUIRE_THAT(s.message(), Contains("state weights is a host tensor"));
  REQUIRE(p.untouched());
  // The requirements a device backend reports are the op's, not the host rows'.
  const Requirements r = policy.requirements(Context<EmulatedDevice>{}, ProblemShape{H, H, d, T, 1});
  REQUIRE(r.status.is_ok());
  REQUIRE(r.workspace_bytes == backend::Scalar::merge_head_workspace(T, d));
  REQUIRE(r.output.capacity == H * T);
}
