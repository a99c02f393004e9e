// SPDX-License-Identifier: Apache-2.0
// Selection: Quest over a paged cache given as arrays (a key page pool, NHD
// or HND, and a FlashInfer CSR page table), its page metadata held in a numpy
// array owned by a state object, on_append and select returning the
// PageSelection arrays.
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "common.hpp"
#include "kvpolicy/core/dispatch.hpp"
#include "kvpolicy/policy/selection/quest.hpp"
#include "kvpolicy/registry.hpp"

namespace kvpy {

/// A FlashInfer CSR page table from int32 arrays (kept alive by the ArrayArgs).
TableArgs table_args(const char* who, nb::handle indptr, nb::handle indices, nb::handle last_page_len) {
  TableArgs t;
  t.indptr = array_arg(who, "indptr", indptr, {1});
  t.indices = array_arg(who, "indices", indices, {1});
  t.last = array_arg(who, "last_page_len", last_page_len, {1});
  for (const ArrayArg* a : {&t.indptr, &t.indices, &t.last})
    if (a->view.dtype != kvpolicy::DType::kI32) type_error(std::string(who) + ": indptr, indices and last_page_len must be int32");
  for (const ArrayArg* a : {&t.indptr, &t.indices, &t.last})
    if (a->view.extents[0] > 1 && a->view.strides[0] != 1)
      value_error(std::string(who) + ": indptr, indices and last_page_len must be contiguous");
  const std::int64_t batch = t.indptr.view.extents[0] - 1;
  if (batch < 0) value_error(std::string(who) + ": indptr is empty (batch + 1 entries expected)");
  if (t.last.view.extents[0] != batch)
    value_error(std::string(who) + ": last_page_len has " + std::to_string(t.last.view.extents[0]) + " entries, the table has batch " +
                std::to_string(batch));
  const auto* ip = static_cast<const std::int32_t*>(t.indptr.view.data);
  if (batch > 0 && (ip[0] != 0 || ip[batch] < 0 || ip[batch] > t.indices.view.extents[0]))
    value_error(std::string(who) + ": indptr[0] is " + std::to_string(ip[0]) + " and indptr[-1] " + std::to_string(ip[batch]) +
                "; need 0 and at most len(indices) = " + std::to_string(t.indices.view.extents[0]));
  t.table = kvpolicy::PageTable{ip, static_cast<const std::int32_t*>(t.indices.view.data),
                                static_cast<const std::int32_t*>(t.last.view.data), static_cast<std::int32_t>(batch)};
  return t;
}

namespace {

using kvpolicy::DType;
using Ctx = kvpolicy::Context<kvpolicy::backend::Cpu>;

/// Quest's page metadata of one layer: (num_pages, num_kv_heads, 2, head_dim), [.., 0, :] max, [.., 1, :] min.
struct QuestStateObj {
  nb::object data;
  void* ptr = nullptr;
  DType dtype = DType::kF32;
  std::int32_t num_pages = 0, num_kv_heads = 0, head_dim = 0;

  QuestStateObj(std::int64_t pages, std::int64_t heads, std::int64_t dim, const std::string& dt) {
    if (pages < 0 || heads < 1 || dim < 1 || pages > INT32_MAX || heads > INT32_MAX || dim > INT32_MAX)
      value_error("QuestState: num_pages " + std::to_string(pages) + ", num_kv_heads " + std::to_string(heads) + ", head_dim " +
                  std::to_string(dim) + "; need num_pages >= 0, num_kv_heads >= 1, head_dim >= 1");
    if (dt != "float32" && dt != "float16") value_error("QuestState: dtype is '" + dt + "', must be 'float32' or 'float16'");
    dtype = dt == "float32" ? DType::kF32 : DType::kF16;
    num_pages = static_cast<std::int32_t>(pages);
    num_kv_heads = static_cast<std::int32_t>(heads);
    head_dim = static_cast<std::int32_t>(dim);
    const std::size_t shape[4] = {static_cast<std::size_t>(pages), static_cast<std::size_t>(heads), 2, static_cast<std::size_t>(dim)};
    const std::size_t n = shape[0] * shape[1] * 2 * shape[3];
    if (dtype == DType::kF32) {
      auto* p = new float[n > 0 ? n : 1];
      nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<float*>(q); });
      data = nb::cast(nb::ndarray<nb::numpy, float>(p, 4, shape, owner));
      ptr = p;
    } else {
      auto* p = new kvpolicy::half[n > 0 ? n : 1];
      nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<kvpolicy::half*>(q); });
      nb::dlpack::dtype f16{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
      data = nb::cast(nb::ndarray<nb::numpy>(p, 4, shape, owner, nullptr, f16));
      ptr = p;
    }
    reset();
  }

  template <class Tm>
  kvpolicy::PageMetaView<Tm> view() const {
    return kvpolicy::PageMetaView<Tm>::contiguous(static_cast<Tm*>(ptr), num_pages, num_kv_heads, head_dim);
  }

  /// Every page back to the empty state (max = -inf, min = +inf).
  void reset() {
    const std::int64_t rows = static_cast<std::int64_t>(num_pages) * num_kv_heads;
    auto fill = [&](auto* p, auto lo, auto hi) {
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int32_t i = 0; i < head_dim; ++i) {
          p[(2 * r) * head_dim + i] = lo;
          p[(2 * r + 1) * head_dim + i] = hi;
        }
    };
    if (dtype == DType::kF32)
      fill(static_cast<float*>(ptr), kvpolicy::page_meta_empty_max<float>(), kvpolicy::page_meta_empty_min<float>());
    else
      fill(static_cast<kvpolicy::half*>(ptr), kvpolicy::page_meta_empty_max<kvpolicy::half>(),
           kvpolicy::page_meta_empty_min<kvpolicy::half>());
  }
};

