// Fuzz target: Quest (kvpolicy/policy/selection/quest.hpp) on fuzzed page
// tables: on_append (metadata rebuild), plan and select, on the Scalar or Cpu
// backend, every GQA mode, fuzzed budgets / layers / page sizes, page ids
// sometimes repeated, shared or out of range, last_page_len and indptr
// sometimes wrong. Buffers are exactly sized. Contract: no crash or sanitizer
// report; on error the metadata (on_append) or the selection (select) is
// untouched; an accepted selection passes PageSelection::validate and every
// row lists distinct pages of its sequence with the last page last.
#include "fuzz_util.hpp"
#include "kvpolicy/backends/cpu.hpp"
#include "kvpolicy/policy/selection/quest.hpp"

using namespace kvpolicy;
using namespace kvp_fuzz;

namespace {

template <class Backend>
void run(FuzzedDataProvider& fdp) {
  const auto Hkv = fdp.ConsumeIntegralInRange<std::int32_t>(1, 3), G = fdp.ConsumeIntegralInRange<std::int32_t>(1, 3);
  const std::int32_t Hq = Hkv * G, d = fdp.ConsumeIntegralInRange<std::int32_t>(1, 12);
  const std::int32_t ps = fdp.ConsumeIntegralInRange<std::int32_t>(1, 8), pool = fdp.ConsumeIntegralInRange<std::int32_t>(0, 24);
  const std::int32_t batch = fdp.ConsumeIntegralInRange<std::int32_t>(0, 4);
  QuestParams qp;
  qp.budget = Budget::tokens(fdp.ConsumeIntegralInRange<std::int64_t>(-1, 40));
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) qp.budget = Budget::keep_ratio(fdp.ConsumeFloatingPointInRange<double>(-0.1, 1.1));
  qp.page_budget = fdp.ConsumeIntegralInRange<std::int32_t>(-1, 6);
  qp.dense_layers = fdp.ConsumeIntegralInRange<std::int32_t>(-1, 2);
  qp.gqa = static_cast<QuestGqa>(fdp.ConsumeIntegralInRange<int>(0, 3));
  const Quest quest(qp);
  const std::int32_t layer = fdp.ConsumeIntegralInRange<std::int32_t>(-1, 3);

