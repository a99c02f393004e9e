// SPDX-License-Identifier: Apache-2.0
// `backend::CpuReduceOps`: the row reductions of the online policies (the
// one-victim argmin and NaN scans of H2O / TOVA, TOVA's head mean) on the
// level chosen at run time (AVX-512 / AVX2 / SSE2 kernels in
// src/reduce_ops_<isa>.cpp). Results are identical to `ScalarReduceOps`
// (comparisons and element-wise fp32 in the same order); every other row
// reduction falls back to it by inheritance.
#pragma once

#include <cstdint>

#include "kvpolicy/core/tensor_view.hpp"
#include "kvpolicy/ops/reduce_scalar.hpp"

KVP_NAMESPACE_BEGIN
namespace backend {

struct CpuReduceOps : ScalarReduceOps {
  static bool has_nan(const float* x, std::int64_t n) noexcept;
  static std::int64_t argmin_or_nan(const float* x, std::int64_t n, std::int64_t* at) noexcept;

  /// fp32 rows contiguous along j: the vectorised kernel; other dtypes / strides: the reference.
  template <class Tp>
  static void mean_rows(const TensorView<const Tp, 2> rows, float* mean) noexcept {
    if constexpr (std::is_same_v<Tp, float>) {
      if (rows.stride(1) == 1 || rows.extent(1) <= 1) {
        mean_rows_f32(rows.data(), rows.extent(0), rows.stride(0), rows.extent(1), mean);
        return;
      }
    }
    ScalarReduceOps::mean_rows(rows, mean);
  }

 private:
  static void mean_rows_f32(const float* rows, std::int64_t H, std::int64_t ld, std::int64_t n, float* mean) noexcept;
};

}  // namespace backend
KVP_NAMESPACE_END
