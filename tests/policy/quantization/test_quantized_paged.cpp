// A paged cache in a per-token quantization format: quantize-on-append at the
// tokens' slots, Quest's page metadata from the codes (equal to Quest on the
// decoded pool), decode attention over a page list of codes (equal to the
// scalar reference over the decoded pool), NHD and HND pools, bad input; and
// the device path of all three (ops/quantized_paged_ops.hpp) on the emulated
// device: the host's code bytes and metadata exactly, attention within 1e-5.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/quantized_paged.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/util/thread_pool.hpp"
#include "../emulated_device.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {

constexpr std::int32_t kPages = 9, H = 2, P = 16;
constexpr std::int64_t d = 64;

/// Two sequences over scattered pages: 40 and 29 tokens.
struct Table {
  std::vector<std::int32_t> indptr{0, 3, 5}, indices{4, 0, 7, 2, 8}, last{8, 13};
  PageTable view() const { return PageTable{indptr.data(), indices.data(), last.data(), 2}; }
};

template <class Q>
void check_format(const Q& q, PageLayout layout, const char* name) {
  INFO(name << (layout == PageLayout::kHND ? " HND" : " NHD"));
  const Table tab;
  const std::int64_t rb = q.row_bytes(d);
  std::vector<std::uint8_t> kc(static_cast<std::size_t>(kPages * H * P * rb), 0), vc(kc.size(), 0);
  PagedKVView<std::uint8_t> codes{kc.data(),
                                  vc.data(),
                                  PageStrides::contiguous(layout, H, P, rb),
                                  PageStrides::contiguous(layout, H, P, rb),
                                  kPages,
                                  H,
                                  P,
                                  static_cast<std::int32_t>(rb),
                                  tab.view(),
                                  {}};
  std::mt19937 rng(8);
  std::normal_distribution<float> nd;
  const std::int64_t lens[2] = {40, 29};
  for (std::int32_t b = 0; b < 2; ++b) {
    std::vector<float> k(static_cast<std::size_t>(H * lens[b] * d)), v(k.size());
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    REQUIRE(quantize_paged_append(q, codes, b, TensorView<const float, 3>::contiguous(k.data(), {H, lens[b], d}), false).is_ok());
    REQUIRE(quantize_paged_append(q, codes, b, TensorView<const float, 3>::contiguous(v.data(), {H, lens[b], d}), true).is_ok());
    // On backend::Cpu the same bytes (into a second pool that starts equal).
    std::vector<std::uint8_t> kc2(kc.size(), 0), vc2(kc.size(), 0);
    PagedKVView<std::uint8_t> codes2 = codes;
    codes2.k_data = kc2.data(), codes2.v_data = vc2.data();
    REQUIRE(quantize_paged_append(Context<backend::Cpu>{}, q, codes2, b, TensorView<const float, 3>::contiguous(k.data(), {H, lens[b], d}),
                                  false)
                .is_ok());
    REQUIRE(quantize_paged_append(Context<backend::Cpu>{}, q, codes2, b, TensorView<const float, 3>::contiguous(v.data(), {H, lens[b], d}),
                                  true)
                .is_ok());
    for (std::int32_t t = 0; t < lens[b]; ++t)
      for (std::int32_t h = 0; h < H; ++h) {
        const std::int32_t page = tab.view().page_of(b, t, P);
        const std::size_t at = static_cast<std::size_t>(codes.k_ptr(page, h, t % P) - kc.data());
        REQUIRE(std::equal(kc.begin() + at, kc.begin() + at + rb, kc2.begin() + at));
        REQUIRE(std::equal(vc.begin() + at, vc.begin() + at + rb, vc2.begin() + at));
      }
  }
  // The decoded pool, fp32, same layout.
  std::vector<float> kf(static_cast<std::size_t>(kPages * H * P * d)), vf(kf.size());
  const PageStrides fs = PageStrides::contiguous(layout, H, P, d);
  const PagedKVView<const std::uint8_t> cc = codes;
  for (std::int32_t pg = 0; pg < kPages; ++pg)
    for (std::int32_t h = 0; h < H; ++h) {
      std::vector<float> rows(static_cast<std::size_t>(P * d));
      detail::decode_code_rows(q, cc.k_ptr(pg, h, 0), cc.k_strides.slot, P, d, rows.data());
      for (std::int32_t s = 0; s < P; ++s)
        std::copy(rows.begin() + s * d, rows.begin() + (s + 1) * d, kf.begin() + pg * fs.page + h * fs.head + s * fs.slot);
      detail::decode_code_rows(q, cc.v_ptr(pg, h, 0), cc.v_strides.slot, P, d, rows.data());
      for (std::int32_t s = 0; s < P; ++s)
        std::copy(rows.begin() + s * d, rows.begin() + (s + 1) * d, vf.begin() + pg * fs.page + h * fs.head + s * fs.slot);
    }
  const PagedKVView<const float> fpool{kf.data(), vf.data(), fs, fs, kPages, H, P, static_cast<std::int32_t>(d), tab.view(), {}};
  // Quest metadata: from the codes == Quest::on_append on the decoded pool (every page, then one appended token).
  std::vector<float> m1(static_cast<std::size_t>(PageMetaView<float>::contiguous_size(kPages, H, d)), 0.0f), m2(m1.size(), 0.0f);
  const auto meta1 = PageMetaView<float>::contiguous(m1.data(), kPages, H, static_cast<std::int32_t>(d));
  const auto meta2 = PageMetaView<float>::contiguous(m2.data(), kPages, H, static_cast<std::int32_t>(d));
  const Quest quest{};
  std::vector<std::byte> ws(quantized_paged_workspace(P, d, 4, 2));
  ThreadPool pool(2);
  REQUIRE(
      quantized_page_meta_append(Context<backend::Cpu>{Workspace{ws.data(), ws.size()}, pool.context()}, q, cc, d, nullptr, meta1).is_ok());
  REQUIRE(quest.on_append(Context<backend::Cpu>{}, AppendInput<float>{fpool, nullptr}, meta2).is_ok());
  REQUIRE(m1 == m2);
  const std::int32_t one[2] = {1, 1};
  REQUIRE(quantized_page_meta_append(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, q, cc, d, one, meta1).is_ok());
  REQUIRE(m1 == m2);
  // Decode attention of a 4-query group over each sequence's pages, each kv head.
  std::vector<float> qv(static_cast<std::size_t>(4 * d));
  for (auto& x : qv) x = nd(rng);
  for (std::int32_t b = 0; b < 2; ++b)
    for (std::int32_t h = 0; h < H; ++h) {
      std::vector<float> o1(static_cast<std::size_t>(4 * d)), o2(o1.size()), l1(4), l2(4);
      REQUIRE(quantized_paged_decode_attention(q, q, cc, h, tab.indices.data() + tab.indptr[b], lens[b], qv.data(), 4, d, 0.125f, o1.data(),
                                               l1.data(), Workspace{ws.data(), ws.size()})
                  .is_ok());
      std::vector<std::byte> rws(backend::Scalar::paged_attention_workspace(4, P, d));
      backend::Scalar::paged_decode_attention(qv.data(), 4, d, Rows<float>::paged_keys(fpool, b, h), Rows<float>::paged_values(fpool, b, h),
                                              lens[b], 0.125f, o2.data(), l2.data(), Workspace{rws.data(), rws.size()});
      for (std::size_t i = 0; i < o1.size(); ++i) REQUIRE(o1[i] == Approx(o2[i]).epsilon(1e-6).margin(1e-7));
      for (std::size_t i = 0; i < l1.size(); ++i) REQUIRE(l1[i] == Approx(l2[i]).epsilon(1e-6));
      // The Context overload: on Scalar the same bits; on Cpu (page-wise op + log-sum-exp merge) within 1e-5.
      std::vector<float> o3(o1.size(), 9.0f), l3(4, 9.0f);
      REQUIRE(quantized_paged_decode_attention(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, q, q, cc, h,
                                               tab.indices.data() + tab.indptr[b], lens[b], qv.data(), 4, d, 0.125f, o3.data(), l3.data())
                  .is_ok());
      REQUIRE((o3 == o1 && l3 == l1));
      std::vector<std::byte> cws(quantized_paged_attention_workspace<backend::Cpu>(P, d, 4));
      REQUIRE_THAT(
          quantized_paged_decode_attention(Context<backend::Cpu>{Workspace{cws.data(), cws.size() - 64}}, q, q, cc, h,
                                           tab.indices.data() + tab.indptr[b], lens[b], qv.data(), 4, d, 0.125f, o3.data(), l3.data())
              .message(),
          Contains("workspace"));
      REQUIRE((o3 == o1 && l3 == l1));
      REQUIRE(quantized_paged_decode_attention(Context<backend::Cpu>{Workspace{cws.data(), cws.size()}}, q, q, cc, h,
                                               tab.indices.data() + tab.indptr[b], lens[b], qv.data(), 4, d, 0.125f, o3.data(), l3.data())
                  .is_ok());
      for (std::size_t i = 0; i < o1.size(); ++i) REQUIRE(o3[i] == Approx(o1[i]).epsilon(1e-5).margin(1e-6));
      for (std::size_t i = 0; i < l1.size(); ++i) REQUIRE(l3[i] == Approx(l1[i]).epsilon(1e-5));
    }
  // Corner cases on Cpu, as the reference: no tokens gives 0 and -inf; a NaN query gives NaN output and lse.
  std::vector<std::byte> cws(quantized_paged_attention_workspace<backend::Cpu>(P, d, 4));
  std::vector<float> o(static_cast<std::size_t>(4 * d), 5.0f), l(4, 5.0f), qn = qv;
  REQUIRE(quantized_paged_decode_attention(Context<backend::Cpu>{Workspace{cws.data(), cws.size()}}, q, q, cc, 0, tab.indices.data(), 0,
                                           qv.data(), 4, d, 0.125f, o.data(), l.data())
              .is_ok());
  REQUIRE(std::all_of(o.begin(), o.end(), [](float x) { return x == 0.0f; }));
  REQUIRE(std::all_of(l.begin(), l.end(), [](float x) { return x == -std::numeric_limits<float>::infinity(); }));
  qn[static_cast<std::size_t>(d + 3)] = std::numeric_limits<float>::quiet_NaN();  // query head 1
  REQUIRE(quantized_paged_decode_attention(Context<backend::Cpu>{Workspace{cws.data(), cws.size()}}, q, q, cc, 0, tab.indices.data(), 40,
                                           qn.data(), 4, d, 0.125f, o.data(), l.data())
              .is_ok());
  for (std::int64_t g = 0; g < 4; ++g) {
    REQUIRE(std::isnan(l[static_cast<std::size_t>(g)]) == (g == 1));
    REQUIRE(std::isnan(o[static_cast<std::size_t>(g * d)]) == (g == 1));
  }
}

}  // namespace

