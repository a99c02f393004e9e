// The PageOps family of `backend::Cuda` (Quest's page metadata fold, the
// per-page bound of q.k, decode attention over pages) against
// `backend::Scalar` on the host, on a GPU:
// - page_meta_fold and page_bounds bit-identical (NaN compared as NaN where
//   the reference's NaN comes from arithmetic, whose payload is not specified);
// - paged_decode_attention within |out - ref| <= 2e-5 * |ref| + 2e-5 * max|v|
//   and |lse - ref| <= 2e-5 * |ref| + 2e-5 (expf and summation order), with
//   exactly the reference's NaN / inf / "nothing attended" outputs;
// - arguments rejected by recording an error, workspace bounds respected, and
//   the three ops captured in a CUDA graph;
// - the paged quantized pool (policy/quantization/quantized_paged.hpp) on the
//   device: the appended code bytes and Quest metadata bit-identical to the
//   host's, decode attention over the codes within 5e-5 relative + 2e-4
//   absolute of the scalar overload (the device attention's and the merge's
//   expf), the NaN / empty rules exactly, and the attention call captured in
//   a CUDA graph and replayed with the eager call's bits.
//
// Own main: without a usable CUDA device the program prints "SKIPPED: ..."
// and exits with 77, which ctest reports as skipped.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_test_util.hpp"
#include "kvpolicy/backends/cuda.hpp"
#include "kvpolicy/kvpolicy.hpp"
#include "kvpolicy/policy/quantization/fp8_quant.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/quantized_paged.hpp"

namespace kvp = kvpolicy;
using kvp::bfloat16;
using kvp::half;
using kvp::backend::Cuda;
using kvp::backend::Scalar;
using kvp_cuda_test::DeviceBuffer;
using kvp_cuda_test::run_ops;
using kvp_cuda_test::Stream;

static_assert(kvp::PageOps<Cuda, float, float> && kvp::PageOps<Cuda, half, half> && kvp::PageOps<Cuda, bfloat16, bfloat16>,
              "backend::Cuda models the page-op family for every key dtype");
static_assert(kvp::QuantizedPagedOps<Cuda>, "backend::Cuda has its own form of every op of the paged quantized pool");

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Tolerances of paged_decode_attention (see the file comment and page_ops.cu).
constexpr double kAttnRel = 2e-5;
constexpr double kAttnAbsPerValue = 2e-5;  // times max |v|
constexpr double kLseAbs = 2e-5;
double g_worst_ratio = 0.0;  // largest |err| / tolerance seen by check_attention (printed by main)

/// The status `f` records (the ops themselves return void).
template <class F>
kvp::Status recorded(const Stream& st, F&& f) {
  const Cuda::CallScope scope(st.s, 1);
  f();
  const kvp::Status s = scope.end();
  st.sync();
  return s;
}

template <class T>
const char* type_name() {
  return kvp::dtype_name(kvp::dtype_v<T>);
}

template <class T>
T from_f(float x) {
  return kvp::from_float<T>(x);
}

template <class T>
std::vector<T> random_elems(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = from_f<T>(nd(rng));
  return v;
}

template <class T>
std::uint32_t bits_of(const T& x) {
  if constexpr (std::is_same_v<T, float>) {
    std::uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  } else {
    return x.bits;
  }
}

/// Exact bit equality of two storage vectors.
template <class T>
void require_same_bits(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (bits_of(got[i]) != bits_of(want[i])) {
      INFO(what << "[" << i << "]: got " << kvp::to_float(got[i]) << " (0x" << std::hex << bits_of(got[i]) << "), want "
                << kvp::to_float(want[i]) << " (0x" << bits_of(want[i]) << std::dec << ")");
      REQUIRE(bits_of(got[i]) == bits_of(want[i]));
    }
  }
}

/// Bit equality of fp32 results whose NaNs come from arithmetic (any NaN matches any NaN).
void require_same_floats(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i]) && std::isnan(got[i])) continue;
    if (bits_of(got[i]) != bits_of(want[i])) {
      INFO(what << "[" << i << "]: got " << got[i] << " (0x" << std::hex << bits_of(got[i]) << "), want " << want[i] << " (0x"
                << bits_of(want[i]) << std::dec << ")");
      REQUIRE(bits_of(got[i]) == bits_of(want[i]));
    }
  }
}

// ---- page_meta_fold ---------------------------------------------------------------

/// Rows with specials: NaN components, signed zeros in both orders (the fold keeps the first of equal
/// values), infinities.
template <class Tk>
std::vector<Tk> fold_rows(std::int64_t num_rows, std::int64_t stride, std::int64_t d, std::mt19937& rng) {
  std::vector<Tk> rows = random_elems<Tk>(static_cast<std::size_t>(std::max<std::int64_t>(num_rows * stride, 1)), rng);
  for (std::int64_t r = 0; r < num_rows; ++r) {
    Tk* row = rows.data() + r * stride;
    for (std::int64_t c = d; c < stride; ++c) row[c] = from_f<Tk>(kNaN);  // padding: must never be read
    row[3] = from_f<Tk>(r % 2 == 0 ? 0.0f : -0.0f);
    row[4] = from_f<Tk>(r % 2 == 0 ? -0.0f : 0.0f);
    row[5] = from_f<Tk>(r % 3 == 1 ? kNaN : -0.0f);
    if (r % 7 == 2) row[(r * 13) % d] = from_f<Tk>(kNaN);
    if (r % 11 == 4) row[9] = from_f<Tk>(r % 2 == 0 ? kInf : -kInf);
    row[10] = from_f<Tk>(kNaN);  // an all-NaN channel: the metadata keeps its start value
  }
  return rows;
}

