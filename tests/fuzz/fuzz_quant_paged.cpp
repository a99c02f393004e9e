// Fuzz target: the paged quantized pool (policy/quantization/quantized_paged.hpp)
// over fuzzed formats (ggml types with and without rotation, INT4 / INT8),
// page sizes, layouts, shuffled page tables and lengths (sometimes past one
// 1024-row device chunk), appends (sometimes more rows than the sequence
// holds), metadata tails (sometimes too long), attention calls (head out of
// range, groups up to 20, NaN queries) and workspaces one byte short.
// Contract: its device path on the emulated device against the host path,
// call by call: the same status (the device alone may refuse a short
// workspace); the same pool bytes and metadata bit for bit; attention within
// 1e-5 relative (NaN and infinities where the host has them); nothing
// written on error. A separate target from fuzz_quant: each input quantizes
// whole sequences, about a thousand times the work of fuzz_quant's inputs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "fuzz_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/quantization/ggml_quant.hpp"
#include "kvpolicy/policy/quantization/int4_quant.hpp"
#include "kvpolicy/policy/quantization/quantized_paged.hpp"
#include "policy/emulated_device_ops.hpp"

using namespace kvpolicy;
using namespace kvp_fuzz;

namespace {

/// The paged quantized pool: the emulated device's path against the host's, call by call.
template <class Q>
void fuzz_paged(FuzzedDataProvider& fdp, const Q& q) {
  using kvp_test::EmulatedDevice;
  using kvp_test::kEmulatedDevice;
  const auto H = fdp.ConsumeIntegralInRange<std::int32_t>(1, 3), P = fdp.ConsumeIntegralInRange<std::int32_t>(1, 40);
  const std::int64_t d = 32 * fdp.ConsumeIntegralInRange<std::int64_t>(1, 2);
  const PageLayout layout = fdp.ConsumeBool() ? PageLayout::kNHD : PageLayout::kHND;
  const auto B = fdp.ConsumeIntegralInRange<std::int32_t>(1, 2);
  std::vector<std::int32_t> indptr{0}, last;
  std::vector<std::int64_t> lens;
  for (std::int32_t b = 0; b < B; ++b) {
    const std::int64_t len = fdp.ConsumeIntegralInRange<int>(0, 7) == 0
                                 ? fdp.ConsumeIntegralInRange<std::int64_t>(1020, 1100)  // two chunks
                                 : fdp.ConsumeIntegralInRange<std::int64_t>(0, 90);
    const auto np = static_cast<std::int32_t>((len + P - 1) / P);
    lens.push_back(len);
    indptr.push_back(indptr.back() + np);
    last.push_back(np == 0 ? 0 : static_cast<std::int32_t>(len - (np - 1) * P));
  }
  const std::int32_t pages = indptr.back() + fdp.ConsumeIntegralInRange<std::int32_t>(0, 3);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(pages));
  for (std::int32_t i = 0; i < pages; ++i) ids[static_cast<std::size_t>(i)] = i;
  for (std::int32_t i = pages - 1; i > 0; --i)
    std::swap(ids[static_cast<std::size_t>(i)], ids[static_cast<std::size_t>(fdp.ConsumeIntegralInRange<std::int32_t>(0, i))]);
  const PageTable table{indptr.data(), ids.data(), last.data(), B};
  const std::int64_t rb = q.row_bytes(d);
  const PageStrides cs = PageStrides::contiguous(layout, H, P, rb);
  const std::uint8_t fill = fdp.ConsumeIntegral<std::uint8_t>();
  std::vector<std::uint8_t> hk(static_cast<std::size_t>(std::max<std::int64_t>(pages * H * P * rb, 1)), fill), hv(hk.size(), fill ^ 0xFF),
      dk = hk, dv = hv;
  const PagedKVView<std::uint8_t> host{hk.data(), hv.data(), cs, cs, pages, H, P, static_cast<std::int32_t>(rb), table, {}};
  const PagedKVView<std::uint8_t> dev{dk.data(), dv.data(), cs, cs, pages, H, P, static_cast<std::int32_t>(rb), table, kEmulatedDevice};
  std::mt19937 rng(fdp.ConsumeIntegral<std::uint32_t>());
  std::normal_distribution<float> nd(0.0f, fdp.ConsumeFloatingPointInRange<float>(0.01f, 8.0f));
  const auto workspace = [&](std::size_t need) {  // sometimes one byte short
    return need > 0 && fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? need - 1 : need;
  };
  // Appends: every sequence's rows (keys and values), then a tail of one, sometimes more rows than it holds.
  for (int step = 0; step < B + 1; ++step) {
    const std::int32_t b = step < B ? step : fdp.ConsumeIntegralInRange<std::int32_t>(0, B - 1);
    const std::int64_t len = lens[static_cast<std::size_t>(b)];
    const std::int64_t n = step < B ? len : fdp.ConsumeIntegralInRange<std::int64_t>(0, len + 1);
    const bool values = fdp.ConsumeBool();
    std::vector<float> x(static_cast<std::size_t>(std::max<std::int64_t>(H * n * d, 1)));
    for (auto& e : x) e = nd(rng);
    const Status hs = quantize_paged_append(q, host, b, TensorView<const float, 3>::contiguous(x.data(), {H, n, d}), values);
    std::vector<std::byte> ws(workspace(quantize_paged_append_workspace<EmulatedDevice>(q, P, d, H)), std::byte{0xFF});
    const auto k0 = dk, v0 = dv;
    const Status ds = quantize_paged_append(Context<EmulatedDevice>{Workspace{ws.data(), ws.size()}}, q, dev, b,
                                            TensorView<const float, 3>::contiguous(x.data(), {H, n, d}, kEmulatedDevice), values);
    if (!ds.is_ok()) {
      if (dk != k0 || dv != v0) __builtin_trap();  // nothing written on error
      if (hs.is_ok()) {                            // only the workspace may differ
        if (ds.code() != StatusCode::kWorkspaceTooSmall) __builtin_trap();
        hk = dk, hv = dv;  // (undo the host's write: both pools stay equal)
      }
      continue;
    }
    if (!hs.is_ok() || dk != hk || dv != hv) __builtin_trap();
  }
  // Metadata: every page, then a fuzzed tail per sequence (sometimes too long: refused by both).
  const PagedKVView<const std::uint8_t> hc = host, dc = dev;
  const std::size_t msize = static_cast<std::size_t>(PageMetaView<float>::contiguous_size(pages, H, static_cast<std::int32_t>(d)));
  std::vector<float> hm(std::max<std::size_t>(msize, 1), 2.0f), dm = hm;
  const auto hmeta = PageMetaView<float>::contiguous(hm.data(), pages, H, static_cast<std::int32_t>(d));
  const auto dmeta = PageMetaView<float>::contiguous(dm.data(), pages, H, static_cast<std::int32_t>(d), kEmulatedDevice);
  std::vector<std::int32_t> tail(static_cast<std::size_t>(B));
  for (std::int32_t b = 0; b < B; ++b)
    tail[static_cast<std::size_t>(b)] =
        fdp.ConsumeIntegralInRange<std::int32_t>(0, static_cast<std::int32_t>(lens[static_cast<std::size_t>(b)]) + 1);
  for (const std::int32_t* append : {static_cast<const std::int32_t*>(nullptr), static_cast<const std::int32_t*>(tail.data())}) {
    std::vector<std::byte> hws(quantized_page_meta_workspace<backend::Scalar>(q, P, d, H));
    std::vector<std::byte> dws(workspace(quantized_page_meta_workspace<EmulatedDevice>(q, P, d, H)), std::byte{0xFF});
    const Status hs = quantized_page_meta_append(Context<backend::Scalar>{Workspace{hws.data(), hws.size()}}, q, hc, d, append, hmeta);
    const auto m0 = dm;
    const Status ds = quantized_page_meta_append(Context<EmulatedDevice>{Workspace{dws.data(), dws.size()}}, q, dc, d, append, dmeta);
    if (!ds.is_ok()) {
      if (dm != m0) __builtin_trap();
      if (hs.is_ok()) {
        if (ds.code() != StatusCode::kWorkspaceTooSmall) __builtin_trap();
        hm = dm;
      }
      continue;
    }
    if (!hs.is_ok() || std::memcmp(dm.data(), hm.data(), dm.size() * sizeof(float)) != 0) __builtin_trap();
  }
  // Attention: a fuzzed head (sometimes out of range), group and token count, over a sequence's page list.
  for (int call = 0; call < 2; ++call) {
    const std::int32_t b = fdp.ConsumeIntegralInRange<std::int32_t>(0, B - 1);
    const std::int32_t h = fdp.ConsumeIntegralInRange<std::int32_t>(0, H);
    const std::int64_t G = fdp.ConsumeIntegralInRange<std::int64_t>(1, 20);
    const std::int64_t n = fdp.ConsumeIntegralInRange<std::int64_t>(0, lens[static_cast<std::size_t>(b)]);
    std::vector<float> qv(static_cast<std::size_t>(G * d));
    for (auto& e : qv) e = nd(rng);
    if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) qv[fdp.ConsumeIntegralInRange<std::size_t>(0, qv.size() - 1)] = std::nanf("");
    const float scale = fdp.ConsumeFloatingPointInRange<float>(0.01f, 1.0f);
    std::vector<float> o1(qv.size(), 5.0f), l1(static_cast<std::size_t>(G), 5.0f), o2 = o1, l2 = l1;
    std::vector<std::byte> sws(quantized_paged_workspace(P, d, G));
    std::vector<std::byte> dws(workspace(quantized_paged_attention_workspace<EmulatedDevice>(q, P, d, G)), std::byte{0xFF});
    const std::int32_t* list = ids.data() + indptr[static_cast<std::size_t>(b)];
    const Status hs = quantized_paged_decode_attention(q, q, hc, h, list, n, qv.data(), G, d, scale, o1.data(), l1.data(),
                                                       Workspace{sws.data(), sws.size()});
    const Status ds = quantized_paged_decode_attention(Context<EmulatedDevice>{Workspace{dws.data(), dws.size()}}, q, q, dc, h, list, n,
                                                       qv.data(), G, d, scale, o2.data(), l2.data());
    if (!ds.is_ok()) {
      if (std::any_of(o2.begin(), o2.end(), [](float x) { return x != 5.0f; })) __builtin_trap();
      if (hs.is_ok() && ds.code() != StatusCode::kWorkspaceTooSmall) __builtin_trap();
      continue;
    }
    if (!hs.is_ok()) __builtin_trap();
    const auto close = [](float a, float r) {
      if (std::isnan(r) || std::isnan(a)) return std::isnan(r) && std::isnan(a);
      if (std::isinf(r) || std::isinf(a)) return a == r;
      return std::fabs(a - r) <= 1e-5f * std::fabs(r) + 1e-5f;
    };
    for (std::size_t i = 0; i < o1.size(); ++i)
      if (!close(o2[i], o1[i])) __builtin_trap();
    for (std::size_t i = 0; i < l1.size(); ++i)
      if (!close(l2[i], l1[i])) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const HadamardMode modes[] = {HadamardMode::kNone, HadamardMode::kLlamaCpp, HadamardMode::kBlock};
  if (fdp.ConsumeBool())
    fuzz_paged(fdp, GgmlQuant(GgmlQuantParams{static_cast<GgmlType>(fdp.ConsumeIntegralInRange<int>(0, 5)),
                                              modes[fdp.ConsumeIntegralInRange<int>(0, 1)]}));
  else
    fuzz_paged(fdp, Int4Quant(Int4QuantParams{fdp.ConsumeBool() ? 4 : 8, modes[fdp.ConsumeIntegralInRange<int>(0, 2)]}));
  return 0;
}
