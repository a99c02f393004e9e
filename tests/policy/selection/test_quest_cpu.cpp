// CpuPageOps (every ISA level this machine has) against the scalar reference:
// metadata bit-identical, bounds and attention within the stated tolerance,
// Quest selections identical on data whose bounds are exact in fp32.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>
#include <type_traits>

#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/backends/cpu_page_ops.hpp"
#include "kvpolicy/eval/page_metrics.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "policy/selection/quest_fixture.hpp"

using namespace kvpolicy;
using namespace quest_test;

namespace {

using Cpu = backend::Cpu;
using CpuOps = backend::CpuPageOps;

/// Runs f() once per ISA level the machine supports, restoring the best level.
template <class F>
void for_each_isa(F&& f) {
  for (CpuIsa isa : {CpuIsa::kSse2, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!Cpu::set_isa(isa)) continue;
    INFO("isa " << cpu_isa_name(isa));
    f();
  }
  REQUIRE(Cpu::set_isa(Cpu::best_isa()));
}

template <class T>
T special_value(std::mt19937& rng) {
  static const float pool[] = {0.0f, -0.0f, INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN(), 6e-8f, -3e-5f, 65504.0f, 1e-40f};
  std::normal_distribution<float> nd;
  const unsigned r = rng() % 16;
  return from_float<T>(r < 9 ? pool[r] : nd(rng) * 10.0f);
}

template <class Tk, class Tm>
void fold_case(std::int64_t d, std::int64_t n, bool specials, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const std::int64_t stride = d + 3;
  std::vector<Tk> rows(static_cast<std::size_t>(std::max<std::int64_t>(n, 1) * stride));
  for (auto& x : rows) x = specials ? special_value<Tk>(rng) : from_float<Tk>(nd(rng));
  for (int fresh = 0; fresh < 2; ++fresh) {
    std::vector<Tm> mx0(static_cast<std::size_t>(d)), mn0(mx0.size());
    for (std::size_t i = 0; i < mx0.size(); ++i) {  // stored state to resume from (Tk values)
      mx0[i] = from_float<Tm>(to_float(from_float<Tk>(nd(rng))));
      mn0[i] = from_float<Tm>(to_float(mx0[i]) - 1.0f);
    }
    auto mx1 = mx0, mn1 = mn0, mx2 = mx0, mn2 = mn0;
    backend::Scalar::page_meta_fold(rows.data(), stride, n, d, mx1.data(), mn1.data(), fresh != 0);
    CpuOps::page_meta_fold(rows.data(), stride, n, d, mx2.data(), mn2.data(), fresh != 0);
    INFO("d " << d << " n " << n << " fresh " << fresh << " specials " << specials);
    REQUIRE(std::memcmp(mx1.data(), mx2.data(), mx1.size() * sizeof(Tm)) == 0);
    REQUIRE(std::memcmp(mn1.data(), mn2.data(), mn1.size() * sizeof(Tm)) == 0);
  }
}

template <class Tk, class Tm>
void fold_all(unsigned& seed) {
  for (std::int64_t d : {1, 5, 8, 16, 33, 64, 128, 200})
    for (std::int64_t n : {0, 1, 3, 16, 64}) {
      fold_case<Tk, Tm>(d, n, false, seed++);
      fold_case<Tk, Tm>(d, n, true, seed++);
    }
}

}  // namespace

TEST_CASE("cpu page_meta_fold is bit-identical to the reference (all ISAs, dtype pairs, specials)", "[quest][cpu]") {
  for_each_isa([] {
    unsigned seed = 1;
    fold_all<float, float>(seed);
    fold_all<half, half>(seed);
    fold_all<half, float>(seed);
    fold_all<bfloat16, bfloat16>(seed);
    fold_all<bfloat16, float>(seed);
  });
}

