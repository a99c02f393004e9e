// SPDX-License-Identifier: Apache-2.0
// apply/: compaction of a contiguous cache given as arrays, in place.
#include <nanobind/stl/string.h>

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

}  // namespace

void bind_apply(nb::module_& m) {
  m.def("compact_contiguous", &compact_contiguous, nb::arg("keys"), nb::arg("kv_len"), nb::arg("indptr"), nb::arg("indices"),
        nb::arg("values").none() = nb::none(), nb::arg("row0") = 0, nb::arg("positions").none() = nb::none(),
        "Compacts a contiguous cache in place: per kv head, the kept rows (the KeepSet rows row0 + seq * kv_heads + head) "
        "move to the front of keys / values ((kv_heads, capacity, head_dim) or (batch, kv_heads, capacity, head_dim), any "
        "strides) and of positions ((kv_heads, capacity) int32, optional). Returns each head's new length (int64, "
        "(kv_heads,) or (batch, kv_heads)). Everything is validated before the first write.");
}

}  // namespace kvpy
