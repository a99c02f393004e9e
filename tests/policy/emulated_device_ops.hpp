// The emulated device backend itself, without the test framework (the fuzz
// targets use it too): the scalar ops on host memory behind a `CallScope`, so
// `kDeviceBackend` holds and policies take their device paths with the
// reference arithmetic. tests/policy/emulated_device.hpp adds the Catch2
// helpers that compare such runs with backend::Scalar.
#pragma once

#include <cstdint>

#include "kvpolicy/core/status.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

namespace kvp_test {

struct EmulatedDevice : kvpolicy::backend::Scalar {
  class CallScope {
   public:
    CallScope(void*, int workers) noexcept : workers_(workers) {}
    kvpolicy::Status begin() const noexcept {
      if (workers_ > 1) return kvpolicy::Status::error(kvpolicy::StatusCode::kUnsupported, "emulated device: %d workers", workers_);
      return kvpolicy::Status::ok();
    }
    kvpolicy::Status end() const noexcept { return kvpolicy::Status::ok(); }

   private:
    int workers_ = 1;
  };
  // The batched forms a device path calls (one launch each on a GPU): row loops of the unit ops here.
  static void pool1d_rows(const float* in, std::int64_t rows, std::int64_t n, std::int64_t ld, int kernel, kvpolicy::Pooling kind,
                          float* out) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) pool1d(in + r * ld, n, kernel, kind, out + r * ld);
  }
  static void topk_rows_strided(const float* scores, std::int64_t ld, std::int64_t rows, std::int64_t n, std::int64_t k, std::int32_t* out,
                                std::int64_t out_ld, kvpolicy::Workspace ws) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) topk(scores + r * ld, n, k, out + r * out_ld, ws);
  }
  static void iota_rows(std::int32_t* dst, std::int64_t dst_ld, std::int64_t rows, std::int64_t first, std::int64_t n) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) iota(dst + r * dst_ld, first, n);
  }
  // Quest's page-selection rows (backend::Cuda::gather_page_rows' contract).
  static void gather_page_rows(const std::int32_t* pages, const std::int32_t* sel, std::int64_t sel_ld, std::int64_t rows, std::int64_t k,
                               std::int64_t last, std::int32_t* dst, std::int32_t* logical, std::int64_t dst_ld) noexcept {
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int32_t* s = sel != nullptr ? sel + r * sel_ld : nullptr;
      gather_ids(pages, s, k, dst + r * dst_ld);
      if (logical != nullptr) {
        if (s != nullptr)
          copy_ids(s, k, logical + r * dst_ld);
        else
          iota(logical + r * dst_ld, 0, k);
      }
      if (last >= 0) {
        dst[r * dst_ld + k] = pages[last];
        if (logical != nullptr) logical[r * dst_ld + k] = static_cast<std::int32_t>(last);
      }
    }
  }
};
static_assert(kvpolicy::kDeviceBackend<EmulatedDevice>);

/// Host memory tagged as a device's, for views an emulated device reads.
inline constexpr kvpolicy::Device kEmulatedDevice{kvpolicy::DeviceType::kCUDA, 0};

}  // namespace kvp_test
