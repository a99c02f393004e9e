// apply/merge.hpp: merged rows written into contiguous (any strides, fp16)
// and paged caches, before / after compaction and fused with it, logical
// positions kept; bad plans (outside the cache, NaN / negative weights,
// aliasing source rows, merged buffers overlapping the cache) rejected with
// the cache unchanged.
#include <catch2/catch.hpp>

#include <cmath>
#include <numeric>
#include <vector>

#include "kvpolicy/apply/merge.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/merging/lookm.hpp"
#include "merge_test_util.hpp"

using namespace kvpolicy;
using namespace kvp_merge_test;
using Catch::Matchers::Contains;

namespace {

/// A (H, T, d) cache stored token-major with padding: (capacity, H, d + pad), fp16.
struct StridedCache {
  std::int64_t H, T, d, cap, dp;
  std::vector<half> k, v;
  std::vector<std::int32_t> pos;
  StridedCache(std::int64_t h, std::int64_t t, std::int64_t dd)
      : H(h), T(t), d(dd), cap(t + 3), dp(dd + 5), k(cap * h * dp), v(cap * h * dp), pos(h * cap) {
    for (std::int64_t hh = 0; hh < H; ++hh)
      for (std::int64_t j = 0; j < cap; ++j) {
        pos[hh * cap + j] = static_cast<std::int32_t>(100 + j);
        for (std::int64_t c = 0; c < dp; ++c) {
          k[(j * H + hh) * dp + c] = from_float<half>(static_cast<float>(hh * 1000 + j * 10 + c) / 64.0f);
          v[(j * H + hh) * dp + c] = from_float<half>(-static_cast<float>(hh * 1000 + j * 10 + c) / 64.0f);
        }
      }
  }
  TensorView<half, 3> keys() { return TensorView<half, 3>(k.data(), {H, cap, d}, {dp, H * dp, 1}); }
  TensorView<half, 3> values() { return TensorView<half, 3>(v.data(), {H, cap, d}, {dp, H * dp, 1}); }
  TensorView<std::int32_t, 2> positions() { return TensorView<std::int32_t, 2>::contiguous(pos.data(), {H, cap}); }
  MergeInput<half> input() {
    MergeInput<half> in;
    in.keys = KVSource<half>::from(TensorView<const half, 3>(keys().narrow(1, 0, T)));
    in.values = KVSource<half>::from(TensorView<const half, 3>(values().narrow(1, 0, T)));
    return in;
  }
};

bool same(const std::vector<half>& a, const std::vector<half>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](half x, half y) { return x.bits == y.bits; });
}

/// A plan for H rows with one entry per row: dst slot 0 <- src, merged rows constant `val`.
struct OneEntryPlan {
  PlanBuffer buf;
  OneEntryPlan(std::int64_t H, std::int64_t slots, std::int64_t d, std::int32_t src, float val) : buf(H, H, slots, d) {
    for (std::int64_t h = 0; h <= H; ++h) buf.indptr[h] = static_cast<std::int32_t>(h);
    for (std::int64_t h = 0; h < H; ++h) {
      buf.dst[h] = 0;
      buf.src[h] = src;
      buf.weight[h] = 0.5f;
      for (std::int64_t c = 0; c < d; ++c) buf.keys[(h * slots) * d + c] = val, buf.values[(h * slots) * d + c] = -val;
    }
  }
};

}  // namespace