namespace {

template <class Tm>
void bounds_case(std::int64_t H, std::int64_t G, std::int64_t d, std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const auto pool = static_cast<std::int32_t>(n + 5);
  std::vector<Tm> data(
      static_cast<std::size_t>(PageMetaView<Tm>::contiguous_size(pool, static_cast<std::int32_t>(H), static_cast<std::int32_t>(d))));
  const auto mv = PageMetaView<Tm>::contiguous(data.data(), pool, static_cast<std::int32_t>(H), static_cast<std::int32_t>(d));
  for (std::int32_t p = 0; p < pool; ++p)
    for (std::int32_t g = 0; g < H; ++g)
      for (std::int64_t c = 0; c < d; ++c) {
        const float a = nd(rng), b = nd(rng);
        mv.max_row(p, g)[c] = from_float<Tm>(std::max(a, b));
        mv.min_row(p, g)[c] = from_float<Tm>(std::min(a, b));
      }
  const PageMetaView<const Tm> meta = mv;
  std::vector<std::int32_t> pages(static_cast<std::size_t>(pool));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<float> q(static_cast<std::size_t>(H * G * d));
  for (auto& x : q) x = (rng() % 9 == 0) ? 0.0f : nd(rng);
  const std::int64_t ld = n + 2;
  std::vector<float> ref(static_cast<std::size_t>(H * G * ld), -1.0f), got(ref.size(), -1.0f);
  std::vector<std::byte> ws(CpuOps::page_bounds_workspace(H * G, d));
  for (const std::int32_t* pg : {static_cast<const std::int32_t*>(pages.data()), static_cast<const std::int32_t*>(nullptr)}) {
    backend::Scalar::page_bounds(q.data(), G, d, meta, pg, n, ref.data(), ld, Workspace{});
    CpuOps::page_bounds(q.data(), G, d, meta, pg, n, got.data(), ld, Workspace{ws.data(), ws.size()});
    for (std::int64_t row = 0; row < H * G; ++row)
      for (std::int64_t i = 0; i < ld; ++i) {
        const auto k = static_cast<std::size_t>(row * ld + i);
        if (i >= n) {
          REQUIRE(got[k] == -1.0f);  // nothing written past n
          continue;
        }
        const std::int32_t p = pg ? pg[i] : static_cast<std::int32_t>(i);
        const auto g = static_cast<std::int32_t>(row / G);
        double mag = 0.0;
        for (std::int64_t c = 0; c < d; ++c)
          mag += std::fabs(q[static_cast<std::size_t>(row * d + c)]) *
                 std::max(std::fabs(to_float(meta.max_row(p, g)[c])), std::fabs(to_float(meta.min_row(p, g)[c])));
        INFO("H " << H << " G " << G << " d " << d << " n " << n << " row " << row << " i " << i);
        REQUIRE(std::fabs(got[k] - ref[k]) <= 1e-5 * mag + 1e-30);
      }
  }
  // A workspace too small for the SIMD path: the reference, bit for bit.
  CpuOps::page_bounds(q.data(), G, d, meta, pages.data(), n, got.data(), ld, Workspace{});
  backend::Scalar::page_bounds(q.data(), G, d, meta, pages.data(), n, ref.data(), ld, Workspace{});
  REQUIRE(got == ref);
}

}  // namespace

TEST_CASE("cpu page_bounds agrees with the reference within 1e-5 * sum|q|max|M,m|", "[quest][cpu]") {
  for_each_isa([] {
    unsigned seed = 5;
    for (std::int64_t H : {1, 3})
      for (std::int64_t G : {1, 2, 4, 5, 8})
        for (std::int64_t d : {1, 7, 16, 40, 128})
          for (std::int64_t n : {0, 1, 2, 7, 17, 64}) {
            bounds_case<float>(H, G, d, n, seed++);
            bounds_case<half>(H, G, d, n, seed++);
            bounds_case<bfloat16>(H, G, d, n, seed++);
          }
    // Groups over one tile of 8 rows (8 + 2 + 1, 8 + 8) and pages past several chunks of 16.
    for (std::int64_t G : {11, 16})
      for (std::int64_t d : {24, 128})
        for (std::int64_t n : {3, 51}) {
          bounds_case<float>(2, G, d, n, seed++);
          bounds_case<half>(2, G, d, n, seed++);
        }
  });
}

