// SPDX-License-Identifier: Apache-2.0
// apply/: compaction of a contiguous cache given as arrays, in place.
#include <nanobind/stl/string.h>

#include <memory>
#include <vector>

#include "common.hpp"
#include "kvpolicy/apply/compact.hpp"
#include "kvpolicy/core/dispatch.hpp"

namespace kvpy {

namespace {

using kvpolicy::DType;

/// Moves each kv head's kept rows to the front of keys / values (and positions), in place.
nb::object compact_contiguous(nb::handle keys, std::int64_t kv_len, nb::handle indptr, nb::handle indices, nb::handle values,
                              std::int64_t row0, nb::handle positions) {
  const char* who = "compact_contiguous";
  clear_pointers();
  const ArrayArg K = array_arg(who, "keys", keys, {3, 4}, true);
  const bool batched = K.view.rank == 4;
  const ArrayArg V = array_arg(who, "values", values, {K.view.rank}, true, true, true);
  const ArrayArg P = array_arg(who, "positions", positions, {batched ? 3 : 2}, true, false, true);
  const ArrayArg IP = array_arg(who, "indptr", indptr, {1});
  const ArrayArg ID = array_arg(who, "indices", indices, {1});
  if (IP.view.dtype != DType::kI32 || ID.view.dtype != DType::kI32) type_error(std::string(who) + ": indptr and indices must be int32");
  if (V.present() && V.view.dtype != K.view.dtype) type_error(std::string(who) + ": values and keys must share one dtype");
  if (P.present() && P.view.dtype != DType::kI32) type_error(std::string(who) + ": positions must be int32");
  if (IP.view.extents[0] < 1) value_error(std::string(who) + ": indptr is empty");
  if (IP.view.strides[0] != 1 || ID.view.strides[0] != 1) value_error(std::string(who) + ": indptr and indices must be contiguous");
  const std::int64_t B = batched ? K.view.extents[0] : 1;
  const std::int64_t H = batched ? K.view.extents[1] : K.view.extents[0];
  const kvpolicy::KeepSet keep{static_cast<std::int32_t*>(IP.view.data), static_cast<std::int32_t*>(ID.view.data), IP.view.extents[0] - 1,
                               ID.view.extents[0]};
  auto [lens, lens_ptr] = batched ? new_array<std::int64_t>({static_cast<std::size_t>(B), static_cast<std::size_t>(H)})
                                  : new_array<std::int64_t>({static_cast<std::size_t>(H)});
  auto seq = [&](const ArrayArg& a, std::int64_t b) { return batched ? batch_slice(a.view, b) : a.view; };
  check(kvpolicy::dispatch_dtype(K.view.dtype, "keys", [&](auto tag) -> kvpolicy::Status {
    using T = typename decltype(tag)::type;
    for (std::int64_t b = 0; b < B; ++b) {
      kvpolicy::TensorView<T, 3> k, v;
      kvpolicy::TensorView<std::int32_t, 2> pos;
      KVP_RETURN_IF_ERROR((seq(K, b).template as<T, 3>(&k, "keys")));
      if (V.present()) KVP_RETURN_IF_ERROR((seq(V, b).template as<T, 3>(&v, "values")));
      if (P.present()) KVP_RETURN_IF_ERROR((seq(P, b).template as<std::int32_t, 2>(&pos, "positions")));
      nb::gil_scoped_release nogil;
      KVP_RETURN_IF_ERROR((kvpolicy::compact_contiguous(k, v, pos, kv_len, keep, row0 + b * H,
                                                        std::span<std::int64_t>(lens_ptr + b * H, static_cast<std::size_t>(H)))));
    }
    return kvpolicy::Status::ok();
  }));
  return nb::cast(lens);
}

/// Compacts a paged cache in place to a KeepSet (rows b * kv_heads + h); returns the new table and the freed pages.
nb::tuple compact_paged(nb::handle k_pages, nb::handle indptr, nb::handle indices, nb::handle last_page_len, nb::handle keep_indptr,
                        nb::handle keep_indices, nb::handle v_pages, nb::handle positions, const std::string& layout) {
  const char* who = "compact_paged";
  clear_pointers();
  if (layout != "NHD" && layout != "HND") value_error(std::string(who) + ": layout is '" + layout + "', must be 'NHD' or 'HND'");
  const ArrayArg K = array_arg(who, "k_pages", k_pages, {4}, true);
  const ArrayArg V = array_arg(who, "v_pages", v_pages, {4}, true, true, true);
  const ArrayArg P = array_arg(who, "positions", positions, {3}, true, false, true);
  const TableArgs t = table_args(who, indptr, indices, last_page_len);
  const ArrayArg IP = array_arg(who, "keep_indptr", keep_indptr, {1});
  const ArrayArg ID = array_arg(who, "keep_indices", keep_indices, {1});
  if (IP.view.dtype != DType::kI32 || ID.view.dtype != DType::kI32)
    type_error(std::string(who) + ": keep indptr and indices must be int32");
  if (IP.view.extents[0] < 1) value_error(std::string(who) + ": keep indptr is empty");
  if (IP.view.strides[0] != 1 || ID.view.strides[0] != 1) value_error(std::string(who) + ": keep indptr and indices must be contiguous");
  if (V.present() && V.view.dtype != K.view.dtype) type_error(std::string(who) + ": v_pages and k_pages must share one dtype");
  if (P.present() && P.view.dtype != DType::kI32) type_error(std::string(who) + ": positions must be int32");
  const bool nhd = layout == "NHD";
  const auto& e = K.view.extents;
  if (V.present())
    for (int i = 0; i < 4; ++i)
      if (V.view.extents[i] != e[i]) value_error(std::string(who) + ": v_pages and k_pages have different shapes");
  const kvpolicy::KeepSet keep{static_cast<std::int32_t*>(IP.view.data), static_cast<std::int32_t*>(ID.view.data), IP.view.extents[0] - 1,
                               ID.view.extents[0]};
  const std::int32_t batch = t.table.batch;
  const std::int64_t old_pages = batch > 0 ? t.table.indptr[batch] : 0;
  auto [oip, oipp] = new_array<std::int32_t>({static_cast<std::size_t>(batch + 1)});
  auto [oid, oidp] = new_array<std::int32_t>({static_cast<std::size_t>(old_pages)});
  auto [olp, olpp] = new_array<std::int32_t>({static_cast<std::size_t>(batch)});
  auto [ofr, ofrp] = new_array<std::int32_t>({static_cast<std::size_t>(old_pages)});
  oipp[0] = 0;
  kvpolicy::PagedCompactOutput out{oipp, oidp, olpp, old_pages, ofrp, old_pages, 0};
  auto strides = [&](const ArrayArg& a) {
    const auto& s = a.view.strides;
    return kvpolicy::PageStrides{s[0], nhd ? s[2] : s[1], nhd ? s[1] : s[2], a.view.extents[3] > 1 ? s[3] : 1};
  };
  check(kvpolicy::dispatch_dtype(K.view.dtype, "k_pages", [&](auto tag) -> kvpolicy::Status {
    using T = typename decltype(tag)::type;
    kvpolicy::PagedKVView<T> kv;
    kv.k_data = static_cast<T*>(K.view.data);
    kv.v_data = V.present() ? static_cast<T*>(V.view.data) : nullptr;
    kv.k_strides = strides(K);
    if (V.present()) kv.v_strides = strides(V);
    kv.num_pages = static_cast<std::int32_t>(e[0]);
    kv.page_size = static_cast<std::int32_t>(nhd ? e[1] : e[2]);
    kv.num_kv_heads = static_cast<std::int32_t>(nhd ? e[2] : e[1]);
    kv.head_dim = static_cast<std::int32_t>(e[3]);
    kv.table = t.table;
    kv.device = kvpolicy::kHost;
    kvpolicy::TensorView<std::int32_t, 3> pos;
    if (P.present()) KVP_RETURN_IF_ERROR((P.view.template as<std::int32_t, 3>(&pos, "positions")));
    const std::size_t ws_bytes = kvpolicy::compact_paged_workspace(kv.num_pages);
    std::unique_ptr<std::byte[]> ws(new std::byte[ws_bytes > 0 ? ws_bytes : 1]);
    nb::gil_scoped_release nogil;
    return kvpolicy::compact_paged(kv, keep, pos, out, kvpolicy::Workspace{ws.get(), ws_bytes});
  }));
  const std::int64_t n = batch > 0 ? oipp[batch] : 0;
  nb::object ids = nb::cast(oid).attr("__getitem__")(nb::slice(nb::int_(0), nb::int_(n), nb::none()));
  nb::object freed = nb::cast(ofr).attr("__getitem__")(nb::slice(nb::int_(0), nb::int_(out.num_freed), nb::none()));
  return nb::make_tuple(oip, ids, olp, freed);
}

}  // namespace

void bind_apply(nb::module_& m) {
  m.def("compact_contiguous", &compact_contiguous, nb::arg("keys"), nb::arg("kv_len"), nb::arg("indptr"), nb::arg("indices"),
        nb::arg("values").none() = nb::none(), nb::arg("row0") = 0, nb::arg("positions").none() = nb::none(),
        "Compacts a contiguous cache in place: per kv head, the kept rows (the KeepSet rows row0 + seq * kv_heads + head) "
        "move to the front of keys / values ((kv_heads, capacity, head_dim) or (batch, kv_heads, capacity, head_dim), any "
        "strides) and of positions ((kv_heads, capacity) int32, optional). Returns each head's new length (int64, "
        "(kv_heads,) or (batch, kv_heads)). Everything is validated before the first write.");
  m.def("compact_paged", &compact_paged, nb::arg("k_pages"), nb::arg("indptr"), nb::arg("indices"), nb::arg("last_page_len"),
        nb::arg("keep_indptr"), nb::arg("keep_indices"), nb::arg("v_pages").none() = nb::none(), nb::arg("positions").none() = nb::none(),
        nb::arg("layout") = "NHD",
        "Compacts a paged cache in place: per sequence b and kv head h, the kept tokens (KeepSet row b * kv_heads + h; "
        "every head of a sequence keeps the same count) move to the front of the sequence's pages in k_pages / v_pages "
        "((num_pages, page_size, kv_heads, head_dim) NHD or (num_pages, kv_heads, page_size, head_dim) HND) and of "
        "positions ((num_pages, kv_heads, page_size) int32, optional). Page ids must be distinct within and across "
        "sequences. Returns the new table (indptr, indices, last_page_len) and the freed page ids, int32 arrays. "
        "Everything is validated before the first write.");
}

}  // namespace kvpy
