// SPDX-License-Identifier: Apache-2.0
// Input checks the quantization policies share.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/core/tensor_view.hpp"

KVP_NAMESPACE_BEGIN
namespace detail {

/// Every value of rows (kv_heads, T, head_dim) is finite; the error names the policy, head, token and channel
/// of the first non-finite value in (head, token, channel) order. Rows with contiguous channels are scanned
/// by the backend's `first_nonfinite`, a head whose rows are contiguous in one call over all of them; with
/// `exec`, heads are scanned in parallel (the reported value is the same: the first head that has one).
template <class Backend, class Tk>
Status check_finite_rows(const char* who, const TensorView<const Tk, 3>& rows, const ExecContext& exec = {}) noexcept {
  const std::int64_t H = rows.extent(0), T = rows.extent(1), d = rows.extent(2);
  const bool unit = rows.stride(2) == 1 || d == 1;
  // Position (token * d + channel) of the first non-finite value of head h, or -1.
  const auto first_bad = [&](std::int64_t h) noexcept -> std::int64_t {
    if (unit && (rows.stride(1) == d || T == 1)) {
      if (T == 0 || d == 0) return -1;
      return Backend::first_nonfinite(&rows(h, 0, 0), T * d);
    }
    for (std::int64_t t = 0; t < T; ++t) {
      if (unit) {
        const std::int64_t c = Backend::first_nonfinite(&rows(h, t, 0), d);
        if (c >= 0) return t * d + c;
        continue;
      }
      for (std::int64_t c = 0; c < d; ++c)
        if (!std::isfinite(to_float(rows(h, t, c)))) return t * d + c;
    }
    return -1;
  };
  std::atomic<std::int64_t> bad_head{H};
  exec.parallel_for(H, [&](std::int64_t h, int) {
    if (h >= bad_head.load(std::memory_order_relaxed) || first_bad(h) < 0) return;
    std::int64_t cur = bad_head.load(std::memory_order_relaxed);
    while (h < cur && !bad_head.compare_exchange_weak(cur, h, std::memory_order_relaxed)) {
    }
  });
  const std::int64_t h = bad_head.load();
  if (h == H) return Status::ok();
  const std::int64_t at = first_bad(h), t = at / d, c = at % d;
  return KVP_INVALID("%s: rows head %lld token %lld channel %lld is not finite (%g); nothing was written", who, static_cast<long long>(h),
                     static_cast<long long>(t), static_cast<long long>(c), static_cast<double>(to_float(rows(h, t, c))));
}

/// Where a quantization policy's view `name` lives against its backend: host memory on a host backend;
/// device memory on a device backend (`on_device`), with contiguous channels there (the device row codecs
/// read and write whole rows). `writes`: the view is an output (the host message says "writes").
inline Status check_quant_memory(const char* who, const char* name, bool on_device, Device dev, std::int64_t channel_stride, std::int64_t d,
                                 bool writes = false) noexcept {
  if (!on_device) {
    KVP_REQUIRE(dev.is_host(), "%s: %s is a device tensor; this entry point %s host memory", who, name, writes ? "writes" : "reads");
    return Status::ok();
  }
  KVP_REQUIRE(!dev.is_host(), "%s: %s is a host tensor; a device backend reads device memory (tag the view kCUDA)", who, name);
  KVP_REQUIRE(channel_stride == 1 || d <= 1, "%s: %s has channel stride %lld; a device backend takes contiguous channels", who, name,
              static_cast<long long>(channel_stride));
  return Status::ok();
}

}  // namespace detail
KVP_NAMESPACE_END