TEST_CASE("cpu page_bounds follows the reference on non-finite metadata and queries", "[quest][cpu]") {
  // Page 0 channel 0: M = +inf with q = 0 (reference term max(NaN, 0*m) = 0*m);
  // channel 1: m = -inf with q > 0 (term q*M); channel 2: M = m = +inf (term
  // +inf for q > 0, -inf for q < 0). Page 1 is finite, with an infinite query.
  const std::int32_t d = 20;
  std::vector<float> data(static_cast<std::size_t>(PageMetaView<float>::contiguous_size(2, 1, d)), 1.0f);
  const auto mv = PageMetaView<float>::contiguous(data.data(), 2, 1, d);
  mv.max_row(0, 0)[0] = INFINITY;
  mv.min_row(0, 0)[0] = 0.5f;
  mv.min_row(0, 0)[1] = -INFINITY;
  mv.max_row(0, 0)[2] = INFINITY;
  mv.min_row(0, 0)[2] = INFINITY;
  mv.min_row(1, 0)[3] = 0.0f;
  mv.max_row(1, 0)[3] = 0.0f;
  std::vector<std::byte> ws(CpuOps::page_bounds_workspace(1, d));
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<float> q(d, 0.25f);
    q[0] = 0.0f;
    if (variant >= 1) q[2] = -0.25f;
    if (variant == 2) q[3] = INFINITY;  // inf * 0 on page 1: the reference's NaN rule
    float ref[2], got[2];
    backend::Scalar::page_bounds(q.data(), 1, d, PageMetaView<const float>(mv), nullptr, 2, ref, 2, Workspace{});
    if (variant == 0) REQUIRE(ref[0] == INFINITY);
    if (variant == 1) REQUIRE(ref[0] == -INFINITY);
    for_each_isa([&] {
      CpuOps::page_bounds(q.data(), 1, d, PageMetaView<const float>(mv), nullptr, 2, got, 2, Workspace{ws.data(), ws.size()});
      for (int i = 0; i < 2; ++i) {
        INFO("variant " << variant << " page " << i << " ref " << ref[i] << " got " << got[i]);
        if (std::isfinite(ref[i]))
          REQUIRE(got[i] == Approx(ref[i]).epsilon(1e-5));
        else
          REQUIRE((std::isnan(ref[i]) ? std::isnan(got[i]) : got[i] == ref[i]));
      }
    });
  }
}

