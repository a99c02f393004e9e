// Fuzz target: one-shot eviction through the type-erased AnyEvictionPolicy of
// the registry (every erased policy: StreamingLLM, SnapKV, ObservedAttention,
// TOVA, PyramidKV, Ada-KV, Expected Attention) on the Scalar or Cpu backend,
// from fuzzer-chosen shapes, strides, layouts (dense, paged, sometimes with a
// corrupt page table), dtypes, budgets and output sizes. Every buffer is
// exactly as large as its view says (ASan sees any overread); the workspace is
// exactly what `requirements` reports. Contract: no crash or sanitizer
// report; on error the KeepSet is untouched; on success every row is a
// strictly ascending list of token ids of its sequence inside the capacity.
#include <memory>
#include <string>

#include "fuzz_util.hpp"
#include "kvpolicy/kvpolicy.hpp"
#include "kvpolicy/registry.hpp"

using namespace kvpolicy;
using namespace kvp_fuzz;

namespace {

const char* const kPolicies[] = {"streaming_llm", "snapkv", "observed_attention", "tova", "pyramidkv", "adakv", "expected_attention"};

std::string fuzz_spec(FuzzedDataProvider& fdp) {
  std::string s = kPolicies[fdp.ConsumeIntegralInRange<std::size_t>(0, std::size(kPolicies) - 1)];
  s += ':';
  switch (fdp.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: s += "tokens=" + std::to_string(fdp.ConsumeIntegralInRange<int>(-2, 70)); break;
    case 1: s += "compression_ratio=" + std::to_string(fdp.ConsumeFloatingPointInRange<double>(-0.1, 1.1)); break;
    case 2: s += "keep_ratio=" + std::to_string(fdp.ConsumeFloatingPointInRange<double>(-0.1, 1.1)); break;
    default: break;
  }
  if (fdp.ConsumeBool()) s += ",window=" + std::to_string(fdp.ConsumeIntegralInRange<int>(-1, 10));
  if (fdp.ConsumeBool()) s += ",kernel=" + std::to_string(fdp.ConsumeIntegralInRange<int>(-1, 9));
  return s;
}

/// A (H, T, d) strided view over an exactly-sized buffer: head-major or token-major, padded rows.
template <class T>
struct Dense {
  std::vector<T> buf;
  TensorView<const T, 3> view;
  Dense(FuzzedDataProvider& fdp, std::int64_t H, std::int64_t len, std::int64_t d) {
    const std::int64_t pad = fdp.ConsumeIntegralInRange<int>(0, 3), s2 = fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? 2 : 1;
    std::int64_t s0, s1;
    if (fdp.ConsumeBool()) {
      s1 = d * s2 + pad;
      s0 = len * s1 + fdp.ConsumeIntegralInRange<int>(0, 3);
    } else {
      s0 = d * s2 + pad;
      s1 = H * s0 + fdp.ConsumeIntegralInRange<int>(0, 3);
    }
    const std::int64_t n = (H == 0 || len == 0 || d == 0) ? 0 : (H - 1) * s0 + (len - 1) * s1 + (d - 1) * s2 + 1;
    buf.resize(static_cast<std::size_t>(n));
    for (auto& x : buf) x = from_float<T>(fuzz_float(fdp));
    view = TensorView<const T, 3>(buf.empty() ? nullptr : buf.data(), {H, len, d}, {s0, s1, s2});
  }
};

/// One paged sequence: a shuffled page list in an exactly-sized pool, sometimes a corrupt table.
template <class T>
struct Paged {
  std::vector<T> pool;
  std::vector<std::int32_t> indptr, indices, last;
  PagedKVView<const T> view{};
  Paged(FuzzedDataProvider& fdp, std::int32_t H, std::int64_t len, std::int32_t d) {
    const std::int32_t ps = fdp.ConsumeIntegralInRange<std::int32_t>(1, 8);
    const auto pages = static_cast<std::int32_t>((len + ps - 1) / ps);
    const std::int32_t num_pages = pages + fdp.ConsumeIntegralInRange<std::int32_t>(0, 3);
    const PageLayout layout = fdp.ConsumeBool() ? PageLayout::kNHD : PageLayout::kHND;
    const PageStrides st = PageStrides::contiguous(layout, H, ps, d);
    pool.resize(static_cast<std::size_t>(num_pages) * static_cast<std::size_t>(st.page));
    for (auto& x : pool) x = from_float<T>(fuzz_float(fdp));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(num_pages));
    for (std::int32_t i = 0; i < num_pages; ++i) ids[static_cast<std::size_t>(i)] = i;
    for (std::int32_t i = num_pages - 1; i > 0; --i)
      std::swap(ids[static_cast<std::size_t>(i)], ids[fdp.ConsumeIntegralInRange<std::size_t>(0, static_cast<std::size_t>(i))]);
    indices.assign(ids.begin(), ids.begin() + pages);
    indptr = {0, pages};
    last = {pages == 0 ? 0 : static_cast<std::int32_t>(len - static_cast<std::int64_t>(pages - 1) * ps)};
    switch (fdp.ConsumeIntegralInRange<int>(0, 15)) {  // corrupt the table now and then
      case 0: indptr[1] = fdp.ConsumeIntegral<std::int32_t>(); break;
      case 1: last[0] = fdp.ConsumeIntegral<std::int32_t>(); break;
      case 2:
        if (!indices.empty()) indices[0] = fdp.ConsumeIntegral<std::int32_t>();
        break;
      case 3: indptr[0] = fdp.ConsumeIntegralInRange<std::int32_t>(-3, 3); break;
      default: break;
    }
    // indptr[1] may now exceed the indices: give the table exactly what it claims when that is small.
    if (indptr[1] > pages && indptr[1] <= pages + 4)
      for (std::int32_t i = pages; i < indptr[1]; ++i) indices.push_back(fdp.ConsumeIntegralInRange<std::int32_t>(-1, num_pages));
    view = PagedKVView<const T>{pool.empty() ? nullptr : pool.data(),
                                nullptr,
                                st,
                                st,
                                num_pages,
                                H,
                                ps,
                                d,
                                PageTable{indptr.data(), indices.data(), last.data(), 1},
                                kHost};
  }
  // Tables whose indptr claims more entries than `indices` holds can only be rejected by a check this
  // harness cannot express; they are not generated (see the resize above), so a crash is a real defect.
  bool claims_beyond_indices() const { return indptr[0] == 0 && indptr[1] > static_cast<std::int32_t>(indices.size()); }
};

