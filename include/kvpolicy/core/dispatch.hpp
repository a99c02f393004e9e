// SPDX-License-Identifier: Apache-2.0
// Run-time values become compile-time constants once, at the entry point:
// `dispatch_dtype(dt, f)` calls `f(TypeTag<T>{})` for the KV element types and
// fails loudly for anything else; `dispatch_int<64, 96, 128>(v, f)` likewise.
#pragma once

#include <type_traits>
#include <utility>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

template <class T>
struct TypeTag {
  using type = T;
};

/// f(TypeTag<T>) -> Status, T in {float, half, bfloat16}.
template <class F>
Status dispatch_dtype(DType dt, const char* what, F&& f) {
  switch (dt) {
    case DType::kF32: return f(TypeTag<float>{});
    case DType::kF16: return f(TypeTag<half>{});
    case DType::kBF16: return f(TypeTag<bfloat16>{});
    default: return Status::error(StatusCode::kUnsupported, "%s has dtype %s; supported: float32, float16, bfloat16", what, dtype_name(dt));
  }
}

/// f(std::integral_constant<int, V>) -> Status for the first V == v.
template <int... Vs, class F>
Status dispatch_int(int v, const char* what, F&& f) {
  Status s = Status::error(StatusCode::kUnsupported, "%s is %d; this entry point is compiled for a fixed set of values", what, v);
  (void)((v == Vs ? (s = f(std::integral_constant<int, Vs>{}), true) : false) || ...);
  return s;
}

KVP_NAMESPACE_END