namespace {

template <class T>
void attention_case(std::int64_t G, std::int64_t d, std::int32_t P, std::int64_t tokens, bool paged, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const std::int64_t pool_pages = tokens / std::max(P, 1) + 3, row_stride = d + 2;
  const std::int64_t rows = paged ? pool_pages * P : tokens + 1;
  std::vector<T> k(static_cast<std::size_t>(rows * row_stride)), v(k.size());
  for (auto& x : k) x = from_float<T>(nd(rng) * 1.5f);
  for (auto& x : v) x = from_float<T>(nd(rng));
  std::vector<std::int32_t> pages(static_cast<std::size_t>(pool_pages));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  const Rows<T> kr = paged ? Rows<T>{k.data(), row_stride, pages.data(), P * row_stride, P} : Rows<T>{k.data(), row_stride, nullptr, 0, 0};
  const Rows<T> vr = paged ? Rows<T>{v.data(), row_stride, pages.data(), P * row_stride, P} : Rows<T>{v.data(), row_stride, nullptr, 0, 0};
  std::vector<float> q(static_cast<std::size_t>(G * d));
  for (auto& x : q) x = nd(rng);
  const std::int64_t block = backend::Scalar::attention_block(kr);
  std::vector<std::byte> ws_ref(backend::Scalar::paged_attention_workspace(G, block, d)),
      ws(CpuOps::paged_attention_workspace(G, block, d));
  std::vector<float> o_ref(static_cast<std::size_t>(G * d)), o(o_ref.size()), l_ref(static_cast<std::size_t>(G)), l(l_ref.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  backend::Scalar::paged_decode_attention(q.data(), G, d, kr, vr, tokens, scale, o_ref.data(), l_ref.data(),
                                          Workspace{ws_ref.data(), ws_ref.size()});
  CpuOps::paged_decode_attention(q.data(), G, d, kr, vr, tokens, scale, o.data(), l.data(), Workspace{ws.data(), ws.size()});
  INFO("G " << G << " d " << d << " P " << P << " tokens " << tokens << " paged " << paged);
  for (std::size_t i = 0; i < o.size(); ++i) REQUIRE(o[i] == Approx(o_ref[i]).epsilon(1e-4).margin(1e-5));
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (tokens == 0)
      REQUIRE(l[i] == -INFINITY);
    else
      REQUIRE(l[i] == Approx(l_ref[i]).epsilon(1e-5).margin(1e-5));
  }
  // A workspace sized for the reference: the op falls back to it, same result bit for bit.
  CpuOps::paged_decode_attention(q.data(), G, d, kr, vr, tokens, scale, o.data(), l.data(), Workspace{ws_ref.data(), ws_ref.size()});
  REQUIRE(o == o_ref);
}

}  // namespace

TEST_CASE("cpu paged_decode_attention agrees with the reference (dtypes, groups, tails, page sizes)", "[quest][cpu]") {
  for_each_isa([] {
    unsigned seed = 9;
    for (std::int64_t G : {1, 3, 4, 8})
      for (std::int64_t d : {16, 33, 128})
        for (std::int32_t P : {1, 16, 64})
          for (std::int64_t tokens : {std::int64_t{0}, std::int64_t{1}, std::int64_t{P} * 3 + 2}) {
            attention_case<float>(G, d, P, tokens, true, seed++);
            attention_case<half>(G, d, P, tokens, true, seed++);
            attention_case<bfloat16>(G, d, P, tokens, P == 16, seed++);
          }
  });
}