TEST_CASE("merge_contiguous: merged rows land on the kept tokens before or after compaction, positions untouched", "[merging][apply]") {
  StridedCache c(2, 9, 8);
  const Keep keep({{0, 3, 5, 8}, {1, 2, 6, 7}});
  const LookMPivot pol;
  PlanBuffer plan(2, 2 * 9, 4, 8);
  REQUIRE(run_merge<backend::Scalar>(pol, c.input(), keep.view(), plan.view(), 2, 9, 8).is_ok());
  StridedCache before = c, after = c;
  REQUIRE(merge_contiguous(before.keys(), before.values(), 9, keep.view(), 0, plan.view(), MergeSlots::kBeforeCompaction).is_ok());
  std::vector<std::int64_t> lens(2);
  REQUIRE(compact_contiguous(before.keys(), before.values(), before.positions(), 9, keep.view(), 0, lens).is_ok());
  REQUIRE(compact_contiguous(after.keys(), after.values(), after.positions(), 9, keep.view(), 0, lens).is_ok());
  REQUIRE(merge_contiguous(after.keys(), after.values(), 9, keep.view(), 0, plan.view(), MergeSlots::kAfterCompaction).is_ok());
  StridedCache fused = c;
  REQUIRE(merge_and_compact_contiguous(fused.keys(), fused.values(), fused.positions(), 9, keep.view(), 0, plan.view(), lens).is_ok());
  REQUIRE(lens == std::vector<std::int64_t>{4, 4});
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t s = 0; s < 4; ++s) {
      bool merged = false;
      for (const auto& e : plan.entries(h)) merged |= e.dst == s;
      for (std::int64_t ch = 0; ch < 8; ++ch) {
        const float want_k = merged ? to_float(from_float<half>(plan.key_row(h, s)[ch])) : to_float(c.keys()(h, keep.view().row(h)[s], ch));
        REQUIRE(to_float(before.keys()(h, s, ch)) == want_k);
        REQUIRE(to_float(after.keys()(h, s, ch)) == want_k);
        REQUIRE(to_float(fused.keys()(h, s, ch)) == want_k);
        if (merged) REQUIRE(to_float(fused.values()(h, s, ch)) == to_float(from_float<half>(plan.value_row(h, s)[ch])));
      }
      // The logical position is the kept token's (RoPE phase of the destination).
      REQUIRE(fused.positions()(h, s) == 100 + keep.view().row(h)[s]);
    }
  // Padding columns beyond head_dim are never written.
  for (std::int64_t j = 0; j < fused.cap; ++j) REQUIRE(fused.k[(j * 2 + 0) * fused.dp + 8].bits == c.k[(j * 2 + 0) * c.dp + 8].bits);
}

TEST_CASE("merge_contiguous: bad plans are rejected, naming the argument, and the cache is unchanged", "[merging][apply]") {
  StridedCache c(2, 6, 4);
  const Keep keep({{0, 2, 5}, {1, 2, 3}});
  auto expect = [&](OneEntryPlan& p, const char* msg) {
    StridedCache copy = c;
    const Status s = merge_contiguous(copy.keys(), copy.values(), 6, keep.view(), 0, p.buf.view());
    INFO(s.message());
    REQUIRE(!s.is_ok());
    REQUIRE_THAT(s.message(), Contains(msg));
    REQUIRE(same(copy.k, c.k));
    REQUIRE(same(copy.v, c.v));
    std::vector<std::int64_t> lens(2, -1);
    REQUIRE(!merge_and_compact_contiguous(copy.keys(), copy.values(), copy.positions(), 6, keep.view(), 0, p.buf.view(), lens).is_ok());
    REQUIRE(same(copy.k, c.k));
    REQUIRE(copy.pos == c.pos);
    REQUIRE(lens == std::vector<std::int64_t>{-1, -1});
  };
  {
    OneEntryPlan p(2, 3, 4, 4, 1.0f);  // src 4 is evicted in both rows: valid
    StridedCache copy = c;
    REQUIRE(merge_contiguous(copy.keys(), copy.values(), 6, keep.view(), 0, p.buf.view()).is_ok());
  }
  {
    OneEntryPlan p(2, 3, 4, 4, 1.0f);
    p.buf.dst[1] = 3;
    expect(p, "dst slot 3 is outside the 3 kept tokens");
  }
  {
    OneEntryPlan p(2, 3, 4, 6, 1.0f);
    expect(p, "src token 6 is outside the cache");
  }
  {
    OneEntryPlan p(2, 3, 4, 4, 1.0f);
    p.buf.src[1] = 2;  // token 2 is kept in row 1
    expect(p, "aliases a destination row");
  }
  {
    OneEntryPlan p(2, 3, 4, 4, 1.0f);
    p.buf.weight[0] = std::nanf("");
    expect(p, "weight nan must be finite");
  }
  {
    OneEntryPlan p(2, 3, 4, 4, 1.0f);
    p.buf.weight[1] = -0.25f;
    expect(p, "weight -0.25 must be finite and >= 0");
  }
  {
    OneEntryPlan p(2, 3, 4, 4, 1.0f);
    p.buf.values[3 * 4 + 2] = INFINITY;  // row 1, slot 0, channel 2
    expect(p, "merged_values row of plan row 1 slot 0 is not finite");
  }
  {
    OneEntryPlan p(2, 3, 4, 4, 1.0f);
    p.buf.indptr[2] = 5;
    expect(p, "is not a valid range");
  }
  {
    OneEntryPlan p(2, 2, 4, 4, 1.0f);  // 2 slots per row, 3 kept tokens
    expect(p, "slots_per_row is 2");
  }
  {
    OneEntryPlan p(1, 3, 4, 4, 1.0f);
    expect(p, "merge plan has 1 rows");
  }
  {
    // Merged rows that live inside the cache itself (aliasing the destination storage).
    OneEntryPlan p(2, 3, 4, 4, 1.0f);
    StridedCache copy = c;
    std::vector<float> fk(copy.k.size() * 4);
    MergePlan mp = p.buf.view();
    mp.merged_values = {};
    const Status ok = merge_contiguous(copy.keys(), TensorView<half, 3>{}, 6, keep.view(), 0, mp);
    REQUIRE(ok.is_ok());
    auto fcache = TensorView<float, 3>::contiguous(fk.data(), {2, 6, 4});
    mp.merged_keys = TensorView<float, 2>::contiguous(fk.data() + 8, {6, 4});
    const std::vector<float> before = fk;
    const Status s = merge_contiguous(fcache, TensorView<float, 3>{}, 6, keep.view(), 0, mp);
    REQUIRE_THAT(s.message(), Contains("merged_keys overlaps the cache's key storage"));
    REQUIRE(fk == before);
  }
}