template <class Tk>
void run(FuzzedDataProvider& fdp, const AnyEvictionPolicy& p, BackendKind backend) {
  const auto Hkv = fdp.ConsumeIntegralInRange<std::int32_t>(1, 3), G = fdp.ConsumeIntegralInRange<std::int32_t>(1, 3);
  const std::int32_t Hq = Hkv * G, d = fdp.ConsumeIntegralInRange<std::int32_t>(1, 12);
  const auto q_len = fdp.ConsumeIntegralInRange<std::int64_t>(0, 8);
  const auto batch = fdp.ConsumeIntegralInRange<std::size_t>(1, 3);
  const bool paged = fdp.ConsumeIntegralInRange<int>(0, 2) == 0;
  const bool with_values = fdp.ConsumeBool(), with_attention = fdp.ConsumeIntegralInRange<int>(0, 3) == 0,
             with_sums = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
  std::vector<std::unique_ptr<Dense<Tk>>> dense;
  std::vector<std::unique_ptr<Paged<Tk>>> pages;
  std::vector<std::unique_ptr<Dense<float>>> extra;
  std::vector<ScoreInput<float, Tk>> in(batch);
  std::vector<std::int64_t> lens(batch);
  std::int64_t max_len = 0;
  for (std::size_t b = 0; b < batch; ++b) {
    const auto len = fdp.ConsumeIntegralInRange<std::int64_t>(0, 48);
    lens[b] = len;
    max_len = std::max(max_len, len);
    extra.push_back(std::make_unique<Dense<float>>(fdp, Hq, q_len, d));
    in[b].queries = extra.back()->view;
    if (paged) {
      pages.push_back(std::make_unique<Paged<Tk>>(fdp, Hkv, len, d));
      if (pages.back()->claims_beyond_indices()) return;
      in[b].keys = KVSource<Tk>::from_paged(pages.back()->view, 0);
      if (with_values) in[b].values = KVSource<Tk>::from_paged_values(pages.back()->view, 0);  // v_data null: must be rejected
    } else {
      dense.push_back(std::make_unique<Dense<Tk>>(fdp, Hkv, len, d));
      in[b].keys = KVSource<Tk>::from(dense.back()->view);
      if (with_values) {
        dense.push_back(std::make_unique<Dense<Tk>>(fdp, Hkv, len, d));
        in[b].values = KVSource<Tk>::from(dense.back()->view);
      }
    }
    if (with_attention) {
      extra.push_back(std::make_unique<Dense<float>>(fdp, Hq, q_len, len));
      in[b].attention = extra.back()->view;
    }
    if (with_sums) {
      extra.push_back(std::make_unique<Dense<float>>(fdp, 1, Hq, len));
      const auto& v = extra.back()->view;
      in[b].column_sums = TensorView<const float, 2>(v.data(), {Hq, len}, {v.stride(1), v.stride(2)});
    }
  }
  const ProblemShape shape{Hq, Hkv, d, max_len, q_len, static_cast<std::int64_t>(batch)};
  const Requirements r = p.requirements(backend, shape);
  const std::int64_t rows = r.status.is_ok() ? r.output.rows : static_cast<std::int64_t>(batch) * Hkv;
  std::int64_t cap = r.status.is_ok() ? r.output.capacity : fdp.ConsumeIntegralInRange<std::int64_t>(0, 64);
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) cap = std::max<std::int64_t>(0, cap - fdp.ConsumeIntegralInRange<int>(1, 3));
  if (rows < 0 || rows > 4096 || cap < 0 || cap > (1 << 20)) return;
  std::vector<std::byte> ws(r.status.is_ok() ? r.workspace_bytes : 0);
  if (ws.size() > (std::size_t{64} << 20)) return;
  // A zero-capacity KeepSet still gets a (1-entry) indices buffer: with a null one TOVA calls
  // memcpy(nullptr, src, 0), which UBSan reports (tova.hpp, reported in tests/fuzz/README.md).
  Poisoned indptr(static_cast<std::size_t>(rows + 1)), indices(static_cast<std::size_t>(std::max<std::int64_t>(cap, 1)));
  const KeepSet keep{indptr.data(), indices.data(), rows, cap};
  const Status s =
      p.evict(backend, std::span<const ScoreInput<float, Tk>>(in), keep, Workspace{ws.empty() ? nullptr : ws.data(), ws.size()});
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(indptr.untouched() && indices.untouched(), "%s failed (%s) but wrote the KeepSet", p.name().c_str(), s.message());
    return;
  }
  KVP_FUZZ_CHECK(indptr.v[0] == 0, "indptr[0] = %d", indptr.v[0]);
  const std::int64_t per_seq = rows / static_cast<std::int64_t>(batch);
  KVP_FUZZ_CHECK(per_seq * static_cast<std::int64_t>(batch) == rows, "%lld rows for %zu sequences", static_cast<long long>(rows), batch);
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int32_t b0 = indptr.v[static_cast<std::size_t>(row)], e0 = indptr.v[static_cast<std::size_t>(row + 1)];
    KVP_FUZZ_CHECK(b0 <= e0 && e0 <= cap, "%s: row %lld = [%d, %d), capacity %lld", p.name().c_str(), static_cast<long long>(row), b0, e0,
                   static_cast<long long>(cap));
    const std::int64_t len = lens[static_cast<std::size_t>(row / per_seq)];
    for (std::int32_t i = b0; i < e0; ++i) {
      const std::int32_t t = indices.v[static_cast<std::size_t>(i)];
      KVP_FUZZ_CHECK(t >= 0 && t < len && (i == b0 || t > indices.v[static_cast<std::size_t>(i - 1)]),
                     "%s: row %lld entry %d is %d (kv_len %lld)", p.name().c_str(), static_cast<long long>(row), i - b0, t,
                     static_cast<long long>(len));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const std::string spec = fuzz_spec(fdp);
  AnyEvictionPolicy p;
  if (!make_eviction_policy(spec, &p).is_ok()) return 0;
  const BackendKind backend = fdp.ConsumeBool() ? BackendKind::kCpu : BackendKind::kScalar;
  if (fdp.ConsumeBool())
    run<half>(fdp, p, backend);
  else
    run<float>(fdp, p, backend);
  return 0;
}