  // Page table: each sequence takes pages, usually fresh ones, sometimes repeated / shared / out of range.
  std::vector<std::int32_t> indptr{0}, indices, last;
  std::vector<std::int32_t> free_ids;
  for (std::int32_t i = pool - 1; i >= 0; --i) free_ids.push_back(i);
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int32_t n = fdp.ConsumeIntegralInRange<std::int32_t>(0, 8);
    for (std::int32_t i = 0; i < n; ++i) {
      std::int32_t id;
      switch (fdp.ConsumeIntegralInRange<int>(0, 19)) {
        case 0: id = fdp.ConsumeIntegralInRange<std::int32_t>(-2, pool + 2); break;  // anything (repeats, sharing, bad ids)
        case 1: id = indices.empty() ? 0 : indices[fdp.ConsumeIntegralInRange<std::size_t>(0, indices.size() - 1)]; break;
        default:
          if (free_ids.empty()) continue;
          id = free_ids.back();
          free_ids.pop_back();
      }
      indices.push_back(id);
    }
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last.push_back(fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? fdp.ConsumeIntegralInRange<std::int32_t>(-1, ps + 1)
                                                               : fdp.ConsumeIntegralInRange<std::int32_t>(1, ps));
  }
  if (batch > 0 && fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {  // a non-monotonic indptr (within the indices)
    const auto b = fdp.ConsumeIntegralInRange<std::size_t>(1, static_cast<std::size_t>(batch));
    indptr[b] = fdp.ConsumeIntegralInRange<std::int32_t>(0, static_cast<std::int32_t>(indices.size()));
  }
  const PageTable table{batch ? indptr.data() : nullptr, indices.empty() ? nullptr : indices.data(), batch ? last.data() : nullptr, batch};

  const PageLayout layout = fdp.ConsumeBool() ? PageLayout::kNHD : PageLayout::kHND;
  const PageStrides st = PageStrides::contiguous(layout, Hkv, ps, d);
  std::vector<float> keys(static_cast<std::size_t>(pool) * static_cast<std::size_t>(st.page));
  for (auto& x : keys) x = fuzz_float(fdp);
  const PagedKVView<const float> kv{keys.empty() ? nullptr : keys.data(), nullptr, st, st, pool, Hkv, ps, d, table, kHost};
  std::vector<float> meta(static_cast<std::size_t>(PageMetaView<float>::contiguous_size(pool, Hkv, d)), 12345.f);
  const PageMetaView<float> mv = PageMetaView<float>::contiguous(meta.empty() ? nullptr : meta.data(), pool, Hkv, d);
  const std::vector<float> meta_before = meta;
  const Status sa = quest.on_append(Context<Backend>{}, AppendInput<float>{kv, nullptr}, mv);
  if (!sa.is_ok()) KVP_FUZZ_CHECK(same_bytes(meta, meta_before), "on_append failed (%s) but wrote the metadata", sa.message());

  std::vector<float> q(static_cast<std::size_t>(batch) * static_cast<std::size_t>(Hq * d));
  for (auto& x : q) x = fuzz_float(fdp);
  const DecodeInput<float> in{TensorView<const float, 3>::contiguous(q.empty() ? nullptr : q.data(), {batch, Hq, d}), table, ps, layer};
  Quest::Plan plan;
  const Status sp = quest.plan(Context<Backend>{}, in, ProblemShape{.num_q_heads = Hq, .num_kv_heads = Hkv, .head_dim = d}, plan);
  if (!sp.is_ok()) return;
  const Requirements& r = plan.requirements;
  std::int64_t cap = r.output.capacity;
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) cap = std::max<std::int64_t>(0, cap - 1);
  if (r.output.rows > 4096 || cap > (1 << 20) || r.workspace_bytes > (std::size_t{64} << 20)) return;
  std::vector<std::byte> ws(r.workspace_bytes);
  Poisoned sel_indptr(static_cast<std::size_t>(r.output.rows + 1)), sel_indices(static_cast<std::size_t>(cap)),
      sel_last(static_cast<std::size_t>(r.output.rows)), sel_logical(static_cast<std::size_t>(cap));
  const PageSelection out{sel_indptr.data(), sel_indices.data(), sel_last.data(), sel_logical.data(), r.output.rows, cap};
  const Status s =
      quest.select(Context<Backend>{Workspace{ws.empty() ? nullptr : ws.data(), ws.size()}}, plan, in, PageMetaView<const float>(mv), out);
  if (!s.is_ok()) {
    KVP_FUZZ_CHECK(sel_indptr.untouched() && sel_indices.untouched() && sel_last.untouched() && sel_logical.untouched(),
                   "select failed (%s) but wrote the selection", s.message());
    return;
  }
  KVP_FUZZ_CHECK(sa.is_ok(), "select accepted a table on_append rejected (%s)", sa.message());
  const Status v = out.validate("fuzz", pool, ps);
  KVP_FUZZ_CHECK(v.is_ok(), "selection invalid: %s", v.message());
  const std::int64_t per_seq = batch ? r.output.rows / batch : 0;
  for (std::int64_t row = 0; row < r.output.rows; ++row) {
    const auto b = static_cast<std::int32_t>(row / per_seq);
    const std::int32_t n = table.num_pages(b), e = sel_indptr.v[static_cast<std::size_t>(row + 1)];
    const std::int32_t* pages = indices.data() + indptr[static_cast<std::size_t>(b)];
    for (std::int32_t i = sel_indptr.v[static_cast<std::size_t>(row)]; i < e; ++i) {
      const std::int32_t lg = sel_logical.v[static_cast<std::size_t>(i)];
      KVP_FUZZ_CHECK(lg >= 0 && lg < n && pages[lg] == sel_indices.v[static_cast<std::size_t>(i)], "row %lld entry %d: logical %d",
                     static_cast<long long>(row), i, lg);
      for (std::int32_t j = sel_indptr.v[static_cast<std::size_t>(row)]; j < i; ++j)
        KVP_FUZZ_CHECK(sel_indices.v[static_cast<std::size_t>(j)] != sel_indices.v[static_cast<std::size_t>(i)],
                       "row %lld lists page %d twice", static_cast<long long>(row), sel_indices.v[static_cast<std::size_t>(i)]);
    }
    if (e > sel_indptr.v[static_cast<std::size_t>(row)])
      KVP_FUZZ_CHECK(sel_logical.v[static_cast<std::size_t>(e - 1)] == n - 1, "row %lld does not end with the last page",
                     static_cast<long long>(row));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  if (fdp.ConsumeBool())
    run<backend::Cpu>(fdp);
  else
    run<backend::Scalar>(fdp);
  return 0;
}