TEST_CASE("merge_paged / merge_and_compact_paged: merged rows through the page table, pages freed, positions kept", "[merging][apply]") {
  const std::int32_t H = 2, ps = 4, d = 8, T0 = 10, T1 = 7;
  const PageStrides st = PageStrides::contiguous(PageLayout::kHND, H, ps, d);
  const std::int32_t pool_pages = 8;
  std::vector<float> kp(pool_pages * st.page), vp(pool_pages * st.page);
  for (std::size_t i = 0; i < kp.size(); ++i)
    kp[i] = std::sin(0.37f * static_cast<float>(i)), vp[i] = std::cos(0.11f * static_cast<float>(i));
  std::vector<std::int32_t> indptr = {0, 3, 5}, indices = {6, 1, 4, 0, 7}, last = {2, 3};
  PagedKVView<float> cache{kp.data(), vp.data(), st, st, pool_pages, H, ps, d, PageTable{indptr.data(), indices.data(), last.data(), 2},
                           kHost};
  std::vector<std::int32_t> pos(pool_pages * H * ps);
  std::iota(pos.begin(), pos.end(), 0);
  const auto positions = TensorView<std::int32_t, 3>::contiguous(pos.data(), {pool_pages, H, ps});
  // Sequence 0 keeps 5 of 10, sequence 1 keeps 3 of 7 (equal counts across its heads).
  const Keep keep({{0, 2, 4, 8, 9}, {0, 1, 5, 6, 9}, {0, 3, 6}, {1, 2, 6}});
  // Plan: the LOOK-M merge of each sequence, computed on a dense copy of its K/V.
  PlanBuffer plan(4, 4 * 10, 5, d);
  plan.indptr[0] = 0;
  std::int32_t at = 0;
  for (std::int32_t b = 0; b < 2; ++b) {
    const std::int64_t T = b == 0 ? T0 : T1;
    MergeInput<float> in;
    const PagedKVView<const float> ro = cache;
    in.keys = KVSource<float>::from_paged(ro, b);
    in.values = KVSource<float>::from_paged_values(ro, b);
    const Keep kb(b == 0 ? std::vector<std::vector<std::int32_t>>{{0, 2, 4, 8, 9}, {0, 1, 5, 6, 9}}
                         : std::vector<std::vector<std::int32_t>>{{0, 3, 6}, {1, 2, 6}});
    PlanBuffer pb(2, 2 * T, 5, d);
    REQUIRE(run_merge<backend::Scalar>(LookMPivot{}, in, kb.view(), pb.view(), 2, T, d).is_ok());
    for (std::int32_t h = 0; h < 2; ++h) {
      for (std::int32_t i = pb.indptr[h]; i < pb.indptr[h + 1]; ++i, ++at) {
        plan.dst[at] = pb.dst[i];
        plan.src[at] = pb.src[i];
        plan.weight[at] = pb.weight[i];
      }
      plan.indptr[b * 2 + h + 1] = at;
      std::copy(pb.keys.begin() + h * 5 * d, pb.keys.begin() + (h + 1) * 5 * d, plan.keys.begin() + (b * 2 + h) * 5 * d);
      std::copy(pb.values.begin() + h * 5 * d, pb.values.begin() + (h + 1) * 5 * d, plan.values.begin() + (b * 2 + h) * 5 * d);
    }
  }
  std::vector<std::byte> ws(compact_paged_workspace(pool_pages));
  REQUIRE(plan.indptr[1] > 0);
  {  // A bad plan (src 0 is kept in row 0: it would alias a destination) leaves pool, positions and table untouched.
    PlanBuffer bad = plan;
    bad.src[0] = 0;
    const std::vector<float> kb = kp, vb = vp;
    const std::vector<std::int32_t> pb = pos, ib = indices;
    std::vector<std::int32_t> fi(3, -1), fn(5, -1), fl(2, -1), ff(5, -1);
    PagedCompactOutput o{fi.data(), fn.data(), fl.data(), 5, ff.data(), 5};
    REQUIRE_THAT(merge_and_compact_paged(cache, keep.view(), bad.view(), positions, o, Workspace{ws.data(), ws.size()}).message(),
                 Contains("aliases a destination row"));
    REQUIRE_THAT(merge_paged(cache, keep.view(), bad.view(), Workspace{ws.data(), ws.size()}).message(), Contains("merge_paged"));
    REQUIRE((kp == kb && vp == vb && pos == pb && indices == ib && fi == std::vector<std::int32_t>(3, -1)));
    // A page listed twice is rejected (a shared page would be merged for two sequences).
    std::vector<std::int32_t> dup = indices;
    dup[4] = dup[0];
    PagedKVView<float> cd = cache;
    cd.table.indices = dup.data();
    REQUIRE_THAT(merge_paged(cd, keep.view(), plan.view(), Workspace{ws.data(), ws.size()}).message(), Contains("appears twice"));
    REQUIRE(kp == kb);
  }
  // In place before compaction, then compaction: equals the fused call.
  std::vector<float> k2 = kp, v2 = vp;
  std::vector<std::int32_t> pos2 = pos, indptr2 = indptr, indices2 = indices, last2 = last;
  PagedKVView<float> c2{k2.data(), v2.data(), st, st, pool_pages, H, ps, d, PageTable{indptr2.data(), indices2.data(), last2.data(), 2},
                        kHost};
  REQUIRE(merge_paged(c2, keep.view(), plan.view(), Workspace{ws.data(), ws.size()}).is_ok());
  std::vector<std::int32_t> oi(3), on(5), ol(2), freed(5);
  PagedCompactOutput out2{oi.data(), on.data(), ol.data(), 5, freed.data(), 5};
  REQUIRE(compact_paged(c2, keep.view(), TensorView<std::int32_t, 3>::contiguous(pos2.data(), {pool_pages, H, ps}), out2,
                        Workspace{ws.data(), ws.size()})
              .is_ok());
  std::vector<std::int32_t> fi(3), fn(5), fl(2), ff(5);
  PagedCompactOutput out{fi.data(), fn.data(), fl.data(), 5, ff.data(), 5};
  REQUIRE(merge_and_compact_paged(cache, keep.view(), plan.view(), positions, out, Workspace{ws.data(), ws.size()}).is_ok());
  // Same tables, and the same live rows and positions (stale tails differ: merging first leaves merged rows there).
  REQUIRE((fi == oi && fn == on && fl == ol));
  for (std::int32_t b = 0; b < 2; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int64_t c = 0; c < keep.view().row_size(b * H + h); ++c) {
        const std::int64_t at0 = fn[fi[b] + c / ps] * st.page + h * st.head + (c % ps) * st.slot;
        REQUIRE(std::equal(kp.begin() + at0, kp.begin() + at0 + d, k2.begin() + at0));
        REQUIRE(std::equal(vp.begin() + at0, vp.begin() + at0 + d, v2.begin() + at0));
        const std::int64_t p0 = (fn[fi[b] + c / ps] * H + h) * ps + c % ps;
        REQUIRE(pos[p0] == pos2[p0]);
      }
  REQUIRE(out.num_freed == 2);  // 3 + 2 pages -> 2 + 1
  // Every merged slot holds its merged row; positions are the kept tokens'.
  for (std::int32_t b = 0; b < 2; ++b)
    for (std::int32_t h = 0; h < H; ++h) {
      const std::int64_t r = b * H + h;
      for (const auto& e : plan.entries(r)) {
        const std::int32_t page = fn[fi[b] + e.dst / ps];
        REQUIRE(kp[page * st.page + h * st.head + (e.dst % ps) * st.slot + 3] == plan.key_row(r, e.dst)[3]);
        REQUIRE(vp[page * st.page + h * st.head + (e.dst % ps) * st.slot + 5] == plan.value_row(r, e.dst)[5]);
      }
    }
}