template <class Tk, class Tm>
void check_page_meta_fold(std::uint32_t seed) {
  INFO("Tk = " << type_name<Tk>() << ", Tm = " << type_name<Tm>());
  Stream st;
  std::mt19937 rng(seed);
  for (const std::int64_t d : {64, 128, 200}) {
    for (const std::int64_t num_rows : {0, 1, 5, 16, 37}) {
      INFO("head_dim " << d << ", num_rows " << num_rows);
      const std::int64_t stride = d + 24;
      // Metadata starts as garbage (fresh must ignore it), with a stored NaN and a stored -0.
      std::vector<Tm> mx = random_elems<Tm>(static_cast<std::size_t>(d), rng), mn = random_elems<Tm>(static_cast<std::size_t>(d), rng);
      mx[7] = mn[7] = from_f<Tm>(kNaN);
      DeviceBuffer dmx(mx), dmn(mn);

      // Fresh fold.
      const std::vector<Tk> rows = fold_rows<Tk>(num_rows, stride, d, rng);
      DeviceBuffer drows(rows);
      Scalar::page_meta_fold(rows.data(), stride, num_rows, d, mx.data(), mn.data(), /*fresh=*/true);
      run_ops(st, [&] { Cuda::page_meta_fold(drows.get<const Tk>(), stride, num_rows, d, dmx.get<Tm>(), dmn.get<Tm>(), true); });
      require_same_bits(dmx.download<Tm>(static_cast<std::size_t>(d)), mx, "fresh max");
      require_same_bits(dmn.download<Tm>(static_cast<std::size_t>(d)), mn, "fresh min");

      // Resumed fold on top of it (stored NaN, stored signed zeros), with a different row count.
      mx[7] = mn[7] = from_f<Tm>(kNaN);
      mx[11] = mn[11] = from_f<Tm>(-0.0f);
      mx[12] = from_f<Tm>(kInf);
      mn[12] = from_f<Tm>(-kInf);
      dmx.upload(mx);
      dmn.upload(mn);
      const std::int64_t more = num_rows == 0 ? 3 : num_rows + 4;
      const std::vector<Tk> rows2 = fold_rows<Tk>(more, stride, d, rng);
      DeviceBuffer drows2(rows2);
      Scalar::page_meta_fold(rows2.data(), stride, more, d, mx.data(), mn.data(), /*fresh=*/false);
      run_ops(st, [&] { Cuda::page_meta_fold(drows2.get<const Tk>(), stride, more, d, dmx.get<Tm>(), dmn.get<Tm>(), false); });
      require_same_bits(dmx.download<Tm>(static_cast<std::size_t>(d)), mx, "resumed max");
      require_same_bits(dmn.download<Tm>(static_cast<std::size_t>(d)), mn, "resumed min");

      // Resuming with no rows rewrites the stored values unchanged (NaN quieted as the reference does).
      Scalar::page_meta_fold(rows2.data(), stride, 0, d, mx.data(), mn.data(), false);
      run_ops(st, [&] { Cuda::page_meta_fold(drows2.get<const Tk>(), stride, 0, d, dmx.get<Tm>(), dmn.get<Tm>(), false); });
      require_same_bits(dmx.download<Tm>(static_cast<std::size_t>(d)), mx, "empty resume max");
      require_same_bits(dmn.download<Tm>(static_cast<std::size_t>(d)), mn, "empty resume min");
    }
  }
}

// ---- page_bounds ----------------------------------------------------------------

template <class Tm>
void check_page_bounds(std::uint32_t seed) {
  INFO("Tm = " << type_name<Tm>());
  Stream st;
  std::mt19937 rng(seed);
  constexpr std::int32_t P = 50;  // pool pages
  struct Shape {
    std::int32_t heads;
    std::int64_t group;
  };
  for (const Shape sh : {Shape{2, 1}, Shape{2, 4}, Shape{3, 12}}) {
    for (const std::int32_t d : {64, 128, 200}) {
      for (const bool packed : {true, false}) {
        INFO("kv heads " << sh.heads << ", group " << sh.group << ", head_dim " << d << ", packed " << packed);
        const std::int32_t H = sh.heads;
        const std::int64_t G = sh.group, rows = H * G;
        // Metadata: packed (num_pages, heads, 2, d), or separate max / min buffers with padded strides.
        const std::int64_t head_stride = packed ? 2 * d : d + 8;
        const std::int64_t page_stride = packed ? 2 * d * H : H * head_stride + 16;
        const std::size_t elems = static_cast<std::size_t>(P * page_stride + 2 * d);
        std::vector<Tm> hmeta = random_elems<Tm>(elems, rng), hmin_sep = random_elems<Tm>(packed ? 0 : elems, rng);
        for (std::size_t i = 0; i < elems; i += 97) hmeta[i] = from_f<Tm>(i % 2 ? kNaN : kInf);
        DeviceBuffer dmeta(hmeta), dmin_sep(hmin_sep);
        kvp::PageMetaView<const Tm> hv, dv;
        if (packed) {
          hv = kvp::PageMetaView<const Tm>::contiguous(hmeta.data(), P, H, d);
          dv = kvp::PageMetaView<const Tm>::contiguous(dmeta.get<const Tm>(), P, H, d);
        } else {
          hv = kvp::PageMetaView<const Tm>{hmeta.data(), hmin_sep.data(), page_stride, head_stride, P, H, d, kvp::kHost};
          dv = kvp::PageMetaView<const Tm>{dmeta.get<const Tm>(), dmin_sep.get<const Tm>(), page_stride, head_stride, P, H, d, kvp::kHost};
        }
        std::vector<float> q = random_elems<float>(static_cast<std::size_t>(rows * d), rng);
        q[static_cast<std::size_t>(d + 5)] = kNaN;  // one NaN query component (row 1)
        q[static_cast<std::size_t>(2 * d + 1)] = kInf;
        DeviceBuffer dq(q);

        std::vector<std::int32_t> perm(P);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        const std::vector<std::int32_t> list(perm.begin(), perm.begin() + 37);  // scattered pages, 13 spare
        DeviceBuffer dlist(list);

        for (const bool use_list : {false, true}) {
          INFO("page list " << use_list);
          const std::int64_t n = use_list ? static_cast<std::int64_t>(list.size()) : P;
          const std::int64_t ld = n + 3;
          const std::vector<float> init(static_cast<std::size_t>(rows * ld), 12345.0f);  // the padding must stay
          std::vector<float> ref = init;
          Scalar::page_bounds<Tm>(q.data(), G, d, hv, use_list ? list.data() : nullptr, n, ref.data(), ld, kvp::Workspace{});
          DeviceBuffer dout(init);
          const std::size_t wsb = Cuda::page_bounds_workspace(rows, d);
          DeviceBuffer dws(wsb);
          run_ops(st, [&] {
            Cuda::page_bounds<Tm>(dq.get<const float>(), G, d, dv, use_list ? dlist.get<const std::int32_t>() : nullptr, n,
                                  dout.get<float>(), ld, kvp::Workspace{dws.get(), wsb});
          });
          require_same_floats(dout.download<float>(init.size()), ref, "bounds");

          // One kv head alone through head_view (q and out of that head only).
          for (std::int32_t g = 0; g < H; ++g) {
            INFO("head_view " << g);
            std::vector<float> ref1(static_cast<std::size_t>(G * ld), -1.0f);
            Scalar::page_bounds<Tm>(q.data() + g * G * d, G, d, hv.head_view(g), use_list ? list.data() : nullptr, n, ref1.data(), ld,
                                    kvp::Workspace{});
            DeviceBuffer dout1(std::vector<float>(ref1.size(), -1.0f));
            run_ops(st, [&] {
              Cuda::page_bounds<Tm>(dq.get<const float>() + g * G * d, G, d, dv.head_view(g),
                                    use_list ? dlist.get<const std::int32_t>() : nullptr, n, dout1.get<float>(), ld, kvp::Workspace{});
            });
            require_same_floats(dout1.download<float>(ref1.size()), ref1, "head_view bounds");
          }
        }
      }
    }
  }
}

