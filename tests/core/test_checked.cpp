// core/checked.hpp and the validations built on it: extent products that
// overflow int64, workspace sizes that saturate.
#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <vector>

#include "kvpolicy/core/any_tensor_view.hpp"
#include "kvpolicy/core/checked.hpp"
#include "kvpolicy/core/workspace.hpp"

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t k2p32 = std::int64_t{1} << 32;
}  // namespace

TEST_CASE("checked: mul / add / extent products / strides report overflow", "[checked]") {
  std::int64_t r = 0;
  REQUIRE(checked_mul<std::int64_t>(k2p32, k2p32 / 2 - 1, &r));
  REQUIRE_FALSE(checked_mul<std::int64_t>(k2p32, k2p32, &r));
  REQUIRE_FALSE(checked_mul<std::int64_t>(-k2p32, k2p32, &r));
  REQUIRE(checked_add<std::int64_t>(kMax - 1, 1, &r));
  REQUIRE(r == kMax);
  REQUIRE_FALSE(checked_add<std::int64_t>(kMax, 1, &r));
  const std::int64_t huge[] = {k2p32, k2p32, 1};
  REQUIRE_FALSE(checked_extent_product(huge, 3, &r));
  const std::int64_t empty[] = {k2p32, k2p32, 0};
  REQUIRE(checked_extent_product(empty, 3, &r));
  REQUIRE(r == 0);
  const std::int64_t neg[] = {2, -1};
  REQUIRE_FALSE(checked_extent_product(neg, 2, &r));
  std::int64_t st[4] = {};
  const std::int64_t ok[] = {2, 3, 4};
  REQUIRE(checked_row_major_strides(ok, 3, st));
  REQUIRE((st[0] == 12 && st[1] == 4 && st[2] == 1));
  const std::int64_t bad[] = {0, std::int64_t{1} << 61, std::int64_t{1} << 61, 4};  // 0 elements, stride 2^64 on axis 0
  REQUIRE_FALSE(checked_row_major_strides(bad, 4, st));
  REQUIRE(saturating_mul(SIZE_MAX / 2, 3) == SIZE_MAX);
  REQUIRE(saturating_add(SIZE_MAX, 1) == SIZE_MAX);
}

TEST_CASE("TensorView / AnyTensorView: null data with an overflowing element count is rejected", "[checked][views]") {
  // 2^32 * 2^32 = 2^64 elements wraps to 0 in int64 arithmetic: it must not pass as "empty".
  AnyTensorView a;
  a.data = nullptr;
  a.dtype = DType::kF32;
  a.rank = 2;
  a.extents[0] = a.extents[1] = k2p32;
  a.strides[0] = k2p32;
  a.strides[1] = 1;
  TensorView<float, 2> v(reinterpret_cast<float*>(16), {1, 1}, {1, 1});
  const auto before = v.data();
  Status s = a.as(&v, "probe");
  INFO(s.message());
  REQUIRE(!s.is_ok());
  REQUIRE_THAT(s.message(), Contains("probe") && Contains("overflows int64"));
  REQUIRE(v.data() == before);  // untouched on error
  // Non-null data, same extents: still an error (the count is not representable).
  float x = 0.0f;
  a.data = &x;
  REQUIRE_THAT(a.as(&v, "probe").message(), Contains("overflows int64"));
  // Null data with a real element count.
  a.data = nullptr;
  a.extents[0] = 3;
  a.extents[1] = 2;
  REQUIRE_THAT(a.as(&v, "probe").message(), Contains("null data but 6 elements"));
  // An empty tensor of large extents stays valid.
  a.extents[0] = 0;
  a.extents[1] = k2p32;
  REQUIRE(a.as(&v, "probe").is_ok());
  const TensorView<float, 3> t(nullptr, {k2p32, k2p32, 4}, {0, 0, 1});
  REQUIRE_THAT(t.check_basic("op", "keys").message(), Contains("op: keys has extents whose product"));
}

TEST_CASE("Workspace: sizes saturate instead of wrapping, the carver never hands out a block past the end", "[checked][views]") {
  WorkspacePlan plan;
  plan.add<float>(SIZE_MAX / 2);
  REQUIRE(plan.total() == SIZE_MAX);
  REQUIRE(align_up(SIZE_MAX - 3) == SIZE_MAX);
  REQUIRE(detail::WorkerSlices::bytes(SIZE_MAX / 2, 4) == SIZE_MAX);
  std::vector<std::byte> mem(256);
  WorkspaceCarver c(Workspace{mem.data(), mem.size()});
  REQUIRE(c.take<float>(8) != nullptr);
  REQUIRE(c.take<double>(SIZE_MAX / 4) == nullptr);
  REQUIRE(c.take<std::byte>(SIZE_MAX) == nullptr);
  // WorkspacePlan::take mirrors WorkspaceCarver::take (one layout function for both).
  WorkspacePlan p2;
  REQUIRE(p2.take<float>(3) == nullptr);
  REQUIRE(p2.take<std::int32_t>(20) == nullptr);
  REQUIRE(p2.bytes == 64 + 128);
}
