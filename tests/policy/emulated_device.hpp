// A device backend emulated on the host for tests: the scalar ops on host
// memory behind a `CallScope`, so `kDeviceBackend` holds and policies take
// their device paths (device-written offsets, batched launches, one worker)
// with the reference arithmetic. Comparing such a run with `backend::Scalar`
// tests a device path's logic on the CPU; `backend::Cuda` is then compared
// with the same reference on a GPU (tests/cuda/).
#pragma once

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "emulated_device_ops.hpp"
#include "keep_set_buffer.hpp"
#include "kvpolicy/core/status.hpp"
#include "kvpolicy/ops/scalar.hpp"
#include "kvpolicy/policy/vocabulary.hpp"

namespace kvp_test {

/// The byte every emulated-device test fills its workspaces with (0xFF: NaN as floats, -1 as integers).
/// cudaMalloc memory is not zeroed and a reused allocation holds the last call's data, while a fresh
/// std::vector is all zeros: a path that read a workspace before writing it would pass on zeros here and
/// fail on a GPU. A poisoned workspace makes such a read change the result.
inline constexpr std::byte kWorkspacePoison{0xFF};

/// `policy`'s requirements for `shape` on backend::Scalar (`host`) and on EmulatedDevice (`device`), both
/// required valid, with a workspace of each size.
struct TwoSides {
  kvpolicy::Requirements host, device;
  std::vector<std::byte> host_ws, device_ws;
  kvpolicy::Workspace host_workspace() { return kvpolicy::Workspace{host_ws.data(), host_ws.size()}; }
  kvpolicy::Workspace device_workspace() { return kvpolicy::Workspace{device_ws.data(), device_ws.size()}; }
};
template <class Policy>
TwoSides two_sides(const Policy& policy, const kvpolicy::ProblemShape& shape) {
  using namespace kvpolicy;
  TwoSides t{policy.requirements(Context<backend::Scalar>{}, shape), policy.requirements(Context<EmulatedDevice>{}, shape), {}, {}};
  INFO(t.host.status.message() << " / " << t.device.status.message());
  REQUIRE(t.host.status.is_ok());
  REQUIRE(t.device.status.is_ok());
  t.host_ws.assign(t.host.workspace_bytes, kWorkspacePoison);
  t.device_ws.assign(t.device.workspace_bytes, kWorkspacePoison);
  return t;
}

/// `policy.evict` over `host` (host views) on backend::Scalar and over `device` (the same data, views tagged
/// kEmulatedDevice) on EmulatedDevice: the same requirements and identical KeepSets.
template <class Policy, class In>
void require_same_evict(const Policy& policy, const kvpolicy::ProblemShape& shape, std::span<const In> host, std::span<const In> device) {
  using namespace kvpolicy;
  TwoSides sides = two_sides(policy, shape);
  const Requirements &hreq = sides.host, &dreq = sides.device;
  REQUIRE(dreq.output.rows == hreq.output.rows);
  REQUIRE(dreq.output.capacity == hreq.output.capacity);
  std::vector<std::byte>&hws = sides.host_ws, &dws = sides.device_ws;
  KeepSetBuffer want(hreq.output.rows, hreq.output.capacity), got(dreq.output.rows, dreq.output.capacity);
  got.fill_sentinel();
  const Status hs = policy.evict(Context<backend::Scalar>{Workspace{hws.data(), hws.size()}}, host, want.view());
  INFO(hs.message());
  REQUIRE(hs.is_ok());
  const Status ds = policy.evict(Context<EmulatedDevice>{Workspace{dws.data(), dws.size()}}, device, got.view());
  INFO(ds.message());
  REQUIRE(ds.is_ok());
  REQUIRE(got == want);
}

}  // namespace kvp_test