// ---- paged_decode_attention ---------------------------------------------------------

enum class Special {
  kNone,
  kNegInfPrefix,         // logits -inf on [0, A), A mid-block; NaN / inf values in it (some in the block of A)
  kNegInfPrefixAligned,  // the same with A on a block boundary
  kNegInfGap,            // finite, then -inf over several whole blocks (and splits), then finite; NaN values in the gap
  kNegInfSuffix,         // finite, then -inf to the end; NaN values in the -inf part
  kAllNegInf,            // every logit -inf (NaN values too): out 0, lse -inf
  kPosInfLogit,          // one +inf logit: every head NaN
  kNaNKey,               // a NaN key component late in the sequence: every head NaN
  kNaNQuery,             // a NaN in query head 1 only
  kNaNValue,             // a NaN value component of a finite-logit row: that channel NaN
};

const char* special_name(Special s) {
  switch (s) {
    case Special::kNone: return "none";
    case Special::kNegInfPrefix: return "-inf prefix";
    case Special::kNegInfPrefixAligned: return "-inf prefix (block-aligned)";
    case Special::kNegInfGap: return "-inf gap";
    case Special::kNegInfSuffix: return "-inf suffix";
    case Special::kAllNegInf: return "all -inf";
    case Special::kPosInfLogit: return "+inf logit";
    case Special::kNaNKey: return "NaN key";
    case Special::kNaNQuery: return "NaN query";
    case Special::kNaNValue: return "NaN value";
  }
  return "?";
}

struct AttnCase {
  std::int64_t group = 1;
  std::int64_t head_dim = 64;
  std::int64_t num_tokens = 0;
  std::int32_t page_size = 0;  // 0: contiguous rows
  bool with_lse = true;
  Special special = Special::kNone;
  std::uint32_t seed = 1;
};

/// Keys and values of one kv head with the same logical rows in the host copy and the device copy: a
/// contiguous run with padded rows, or pages of a pool (padded slots and pages, a shuffled page list,
/// spare pages). Every element that is not a logical row's component is NaN, so a read past num_tokens or
/// into padding shows up as a NaN the reference does not have.
template <class T>
struct RowStore {
  std::vector<T> host;
  std::int64_t row_stride = 0, page_stride = 0;
  std::int32_t page_size = 0;
  std::vector<std::int64_t> row_offset;  // logical row -> element offset

  RowStore(std::int64_t n, std::int64_t d, std::int32_t ps, const std::vector<std::int32_t>& pages, std::int32_t pool_pages,
           std::int64_t pad) {
    page_size = ps;
    row_stride = d + pad;
    if (ps == 0) {
      host.assign(static_cast<std::size_t>((n + 1) * row_stride), from_f<T>(kNaN));
      for (std::int64_t j = 0; j < n; ++j) row_offset.push_back(j * row_stride);
    } else {
      page_stride = ps * row_stride + 2 * pad + 1;
      host.assign(static_cast<std::size_t>(pool_pages * page_stride), from_f<T>(kNaN));
      for (std::int64_t j = 0; j < n; ++j)
        row_offset.push_back(pages[static_cast<std::size_t>(j / ps)] * page_stride + (j % ps) * row_stride);
    }
  }
  T* row(std::int64_t j) { return host.data() + row_offset[static_cast<std::size_t>(j)]; }
  kvp::Rows<T> rows(const T* base, const std::int32_t* pages) const {
    return page_size == 0 ? kvp::Rows<T>{base, row_stride, nullptr, 0, 0} : kvp::Rows<T>{base, row_stride, pages, page_stride, page_size};
  }
};