TEST_CASE("quantized paged cache: append, Quest metadata and decode attention from the codes", "[quant][paged]") {
  for (PageLayout layout : {PageLayout::kHND, PageLayout::kNHD}) {
    check_format(GgmlQuant(GgmlQuantParams{GgmlType::kQ4_0}), layout, "q4_0");
    check_format(GgmlQuant(GgmlQuantParams{GgmlType::kQ8_0, HadamardMode::kLlamaCpp}), layout, "q8_0 rotated");
    check_format(Int4Quant{}, layout, "int4");
    check_format(Fp8Quant{}, layout, "fp8");
  }
}

namespace {

using kvp_test::EmulatedDevice;
using kvp_test::kEmulatedDevice;

/// A long sequence (1100 tokens: two device chunks of 1024 rows at P = 16) and a short one over a shuffled
/// page list; the device path on EmulatedDevice against the host path.
template <class Q>
void check_device_format(const Q& q, PageLayout layout, const char* name) {
  INFO(name << (layout == PageLayout::kHND ? " HND" : " NHD"));
  const std::int64_t lens[2] = {1100, 29};
  const std::int32_t np0 = 69, np1 = 2, pages = np0 + np1 + 3;  // 3 pages nobody owns
  std::vector<std::int32_t> ids(pages);
  for (std::int32_t i = 0; i < pages; ++i) ids[static_cast<std::size_t>(i)] = (i * 31 + 5) % pages;
  std::vector<std::int32_t> indptr{0, np0, np0 + np1}, indices(ids.begin(), ids.begin() + np0 + np1), last{1100 - 68 * P, 29 - P};
  const PageTable table{indptr.data(), indices.data(), last.data(), 2};
  const std::int64_t rb = q.row_bytes(d);
  const PageStrides cs = PageStrides::contiguous(layout, H, P, rb);
  std::vector<std::uint8_t> hk(static_cast<std::size_t>(pages * H * P * rb), 0x5A), hv(hk.size(), 0xA5), dk = hk, dv = hv;
  const PagedKVView<std::uint8_t> host{hk.data(), hv.data(), cs, cs, pages, H, P, static_cast<std::int32_t>(rb), table, {}};
  const PagedKVView<std::uint8_t> dev{dk.data(), dv.data(), cs, cs, pages, H, P, static_cast<std::int32_t>(rb), table, kEmulatedDevice};
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  std::vector<std::byte> aws(quantize_paged_append_workspace<EmulatedDevice>(q, P, d, H), kvp_test::kWorkspacePoison);
  REQUIRE(quantize_paged_append_workspace<backend::Scalar>(q, P, d, H) == 0);
  const auto append = [&](std::int32_t b, std::int64_t n) {
    std::vector<float> k(static_cast<std::size_t>(H * n * d)), v(k.size());
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    for (const bool values : {false, true}) {
      const std::vector<float>& x = values ? v : k;
      REQUIRE(quantize_paged_append(q, host, b, TensorView<const float, 3>::contiguous(x.data(), {H, n, d}), values).is_ok());
      const Status s = quantize_paged_append(Context<EmulatedDevice>{Workspace{aws.data(), aws.size()}}, q, dev, b,
                                             TensorView<const float, 3>::contiguous(x.data(), {H, n, d}, kEmulatedDevice), values);
      INFO(s.message());
      REQUIRE(s.is_ok());
    }
    REQUIRE(dk == hk);
    REQUIRE(dv == hv);
  };
  append(0, lens[0]);  // two chunks
  append(1, lens[1]);
  append(0, 37);  // the last 37 tokens rewritten: a run that starts inside a page

  // Metadata: every page, then the last few tokens, each equal to the host's bits.
  const PagedKVView<const std::uint8_t> hc = host, dc = dev;
  const std::size_t msize = static_cast<std::size_t>(PageMetaView<float>::contiguous_size(pages, H, d));
  std::vector<float> hm(msize, 3.0f), dm(msize, 3.0f);
  const auto hmeta = PageMetaView<float>::contiguous(hm.data(), pages, H, static_cast<std::int32_t>(d));
  const auto dmeta = PageMetaView<float>::contiguous(dm.data(), pages, H, static_cast<std::int32_t>(d), kEmulatedDevice);
  std::vector<std::byte> hws(quantized_page_meta_workspace<backend::Scalar>(q, P, d, H));
  std::vector<std::byte> dws(quantized_page_meta_workspace<EmulatedDevice>(q, P, d, H), kvp_test::kWorkspacePoison);
  REQUIRE(quantized_page_meta_append(Context<backend::Scalar>{Workspace{hws.data(), hws.size()}}, q, hc, d, nullptr, hmeta).is_ok());
  REQUIRE(quantized_page_meta_append(Context<EmulatedDevice>{Workspace{dws.data(), dws.size()}}, q, dc, d, nullptr, dmeta).is_ok());
  REQUIRE(dm == hm);
  for (auto& x : hm) x = 1.0f;  // a partial append folds into what the pages hold
  dm = hm;
  const std::int32_t tail[2] = {37, 29};
  REQUIRE(quantized_page_meta_append(Context<backend::Scalar>{Workspace{hws.data(), hws.size()}}, q, hc, d, tail, hmeta).is_ok());
  REQUIRE(quantized_page_meta_append(Context<EmulatedDevice>{Workspace{dws.data(), dws.size()}}, q, dc, d, tail, dmeta).is_ok());
  REQUIRE(dm == hm);

  // Decode attention of a 5-query group (more than one 1024-row chunk for sequence 0).
  constexpr std::int64_t G = 5;
  std::vector<float> qv(static_cast<std::size_t>(G * d));
  for (auto& x : qv) x = nd(rng);
  std::vector<std::byte> sws(quantized_paged_workspace(P, d, G));
  std::vector<std::byte> ews(quantized_paged_attention_workspace<EmulatedDevice>(q, P, d, G), kvp_test::kWorkspacePoison);
  for (std::int32_t b = 0; b < 2; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (const std::int64_t n : {lens[b], std::int64_t{17}, std::int64_t{0}}) {
        INFO("sequence " << b << " head " << h << " tokens " << n);
        const std::int32_t* list = indices.data() + indptr[static_cast<std::size_t>(b)];
        std::vector<float> o1(static_cast<std::size_t>(G * d), 2.0f), l1(G, 2.0f), o2(o1.size(), 4.0f), l2(G, 4.0f);
        REQUIRE(quantized_paged_decode_attention(q, q, hc, h, list, n, qv.data(), G, d, 0.125f, o1.data(), l1.data(),
                                                 Workspace{sws.data(), sws.size()})
                    .is_ok());
        const Status s = quantized_paged_decode_attention(Context<EmulatedDevice>{Workspace{ews.data(), ews.size()}}, q, q, dc, h, list, n,
                                                          qv.data(), G, d, 0.125f, o2.data(), l2.data());
        INFO(s.message());
        REQUIRE(s.is_ok());
        for (std::size_t i = 0; i < o1.size(); ++i) REQUIRE(o2[i] == Approx(o1[i]).epsilon(1e-5).margin(1e-6));
        for (std::size_t i = 0; i < l1.size(); ++i) REQUIRE(l2[i] == Approx(l1[i]).epsilon(1e-5));
      }
  // backend::Cpu with a group wider than the reference's 16-head blocks (20 heads in one op call): within
  // 1e-5 of the scalar overload.
  {
    constexpr std::int64_t G20 = 20;
    std::vector<float> q20(static_cast<std::size_t>(G20 * d));
    for (auto& x : q20) x = nd(rng);
    std::vector<std::byte> s20(quantized_paged_workspace(P, d, G20)), c20(quantized_paged_attention_workspace<backend::Cpu>(q, P, d, G20));
    std::vector<float> o1(q20.size()), l1(G20), o2(q20.size()), l2(G20);
    REQUIRE(quantized_paged_decode_attention(q, q, hc, 1, indices.data(), lens[0], q20.data(), G20, d, 0.125f, o1.data(), l1.data(),
                                             Workspace{s20.data(), s20.size()})
                .is_ok());
    REQUIRE(quantized_paged_decode_attention(Context<backend::Cpu>{Workspace{c20.data(), c20.size()}}, q, q, hc, 1, indices.data(), lens[0],
                                             q20.data(), G20, d, 0.125f, o2.data(), l2.data())
                .is_ok());
    for (std::size_t i = 0; i < o1.size(); ++i) REQUIRE(o2[i] == Approx(o1[i]).epsilon(1e-5).margin(1e-6));
    for (std::size_t i = 0; i < l1.size(); ++i) REQUIRE(l2[i] == Approx(l1[i]).epsilon(1e-5));
  }
  // A NaN query head: its output and lse NaN, the others finite, as the host.
  std::vector<float> qn = qv, o(static_cast<std::size_t>(G * d)), l(G);
  qn[static_cast<std::size_t>(3 * d + 1)] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE(quantized_paged_decode_attention(Context<EmulatedDevice>{Workspace{ews.data(), ews.size()}}, q, q, dc, 1, indices.data(), lens[0],
                                           qn.data(), G, d, 0.125f, o.data(), l.data())
              .is_ok());
  for (std::int64_t g = 0; g < G; ++g) {
    REQUIRE(std::isnan(l[static_cast<std::size_t>(g)]) == (g == 3));
    REQUIRE(std::isnan(o[static_cast<std::size_t>(g * d + 7)]) == (g == 3));
  }
}

}  // namespace

TEST_CASE("quantized paged cache on a device backend (emulated): the host's bytes and metadata, attention within 1e-5",
          "[quant][paged][device]") {
  for (PageLayout layout : {PageLayout::kHND, PageLayout::kNHD}) {
    check_device_format(GgmlQuant(GgmlQuantParams{GgmlType::kQ4_1}), layout, "q4_1");
    check_device_format(GgmlQuant(GgmlQuantParams{GgmlType::kQ8_0, HadamardMode::kLlamaCpp}), layout, "q8_0 rotated");
    check_device_format(Int4Quant{}, layout, "int4");
    check_device_format(Fp8Quant{}, layout, "fp8");
  }
}

TEST_CASE("quantized paged cache on a device backend (emulated): host-side checks before anything is written",
          "[quant][paged][device][errors]") {
  const Table tab;
  const GgmlQuant q4(GgmlQuantParams{GgmlType::kQ4_0});
  const std::int64_t rb = q4.row_bytes(d);
  const PageStrides cs = PageStrides::contiguous(PageLayout::kNHD, H, P, rb);
  std::vector<std::uint8_t> kc(static_cast<std::size_t>(kPages * H * P * rb), 0x11), vc(kc.size(), 0x22);
  const auto k0 = kc;
  PagedKVView<std::uint8_t> dev{kc.data(), vc.data(), cs, cs, kPages, H, P, static_cast<std::int32_t>(rb), tab.view(), kEmulatedDevice};
  PagedKVView<std::uint8_t> hostpool = dev;
  hostpool.device = {};
  std::vector<float> rows(static_cast<std::size_t>(H * 40 * d), 0.5f);
  const auto drows = TensorView<const float, 3>::contiguous(rows.data(), {H, 40, d}, kEmulatedDevice);
  std::vector<std::byte> ws(quantize_paged_append_workspace<EmulatedDevice>(q4, P, d, H));
  const Context<EmulatedDevice> ctx{Workspace{ws.data(), ws.size()}};
  REQUIRE_THAT(quantize_paged_append(ctx, q4, hostpool, 0, drows, false).message(), Contains("the code pool is host memory"));
  REQUIRE_THAT(quantize_paged_append(ctx, q4, dev, 0, TensorView<const float, 3>::contiguous(rows.data(), {H, 40, d}), false).message(),
               Contains("rows is a host tensor"));
  REQUIRE_THAT(quantize_paged_append(Context<EmulatedDevice>{Workspace{ws.data(), ws.size() - 128}}, q4, dev, 0, drows, false).message(),
               Contains("workspace"));
  REQUIRE(kc == k0);
  // The device path does not read page ids on the host: an id out of range is not reported there.
  std::vector<float> m(static_cast<std::size_t>(PageMetaView<float>::contiguous_size(kPages, H, d)), 7.0f);
  const auto m0 = m;
  std::vector<std::byte> mws(quantized_page_meta_workspace<EmulatedDevice>(q4, P, d, H));
  const PagedKVView<const std::uint8_t> cdev = dev;
  REQUIRE_THAT(quantized_page_meta_append(Context<EmulatedDevice>{Workspace{mws.data(), mws.size()}}, q4, cdev, d, nullptr,
                                          PageMetaView<float>::contiguous(m.data(), kPages, H, static_cast<std::int32_t>(d)))
                   .message(),
               Contains("metadata is host memory"));
  REQUIRE_THAT(
      quantized_page_meta_append(Context<EmulatedDevice>{Workspace{mws.data(), mws.size() - 128}}, q4, cdev, d, nullptr,
                                 PageMetaView<float>::contiguous(m.data(), kPages, H, static_cast<std::int32_t>(d), kEmulatedDevice))
          .message(),
      Contains("workspace"));
  REQUIRE(m == m0);
  std::vector<float> q(static_cast<std::size_t>(4 * d), 1.0f), o(q.size(), 3.0f);
  std::vector<std::byte> aws(quantized_paged_attention_workspace<EmulatedDevice>(q4, P, d, 4));
  REQUIRE_THAT(quantized_paged_decode_attention(Context<EmulatedDevice>{Workspace{aws.data(), aws.size() - 128}}, q4, q4, cdev, 0,
                                                tab.indices.data(), 40, q.data(), 4, d, 0.125f, o.data(), nullptr)
                   .message(),
               Contains("workspace"));
  REQUIRE_THAT(quantized_paged_decode_attention(Context<EmulatedDevice>{Workspace{aws.data(), aws.size()}}, q4, q4, cdev, 2,
                                                tab.indices.data(), 40, q.data(), 4, d, 0.125f, o.data(), nullptr)
                   .message(),
               Contains("kv head 2 out of range"));
  REQUIRE(std::all_of(o.begin(), o.end(), [](float x) { return x == 3.0f; }));
}

TEST_CASE("quantized paged cache: bad input is rejected and nothing is written", "[quant][paged][errors]") {
  const Table tab;
  const GgmlQuant q4(GgmlQuantParams{GgmlType::kQ4_0});
  const std::int64_t rb = q4.row_bytes(d);
  std::vector<std::uint8_t> kc(static_cast<std::size_t>(kPages * H * P * rb), 0x11), vc(kc.size(), 0x22);
  PagedKVView<std::uint8_t> codes{kc.data(),
                                  vc.data(),
                                  PageStrides::contiguous(PageLayout::kHND, H, P, rb),
                                  PageStrides::contiguous(PageLayout::kHND, H, P, rb),
                                  kPages,
                                  H,
                                  P,
                                  static_cast<std::int32_t>(rb),
                                  tab.view(),
                                  {}};
  const auto k0 = kc, v0 = vc;
  std::vector<float> rows(static_cast<std::size_t>(H * 40 * d), 0.5f);
  rows[100] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THAT(quantize_paged_append(q4, codes, 0, TensorView<const float, 3>::contiguous(rows.data(), {H, 40, d}), false).message(),
               Contains("not finite"));
  REQUIRE(kc == k0);
  rows[100] = 0.5f;
  REQUIRE_THAT(quantize_paged_append(q4, codes, 0, TensorView<const float, 3>::contiguous(rows.data(), {H, 41, d}), false).message(),
               Contains("41 rows for a sequence of 40 tokens"));
  const GgmlQuant q8(GgmlQuantParams{GgmlType::kQ8_0});
  REQUIRE_THAT(quantize_paged_append(q8, codes, 0, TensorView<const float, 3>::contiguous(rows.data(), {H, 40, d}), false).message(),
               Contains("the code pool's rows are 36 bytes, the format's rows are 68 bytes"));
  REQUIRE(kc == k0);
  std::vector<float> m(static_cast<std::size_t>(PageMetaView<float>::contiguous_size(kPages, H, d)), 7.0f);
  const auto m0 = m;
  std::vector<std::byte> ws(quantized_paged_workspace(P, d, 4));
  const PagedKVView<const std::uint8_t> cc = codes;
  REQUIRE_THAT(quantized_page_meta_append(Context<backend::Scalar>{Workspace{ws.data(), 16}}, q4, cc, d, nullptr,
                                          PageMetaView<float>::contiguous(m.data(), kPages, H, static_cast<std::int32_t>(d)))
                   .message(),
               Contains("workspace"));
  REQUIRE_THAT(quantized_page_meta_append(Context<backend::Scalar>{Workspace{ws.data(), ws.size()}}, q4, cc, d, nullptr,
                                          PageMetaView<float>::contiguous(m.data(), kPages - 1, H, static_cast<std::int32_t>(d)))
                   .message(),
               Contains("metadata has 8 pages, the page pool has 9"));
  REQUIRE(m == m0);
  std::vector<float> q(static_cast<std::size_t>(4 * d), 1.0f), o(q.size(), 3.0f);
  const std::int32_t bad_pages[3] = {4, 12, 7};
  REQUIRE_THAT(quantized_paged_decode_attention(q4, q4, cc, 0, bad_pages, 40, q.data(), 4, d, 0.125f, o.data(), nullptr,
                                                Workspace{ws.data(), ws.size()})
                   .message(),
               Contains("page 1 of the list is 12, out of range [0, 9)"));
  REQUIRE(std::all_of(o.begin(), o.end(), [](float x) { return x == 3.0f; }));
}
