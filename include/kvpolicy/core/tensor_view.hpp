// SPDX-License-Identifier: Apache-2.0
// Non-owning strided views. `TensorView<T, Rank>` is pointer + extents +
// strides (in elements) + device; `TensorView<const T, R>` is the read-only
// form, and a mutable view converts to it implicitly (never the reverse).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "kvpolicy/core/checked.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

enum class DeviceType : std::uint8_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3 };  // DLPack codes

struct Device {
  DeviceType type = DeviceType::kCPU;
  std::int32_t id = 0;
  constexpr bool is_host() const noexcept { return type != DeviceType::kCUDA; }
  friend constexpr bool operator==(const Device&, const Device&) = default;
};

inline constexpr Device kHost{};

template <class T, int Rank>
class TensorView {
  static_assert(Rank >= 1 && Rank <= 8, "TensorView rank must be in [1, 8]");

 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using Index = std::array<std::int64_t, Rank>;
  static constexpr int kRank = Rank;

  constexpr TensorView() noexcept = default;
  constexpr TensorView(T* data, const Index& extents, const Index& strides, Device device = kHost) noexcept
      : data_(data), extents_(extents), strides_(strides), device_(device) {}

  /// Row-major contiguous view.
  static constexpr TensorView contiguous(T* data, const Index& extents, Device device = kHost) noexcept {
    Index strides{};
    std::int64_t s = 1;
    for (int i = Rank - 1; i >= 0; --i) {
      strides[i] = s;
      s *= extents[i];
    }
    return TensorView(data, extents, strides, device);
  }