template <class Tk, class Tv>
void check_attention(const Stream& st, const AttnCase& tc) {
  const std::int64_t G = tc.group, d = tc.head_dim, n = tc.num_tokens;
  INFO("Tk = " << type_name<Tk>() << ", Tv = " << type_name<Tv>() << ", group " << G << ", head_dim " << d << ", num_tokens " << n
               << ", page_size " << tc.page_size << ", lse " << tc.with_lse << ", special " << special_name(tc.special));
  std::mt19937 rng(tc.seed);
  const std::int32_t ps = tc.page_size;
  const std::int64_t block = ps == 0 ? 64 : ps;
  std::vector<std::int32_t> pages;
  std::int32_t pool_pages = 0;
  if (ps > 0) {
    const auto used = static_cast<std::int32_t>((n + ps - 1) / ps);
    pool_pages = used + 3;
    std::vector<std::int32_t> perm(static_cast<std::size_t>(pool_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    pages.assign(perm.begin(), perm.begin() + used + 1);  // one entry more than needed (never read): never empty
  }
  RowStore<Tk> keys(n, d, ps, pages, pool_pages, 8);
  RowStore<Tv> vals(n, d, ps, pages, pool_pages, 4);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  float vmax = 0.0f;
  for (std::int64_t j = 0; j < n; ++j) {
    for (std::int64_t c = 0; c < d; ++c) {
      keys.row(j)[c] = from_f<Tk>(nd(rng));
      vals.row(j)[c] = from_f<Tv>(nd(rng));
      vmax = std::max(vmax, std::fabs(kvp::to_float(vals.row(j)[c])));
    }
  }
  std::vector<float> q = random_elems<float>(static_cast<std::size_t>(G * d), rng);

  // Specials. -inf logits come from key channel 0 = -inf with every head's q[0] > 0.
  const auto neg_inf_row = [&](std::int64_t j) {
    if (j >= 0 && j < n && d > 0) keys.row(j)[0] = from_f<Tk>(-kInf);
  };
  const auto poison_value = [&](std::int64_t j, float x) {
    if (j >= 0 && j < n && d > 0) vals.row(j)[(j * 7 + 3) % d] = from_f<Tv>(x);
  };
  if (tc.special != Special::kNone && d > 0) {
    for (std::int64_t g = 0; g < G; ++g) q[static_cast<std::size_t>(g * d)] = 0.5f + std::fabs(q[static_cast<std::size_t>(g * d)]);
  }
  switch (tc.special) {
    case Special::kNone: break;
    case Special::kNegInfPrefix:
    case Special::kNegInfPrefixAligned: {
      std::int64_t a = n * 3 / 5 + 1;
      if (tc.special == Special::kNegInfPrefixAligned) a = std::max<std::int64_t>(block, (n / 2) / block * block);
      for (std::int64_t j = 0; j < std::min(a, n); ++j) neg_inf_row(j);
      for (const std::int64_t j : {std::int64_t{0}, std::int64_t{3}, a / 2, a - 2, a - 1}) poison_value(j, kNaN);
      poison_value(a / 3, kInf);
      neg_inf_row(a + 5);  // scattered -inf after the first finite logit, with non-finite values
      poison_value(a + 5, kNaN);
      neg_inf_row(n - 2);
      poison_value(n - 2, -kInf);
      break;
    }
    case Special::kNegInfGap:
    case Special::kNegInfSuffix: {
      const std::int64_t b = n * 3 / 10, e = tc.special == Special::kNegInfGap ? n * 7 / 10 : n;
      for (std::int64_t j = b; j < e; ++j) neg_inf_row(j);
      for (std::int64_t j = b; j < e; j += std::max<std::int64_t>(1, (e - b) / 9)) poison_value(j, j % 2 ? kNaN : kInf);
      poison_value(e - 1, kNaN);
      break;
    }
    case Special::kAllNegInf:
      for (std::int64_t j = 0; j < n; ++j) neg_inf_row(j);
      poison_value(n / 2, kNaN);
      poison_value(n - 1, kInf);
      break;
    case Special::kPosInfLogit:
      if (n > 0 && d > 0) keys.row(n / 2)[0] = from_f<Tk>(kInf);
      break;
    case Special::kNaNKey:
      if (n > 0 && d > 0) keys.row(n - 1)[d / 2] = from_f<Tk>(kNaN);
      break;
    case Special::kNaNQuery:
      if (G > 1 && d > 0) q[static_cast<std::size_t>(d + d / 3)] = kNaN;
      break;
    case Special::kNaNValue:
      if (n > 0 && d > 0) vals.row(n / 3)[d - 1] = from_f<Tv>(kNaN);
      break;
  }

  // Reference.
  const kvp::Rows<Tk> hk = keys.rows(keys.host.data(), pages.data());
  const kvp::Rows<Tv> hvr = vals.rows(vals.host.data(), pages.data());
  std::vector<std::byte> hws(Scalar::paged_attention_workspace(G, Scalar::attention_block(hk), d));
  std::vector<float> ref_out(static_cast<std::size_t>(G * d), -7.0f), ref_lse(static_cast<std::size_t>(G), -7.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d > 0 ? d : 1));
  Scalar::paged_decode_attention(q.data(), G, d, hk, hvr, n, scale, ref_out.data(), ref_lse.data(), kvp::Workspace{hws.data(), hws.size()});

  // Device: outputs and workspace with guard bytes after them (must stay untouched).
  constexpr std::size_t kGuard = 64;
  DeviceBuffer dk(keys.host), dv(vals.host), dq(q), dpages(pages);
  const kvp::Rows<Tk> dkr = keys.rows(dk.get<const Tk>(), dpages.get<const std::int32_t>());
  const kvp::Rows<Tv> dvr = vals.rows(dv.get<const Tv>(), dpages.get<const std::int32_t>());
  REQUIRE(Cuda::attention_block(dkr) == block);
  const std::size_t wsb = Cuda::paged_attention_workspace(G, Cuda::attention_block(dkr), d);
  DeviceBuffer dws(wsb + kGuard);
  CUDA_REQUIRE(cudaMemset(dws.get(), 0xab, wsb + kGuard));
  const std::vector<float> out_init(static_cast<std::size_t>(G * d) + kGuard, kNaN);
  DeviceBuffer dout(out_init), dlse(std::vector<float>(static_cast<std::size_t>(G) + kGuard, kNaN));
  run_ops(st, [&] {
    Cuda::paged_decode_attention(dq.get<const float>(), G, d, dkr, dvr, n, scale, dout.get<float>(),
                                 tc.with_lse ? dlse.get<float>() : nullptr, kvp::Workspace{dws.get(), wsb});
  });
  const std::vector<float> out = dout.download<float>(out_init.size()), lse = dlse.download<float>(static_cast<std::size_t>(G) + kGuard);
  const std::vector<unsigned char> ws_after = dws.download<unsigned char>(wsb + kGuard);
  for (std::size_t i = wsb; i < wsb + kGuard; ++i) REQUIRE(ws_after[i] == 0xab);
  for (std::size_t i = static_cast<std::size_t>(G * d); i < out.size(); ++i) REQUIRE(std::isnan(out[i]));
  for (std::size_t i = static_cast<std::size_t>(G); i < lse.size(); ++i) REQUIRE(std::isnan(lse[i]));

  const double abs_tol = kAttnAbsPerValue * std::max(1.0f, vmax);
  // NaN and inf as the reference has them; finite values within kAttnRel relative + `abs`.
  const auto require_close = [](float x, float r, double abs) {
    if (std::isnan(r)) {
      REQUIRE(std::isnan(x));
    } else if (std::isinf(r)) {
      REQUIRE(x == r);
    } else {
      REQUIRE(std::isfinite(x));
      const double tol = kAttnRel * std::fabs(r) + abs;
      g_worst_ratio = std::max(g_worst_ratio, std::fabs(static_cast<double>(x) - r) / tol);
      REQUIRE(std::fabs(static_cast<double>(x) - r) <= tol);
    }
  };
  for (std::int64_t g = 0; g < G; ++g) {
    for (std::int64_t c = 0; c < d; ++c) {
      const float r = ref_out[static_cast<std::size_t>(g * d + c)], x = out[static_cast<std::size_t>(g * d + c)];
      INFO("out[" << g << "][" << c << "]: cuda " << x << ", scalar " << r);
      require_close(x, r, abs_tol);
    }
    if (tc.with_lse) {
      const float r = ref_lse[static_cast<std::size_t>(g)], x = lse[static_cast<std::size_t>(g)];
      INFO("lse[" << g << "]: cuda " << x << ", scalar " << r);
      require_close(x, r, kLseAbs);
    }
  }
}

}  // namespace

