// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the Python extension kvpolicy._core: arrays in (any object
// nanobind's ndarray accepts: numpy arrays, torch tensors, anything with
// __dlpack__) as AnyTensorView without a copy, arrays out, errors as Python
// exceptions, the process-wide thread pool, and the debug record of the data
// pointers the last call's views were built on (tests prove zero-copy with it).
//
// Error mapping: a missing array (None) or an object that is not an array
// raises TypeError; a wrong dtype raises TypeError; a wrong rank, a
// non-contiguous last axis, a non-CPU device and every Status the library
// returns raise ValueError with the library's message.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvpolicy/core/any_tensor_view.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"

namespace kvpy {

namespace nb = nanobind;
using Array = nb::ndarray<nb::ro>;  // any dtype, shape, strides, device; read-only access
using MArray = nb::ndarray<>;       // the same, writable
using I32Out = nb::ndarray<nb::numpy, std::int32_t, nb::ndim<1>>;
using I64Out = nb::ndarray<nb::numpy, std::int64_t, nb::ndim<1>>;
using F32Out = nb::ndarray<nb::numpy, float>;

/// Raises ValueError with the Status message unless it is ok (RuntimeError for
/// a collective's failure or a peer rank's rejection: the input here was fine).
inline void check(const kvpolicy::Status& s) {
  if (s.is_ok()) return;
  if (s.code() == kvpolicy::StatusCode::kCollectiveError) throw std::runtime_error(s.message());
  throw nb::value_error(s.message());
}

[[noreturn]] inline void type_error(const std::string& msg) { throw nb::type_error(msg.c_str()); }
[[noreturn]] inline void value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

/// The element type of a DLPack dtype, or false for one the library does not read.
bool to_dtype(nb::dlpack::dtype dt, kvpolicy::DType* out);
std::string dlpack_dtype_name(nb::dlpack::dtype dt);

/// An array argument as the library's type-erased view (no copy). `obj` may be
/// any object nanobind's ndarray accepts. `ranks` lists the accepted ranks;
/// `last_contiguous` requires stride 1 on the last axis (rows read as vectors).
struct ArrayArg {
  kvpolicy::AnyTensorView view{};
  nb::object owner;  // keeps the exporter alive for the call
  bool present() const { return owner.is_valid() && view.rank > 0; }
};

ArrayArg array_arg(const char* who, const char* name, nb::handle obj, std::initializer_list<int> ranks, bool writable = false,
                   bool last_contiguous = true, bool optional = false);

/// Typed view of an ArrayArg of rank R after the dtype was dispatched.
template <class T, int R>
kvpolicy::TensorView<T, R> typed(const ArrayArg& a, const char* name) {
  kvpolicy::TensorView<T, R> v;
  check(a.view.as<T, R>(&v, name));
  return v;
}

/// Sub-view `b` of a leading batch axis (the rank drops by one).
kvpolicy::AnyTensorView batch_slice(const kvpolicy::AnyTensorView& v, std::int64_t b);

/// A new numpy array owning `n` elements of T (uninitialised) and its pointer.
template <class T>
std::pair<nb::ndarray<nb::numpy, T>, T*> new_array(std::initializer_list<std::size_t> shape) {
  std::size_t n = 1;
  for (auto s : shape) n *= s;
  T* data = new T[n > 0 ? n : 1];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return {nb::ndarray<nb::numpy, T>(data, shape.size(), shape.begin(), owner), data};
}

/// The process-wide thread pool's context (workers = set_num_threads), and
/// the lock that makes one call at a time use it.
kvpolicy::ExecContext exec_context();
std::mutex& exec_mutex();

/// The HeadShard of a `kvpolicy.HeadShard` object (None: nullptr), valid while `obj` lives.
const kvpolicy::HeadShard* head_shard(nb::handle obj);

/// Zero-copy evidence: data pointers of the views the last call built, by argument name.
void record_pointer(const char* name, const void* p);
void clear_pointers();

/// A FlashInfer CSR page table from int32 arrays indptr (batch + 1), indices, last_page_len (batch), kept alive
/// by the ArrayArgs; structure checked here only as far as reading it is safe (the library validates the rest).
struct TableArgs {
  ArrayArg indptr, indices, last;
  kvpolicy::PageTable table{};
};
TableArgs table_args(const char* who, nb::handle indptr, nb::handle indices, nb::handle last_page_len);

void bind_eviction(nb::module_& m);
void bind_apply(nb::module_& m);
void bind_state(nb::module_& m);
void bind_quant(nb::module_& m);
void bind_selection(nb::module_& m);
void bind_merge(nb::module_& m);
void bind_mixed(nb::module_& m);
void bind_distributed(nb::module_& m);
void bind_prefetch(nb::module_& m);

}  // namespace kvpy