  /// Mutable -> const conversion (only adds const).
  template <class U>
    requires(!std::is_same_v<U, T> && std::is_same_v<const U, T>)
  constexpr TensorView(const TensorView<U, Rank>& other) noexcept  // NOLINT(google-explicit-constructor)
      : data_(other.data()), extents_(other.extents()), strides_(other.strides()), device_(other.device()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr const Index& extents() const noexcept { return extents_; }
  constexpr const Index& strides() const noexcept { return strides_; }
  constexpr std::int64_t extent(int i) const noexcept { return extents_[i]; }
  constexpr std::int64_t stride(int i) const noexcept { return strides_[i]; }
  constexpr Device device() const noexcept { return device_; }

  constexpr std::int64_t size() const noexcept {
    std::int64_t n = 1;
    for (auto e : extents_) n *= e;
    return n;
  }
  constexpr bool empty() const noexcept { return size() == 0; }

  constexpr bool is_contiguous() const noexcept {
    std::int64_t s = 1;
    for (int i = Rank - 1; i >= 0; --i) {
      if (extents_[i] != 1 && strides_[i] != s) return false;
      s *= extents_[i];
    }
    return true;
  }

  /// Element offset of a multi-index (no bounds check; see `contains`).
  template <class... I>
    requires(sizeof...(I) == Rank && (std::is_integral_v<I> && ...))
  constexpr std::int64_t offset(I... idx) const noexcept {
    const std::int64_t ii[] = {static_cast<std::int64_t>(idx)...};
    std::int64_t off = 0;
    for (int k = 0; k < Rank; ++k) off += ii[k] * strides_[k];
    return off;
  }

  template <class... I>
    requires(sizeof...(I) == Rank && (std::is_integral_v<I> && ...))
  constexpr T& operator()(I... idx) const noexcept { return data_[offset(idx...)]; }

  /// Fix the leading index: a view of rank Rank-1.
  constexpr TensorView<T, Rank - 1> operator[](std::int64_t i) const noexcept requires(Rank > 1) {
    std::array<std::int64_t, Rank - 1> e{}, s{};
    for (int k = 1; k < Rank; ++k) {
      e[k - 1] = extents_[k];
      s[k - 1] = strides_[k];
    }
    return TensorView<T, Rank - 1>(data_ + i * strides_[0], e, s, device_);
  }

  /// Pointer to row `i` of a rank-1 view's base (rank 1 only): `data() + i*stride(0)`.
  constexpr T* ptr(std::int64_t i) const noexcept requires(Rank == 1) { return data_ + i * strides_[0]; }

  /// Sub-range [begin, begin+len) along `axis`.
  constexpr TensorView narrow(int axis, std::int64_t begin, std::int64_t len) const noexcept {
    TensorView v = *this;
    v.data_ = data_ + begin * strides_[axis];
    v.extents_[axis] = len;
    return v;
  }

  /// Whether distinct indices always address distinct elements (a view an op
  /// may write through). Sufficient test: with the axes of extent > 1 sorted by
  /// |stride|, each |stride| exceeds the span of the smaller axes. Zero strides
  /// and overlapping rows fail; every dense, transposed, padded or paged-slice
  /// layout passes. Stride magnitudes are bounded by the checked element count
  /// of an addressable buffer, so the sums below do not overflow on views that
  /// passed `check_basic` over real memory; they saturate otherwise.
  constexpr bool is_non_overlapping() const noexcept {
    std::array<std::int64_t, Rank> st{}, ex{};
    int n = 0;
    for (int k = 0; k < Rank; ++k) {
      if (extents_[k] <= 1) continue;
      const std::int64_t a = strides_[k] < 0 ? -strides_[k] : strides_[k];
      int j = n++;
      for (; j > 0 && st[j - 1] > a; --j) {
        st[j] = st[j - 1];
        ex[j] = ex[j - 1];
      }
      st[j] = a;
      ex[j] = extents_[k];
    }
    std::int64_t span = 0;  // largest offset reachable through the smaller axes
    for (int k = 0; k < n; ++k) {
      if (st[k] <= span) return false;
      std::int64_t add = 0;
      if (!checked_mul(ex[k] - 1, st[k], &add) || !checked_add(span, add, &span)) return false;
    }
    return true;
  }

  /// `check_basic` for a view an op writes through: also rejects views whose
  /// rows overlap or whose strides are zero on an axis of extent > 1.
  Status check_writable(const char* who, const char* name) const noexcept {
    KVP_RETURN_IF_ERROR(check_basic(who, name));
    if (!empty() && !is_non_overlapping())
      return KVP_INVALID("%s: %s has overlapping elements (strides %s); a view written through must address each element once", who, name,
                         stride_text().data());
    return Status::ok();
  }

  /// "(s0, s1, ...)" for messages.
  std::array<char, 24 * Rank + 4> stride_text() const noexcept {
    std::array<char, 24 * Rank + 4> b{};
    std::size_t used = 0;
    for (int k = 0; k < Rank; ++k) {
      const int w = std::snprintf(b.data() + used, b.size() - used, "%s%lld", k ? ", " : "(", static_cast<long long>(strides_[k]));
      if (w > 0) used = std::min(b.size() - 2, used + static_cast<std::size_t>(w));
    }
    b[used] = ')';
    return b;
  }

  /// Validation used at every public entry point: non-negative extents whose
  /// product (the element count) fits int64, non-null data when non-empty.
  /// `who` / `name` go into the message.
  Status check_basic(const char* who, const char* name) const noexcept {
    for (int k = 0; k < Rank; ++k) {
      if (extents_[k] < 0)
        return KVP_INVALID("%s: %s has negative extent %lld on axis %d", who, name, static_cast<long long>(extents_[k]), k);
    }
    std::int64_t n = 0;
    if (!checked_extent_product(extents_.data(), Rank, &n))
      return KVP_INVALID("%s: %s has extents whose product (the element count) overflows int64", who, name);
    if (data_ == nullptr && n != 0) return KVP_INVALID("%s: %s has null data but %lld elements", who, name, static_cast<long long>(n));
    if (reinterpret_cast<std::uintptr_t>(data_) % alignof(T) != 0)
      return KVP_INVALID("%s: %s data pointer %p is not aligned to its element size (%zu bytes)", who, name,
                         static_cast<const void*>(data_), alignof(T));
    return Status::ok();
  }

 private:
  T* data_ = nullptr;
  Index extents_{};
  Index strides_{};
  Device device_{};
};

namespace detail {

/// Whether any of n contiguous values is a NaN or an infinity: an all-ones exponent, tested on the bits with
/// one OR-reduced pass the compiler vectorises (types other than fp32 / fp16 / bf16 convert each value).
template <class T>
bool any_nonfinite(const T* x, std::int64_t n) noexcept {
  if constexpr (std::is_same_v<std::remove_cv_t<T>, float>) {
    std::uint32_t bad = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint32_t u;
      std::memcpy(&u, x + i, sizeof u);
      bad |= static_cast<std::uint32_t>((u & 0x7f800000u) == 0x7f800000u);
    }
    return bad != 0;
  } else if constexpr (std::is_same_v<std::remove_cv_t<T>, half> || std::is_same_v<std::remove_cv_t<T>, bfloat16>) {
    constexpr std::uint16_t e = std::is_same_v<std::remove_cv_t<T>, half> ? 0x7c00 : 0x7f80;
    std::uint32_t bad = 0;
    for (std::int64_t i = 0; i < n; ++i) bad |= static_cast<std::uint32_t>((x[i].bits & e) == e);
    return bad != 0;
  } else {
    for (std::int64_t i = 0; i < n; ++i)
      if (!std::isfinite(to_float(x[i]))) return true;
    return false;
  }
}

/// Every element of a (host) 3-D view is finite; the message names the view
/// and the first bad element. Queries are small (a window or a decode step),
/// so scorers check them; keys are not scanned (a pass over the cache): a
/// non-finite key yields NaN scores, which rank last.
template <class T>
Status check_finite_3d(const char* who, const char* name, const TensorView<const T, 3>& v) noexcept {
  for (std::int64_t a = 0; a < v.extent(0); ++a)
    for (std::int64_t b = 0; b < v.extent(1); ++b) {
      if (v.stride(2) == 1 && !any_nonfinite(&v(a, b, 0), v.extent(2))) continue;  // the usual case, one branch-free pass
      for (std::int64_t c = 0; c < v.extent(2); ++c) {
        const float x = to_float(v(a, b, c));
        if (!std::isfinite(x))
          return KVP_INVALID("%s: %s[%lld, %lld, %lld] is %g, must be finite", who, name, static_cast<long long>(a),
                             static_cast<long long>(b), static_cast<long long>(c), static_cast<double>(x));
      }
    }
  return Status::ok();
}

}  // namespace detail

KVP_NAMESPACE_END