TEST_CASE("cuda page_meta_fold is bit-identical to Scalar (dtype pairs, fresh and resumed, strides, NaN, signed zeros)",
          "[cuda][pages][meta]") {
  check_page_meta_fold<float, float>(1);
  check_page_meta_fold<half, half>(2);
  check_page_meta_fold<half, float>(3);
  check_page_meta_fold<bfloat16, bfloat16>(4);
  check_page_meta_fold<bfloat16, float>(5);
}

TEST_CASE("cuda page_bounds is bit-identical to Scalar (page lists, groups, head_view, strided metadata, NaN)", "[cuda][pages][bounds]") {
  check_page_bounds<float>(11);
  check_page_bounds<half>(12);
  check_page_bounds<bfloat16>(13);
}

TEST_CASE("cuda paged_decode_attention matches Scalar over contiguous and paged rows", "[cuda][pages][attention]") {
  Stream st;
  std::uint32_t seed = 100;
  for (const std::int32_t ps : {0, 16, 5}) {
    for (const std::int64_t n : {0, 1, 17, 1000, 5000}) {
      for (const std::int64_t group : {1, 4, 8, 12}) {
        for (const std::int64_t d : {64, 128}) {
          const AttnCase tc{group, d, n, ps, (seed % 2) == 0, Special::kNone, ++seed};
          check_attention<half, half>(st, tc);
          if (n <= 1000) {
            check_attention<float, float>(st, tc);
            check_attention<bfloat16, bfloat16>(st, tc);
          }
        }
      }
    }
  }
}

TEST_CASE("cuda paged_decode_attention: every key / value dtype pair", "[cuda][pages][attention]") {
  Stream st;
  for (const std::int32_t ps : {0, 16}) {
    const AttnCase tc{4, 128, ps == 0 ? 333 : 1000, ps, true, Special::kNone, 7u + static_cast<std::uint32_t>(ps)};
    check_attention<float, float>(st, tc);
    check_attention<float, half>(st, tc);
    check_attention<float, bfloat16>(st, tc);
    check_attention<half, float>(st, tc);
    check_attention<half, half>(st, tc);
    check_attention<half, bfloat16>(st, tc);
    check_attention<bfloat16, float>(st, tc);
    check_attention<bfloat16, half>(st, tc);
    check_attention<bfloat16, bfloat16>(st, tc);
  }
}

TEST_CASE("cuda paged_decode_attention: unusual shapes (large head_dim, page size 1, pages longer than 512 rows, group 20)",
          "[cuda][pages][attention]") {
  Stream st;
  check_attention<half, half>(st, AttnCase{4, 300, 777, 16, true, Special::kNone, 21});
  check_attention<float, float>(st, AttnCase{2, 640, 300, 0, true, Special::kNone, 22});
  check_attention<half, half>(st, AttnCase{3, 96, 200, 1, true, Special::kNone, 23});
  check_attention<half, half>(st, AttnCase{4, 64, 2000, 600, true, Special::kNone, 24});
  check_attention<float, float>(st, AttnCase{20, 64, 1500, 32, true, Special::kNone, 25});
  check_attention<half, half>(st, AttnCase{1, 128, 40000, 16, true, Special::kNone, 26});
  check_attention<float, float>(st, AttnCase{2, 0, 10, 0, true, Special::kNone, 27});
}

TEST_CASE("cuda paged_decode_attention: NaN, -inf and empty behave exactly as Scalar", "[cuda][pages][attention][nan]") {
  Stream st;
  const Special specials[] = {Special::kNegInfPrefix, Special::kNegInfPrefixAligned, Special::kNegInfGap, Special::kNegInfSuffix,
                              Special::kAllNegInf,    Special::kPosInfLogit,         Special::kNaNKey,    Special::kNaNQuery,
                              Special::kNaNValue};
  std::uint32_t seed = 500;
  for (const Special sp : specials) {
    for (const std::int32_t ps : {0, 16, 1}) {
      for (const std::int64_t n : {1, 17, 1000, 3000}) {
        const AttnCase tc{4, 64, n, ps, true, sp, ++seed};
        check_attention<float, float>(st, tc);
        check_attention<half, half>(st, tc);
        check_attention<bfloat16, float>(st, AttnCase{1, 128, n, ps, false, sp, ++seed});
      }
    }
  }
}

