// Fuzz target: apply/compact.hpp on fuzzed keep sets and page tables:
// compact_contiguous (any strides, K-only or K+V, with or without positions)
// and compact_paged (NHD / HND pools, ids sometimes repeated or out of range,
// bad last_page_len / indptr, output capacities sometimes too small, the
// output sometimes aliasing the input table). Buffers are exactly sized.
// Contract: no crash or sanitizer report; on error nothing changed (cache,
// positions, table, outputs compared byte for byte); on success the result
// equals a straightforward model (kept rows moved to the front in order; the
// compacted table, last_page_len and freed pages).
#include "fuzz_util.hpp"
#include "kvpolicy/apply/compact.hpp"

using namespace kvpolicy;
using namespace kvp_fuzz;

namespace {

/// A keep set of `rows` rows over lengths `len(row)`: usually valid (a random subset), sometimes raw.
template <class LenFn>
void fuzz_keep(FuzzedDataProvider& fdp, std::int64_t rows, LenFn len, std::int64_t equal_counts, std::vector<std::int32_t>& indptr,
               std::vector<std::int32_t>& indices) {
  indptr.assign(1, 0);
  indices.clear();
  std::int64_t count = -1;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t T = len(r);
    std::vector<std::int32_t> ids;
    for (std::int64_t t = 0; t < T; ++t)
      if (fdp.ConsumeBool()) ids.push_back(static_cast<std::int32_t>(t));
    if (equal_counts > 0) {  // compact_paged: every kv head of a sequence keeps as many tokens
      if (count < 0 || r % equal_counts == 0) count = static_cast<std::int64_t>(ids.size());
      ids.clear();
      for (std::int64_t t = 0; t < count && t < T; ++t) ids.push_back(static_cast<std::int32_t>(T - count + t));
    }
    if (fdp.ConsumeIntegralInRange<int>(0, 31) == 0 && !ids.empty()) ids[0] = fdp.ConsumeIntegralInRange<std::int32_t>(-2, 40);
    indices.insert(indices.end(), ids.begin(), ids.end());
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 31) == 0 && rows > 0)
    indptr[fdp.ConsumeIntegralInRange<std::size_t>(0, static_cast<std::size_t>(rows))] = fdp.ConsumeIntegralInRange<std::int32_t>(-2, 40);
}

void fuzz_contiguous(FuzzedDataProvider& fdp) {
  const auto H = fdp.ConsumeIntegralInRange<std::int64_t>(0, 3), C = fdp.ConsumeIntegralInRange<std::int64_t>(0, 24),
             d = fdp.ConsumeIntegralInRange<std::int64_t>(0, 6);
  const std::int64_t kv_len = fdp.ConsumeIntegralInRange<std::int64_t>(-1, C + 1);
  const std::int64_t s2 = fdp.ConsumeIntegralInRange<int>(1, 2), s1 = d * s2 + fdp.ConsumeIntegralInRange<int>(0, 2),
                     s0 = C * s1 + fdp.ConsumeIntegralInRange<int>(0, 2);
  const std::int64_t n = (H && C && d) ? (H - 1) * s0 + (C - 1) * s1 + (d - 1) * s2 + 1 : 0;
  std::vector<float> k(static_cast<std::size_t>(n)), v(fdp.ConsumeBool() ? static_cast<std::size_t>(n) : 0);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = -static_cast<float>(i);
  std::vector<std::int32_t> pos(fdp.ConsumeBool() ? static_cast<std::size_t>(H * C) : 0);
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int32_t>(1000 + i);
  const TensorView<float, 3> kv(k.empty() ? nullptr : k.data(), {H, C, d}, {s0, s1, s2});
  const TensorView<float, 3> vv = v.empty() ? TensorView<float, 3>{} : TensorView<float, 3>(v.data(), {H, C, d}, {s0, s1, s2});
  const TensorView<std::int32_t, 2> pv =
      pos.empty() ? TensorView<std::int32_t, 2>{} : TensorView<std::int32_t, 2>::contiguous(pos.data(), {H, C});
  const std::int64_t extra_rows = fdp.ConsumeIntegralInRange<std::int64_t>(0, 2), row0 = fdp.ConsumeIntegralInRange<std::int64_t>(-1, 2);
  std::vector<std::int32_t> kp, ki;
  fuzz_keep(
      fdp, H + extra_rows, [&](std::int64_t) { return std::max<std::int64_t>(kv_len, 0); }, 0, kp, ki);
  const KeepSet keep{kp.data(), ki.empty() ? nullptr : ki.data(), H + extra_rows, static_cast<std::int64_t>(ki.size())};
  std::vector<std::int64_t> new_lens(static_cast<std::size_t>(std::max<std::int64_t>(0, H - (fdp.ConsumeIntegralInRange<int>(0, 15) == 0))),
                                     -7);
  const auto k0 = k, v0 = v;
  const auto p0 = pos;
  const auto l0 = new_lens;
  const Status s = compact_contiguous<float>(kv, vv, pv, kv_len, keep, row0, std::span<std::int64_t>(new_lens));
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(same_bytes(k, k0) && same_bytes(v, v0) && same_bytes(pos, p0) && same_bytes(new_lens, l0),
                   "compact_contiguous failed (%s) but wrote", s.message());
    return;
  }
  for (std::int64_t h = 0; h < H; ++h) {
    const auto ids = keep.row(row0 + h);
    KVP_FUZZ_CHECK(new_lens[static_cast<std::size_t>(h)] == static_cast<std::int64_t>(ids.size()), "new_lens[%lld]",
                   static_cast<long long>(h));
    for (std::size_t r = 0; r < ids.size(); ++r) {
      for (std::int64_t c = 0; c < d; ++c) {
        const std::size_t dst = static_cast<std::size_t>(h * s0 + static_cast<std::int64_t>(r) * s1 + c * s2);
        const std::size_t src = static_cast<std::size_t>(h * s0 + ids[r] * s1 + c * s2);
        KVP_FUZZ_CHECK(k[dst] == k0[src] && (v.empty() || v[dst] == v0[src]), "head %lld row %zu", static_cast<long long>(h), r);
      }
      if (!pos.empty())
        KVP_FUZZ_CHECK(pos[static_cast<std::size_t>(h * C) + r] == p0[static_cast<std::size_t>(h * C + ids[r])], "positions");
    }
  }
}

