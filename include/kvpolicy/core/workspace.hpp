// SPDX-License-Identifier: Apache-2.0
// Caller-owned scratch memory. Entry points report their workspace size first
// (`requirements()` of the policies, `*_workspace()` of the ops); the caller
// allocates once and passes a `Workspace` on every call.
// `WorkspacePlan` computes sizes with exactly the same carving rules that
// `WorkspaceCarver` uses at run time, and both offer `take<T>(n)`, so one
// layout function written against either (see `WorkspacePlan::take`) is the
// single definition behind a size report and its carve.
// Sizes saturate at SIZE_MAX instead of wrapping (core/checked.hpp): an absurd
// shape yields a workspace no caller can provide, and the size check fails.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/checked.hpp"
#include "kvpolicy/core/status.hpp"

KVP_NAMESPACE_BEGIN

inline constexpr std::size_t kWorkspaceAlign = 64;

/// n rounded up to a multiple of a; SIZE_MAX when that does not fit.
constexpr std::size_t align_up(std::size_t n, std::size_t a = kWorkspaceAlign) noexcept {
  return n > SIZE_MAX - (a - 1) ? SIZE_MAX : (n + a - 1) / a * a;
}

struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

/// Size accumulator: `add<T>(n)` reserves an aligned block of n T's.
struct WorkspacePlan {
  std::size_t bytes = 0;
  template <class T>
  constexpr WorkspacePlan& add(std::size_t n) noexcept {
    bytes = saturating_add(bytes, align_up(saturating_mul(n, sizeof(T))));
    return *this;
  }
  constexpr WorkspacePlan& add_bytes(std::size_t n) noexcept { return add<std::byte>(n); }
  /// `WorkspaceCarver::take`'s signature on the plan: reserves the block and
  /// returns nullptr, so a layout written once as a sequence of `take` calls
  /// (templated on the allocator) both sizes and carves.
  template <class T>
  constexpr T* take(std::size_t n) noexcept {
    add<T>(n);
    return nullptr;
  }
  /// What a size query reports: the blocks plus slack for an
  /// unaligned base pointer (zero when nothing is needed).
  constexpr std::size_t total() const noexcept { return bytes == 0 ? 0 : saturating_add(bytes, kWorkspaceAlign); }
};

/// Bump allocator over a Workspace (64-byte aligned blocks, in order).
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(Workspace ws) noexcept : base_(static_cast<std::byte*>(ws.data)), bytes_(ws.bytes) {
    // Align the start; the plan assumes an aligned base, so account for the shift.
    const auto addr = reinterpret_cast<std::uintptr_t>(base_);
    const std::size_t pad = (kWorkspaceAlign - addr % kWorkspaceAlign) % kWorkspaceAlign;
    if (base_ != nullptr && pad <= bytes_) {
      base_ += pad;
      bytes_ -= pad;
    } else if (base_ != nullptr) {
      bytes_ = 0;
    }
  }
  /// nullptr when the workspace is exhausted (callers check the reported size first).
  template <class T>
  T* take(std::size_t n) noexcept {
    const std::size_t need = align_up(saturating_mul(n, sizeof(T)));
    if (need == 0) return reinterpret_cast<T*>(base_ + used_);
    if (base_ == nullptr || need > bytes_ - used_) return nullptr;
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += need;
    return p;
  }
  std::size_t used() const noexcept { return used_; }
  /// The not-yet-carved remainder, e.g. to hand to a nested op.
  Workspace rest() const noexcept { return Workspace{base_ == nullptr ? nullptr : base_ + used_, bytes_ - used_}; }

 private:
  std::byte* base_;
  std::size_t bytes_;
  std::size_t used_ = 0;
};

namespace detail {

/// Per-worker workspace slices: `per_worker` bytes each, 64-byte aligned.
struct WorkerSlices {
  std::byte* base = nullptr;
  std::size_t per_worker = 0;
  Workspace slice(int w) const noexcept { return Workspace{base + static_cast<std::size_t>(w) * per_worker, per_worker}; }

  static std::size_t bytes(std::size_t per_worker, int workers) noexcept {
    if (per_worker == 0) return 0;
    return saturating_add(saturating_mul(align_up(per_worker), static_cast<std::size_t>(workers < 1 ? 1 : workers)), kWorkspaceAlign);
  }
  static WorkerSlices carve(Workspace ws, std::size_t per_worker) noexcept {
    WorkspaceCarver c(ws);
    WorkerSlices s;
    s.per_worker = align_up(per_worker);
    s.base = c.take<std::byte>(0);
    return s;
  }
};

}  // namespace detail

/// Workspace size check with the standard message; `need` is a
/// `WorkspacePlan::total()` (i.e. what the size query reported). A workspace
/// sized for another backend (e.g. `Context<Scalar>` requirements passed to a
/// `Context<Cpu>` call) fails here, loudly, rather than running slower.
inline Status check_workspace(const char* who, Workspace ws, std::size_t need) noexcept {
  if (need == 0) return Status::ok();
  if (ws.data == nullptr || ws.bytes < need) {
    return Status::error(StatusCode::kWorkspaceTooSmall,
                         "%s: workspace has %zu bytes, needs at least %zu (size it with requirements() on a context of the same backend)",
                         who, ws.data == nullptr ? std::size_t{0} : ws.bytes, need);
  }
  return Status::ok();
}

KVP_NAMESPACE_END