TEST_CASE("cuda page ops record invalid arguments and enqueue nothing for empty work", "[cuda][pages][args]") {
  Stream st;
  DeviceBuffer buf(std::size_t{1} << 16);
  float* f = buf.get<float>();
  const kvp::Rows<float> rows{f, 64, nullptr, 0, 0};
  // Empty work: nothing to do, nothing recorded, even with null pointers.
  KVP_REQUIRE_OK(recorded(st, [&] {
    Cuda::page_meta_fold<float, float>(nullptr, 64, 3, 0, nullptr, nullptr, true);
    Cuda::page_bounds<float>(nullptr, 4, 64, kvp::PageMetaView<const float>{}, nullptr, 0, nullptr, 0, kvp::Workspace{});
    Cuda::paged_decode_attention<float, float>(nullptr, 0, 64, rows, rows, 10, 1.0f, nullptr, nullptr, kvp::Workspace{});
  }));
  // Null pointers with work to do.
  REQUIRE(recorded(st, [&] { Cuda::page_meta_fold<float, float>(f, 64, 3, 64, nullptr, f, true); }).code() ==
          kvp::StatusCode::kInvalidArgument);
  REQUIRE(recorded(st, [&] { Cuda::page_meta_fold<float, float>(nullptr, 64, 3, 64, f, f + 64, true); }).code() ==
          kvp::StatusCode::kInvalidArgument);
  const auto meta = kvp::PageMetaView<const float>::contiguous(f, 4, 1, 64);
  REQUIRE(recorded(st, [&] { Cuda::page_bounds<float>(f, 1, 64, meta, nullptr, 4, nullptr, 4, kvp::Workspace{}); }).code() ==
          kvp::StatusCode::kInvalidArgument);
  REQUIRE(recorded(st, [&] {
            Cuda::paged_decode_attention<float, float>(f, 1, 64, kvp::Rows<float>{}, rows, 10, 1.0f, f, f, kvp::Workspace{f, 1 << 16});
          }).code() == kvp::StatusCode::kInvalidArgument);
  // A workspace below paged_attention_workspace.
  const std::size_t need = Cuda::paged_attention_workspace(1, 64, 64);
  REQUIRE(need > 0);
  DeviceBuffer ws(need);
  REQUIRE(recorded(st, [&] {
            Cuda::paged_decode_attention<float, float>(f, 1, 64, rows, rows, 10, 1.0f, f, nullptr, kvp::Workspace{ws.get(), need - 1});
          }).code() == kvp::StatusCode::kWorkspaceTooSmall);
  // No tokens: no workspace needed; out 0 and lse -inf.
  DeviceBuffer out(std::vector<float>(65, kNaN));
  run_ops(st, [&] {
    Cuda::paged_decode_attention<float, float>(f, 1, 64, rows, rows, 0, 1.0f, out.get<float>(), out.get<float>() + 64, kvp::Workspace{});
  });
  const std::vector<float> o = out.download<float>(65);
  for (int c = 0; c < 64; ++c) REQUIRE(o[static_cast<std::size_t>(c)] == 0.0f);
  REQUIRE(o[64] == -kInf);
}

