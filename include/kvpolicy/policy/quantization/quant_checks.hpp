// SPDX-License-Identifier: Apache-2.0
// Input checks the quantization policies share.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN
namespace detail {

/// Every value of rows (kv_heads, T, head_dim) is finite; the error names the policy, head, token and channel.
/// Rows with contiguous channels are scanned by the backend's `first_nonfinite`.
template <class Backend, class Tk>
Status check_finite_rows(const char* who, const TensorView<const Tk, 3>& rows) noexcept {
  const std::int64_t d = rows.extent(2);
  for (std::int64_t h = 0; h < rows.extent(0); ++h)
    for (std::int64_t t = 0; t < rows.extent(1); ++t)
      for (std::int64_t c = 0; c < d; ++c) {
        if (c == 0 && (rows.stride(2) == 1 || d == 1)) {
          const std::int64_t bad = Backend::first_nonfinite(&rows(h, t, 0), d);
          if (bad < 0) break;
          c = bad;
        }
        const float v = to_float(rows(h, t, c));
        KVP_REQUIRE(std::isfinite(v), "%s: rows head %lld token %lld channel %lld is not finite (%g); nothing was written", who,
                    static_cast<long long>(h), static_cast<long long>(t), static_cast<long long>(c), static_cast<double>(v));
      }
  return Status::ok();
}

}  // namespace detail
KVP_NAMESPACE_END