namespace {

static_assert(std::is_base_of_v<backend::CpuPageOps, backend::Cpu>, "backend::Cpu carries the SIMD page ops");

template <class Tk, class Tm>
void select_case(PageLayout layout, std::int32_t P, std::int32_t Hkv, std::int32_t G, unsigned seed) {
  const std::int32_t d = 64, Hq = Hkv * G;
  const std::vector<std::int64_t> lens{0, 5 * P + 1, 40 * P, 300 * P + P / 2 + 1};
  std::int32_t pool = 2;
  for (auto l : lens) pool += static_cast<std::int32_t>((l + P - 1) / P);
  PagedCache<Tk> c(pool, Hkv, P, d, layout, static_cast<std::int32_t>(lens.size()), seed);
  std::vector<std::int32_t> append;
  // Small integers: every product and partial sum of a bound is exact in fp32,
  // so both backends compute identical bounds whatever the summation order,
  // and the many exact ties exercise the shared tie-break.
  auto small_int = [](std::mt19937& r) { return static_cast<float>(static_cast<int>(r() % 17) - 8); };
  for (std::size_t b = 0; b < lens.size(); ++b) {
    c.append(static_cast<std::int32_t>(b), lens[b], small_int);
    append.push_back(static_cast<std::int32_t>(lens[b]));
  }
  MetaBuffer<Tm> ms(pool, Hkv, d), mc(pool, Hkv, d);
  REQUIRE(Quest{}.on_append(Context<backend::Scalar>{}, AppendInput<Tk>{c.view(), append.data()}, ms.view()).is_ok());
  REQUIRE(Quest{}.on_append(Context<Cpu>{}, AppendInput<Tk>{c.view(), append.data()}, mc.view()).is_ok());
  REQUIRE(ms.data.size() == mc.data.size());
  REQUIRE(std::memcmp(ms.data.data(), mc.data.data(), ms.data.size() * sizeof(Tm)) == 0);
  std::mt19937 rng(seed);
  std::vector<float> q(lens.size() * static_cast<std::size_t>(Hq * d));
  for (auto& x : q) x = static_cast<float>(static_cast<int>(rng() % 9) - 4);
  const auto qv = TensorView<const float, 3>::contiguous(q.data(), {static_cast<std::int64_t>(lens.size()), Hq, d});
  const GqaMap gqa{Hq, Hkv};
  for (QuestGqa mode : {QuestGqa::kPerQueryHead, QuestGqa::kUnion, QuestGqa::kGroupMax, QuestGqa::kGroupSum}) {
    const Quest quest(QuestParams{.budget = Budget::tokens(16 * P), .gqa = mode});
    const std::int64_t rows = c.batch() * quest.heads_per_seq(gqa), cap = quest.output_capacity(2, c.table(), P, gqa);
    const DecodeInput<float> in{qv, c.table(), P, 2};
    const ProblemShape shape{.num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = d};
    Quest::Plan p1, p2;
    REQUIRE(quest.plan(Context<backend::Scalar>{}, in, shape, p1).is_ok());
    REQUIRE(quest.plan(Context<Cpu>{}, in, shape, p2).is_ok());
    for (const Quest::Plan* p : {&p1, &p2}) {
      REQUIRE(p->requirements.output.rows == rows);
      REQUIRE(p->requirements.output.capacity == cap);
    }
    // The worst-case size query (no table) covers this step's plan.
    const Requirements worst = quest.requirements(Context<Cpu>{}, ProblemShape{Hq, Hkv, d, lens.back(), 0, c.batch()}, P);
    REQUIRE(worst.status.is_ok());
    REQUIRE(worst.workspace_bytes >= p2.requirements.workspace_bytes);
    REQUIRE(worst.output.rows == rows);
    REQUIRE(worst.output.capacity >= cap);
    SelectionBuffer s1(rows, cap), s2(rows, cap);
    std::vector<std::byte> w1(p1.requirements.workspace_bytes);
    std::vector<std::byte> w2(p2.requirements.workspace_bytes);
    REQUIRE(quest.select(Context<backend::Scalar>{Workspace{w1.data(), w1.size()}}, p1, in, ms.cview(), s1.view()).is_ok());
    REQUIRE(quest.select(Context<Cpu>{Workspace{w2.data(), w2.size()}}, p2, in, mc.cview(), s2.view()).is_ok());
    REQUIRE(s2.view().validate("t", pool, P).is_ok());
    REQUIRE(s1.indptr == s2.indptr);
    REQUIRE(s1.last == s2.last);
    for (std::int64_t r = 0; r < rows; ++r) {
      INFO("mode " << static_cast<int>(mode) << " row " << r);
      REQUIRE(s1.row(r) == s2.row(r));
      REQUIRE(s1.row_logical(r) == s2.row_logical(r));
    }
  }
}

}  // namespace

TEST_CASE("Quest with the CPU page ops: metadata identical, selections identical to the reference", "[quest][cpu]") {
  for_each_isa([] {
    unsigned seed = 40;
    for (PageLayout layout : {PageLayout::kNHD, PageLayout::kHND})
      for (std::int32_t P : {1, 16, 64})
        for (std::int32_t G : {1, 4, 8}) {
          select_case<half, half>(layout, P, G == 8 ? 1 : 2, G, seed++);
          select_case<bfloat16, float>(layout, P, G == 8 ? 1 : 2, G, seed++);
          select_case<float, float>(layout, P, G == 8 ? 1 : 2, G, seed++);
        }
  });
}