class QuestPolicy {
 public:
  explicit QuestPolicy(const std::string& spec) : spec_(spec) {
    check(kvpolicy::make_policy<kvpolicy::Quest>(spec, &policy_));
    check(policy_.validate_params());
  }
  const std::string& spec() const { return spec_; }
  std::int32_t page_budget(std::int32_t page_size, std::int64_t seq_tokens) const { return policy_.page_budget(page_size, seq_tokens); }
  int dense_layers() const { return policy_.params().dense_layers; }

  /// k_pages: (num_pages, page_size, kv_heads, d) for NHD or (num_pages, kv_heads, page_size, d) for HND, any strides.
  void on_append(QuestStateObj& s, nb::handle k_pages, nb::handle indptr, nb::handle indices, nb::handle last_page_len,
                 nb::handle append_len, const std::string& layout) const {
    const char* who = "Quest.on_append";
    clear_pointers();
    if (layout != "NHD" && layout != "HND") value_error(std::string(who) + ": layout is '" + layout + "', must be 'NHD' or 'HND'");
    const ArrayArg K = array_arg(who, "k_pages", k_pages, {4});
    const TableArgs t = table_args(who, indptr, indices, last_page_len);
    const ArrayArg A = array_arg(who, "append_len", append_len, {1}, false, true, true);
    if (A.present()) {
      if (A.view.dtype != DType::kI32) type_error(std::string(who) + ": append_len must be int32");
      if (A.view.extents[0] != t.table.batch)
        value_error(std::string(who) + ": append_len has " + std::to_string(A.view.extents[0]) + " entries, the table has batch " +
                    std::to_string(t.table.batch));
    }
    const bool nhd = layout == "NHD";
    const auto& e = K.view.extents;
    const auto& st = K.view.strides;
    check(kvpolicy::dispatch_dtype(K.view.dtype, "k_pages", [&](auto tag) -> kvpolicy::Status {
      using Tk = typename decltype(tag)::type;
      kvpolicy::PagedKVView<const Tk> kv;
      kv.k_data = static_cast<const Tk*>(K.view.data);
      kv.num_pages = static_cast<std::int32_t>(e[0]);
      kv.page_size = static_cast<std::int32_t>(nhd ? e[1] : e[2]);
      kv.num_kv_heads = static_cast<std::int32_t>(nhd ? e[2] : e[1]);
      kv.head_dim = static_cast<std::int32_t>(e[3]);
      kv.k_strides = kvpolicy::PageStrides{st[0], nhd ? st[2] : st[1], nhd ? st[1] : st[2], e[3] > 1 ? st[3] : 1};
      kv.table = t.table;
      kv.device = kvpolicy::kHost;
      const kvpolicy::AppendInput<Tk> app{kv, A.present() ? static_cast<const std::int32_t*>(A.view.data) : nullptr};
      std::lock_guard<std::mutex> lk(exec_mutex());
      const Ctx ctx{{}, exec_context()};
      auto run = [&](auto mtag) -> kvpolicy::Status {
        using Tm = typename decltype(mtag)::type;
        if constexpr (kvpolicy::PageMetaStorableFrom<Tk, Tm>) {
          nb::gil_scoped_release nogil;
          return policy_.on_append(ctx, app, s.view<Tm>());
        } else {
          return KVP_INVALID("quest: metadata dtype %s cannot hold keys of dtype %s exactly; use float32 or the key dtype",
                             kvpolicy::dtype_name(s.dtype), kvpolicy::dtype_name(kvpolicy::dtype_v<Tk>));
        }
      };
      return s.dtype == DType::kF32 ? run(kvpolicy::TypeTag<float>{}) : run(kvpolicy::TypeTag<kvpolicy::half>{});
    }));
  }