void fuzz_paged(FuzzedDataProvider& fdp) {
  const auto H = fdp.ConsumeIntegralInRange<std::int32_t>(1, 3), ps = fdp.ConsumeIntegralInRange<std::int32_t>(1, 6),
             d = fdp.ConsumeIntegralInRange<std::int32_t>(1, 4), pool = fdp.ConsumeIntegralInRange<std::int32_t>(0, 16),
             batch = fdp.ConsumeIntegralInRange<std::int32_t>(0, 3);
  std::vector<std::int32_t> indptr{0}, indices, last, free_ids;
  for (std::int32_t i = pool - 1; i >= 0; --i) free_ids.push_back(i);
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int32_t n = fdp.ConsumeIntegralInRange<std::int32_t>(0, 5);
    for (std::int32_t i = 0; i < n; ++i) {
      if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {
        indices.push_back(fdp.ConsumeIntegralInRange<std::int32_t>(-1, pool));  // repeats, bad ids
      } else if (!free_ids.empty()) {
        indices.push_back(free_ids.back());
        free_ids.pop_back();
      }
    }
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last.push_back(fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? fdp.ConsumeIntegralInRange<std::int32_t>(-1, ps + 1)
                                                               : fdp.ConsumeIntegralInRange<std::int32_t>(1, ps));
  }
  const PageStrides st = PageStrides::contiguous(fdp.ConsumeBool() ? PageLayout::kNHD : PageLayout::kHND, H, ps, d);
  std::vector<float> k(static_cast<std::size_t>(pool) * static_cast<std::size_t>(st.page)), v(fdp.ConsumeBool() ? k.size() : 0);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = -static_cast<float>(i);
  std::vector<std::int32_t> pos(fdp.ConsumeBool() ? static_cast<std::size_t>(pool) * static_cast<std::size_t>(H * ps) : 0);
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int32_t>(i);
  const PageTable table{batch ? indptr.data() : nullptr, indices.empty() ? nullptr : indices.data(), batch ? last.data() : nullptr, batch};
  const PagedKVView<float> cache{k.empty() ? nullptr : k.data(), v.empty() ? nullptr : v.data(), st, st, pool, H, ps, d, table, kHost};
  // Sequence lengths as the table states them, when it is well formed enough to say (else any).
  const bool sane = table.validate("fuzz", pool, ps).is_ok();
  std::vector<std::int32_t> kp, ki;
  fuzz_keep(
      fdp, static_cast<std::int64_t>(batch) * H,
      [&](std::int64_t row) { return sane ? table.seq_len(static_cast<std::int32_t>(row / H), ps) : 4; }, H, kp, ki);
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0 && !kp.empty()) kp.pop_back();  // a row short
  const KeepSet keep{kp.data(), ki.empty() ? nullptr : ki.data(), static_cast<std::int64_t>(kp.size()) - 1,
                     static_cast<std::int64_t>(ki.size())};
  std::vector<std::byte> ws(compact_paged_workspace(pool) - (fdp.ConsumeIntegralInRange<int>(0, 15) == 0 && pool > 0 ? 1 : 0));
  const bool alias = fdp.ConsumeBool();
  std::vector<std::int32_t> o_indptr(static_cast<std::size_t>(batch + 1), kPoison), o_last(static_cast<std::size_t>(batch), kPoison);
  std::vector<std::int32_t> o_indices(indices.size() - std::min<std::size_t>(indices.size(), fdp.ConsumeIntegralInRange<std::size_t>(0, 1)),
                                      kPoison);
  std::vector<std::int32_t> freed(static_cast<std::size_t>(fdp.ConsumeIntegralInRange<int>(0, 20)), kPoison);
  PagedCompactOutput out;
  out.indptr = alias ? indptr.data() : o_indptr.data();
  out.indices = alias ? (indices.empty() ? nullptr : indices.data()) : (o_indices.empty() ? nullptr : o_indices.data());
  out.indices_capacity = static_cast<std::int64_t>(alias ? indices.size() : o_indices.size());
  out.last_page_len = alias ? last.data() : o_last.data();
  out.freed_pages = freed.empty() ? nullptr : freed.data();
  out.freed_capacity = static_cast<std::int64_t>(freed.size());
  out.num_freed = -7;
  if (batch == 0 && alias) return;  // no table buffers to alias
  const auto k0 = k, v0 = v;
  const auto p0 = pos, ip0 = indptr, ix0 = indices, l0 = last, f0 = freed, oi0 = o_indices;
  const TensorView<std::int32_t, 3> pv =
      pos.empty() ? TensorView<std::int32_t, 3>{} : TensorView<std::int32_t, 3>::contiguous(pos.data(), {pool, H, ps});
  const Status s = compact_paged<float>(cache, keep, pv, out, Workspace{ws.empty() ? nullptr : ws.data(), ws.size()});
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(same_bytes(k, k0) && same_bytes(v, v0) && same_bytes(pos, p0) && same_bytes(indptr, ip0) && same_bytes(indices, ix0) &&
                       same_bytes(last, l0) && same_bytes(freed, f0) && same_bytes(o_indices, oi0) && out.num_freed == -7 &&
                       std::all_of(o_indptr.begin(), o_indptr.end(), [](std::int32_t x) { return x == kPoison; }) &&
                       std::all_of(o_last.begin(), o_last.end(), [](std::int32_t x) { return x == kPoison; }),
                   "compact_paged failed (%s) but wrote", s.message());
    return;
  }
  // Model: tokens moved to the front of each sequence's page list; the table keeps the leading pages.
  const std::int32_t* ni = out.indices;
  std::int64_t nf = 0;
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int64_t n = kp[static_cast<std::size_t>(b * H + 1)] - kp[static_cast<std::size_t>(b * H)];
    const std::int64_t pages = (n + ps - 1) / ps;
    KVP_FUZZ_CHECK(out.indptr[b + 1] - out.indptr[b] == pages, "sequence %d has %d pages, expected %lld", b,
                   out.indptr[b + 1] - out.indptr[b], static_cast<long long>(pages));
    KVP_FUZZ_CHECK(out.last_page_len[b] == (pages ? n - (pages - 1) * ps : 0), "last_page_len[%d]", b);
    for (std::int64_t p = 0; p < pages; ++p) KVP_FUZZ_CHECK(ni[out.indptr[b] + p] == ix0[static_cast<std::size_t>(ip0[b] + p)], "page ids");
    for (std::int32_t p = static_cast<std::int32_t>(pages); p < ip0[b + 1] - ip0[b]; ++p)
      KVP_FUZZ_CHECK(freed[static_cast<std::size_t>(nf++)] == ix0[static_cast<std::size_t>(ip0[b] + p)], "freed pages");
    for (std::int32_t h = 0; h < H; ++h) {
      for (std::int64_t r = 0; r < n; ++r) {
        const std::int32_t src = ki[static_cast<std::size_t>(kp[static_cast<std::size_t>(b * H + h)] + r)];
        const std::int32_t sp = ix0[static_cast<std::size_t>(ip0[b] + src / ps)], dp = ix0[static_cast<std::size_t>(ip0[b] + r / ps)];
        const std::int64_t so = sp * st.page + h * st.head + (src % ps) * st.slot, dof = dp * st.page + h * st.head + (r % ps) * st.slot;
        for (std::int32_t c = 0; c < d; ++c) {
          KVP_FUZZ_CHECK(k[static_cast<std::size_t>(dof + c)] == k0[static_cast<std::size_t>(so + c)],
                         "keys of sequence %d head %d row %lld", b, h, static_cast<long long>(r));
          if (!v.empty()) KVP_FUZZ_CHECK(v[static_cast<std::size_t>(dof + c)] == v0[static_cast<std::size_t>(so + c)], "values");
        }
        if (!pos.empty())
          KVP_FUZZ_CHECK(
              pos[static_cast<std::size_t>((dp * H + h) * ps + r % ps)] == p0[static_cast<std::size_t>((sp * H + h) * ps + src % ps)],
              "positions");
      }
    }
  }
  KVP_FUZZ_CHECK(out.num_freed == nf, "num_freed %lld, expected %lld", static_cast<long long>(out.num_freed), static_cast<long long>(nf));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  if (fdp.ConsumeBool())
    fuzz_paged(fdp);
  else
    fuzz_contiguous(fdp);
  return 0;
}
