// SPDX-License-Identifier: Apache-2.0
// Type-erased view: what crosses ABI / FFI boundaries (built from a DLPack
// DLTensor or a Python buffer). `as<T, Rank>()` recovers a typed view after
// checking dtype, rank and const-ness.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN

struct AnyTensorView {
  static constexpr int kMaxRank = 8;

  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device{};
  std::int32_t rank = 0;
  std::int64_t extents[kMaxRank] = {};
  std::int64_t strides[kMaxRank] = {};  ///< in elements
  bool read_only = false;

  template <class T, int Rank>
  static AnyTensorView from(const TensorView<T, Rank>& v) noexcept {
    AnyTensorView a;
    a.data = const_cast<std::remove_const_t<T>*>(v.data());
    a.dtype = dtype_v<T>;
    a.device = v.device();
    a.rank = Rank;
    for (int i = 0; i < Rank; ++i) {
      a.extents[i] = v.extent(i);
      a.strides[i] = v.stride(i);
    }
    a.read_only = std::is_const_v<T>;
    return a;
  }

  /// Typed view, or an error naming `name` when dtype / rank / const-ness
  /// differ, an extent is negative, the element count overflows int64, or the
  /// data is null with a non-zero element count (`out` is untouched on error).
  template <class T, int Rank>
  Status as(TensorView<T, Rank>* out, const char* name) const noexcept {
    if (dtype != dtype_v<T>) return KVP_INVALID("%s has dtype %s, expected %s", name, dtype_name(dtype), dtype_name(dtype_v<T>));
    if (rank != Rank) return KVP_INVALID("%s has rank %d, expected %d", name, static_cast<int>(rank), Rank);
    if (read_only && !std::is_const_v<T>) return KVP_INVALID("%s is read-only but a mutable view was requested", name);
    typename TensorView<T, Rank>::Index e{}, s{};
    for (int i = 0; i < Rank; ++i) {
      e[i] = extents[i];
      s[i] = strides[i];
    }
    const TensorView<T, Rank> v(static_cast<T*>(data), e, s, device);
    KVP_RETURN_IF_ERROR(v.check_basic("AnyTensorView::as", name));
    *out = v;
    return Status::ok();
  }
};

KVP_NAMESPACE_END