  /// One decode step's selection: (indptr, indices, last_page_len, logical) int32, rows b * heads_per_seq + head.
  nb::tuple select(const QuestStateObj& s, nb::handle queries, nb::handle indptr, nb::handle indices, nb::handle last_page_len,
                   std::int32_t page_size, std::int32_t layer) const {
    const char* who = "Quest.select";
    clear_pointers();
    const ArrayArg Q = array_arg(who, "queries", queries, {3});
    const TableArgs t = table_args(who, indptr, indices, last_page_len);
    nb::tuple result;
    check(kvpolicy::dispatch_dtype(Q.view.dtype, "queries", [&](auto tag) -> kvpolicy::Status {
      using Tq = typename decltype(tag)::type;
      kvpolicy::DecodeInput<Tq> in;
      KVP_RETURN_IF_ERROR((Q.view.template as<const Tq, 3>(&in.queries, "queries")));
      in.table = t.table;
      in.page_size = page_size;
      in.layer = layer;
      const kvpolicy::ProblemShape shape{.num_q_heads = in.queries.extent(1), .num_kv_heads = s.num_kv_heads, .head_dim = s.head_dim};
      std::lock_guard<std::mutex> lk(exec_mutex());
      const Ctx ctx{{}, exec_context()};
      kvpolicy::Quest::Plan plan;
      KVP_RETURN_IF_ERROR(policy_.plan(ctx, in, shape, plan));
      const std::int64_t rows = plan.requirements.output.rows, cap = plan.requirements.output.capacity;
      auto [ip, ipp] = new_array<std::int32_t>({static_cast<std::size_t>(rows + 1)});
      auto [id, idp] = new_array<std::int32_t>({static_cast<std::size_t>(cap)});
      auto [lp, lpp] = new_array<std::int32_t>({static_cast<std::size_t>(rows)});
      auto [lg, lgp] = new_array<std::int32_t>({static_cast<std::size_t>(cap)});
      const kvpolicy::PageSelection out{ipp, idp, lpp, lgp, rows, cap};
      std::unique_ptr<std::byte[]> ws(new std::byte[plan.requirements.workspace_bytes > 0 ? plan.requirements.workspace_bytes : 1]);
      const Ctx run_ctx = ctx.with_workspace(kvpolicy::Workspace{ws.get(), plan.requirements.workspace_bytes});
      kvpolicy::Status st;
      {
        nb::gil_scoped_release nogil;
        st = s.dtype == DType::kF32 ? policy_.select(run_ctx, plan, in, s.view<float>(), out)
                                    : policy_.select(run_ctx, plan, in, s.view<kvpolicy::half>(), out);
      }
      KVP_RETURN_IF_ERROR(st);
      result = nb::make_tuple(ip, id, lp, lg);
      return kvpolicy::Status::ok();
    }));
    return result;
  }

 private:
  std::string spec_;
  kvpolicy::Quest policy_;
};

}  // namespace

void bind_selection(nb::module_& m) {
  nb::class_<QuestStateObj>(m, "QuestState",
                            "Quest's page metadata of one layer, indexed by physical page id: data (num_pages, num_kv_heads, "
                            "2, head_dim), [.., 0, :] the channel max and [.., 1, :] the channel min of each page's keys.")
      .def(nb::init<std::int64_t, std::int64_t, std::int64_t, const std::string&>(), nb::arg("num_pages"), nb::arg("num_kv_heads"),
           nb::arg("head_dim"), nb::arg("dtype") = "float32")
      .def_prop_ro(
          "data", [](const QuestStateObj& s) { return s.data; }, "(num_pages, num_kv_heads, 2, head_dim) float32 / float16")
      .def_prop_ro("num_pages", [](const QuestStateObj& s) { return s.num_pages; })
      .def_prop_ro("num_kv_heads", [](const QuestStateObj& s) { return s.num_kv_heads; })
      .def_prop_ro("head_dim", [](const QuestStateObj& s) { return s.head_dim; })
      .def("reset", &QuestStateObj::reset, "Every page back to the empty state (max -inf, min +inf).");

  nb::class_<QuestPolicy>(m, "QuestPolicy", "Quest (query-aware page selection) built from a spec ('quest:token_budget=512').")
      .def(nb::init<const std::string&>(), nb::arg("spec"))
      .def_prop_ro("spec", &QuestPolicy::spec)
      .def_prop_ro("dense_layers", &QuestPolicy::dense_layers)
      .def("page_budget", &QuestPolicy::page_budget, nb::arg("page_size"), nb::arg("seq_tokens") = 0,
           "Pages attended per head (last page included) of a sequence of seq_tokens tokens.")
      .def("on_append", &QuestPolicy::on_append, nb::arg("state"), nb::arg("k_pages"), nb::arg("indptr"), nb::arg("indices"),
           nb::arg("last_page_len"), nb::arg("append_len").none() = nb::none(), nb::arg("layout") = "NHD",
           "Updates the metadata after keys were written to the pool: k_pages (num_pages, page_size, kv_heads, head_dim) "
           "for NHD or (num_pages, kv_heads, page_size, head_dim) for HND, any strides with contiguous rows; the table "
           "(int32 indptr, indices, last_page_len) already counts the new tokens; append_len (int32, per sequence) says how "
           "many are new (None: rebuild every page the table references). Nothing is written on error.")
      .def("select", &QuestPolicy::select, nb::arg("state"), nb::arg("queries"), nb::arg("indptr"), nb::arg("indices"),
           nb::arg("last_page_len"), nb::arg("page_size"), nb::arg("layer"),
           "One decode step: queries (batch, num_q_heads, head_dim) post-RoPE -> (indptr, indices, last_page_len, logical) "
           "int32: row b * heads_per_seq + h lists its physical pages (logical: their positions in the sequence) in "
           "ascending logical order, the last page last; a FlashInfer request as-is.");
}

}  // namespace kvpy