TEST_CASE("cuda page ops can be captured in a CUDA graph", "[cuda][pages][graph]") {
  Stream st;
  std::mt19937 rng(77);
  const std::int64_t d = 128, G = 4, n = 700;
  const std::int32_t ps = 16, P = 50;
  // Keys as pages of a pool; metadata folded per page; bounds of every page; attention over all pages.
  const std::vector<half> pool = random_elems<half>(static_cast<std::size_t>(P * ps * d), rng);
  const std::vector<float> q = random_elems<float>(static_cast<std::size_t>(G * d), rng);
  std::vector<std::int32_t> pages(static_cast<std::size_t>((n + ps - 1) / ps));
  std::iota(pages.begin(), pages.end(), 3);
  DeviceBuffer dpool(pool), dq(q), dpages(pages), dmeta(static_cast<std::size_t>(2 * P * d) * sizeof(half));
  DeviceBuffer dbounds(static_cast<std::size_t>(G * P) * sizeof(float)), dout(static_cast<std::size_t>(G * d) * sizeof(float)),
      dlse(static_cast<std::size_t>(G) * sizeof(float));
  const kvp::Rows<half> rows{dpool.get<const half>(), d, dpages.get<const std::int32_t>(), ps * d, ps};
  const std::size_t wsb = std::max(Cuda::paged_attention_workspace(G, ps, d), Cuda::page_bounds_workspace(G, d));
  DeviceBuffer dws(wsb);
  const auto meta = kvp::PageMetaView<half>::contiguous(dmeta.get<half>(), P, 1, static_cast<std::int32_t>(d));
  const auto enqueue = [&] {
    for (std::int32_t p = 0; p < P; ++p)
      Cuda::page_meta_fold<half, half>(dpool.get<const half>() + p * ps * d, d, ps, d, meta.max_row(p, 0), meta.min_row(p, 0), true);
    Cuda::page_bounds<half>(dq.get<const float>(), G, d, meta, nullptr, P, dbounds.get<float>(), P, kvp::Workspace{dws.get(), wsb});
    Cuda::paged_decode_attention<half, half>(dq.get<const float>(), G, d, rows, rows, n, 0.1f, dout.get<float>(), dlse.get<float>(),
                                             kvp::Workspace{dws.get(), wsb});
  };
  run_ops(st, enqueue);
  const std::vector<float> bounds1 = dbounds.download<float>(static_cast<std::size_t>(G * P)),
                           out1 = dout.download<float>(static_cast<std::size_t>(G * d)),
                           lse1 = dlse.download<float>(static_cast<std::size_t>(G));
  CUDA_REQUIRE(cudaMemset(dbounds.get(), 0, dbounds.bytes()));
  CUDA_REQUIRE(cudaMemset(dout.get(), 0, dout.bytes()));
  CUDA_REQUIRE(cudaMemset(dmeta.get(), 0, dmeta.bytes()));

  cudaGraph_t graph = nullptr;
  CUDA_REQUIRE(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
  {
    const Cuda::CallScope scope(st.s, 1);
    enqueue();
    KVP_REQUIRE_OK(scope.end());
  }
  CUDA_REQUIRE(cudaStreamEndCapture(st.s, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_REQUIRE(cudaGraphLaunch(exec, st.s));
  st.sync();
  // Same kernels, same inputs: identical results.
  require_same_floats(dbounds.download<float>(static_cast<std::size_t>(G * P)), bounds1, "graph bounds");
  require_same_floats(dout.download<float>(static_cast<std::size_t>(G * d)), out1, "graph out");
  require_same_floats(dlse.download<float>(static_cast<std::size_t>(G)), lse1, "graph lse");
  CUDA_REQUIRE(cudaGraphExecDestroy(exec));
  CUDA_REQUIRE(cudaGraphDestroy(graph));
}

namespace {

/// Two sequences (1100 tokens: two 1024-row device chunks at P = 16; and 29) over a shuffled page list: the
/// device path of the paged quantized pool against the host path.
template <class Q>
void check_quantized_pool(const Q& q, kvp::PageLayout layout, const char* name) {
  INFO(name << (layout == kvp::PageLayout::kHND ? " HND" : " NHD"));
  constexpr std::int32_t H = 2, P = 16;
  constexpr std::int64_t d = 128, G = 5;
  const kvp::Device gpu{kvp::DeviceType::kCUDA, 0};
  const std::int64_t lens[2] = {1100, 29};
  const std::int32_t np0 = 69, np1 = 2, pages = np0 + np1 + 3;
  std::vector<std::int32_t> ids(pages);
  for (std::int32_t i = 0; i < pages; ++i) ids[static_cast<std::size_t>(i)] = (i * 31 + 5) % pages;
  std::vector<std::int32_t> indptr{0, np0, np0 + np1}, indices(ids.begin(), ids.begin() + np0 + np1), last{1100 - 68 * P, 29 - P};
  const kvp::PageTable htable{indptr.data(), indices.data(), last.data(), 2};
  DeviceBuffer dindices(indices);
  const kvp::PageTable dtable{indptr.data(), dindices.get<const std::int32_t>(), last.data(), 2};
  const std::int64_t rb = q.row_bytes(d);
  const kvp::PageStrides cs = kvp::PageStrides::contiguous(layout, H, P, rb);
  std::vector<std::uint8_t> hk(static_cast<std::size_t>(pages * H * P * rb), 0x5A), hv(hk.size(), 0xA5);
  DeviceBuffer dk(hk), dv(hv);
  const kvp::PagedKVView<std::uint8_t> host{hk.data(), hv.data(), cs, cs, pages, H, P, static_cast<std::int32_t>(rb), htable, {}};
  const kvp::PagedKVView<std::uint8_t> dev{
      dk.get<std::uint8_t>(), dv.get<std::uint8_t>(), cs, cs, pages, H, P, static_cast<std::int32_t>(rb), dtable, gpu};
  const Stream st;
  DeviceBuffer aws(kvp::quantize_paged_append_workspace<Cuda>(q, P, d, H));
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  const auto append = [&](std::int32_t b, std::int64_t n) {
    for (const bool values : {false, true}) {
      std::vector<float> x(static_cast<std::size_t>(H * n * d));
      for (auto& e : x) e = nd(rng);
      DeviceBuffer dx(x);
      KVP_REQUIRE_OK(kvp::quantize_paged_append(q, host, b, kvp::TensorView<const float, 3>::contiguous(x.data(), {H, n, d}), values));
      KVP_REQUIRE_OK(kvp::quantize_paged_append(kvp::Context<Cuda>{aws.workspace(), {}, st.s}, q, dev, b,
                                                kvp::TensorView<const float, 3>::contiguous(dx.get<const float>(), {H, n, d}, gpu),
                                                values));
      st.sync();
    }
    REQUIRE(dk.download<std::uint8_t>(hk.size()) == hk);
    REQUIRE(dv.download<std::uint8_t>(hv.size()) == hv);
  };
  append(0, lens[0]);
  append(1, lens[1]);
  append(0, 37);  // a run that starts inside a page

  // Metadata: every page, then the tail of each sequence folded into what the pages hold.
  const kvp::PagedKVView<const std::uint8_t> hc = host, dc = dev;
  const std::size_t msize = static_cast<std::size_t>(kvp::PageMetaView<float>::contiguous_size(pages, H, d));
  std::vector<float> hm(msize, 3.0f);
  DeviceBuffer dm(hm);
  const auto hmeta = kvp::PageMetaView<float>::contiguous(hm.data(), pages, H, static_cast<std::int32_t>(d));
  const auto dmeta = kvp::PageMetaView<float>::contiguous(dm.get<float>(), pages, H, static_cast<std::int32_t>(d), gpu);
  std::vector<std::byte> hws(kvp::quantized_page_meta_workspace<Scalar>(q, P, d, H));
  DeviceBuffer mws(kvp::quantized_page_meta_workspace<Cuda>(q, P, d, H));
  KVP_REQUIRE_OK(kvp::quantized_page_meta_append(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}}, q, hc, d, nullptr, hmeta));
  KVP_REQUIRE_OK(kvp::quantized_page_meta_append(kvp::Context<Cuda>{mws.workspace(), {}, st.s}, q, dc, d, nullptr, dmeta));
  st.sync();
  REQUIRE(dm.download<float>(msize) == hm);
  std::fill(hm.begin(), hm.end(), 1.0f);
  dm.upload(hm);
  const std::int32_t tail[2] = {37, 29};
  KVP_REQUIRE_OK(kvp::quantized_page_meta_append(kvp::Context<Scalar>{kvp::Workspace{hws.data(), hws.size()}}, q, hc, d, tail, hmeta));
  KVP_REQUIRE_OK(kvp::quantized_page_meta_append(kvp::Context<Cuda>{mws.workspace(), {}, st.s}, q, dc, d, tail, dmeta));
  st.sync();
  REQUIRE(dm.download<float>(msize) == hm);

  // Decode attention of a G-query group over each sequence's pages (two chunks for sequence 0).
  std::vector<float> qv(static_cast<std::size_t>(G * d));
  for (auto& x : qv) x = nd(rng);
  DeviceBuffer dq(qv), dout(static_cast<std::size_t>(G * d) * sizeof(float)), dlse(static_cast<std::size_t>(G) * sizeof(float));
  std::vector<std::byte> sws(kvp::quantized_paged_workspace(P, d, G));
  DeviceBuffer ews(kvp::quantized_paged_attention_workspace<Cuda>(q, P, d, G));
  const auto attend = [&](std::int32_t b, std::int32_t h, std::int64_t n, const DeviceBuffer& queries) {
    KVP_REQUIRE_OK(kvp::quantized_paged_decode_attention(kvp::Context<Cuda>{ews.workspace(), {}, st.s}, q, q, dc, h,
                                                         dindices.get<const std::int32_t>() + indptr[static_cast<std::size_t>(b)], n,
                                                         queries.get<const float>(), G, d, 0.125f, dout.get<float>(), dlse.get<float>()));
    st.sync();
  };
  for (std::int32_t b = 0; b < 2; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (const std::int64_t n : {lens[b], std::int64_t{17}, std::int64_t{0}}) {
        INFO("sequence " << b << " head " << h << " tokens " << n);
        std::vector<float> o1(static_cast<std::size_t>(G * d)), l1(G);
        KVP_REQUIRE_OK(kvp::quantized_paged_decode_attention(q, q, hc, h, indices.data() + indptr[static_cast<std::size_t>(b)], n,
                                                             qv.data(), G, d, 0.125f, o1.data(), l1.data(),
                                                             kvp::Workspace{sws.data(), sws.size()}));
        attend(b, h, n, dq);
        const auto o2 = dout.download<float>(o1.size()), l2 = dlse.download<float>(l1.size());
        for (std::size_t i = 0; i < o1.size(); ++i) REQUIRE(std::fabs(o2[i] - o1[i]) <= 5e-5 * std::fabs(o1[i]) + 2e-4);
        for (std::size_t i = 0; i < l1.size(); ++i) {
          if (n == 0) {
            REQUIRE((l2[i] == -kInf && l1[i] == -kInf));
            continue;
          }
          REQUIRE(std::fabs(l2[i] - l1[i]) <= 5e-5 * std::fabs(l1[i]) + 5e-5);
        }
      }
  // A NaN query head: its output and lse NaN, the others finite.
  std::vector<float> qn = qv;
  qn[static_cast<std::size_t>(3 * d + 1)] = kNaN;
  DeviceBuffer dqn(qn);
  attend(0, 1, lens[0], dqn);
  const auto o = dout.download<float>(static_cast<std::size_t>(G * d)), l = dlse.download<float>(G);
  for (std::int64_t g = 0; g < G; ++g) {
    REQUIRE(std::isnan(l[static_cast<std::size_t>(g)]) == (g == 3));
    REQUIRE(std::isnan(o[static_cast<std::size_t>(g * d + 7)]) == (g == 3));
  }
  // The attention call captured in a CUDA graph (no allocation, synchronisation or copy inside it) and
  // replayed: the eager call's bits.
  attend(0, 0, lens[0], dq);
  const auto eager_o = dout.download<float>(static_cast<std::size_t>(G * d)), eager_l = dlse.download<float>(G);
  CUDA_REQUIRE(cudaMemsetAsync(dout.get(), 0, dout.bytes(), st.s));
  st.sync();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_REQUIRE(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
  const kvp::Status cs_status =
      kvp::quantized_paged_decode_attention(kvp::Context<Cuda>{ews.workspace(), {}, st.s}, q, q, dc, 0, dindices.get<const std::int32_t>(),
                                            lens[0], dq.get<const float>(), G, d, 0.125f, dout.get<float>(), dlse.get<float>());
  CUDA_REQUIRE(cudaStreamEndCapture(st.s, &graph));
  KVP_REQUIRE_OK(cs_status);
  CUDA_REQUIRE(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_REQUIRE(cudaGraphLaunch(exec, st.s));
  st.sync();
  REQUIRE(dout.download<float>(static_cast<std::size_t>(G * d)) == eager_o);
  REQUIRE(dlse.download<float>(G) == eager_l);
  CUDA_REQUIRE(cudaGraphExecDestroy(exec));
  CUDA_REQUIRE(cudaGraphDestroy(graph));
}

}  // namespace

TEST_CASE("cuda paged quantized pool: append bytes and Quest metadata bit-identical, attention within 5e-5 of Scalar",
          "[cuda][pages][quantized]") {
  for (const kvp::PageLayout layout : {kvp::PageLayout::kHND, kvp::PageLayout::kNHD}) {
    check_quantized_pool(kvp::GgmlQuant(kvp::GgmlQuantParams{kvp::GgmlType::kQ4_0}), layout, "q4_0");
    check_quantized_pool(kvp::GgmlQuant(kvp::GgmlQuantParams{kvp::GgmlType::kQ8_0, kvp::HadamardMode::kLlamaCpp}), layout, "q8_0 rotated");
    check_quantized_pool(kvp::Int4Quant{}, layout, "int4");
    check_quantized_pool(kvp::Fp8Quant{}, layout, "fp8");
  }
}

TEST_CASE("cuda paged quantized pool ops: bad arguments are recorded, empty work enqueues nothing", "[cuda][pages][quantized][args]") {
  const Stream st;
  const kvp::ops::CodePageGeometry geo{kvp::PageStrides::contiguous(kvp::PageLayout::kNHD, 1, 4, 8), 4, 1, 8};
  DeviceBuffer pool(64), buf(64), ids(std::vector<std::int32_t>{1, 0});
  REQUIRE_THAT(
      recorded(st, [&] { Cuda::code_rows_gather(pool.get<std::uint8_t>(), geo, ids.get<std::int32_t>(), -1, 2, buf.get<std::uint8_t>()); })
          .message(),
      Catch::Matchers::Contains("first and count >= 0"));
  REQUIRE_THAT(
      recorded(st, [&] { Cuda::code_rows_scatter(nullptr, geo, ids.get<std::int32_t>(), 0, 2, pool.get<std::uint8_t>()); }).message(),
      Catch::Matchers::Contains("is null"));
  KVP_REQUIRE_OK(recorded(st, [&] { Cuda::code_rows_scatter(nullptr, geo, nullptr, 0, 0, nullptr); }));
  REQUIRE_THAT(recorded(st, [&] { Cuda::lse_merge_chunk(nullptr, nullptr, 0, 8, true, nullptr, nullptr, nullptr); }).message(),
               Catch::Matchers::Contains("need 1 <= group"));
  REQUIRE_THAT(recorded(st, [&] { Cuda::lse_merge_finish(nullptr, nullptr, nullptr, 2, 8, false, nullptr); }).message(),
               Catch::Matchers::Contains("is null"));
  REQUIRE_THAT(recorded(st, [&] { Cuda::code_page_meta_fold(nullptr, 0, geo, nullptr, 0, 4, kvp::PageMetaView<float>{}); }).message(),
               Catch::Matchers::Contains("positive page_size and head_dim"));
  // The copies move exactly the rows' bytes (word and byte paths) through the page list.
  std::vector<std::uint8_t> hp(64);
  std::iota(hp.begin(), hp.end(), std::uint8_t{0});
  pool.upload(hp);
  for (const std::int64_t rb : {8, 6}) {
    const kvp::ops::CodePageGeometry g{kvp::PageStrides::contiguous(kvp::PageLayout::kNHD, 1, 4, rb), 4, 1, rb};
    std::vector<std::uint8_t> want(static_cast<std::size_t>(3 * rb));
    kvp::ops::quantized_paged_ref::gather(hp.data(), g, std::vector<std::int32_t>{1, 0}.data(), 2, 3, want.data());
    run_ops(st, [&] { Cuda::code_rows_gather(pool.get<std::uint8_t>(), g, ids.get<std::int32_t>(), 2, 3, buf.get<std::uint8_t>()); });
    REQUIRE(buf.download<std::uint8_t>(want.size()) == want);
  }
}

int main(int argc, char** argv) {
  if (!kvp_cuda_test::have_device()) return 77;
  const int rc = Catch::Session().run(argc, argv);
  std::printf("paged_decode_attention: largest |cuda - scalar| / tolerance seen: %.3g\n", g_worst_ratio);
  return rc;
}
